"""tqdm's monitor thread off in every test process that collects tests/unit (all of `make test`'s, each pytest-xdist
worker's): started by the first progress bar of HF or lm-eval in a process, it would leave that process with a second
thread for good, and `threed preprocess` from a process with threads starts its workers by forkserver, each
importing megatron-core again (threed.data.encode._start_method): tests/unit/test_preprocess.py took 175 s under
pytest-xdist instead of 9. The CLI is single-threaded and forks; without the monitor the tests take the CLI's path
(test_preprocess.py checks the forkserver path on its own). The monitor only re-times stalled bars. Not in
tests/conftest.py: the lent GPU machine collects that one, and its image has no tqdm
(tests/cli/test_gpu_check.py::test_what_the_gpu_machine_collects_imports_only_what_it_has).
"""

from __future__ import annotations

import tqdm

tqdm.tqdm.monitor_interval = 0
