"""threed.memory under `--pipeline-schedule zb-h1` against what real CPU ranks hold (the engine: threed.model.wgrad,
threed.schedule.zero_bubble_engine).

One launch of tests/memory_worker.py on 2 ranks: a tp1 pp2 ZB-H1 engine's static terms after a step (the same as
1F1B's: no W pass may be left queued, nothing kept beside the model states and buffers), and, on one stage of tp 2,
the bytes one micro-batch's queued weight-gradient passes hold after its input-gradient backward, SP off and on,
next to `threed.memory.deferred`'s count from the linears' widths.
"""
from __future__ import annotations

import json

import pytest

from helpers import TESTS
from threed.launch import run_ranks

STATIC_TOL = 0.02  # as tests/test_memory.py


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = tmp_path_factory.mktemp("memory_zb")
    run_ranks(2, str(TESTS / "memory_worker.py"),
              ["--out", str(out), "--layouts", "1x2", "--pipeline-schedule", "zb-h1", "--deferred"], timeout=900)
    return {"static": [json.loads(p.read_text()) for p in sorted(out.glob("static_1x2x1_rank*.json"))],
            "deferred": [json.loads(p.read_text()) for p in sorted(out.glob("deferred_rank*.json"))]}


def test_zb_h1_engine_static_bytes(measured) -> None:
    assert len(measured["static"]) == 2
    for r in measured["static"]:
        m, p = r["measured"], r["predicted"]
        assert r["engine"] == "ZeroBubbleEngine"
        everything = m["model_states"] + m.get("buffers", 0) + m["unaccounted"]
        print(f"zb-h1 stage {r['stage']}: all live tensors {everything} B measured, {p['static']:.0f} predicted; "
              f"largest unaccounted {m['largest_unaccounted'][:2]}")
        assert abs(p["model_states"] - m["model_states"]) <= STATIC_TOL * m["model_states"]
        assert abs(p["static"] - everything) <= STATIC_TOL * everything


@pytest.mark.parametrize("case", ["tp", "sp"])
def test_deferred_bytes_match_the_queue(measured, case: str) -> None:
    ranks = measured["deferred"]
    assert len(ranks) == 2
    for r in ranks:
        c = r[case]
        print(f"{case}: {c['linears']} linears deferred, holding {c['storage_bytes']} B (tensors {c['tensor_bytes']} "
              f"B); threed.memory.deferred: {c['estimate']} B")
        assert c["linears"] == 4 * 4 + 1  # qkv, proj, fc1, fc2 per block, and the LM head
        assert c["tensor_bytes"] == c["estimate"]
        assert abs(c["storage_bytes"] - c["estimate"]) <= STATIC_TOL * c["estimate"]
