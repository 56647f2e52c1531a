"""`python -m MODULE ARGV...` as a rank-pool worker (tests/ranks/rank_pool.py `RankPool.run_ranks`): what threed's own
launches run on their ranks (`threed verify`'s `threed.verify.worker`, `threed.train`), served by the session's
launch of that world size instead of a torchrun of their own (~7 s of CPU per rank to import torch, DeepSpeed and
megatron-core before the first line of the module runs). The module finds the process group made
(threed.parallel.distributed.init_distributed joins only where none is) and leaves it up: the launch owns it, so
`shutdown_distributed`, which `threed train` calls on its way out, is a no-op for the module's run.

    {"worker": "module_worker.py", "argv": ["threed.verify.worker", "--ckpt", "..."]}   (a request, dispatch_worker.py)
"""

from __future__ import annotations

import runpy
import sys
from unittest import mock

import threed.parallel.distributed

if __name__ == "__main__":
    module, sys.argv = sys.argv[1], sys.argv[1:]
    with mock.patch.object(threed.parallel.distributed, "shutdown_distributed", lambda: None):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
