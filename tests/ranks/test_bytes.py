"""Fewer bytes per micro-batch over a 2-rank pipeline (tests/ranks/bytes_worker.py: tp 1 pp 2, bf16 with fp32
accumulation, micro 2 x gas 3, 3 steps), DeepSpeed's own pieces ("before") against threed's ("after"):

- the fp32 accumulation in one mixed-dtype add (threed.engine.fp32_accumulate) and the last stage letting go of its
  logits (threed.parallel.lean_engine) change no number: losses, gradient norms and fp32 master weights bit for bit;
- after each step the last stage holds no logits and no loss graph (DeepSpeed's keeps both);
- after `destroy()` the engine, its parameters and its optimizer state are freed (DeepSpeed's last stage keeps them
  through the hooks on its logits' graph).

And `--lm-head-chunks` (bytes_worker.py head_chunks): at tp 2, with and without sequence parallelism, tied, and on
packed rows with a loss mask, one fp32 micro-batch gives the whole-logits loss bit for bit and every gradient within
STAGE_REL (all but the head's weight bit for bit); real engines (pp 2 bf16 with BF16_Optimizer, untied and tied; tp 2
fp32) train as with the whole logits: the first loss bit for bit, the rest within ENGINE_REL (make test-slow).
"""

from __future__ import annotations

import json

import pytest

from helpers import RANKS
from bytes_worker import ENGINE_CASES, HEAD_CASES, HEAD_CHUNKS

# Per tensor, max |chunked - whole| / max |whole| of one micro-batch's fp32 gradients: the head's weight gradient is a
# sum of HEAD_CHUNKS partial products instead of one matmul's (measured 3.5e-7 at most).
STAGE_REL = 1e-6
# Relative, per step, chunked against whole over 3 steps: fp32 (measured 1.5e-7 at most), and bf16, where the head's
# weight gradient is summed over the chunks in bf16 (measured 9.7e-5 at most, on a gradient norm; bf16's own rounding
# is 2^-8 = 3.9e-3).
ENGINE_REL = {"fp32": 1e-6, "bf16": 1e-3}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("bytes")
    rank_pool.run(2, str(RANKS / "bytes_worker.py"), ["compare", "--out", str(out)], timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_the_same_numbers_bit_for_bit(ranks) -> None:
    for r in ranks:
        before, after = r["before"], r["after"]
        assert before["optimizer"] == after["optimizer"] == "BF16_Optimizer"
        assert (before["update_hp_grad"], after["update_hp_grad"]) == ("_update_hp_grad", "_add_into_fp32")
        assert (before["class"], after["class"]) == ("PipelineEngine", "LeanPipelineEngine")
        assert after["grad_norms"] == before["grad_norms"] and after["grad_norms"][0] > 0
        assert after["master"] == before["master"]
        assert after["losses"] == before["losses"]
        assert len(set(after["losses"])) == len(after["losses"]), "three different steps"


def test_the_last_stage_keeps_no_logits_after_a_step(ranks) -> None:
    last = [r for r in ranks if r["after"]["last"]]
    assert len(last) == 1
    before, after = last[0]["before"], last[0]["after"]
    # DeepSpeed's: both buffer slots hold a micro-batch's logits [s, b, V] bf16, and the loss its graph.
    assert all(h["outputs"] == 2 and h["output_bytes"] >= 2 * 2 * 32 * 2 * 512 for h in before["held"])
    assert all(h["loss_graph"] for h in before["held"])
    assert all(h == {"outputs": 0, "output_bytes": 0, "loss_graph": False} for h in after["held"])


def test_destroy_frees_the_engine_its_parameters_and_optimizer_state(ranks) -> None:
    for r in ranks:
        print(f"stage {r['after']['stage']}: garbage collection passes after destroy {r['after']['gc_passes']}")
        assert r["after"]["alive_after_destroy"] == {"engine": False, "parameter": False, "adamw state": False}, r[
            "after"
        ]["stage"]
    # What the change fixes: DeepSpeed's last stage is kept alive by the hooks on its logits' graph.
    last = next(r for r in ranks if r["before"]["last"])
    assert last["before"]["alive_after_destroy"]["engine"]


@pytest.fixture(scope="module")
def chunked(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("head_chunks")
    rank_pool.run(2, str(RANKS / "bytes_worker.py"), ["head_chunks", "--out", str(out)], timeout=900)
    return [json.loads((out / f"head_chunks_rank{r}.json").read_text()) for r in range(2)]


def test_chunked_head_at_tp2_gives_the_whole_logits_loss_and_gradients(chunked) -> None:
    for rank, r in enumerate(chunked):
        assert set(r) == set(HEAD_CASES)
        for case, c in r.items():
            print(f"rank {rank} {case}: max relative gradient difference {c['max_rel']:.3g} in {c['differing']}")
            assert c["loss_equal"] and c["all_nonzero"], case
            assert c["max_rel"] <= STAGE_REL, case
            assert all(n.endswith(("lm_head.weight", "word_embeddings.weight")) for n in c["differing"]), case


@pytest.mark.slow  # six engines trained 3 steps each (~40 s on 2 ranks): make test-slow
def test_chunked_head_trains_as_the_whole_logits(tmp_path, rank_pool) -> None:
    """Through DeepSpeed's engines: the backward prologue, ZeRO's and BF16_Optimizer's gradient hooks, the tied
    gradient's sum over stages and TP all see the chunked loss as they see the whole one."""
    rank_pool.run(2, str(RANKS / "bytes_worker.py"), ["head_chunks_engines", "--out", str(tmp_path)], timeout=900)
    for r in (json.loads((tmp_path / f"head_chunks_engines_rank{k}.json").read_text()) for k in range(2)):
        for case, runs in r.items():
            whole, parts = runs["1"], runs[str(HEAD_CHUNKS)]
            tol = ENGINE_REL[ENGINE_CASES[case][3]]
            assert parts["losses"][0] == whole["losses"][0], case  # the same weights, the same logits rows
            for key in ("losses", "grad_norms"):
                worst = max(abs(a - b) / abs(b) for a, b in zip(parts[key], whole[key]))
                print(f"{case} {key}: chunked vs whole, relative {worst:.3g}")
                assert worst <= tol and len(parts[key]) == 3, (case, key)
