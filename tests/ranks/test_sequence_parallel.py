"""Sequence parallelism (megatron-core's, `--sequence-parallel`) at tp2 pp2 dp2 (8 ranks, fp32) against the same run
without it and against single-process HF training: losses, gradient norms and final weights within 1e-5, the
replicated norm weights bit-identical on every TP rank after every step; each rank sends its own [s/tp, b, h] to the
next stage with no TP all-gather after the receive (counted on DeepSpeed's send and gather paths); packed SFT rows
through threed.train; checkpoints resume with sequence parallelism switched on or off, natively and through the
universal checkpoint. One run on 8 gloo ranks (tests/ranks/sp_worker.py) does them all."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import RANKS, hf_model, model_config, sft_examples, write_dataset, write_sft_dataset
from reference import gqa31_reference, sft_reference
from sft_worker import sft_config
from sp_worker import MICRO, SAVED_AT, SEQ, SFT_STEPS, STEPS

TOL = 1e-5
HIDDEN = model_config("gqa31").hidden_size


@pytest.fixture(scope="module")
def run(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("sp")
    data = write_dataset(out / "random", np.random.default_rng(0).integers(0, 200, 8000), 200)
    chat = write_sft_dataset(out / "chat", sft_examples(400, 200), 200)
    rank_pool.run(8, str(RANKS / "sp_worker.py"), ["--out", str(out), "--data", data, "--sft-data", chat], timeout=1500)
    final = {
        name: {k: v for s in (0, 1) for k, v in torch.load(out / f"final_{name}_stage{s}.pt").items()}
        for name in ("plain", "sp")
    }
    return {"result": json.loads((out / "sp.json").read_text()), "final": final, "data": data, "chat": chat}


@pytest.fixture(scope="module")
def ref(run):
    losses, norms = gqa31_reference(run["data"], steps=STEPS)
    return losses, norms


def close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want), (got, want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= TOL * abs(b), f"step {step + 1}: {what} {a} vs {b}"


def test_sequence_parallel_equals_plain_tp_and_single_process_hf(run, ref):
    r = run["result"]
    ref_losses, ref_norms = ref
    print("sp   ", r["sp"]["losses"], "\nplain", r["plain"]["losses"], "\nhf   ", ref_losses)
    assert max(ref_norms) > 0.5, "clipping must be active (grad_clip=0.5)"
    for name in ("sp", "plain"):
        close(r[name]["losses"], ref_losses, f"{name} loss vs HF")
        close(r[name]["grad_norms"], ref_norms, f"{name} grad norm vs HF")
    close(r["sp"]["losses"], r["plain"]["losses"], "sp loss vs plain")
    close(r["sp"]["grad_norms"], r["plain"]["grad_norms"], "sp grad norm vs plain")


def test_final_weights_equal(run):
    sp, plain = run["final"]["sp"], run["final"]["plain"]
    assert set(sp) == set(plain) and "model.norm.weight" in sp and "model.layers.0.input_layernorm.weight" in sp
    for name, want in plain.items():
        err = (sp[name] - want).abs().max().item()
        assert err <= TOL * max(want.abs().max().item(), 1.0), f"{name}: max abs diff {err}"
    # The norms moved: their gradients (partial sums per TP rank under SP) were summed and applied.
    start = hf_model("gqa31").state_dict()
    assert not torch.equal(sp["model.layers.0.input_layernorm.weight"], start["model.layers.0.input_layernorm.weight"])


def test_norm_weights_identical_over_tp_after_every_step(run):
    for name in ("sp", "plain"):
        assert run["result"][name]["norms_equal_over_tp"] == [True] * STEPS, name


def test_each_rank_sends_its_own_shard_with_no_gather_after_the_receive(run):
    """Activations [s, b, h] per micro-batch: 1/tp per rank both ways; with SP the rank's own [s/tp, b, h] goes as
    it is (no PartitionedTensor, no all-gather over TP on the receiving side)."""
    shard = SEQ * MICRO * HIDDEN // 2
    for name, gathers in (("sp", False), ("plain", True)):
        traffic = run["result"][name]["traffic"]
        assert len(traffic) == 8
        for rank in traffic:
            sizes = {int(k): v for k, v in rank["sent"].items()}
            assert sizes.get(shard, 0) > 0, (name, rank)  # activations (stage 0) or their gradients (stage 1)
            assert max(sizes) == shard, (name, rank)  # nothing larger than a shard crosses
            assert (rank["gathers"] > 0) == gathers, (name, rank)


@pytest.mark.parametrize(
    "name,universal",
    [("sp_to_plain", False), ("plain_to_sp", False), ("sp_to_tp1pp2", True), ("plain_to_sp_tp2pp1", True)],
)
def test_resume_switching_sequence_parallelism_continues_the_loss_curve(run, name, universal):
    r = run["result"]
    got = r[name]
    src = "sp" if name.startswith("sp") else "plain"
    assert got["start"] == SAVED_AT and got["universal"] == universal
    close(got["losses"], r[src]["losses"][SAVED_AT:], f"{name} loss")
    close(got["grad_norms"], r[src]["grad_norms"][SAVED_AT:], f"{name} grad norm")


def test_packed_sft_with_sequence_parallelism_equals_single_process_hf(run):
    losses, norms, valid, _ = sft_reference(hf_model("gqa31"), sft_config(run["chat"], True, SFT_STEPS))
    got = run["result"]["sft_sp"]
    print("sp sft", got["losses"], "\nhf", losses)
    close(got["losses"], losses, "packed SFT loss")
    close(got["grad_norms"], norms, "packed SFT grad norm")
    (ev,) = got["evals"]
    assert abs(ev["loss"] - valid) <= TOL * valid
