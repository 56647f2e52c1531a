"""Context parallelism over real ranks (threed.model.context; gloo on CPU, fp64): at cp 2 and 4 the all-gather-K/V
attention of each rank's zigzag share, gathered back to the full row, equals full-sequence SDPACoreAttention in its
output and in dQ, dK, dV (the reduce-scatter of dK/dV included), for plain causal rows and packed documents that
cross chunk edges, with GQA and without; the loss helper gives the exact token-weighted mean over ranks and
micro-batches, which the mean of per-rank means misses when loss masks differ between chunks. One run of 4 ranks
runs both cp (tests/ranks/context_worker.py).

    PYTHONPATH=$PWD/src .venv/bin/python -m pytest -q tests/ranks/test_context_attention.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


# a 4-rank run (~40 s): CP's end-to-end parity, which runs this attention, stays in make test
# (test_context_parallel.py)
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
TOL = 1e-12  # fp64: the same sums in another order
CPS = (2, 4)


@pytest.fixture(scope="module")
def results(tmp_path_factory, rank_pool) -> dict[int, list[dict]]:
    """cp -> each rank's results, from one run on 4 ranks (cp 4 over them all, cp 2 over each pair)."""
    out = tmp_path_factory.mktemp("cp")
    rank_pool.run(4, str(HERE / "context_worker.py"), ["--out", str(out)], timeout=600)
    ranks = [json.loads((out / f"context_rank{r}.json").read_text()) for r in range(4)]
    return {cp: [r[str(cp)] for r in ranks] for cp in CPS}


@pytest.mark.parametrize("cp", CPS)
def test_cp_attention_and_its_gradients_equal_full_sequence_attention(results, cp):
    for rank, result in enumerate(results[cp]):
        cases = result["attention"]
        assert set(cases) == {
            "causal_gqa",
            "causal_mha",
            "documents_gqa",
            "documents_mha",
            "documents_gqa_local_segments",
        }
        bad = {f"{case} {what}": err for case, errs in cases.items() for what, err in errs.items() if not err <= TOL}
        assert not bad, f"cp {cp}, rank {rank}: relative errors above {TOL}: {bad}"


@pytest.mark.parametrize("cp", CPS)
def test_split_then_gather_is_the_identity_over_ranks(results, cp):
    assert all(r["gather_round_trip"] for r in results[cp])


@pytest.mark.parametrize("cp", CPS)
def test_loss_is_the_exact_token_mean_and_the_mean_of_rank_means_is_not(results, cp):
    for result in results[cp]:
        loss = result["loss"]
        assert loss["exact_vs_single_process"] <= TOL, loss
        assert loss["count"] == loss["want_count"] == 68, loss
        # Ranks hold different numbers of loss tokens (29 and 39 at cp 2): the mean of their means is off by ~1%.
        assert loss["mean_of_rank_means_vs_single_process"] > 1e-3, loss
