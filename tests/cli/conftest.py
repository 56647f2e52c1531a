"""The Slurm tests' fixture (only tests/cli/ has Slurm tests; the fixtures shared by every folder are in
tests/cli/conftest.py): a factory of throw-away local Slurm clusters, slurm_cluster.LocalSlurm."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from slurm_cluster import LocalSlurm, ensure_slurm_installed


@pytest.fixture
def local_slurm_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LocalSlurm]]:
    """``make(num_nodes=2, cpus_per_node=8, **kw) -> LocalSlurm``, started; all are stopped after the test."""
    reason = ensure_slurm_installed()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:

        def make(num_nodes: int = 2, cpus_per_node: int = 8, **kw: Any) -> LocalSlurm:
            workdir = tmp_path_factory.mktemp("slurm")
            return stack.enter_context(LocalSlurm(num_nodes, cpus_per_node, workdir, **kw))

        yield make
