"""How pytest-xdist shares the tests between its workers in `make test` and `make test-slow` (`-n 2 --dist loadscope -p
xdist_scheduling`): a test module to a worker, as loadscope does, except that every module of tests/ranks that asks
for the rank pool (names a fixture of tests/ranks/conftest.py) is one unit, run by one worker. Its one rank pool then
serves every pooled test, where modules spread over two workers would start each world size's launch twice (~7 s of
CPU per rank to import and join) and run two 8-rank launches on the same cores; the other worker takes the
single-process tests of tests/unit and tests/cli, and the tests/ranks modules that start their own ranks (a torchrun
per test: a rank's exit code, its start-up output), meanwhile.
xdist's own `xdist_group` mark does not group under pytest 9: it renames `item._nodeid`, which pytest 9 no longer
reads. A plugin named on the command line, not a conftest: the lent GPU machine runs tests/gpu without xdist
(tests/cli/test_gpu_check.py checks what its collection imports).

    .venv/bin/python -m pytest -n 2 --dist loadscope -p xdist_scheduling tests
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

RANKS_SCOPE = "tests/ranks/"


@functools.cache
def pool_fixtures(rootdir: Path) -> re.Pattern:
    """The fixtures tests/ranks/conftest.py defines (`rank_pool` and those built on it), as one word pattern."""
    tree = ast.parse((rootdir / RANKS_SCOPE / "conftest.py").read_text())
    names = [f.name for f in tree.body if isinstance(f, ast.FunctionDef)]
    return re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")


@functools.cache
def asks_for_the_pool(rootdir: Path, module: str) -> bool:
    return bool(pool_fixtures(rootdir).search((rootdir / module).read_text()))


class RanksInOneWorker(LoadScopeScheduling):
    """xdist's loadscope (a test module to a worker), with every pooled module of tests/ranks in one scope."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        rootdir = Path(self.config.rootpath)
        if module.startswith(RANKS_SCOPE) and asks_for_the_pool(rootdir, module):
            return RANKS_SCOPE
        return super()._split_scope(nodeid)


@pytest.hookimpl(optionalhook=True)  # xdist's hook
def pytest_xdist_make_scheduler(config, log):
    return RanksInOneWorker(config, log) if config.getvalue("dist") == "loadscope" else None
