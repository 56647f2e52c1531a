"""The fixture every multi-rank module shares: `rank_pool`, the session's torchrun launches, one per world size
(tests/ranks/rank_pool.py), which the module fixtures ask to run their worker scripts. A launch starts when the
first test that needs its world size runs, so a single file or test starts only the world sizes it uses, and a
test that takes no rank fixture starts none. Under pytest-xdist every module here that asks for these fixtures runs in
one worker, so that one pool serves them all (tests/xdist_scheduling.py)."""

from __future__ import annotations

import pytest

import threed.verify.parity
from rank_pool import RankPool


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory):
    pool = RankPool(tmp_path_factory.mktemp("rank_pool"))
    yield pool
    pool.close()


@pytest.fixture
def verify_in_pool(rank_pool, monkeypatch):
    """`threed verify` with its tp x pp ranks served by the pool's launch of that size, not by a torchrun of its own
    (each of whose ranks would import torch, DeepSpeed and megatron-core anew: ~7 s of CPU). The ranks run the same
    module, threed.verify.worker; test_convert_parity.py::test_deepspeed_load_checkpoint_matches_hf keeps verify's
    own launch."""
    monkeypatch.setattr(threed.verify.parity, "run_ranks", rank_pool.run_ranks)
