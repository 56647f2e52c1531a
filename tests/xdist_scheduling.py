"""How pytest-xdist shares the tests between its workers in `make test` and `make test-slow` (`-n 2 --dist loadscope -p
xdist_scheduling`): a test module to a worker, as loadscope does, except that all of tests/ranks is one unit, run by
one worker. Its one rank pool (tests/ranks/conftest.py) then serves every multi-rank test, where modules spread over
two workers would start each world size's launch twice (~7 s of CPU per rank to import and join) and run two 8-rank
launches on the same cores; the other worker takes the single-process tests of tests/unit and tests/cli meanwhile.
xdist's own `xdist_group` mark does not group under pytest 9: it renames `item._nodeid`, which pytest 9 no longer
reads. A plugin named on the command line, not a conftest: the lent GPU machine runs tests/gpu without xdist
(tests/cli/test_gpu_check.py checks what its collection imports).

    .venv/bin/python -m pytest -n 2 --dist loadscope -p xdist_scheduling tests
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

RANKS_SCOPE = "tests/ranks/"


class RanksInOneWorker(LoadScopeScheduling):
    """xdist's loadscope (a test module to a worker), with every test of tests/ranks in one scope."""

    def _split_scope(self, nodeid: str) -> str:
        return RANKS_SCOPE if nodeid.startswith(RANKS_SCOPE) else super()._split_scope(nodeid)


@pytest.hookimpl(optionalhook=True)  # xdist's hook
def pytest_xdist_make_scheduler(config, log):
    return RanksInOneWorker(config, log) if config.getvalue("dist") == "loadscope" else None
