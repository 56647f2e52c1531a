"""Fewer bytes per micro-batch over a 2-rank pipeline (tests/ranks/bytes_worker.py: tp 1 pp 2, bf16 with fp32
accumulation, micro 2 x gas 3, 3 steps), DeepSpeed's own pieces ("before") against threed's ("after"):

- the fp32 accumulation in one mixed-dtype add (threed.engine.fp32_accumulate) and the last stage letting go of its
  logits (threed.parallel.lean_engine) change no number: losses, gradient norms and fp32 master weights bit for bit;
- after each step the last stage holds no logits and no loss graph (DeepSpeed's keeps both);
- after `destroy()` the engine, its parameters and its optimizer state are freed (DeepSpeed's last stage keeps them
  through the hooks on its logits' graph).
"""

from __future__ import annotations

import json

import pytest

from helpers import RANKS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("bytes")
    rank_pool.run(2, str(RANKS / "bytes_worker.py"), ["--out", str(out)], timeout=600)
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
