"""The fixture every multi-rank module shares: `rank_pool`, the session's torchrun launches, one per world size
(tests/ranks/rank_pool.py), which the module fixtures ask to run their worker scripts. A launch starts when the
first test that needs its world size runs, so a single file or test starts only the world sizes it uses, and a
test that takes no rank fixture starts none. Under pytest-xdist every module here that asks for these fixtures runs in
one worker, so that one pool serves them all (tests/xdist_scheduling.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import threed.verify.parity
from rank_pool import RankPool

RANKS = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory, pytestconfig):
    pool = RankPool(tmp_path_factory.mktemp("rank_pool"))
    yield pool
    pool.close()
    xml = pytestconfig.getoption("xmlpath", None)
    if xml:  # `make test DURATIONS_DIR=...`: each request's seconds and its ranks' CPU, for tools/test_durations.py
        report = Path(xml).with_suffix(".rank-pool.json")
        report.parent.mkdir(parents=True, exist_ok=True)  # before pytest's own XML writer makes it
        report.write_text(json.dumps(pool.requests, indent=1))


@pytest.fixture(scope="session")
def memory_zb_run(tmp_path_factory, rank_pool) -> Path:
    """tests/ranks/memory_zb_worker.py's one run on 2 ranks that test_memory_zb.py and test_interleaved.py's
    activation peak both read: the ZB-H1 engine's static terms, the deferred weight-gradient bytes, and the CPU peak
    of a train step under 1F1B, ZB-H1 and 1F1B at --vpp 2 (bf16 steps of seq 512: the 1F1B peak both compare with is
    measured once). Its output folder."""
    out = tmp_path_factory.mktemp("memory_zb")
    argv = ["--out", str(out), "--layouts", "1x2", "--pipeline-schedule", "zb-h1", "--deferred", "--schedule-peaks"]
    rank_pool.run(2, str(RANKS / "memory_zb_worker.py"), [*argv, "--schedules", "1f1b,zb-h1,1f1b-vpp2"], timeout=900)
    return out


@pytest.fixture
def verify_in_pool(rank_pool, monkeypatch):
    """`threed verify` with its tp x pp ranks served by the pool's launch of that size, not by a torchrun of its own
    (each of whose ranks would import torch, DeepSpeed and megatron-core anew: ~7 s of CPU). The ranks run the same
    module, threed.verify.worker; test_convert_parity.py::test_deepspeed_load_checkpoint_matches_hf[2-2] keeps verify's
    own launch."""
    monkeypatch.setattr(threed.verify.parity, "run_ranks", rank_pool.run_ranks)
