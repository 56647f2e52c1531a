"""threed.memory under context parallelism (issue 27) against what real CPU ranks hold: one stage's activation peak at
cp 2 against cp 1 at the same sequence falls by the factor the model predicts (`activation_ratio`), within 5%.

One run of tests/ranks/memory_worker.py --cp-activations on 2 ranks: tp 1, pp 1 (one stage of four blocks, the
embedding and the head), micro 2 x 512 tokens, first at cp 1 (every rank the whole rows) and then at cp 2 (every
rank 2 of each row's 4 chunks, the K/V all-gathered over both). The factor is not 1/2: each block at cp 2 also keeps
the gathered row's K and V and the chunk x prefix masks (`context_parallel_bytes`), and its backward holds the
gathered K/V's gradient before the reduce-scatter. Measured 0.517 and 0.520 (two runs), predicted 0.517; a model
without the gathered K/V and masks would predict 0.477, outside the 5%.
"""

from __future__ import annotations

import json

import pytest

from helpers import RANKS
from memory_worker import ACT, SP_MODEL
from threed.memory.model import Stage, activation_ratio, stage_activations

FACTOR_TOL = 0.05  # the issue's: the predicted factor within 5% of the measured one
# Each side's estimate against its measured peak; measured within 2% (1.010 at cp 1, 1.020 at cp 2), bounded looser
# because a gloo collective's temporaries move a single peak by a few percent (tests/ranks/test_memory_sp.py).
PEAK_TOL = 0.10
MICRO, SEQ, CP = ACT["micro"], ACT["seq"], 2  # the worker's shapes; it runs cp 1, then cp 2


@pytest.fixture(scope="module")
def measured(tmp_path_factory, rank_pool) -> dict:
    out = tmp_path_factory.mktemp("memory_cp")
    rank_pool.run(2, str(RANKS / "memory_worker.py"), ["--out", str(out), "--cp-activations"], timeout=900)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("cp_activations_rank*.json"))]
    assert len(ranks) == 2
    return {case: [r[case] for r in ranks] for case in ranks[0]}


def _mean(cases: list[dict]) -> float:
    """Averaged over the ranks (each rank holds as much: the zigzag split gives both the same work and tokens)."""
    return sum(c["measured"] for c in cases) / len(cases)


def test_cp2_activation_peak_falls_by_the_predicted_factor(measured) -> None:
    model = SP_MODEL
    got = _mean(measured["cp2"]) / _mean(measured["cp1"])
    want = activation_ratio(model, 1, 1, 0, MICRO, 1, SEQ, CP)
    print(f"activation peak cp2 / cp1 at seq {SEQ}: measured {got:.4f}, predicted {want:.4f}")
    assert want < 0.6  # a real saving: the rank holds half the tokens
    assert abs(want - got) <= FACTOR_TOL * got


@pytest.mark.parametrize("cp", [1, 2])
def test_each_side_against_its_estimate(measured, cp: int) -> None:
    """Each peak against `stage_activations` with CPU kernels, plus the logits the worker keeps through backward
    (the engine keeps them in its pipe buffers; threed.memory counts them under `buffers`), as test_memory_sp does."""
    model = SP_MODEL
    stage = Stage(index=0, blocks=model.num_layers, first=True, last=True)
    for case in measured[f"cp{cp}"]:
        act = stage_activations(model, 1, 1, stage, MICRO, 1, SEQ, False, "cpu", case["max_param"], cp=cp)
        estimate = act + 2 * MICRO * SEQ // cp * model.padded_vocab_size(1)
        print(f"cp{cp}: measured {case['measured'] / 1e6:.2f} MB, estimate {estimate / 1e6:.2f} MB")
        assert abs(estimate - case["measured"]) <= PEAK_TOL * case["measured"]
