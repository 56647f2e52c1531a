"""Tied input / output embeddings (Llama 3.2) trained 3D-parallel: tp2 pp2 dp2 (8 ranks) from a tied HF Llama
equals single-process training of the same HF model (same AdamW, same batches) in losses, gradient norms and final
weights; the first and the last stage's copies of the tied weight are bit-identical after every step (fp32, and
bf16 with fp32 masters); the run resumed at tp1 pp2 dp4 through the universal checkpoint continues the loss curve.
One run on 8 gloo ranks (tests/ranks/tied_worker.py) does them all."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import RANKS, sft_examples, write_dataset, write_sft_dataset
from reference import PARITY, gpt_reference, sft_reference
from threed.config import RunConfig, TrainConfig
from threed.convert.in_memory import random_hf_state
from tied_worker import BF16_STEPS, SAVED_AT, SFT_STEPS, STEPS, tied_hf_model, tied_model_config

TOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("tied")
    data = write_dataset(out / "random", np.random.default_rng(0).integers(0, 200, 8000), 200)
    chat = write_sft_dataset(out / "chat", sft_examples(400, 200), 200)
    rank_pool.run(
        8, str(RANKS / "tied_worker.py"), ["--out", str(out), "--data", data, "--sft-data", chat], timeout=1200
    )
    final = {}
    for stage in (0, 1):
        final.update(torch.load(out / f"final_stage{stage}.pt"))
    return {
        "result": json.loads((out / "tied.json").read_text()),
        "final": final,
        "data": data,
        "chat": chat,
        "out": out,
    }


def reference(data: str):
    """Single-process training of the tied HF model: the same global batches (8 sequences), optimizer, schedule."""
    model = tied_hf_model()
    train = TrainConfig(**PARITY, micro_batch_size=2, global_batch_size=8, seq_length=32, steps=STEPS)
    losses, norms = gpt_reference(model, tied_model_config(), train, data)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor after training
    return losses, norms, {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ref(run):
    return reference(run["data"])


def close(got: list[float], want: list[float], what: str) -> None:
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= TOL * abs(b), f"step {step + 1}: {what} {a} vs reference {b}"


def test_tp2_pp2_dp2_training_equals_single_process_hf(run, ref):
    got = run["result"]["fp32"]
    ref_losses, ref_norms, _ = ref
    print(
        "3D  losses",
        got["losses"],
        "\nref losses",
        ref_losses,
        "\n3D  norms",
        got["grad_norms"],
        "\nref norms",
        ref_norms,
    )
    assert len(got["losses"]) == STEPS
    assert max(ref_norms) > 0.5, "clipping must be active (grad_clip=0.5): the norm counts the tied weight once"
    close(got["losses"], ref_losses, "loss")
    close(got["grad_norms"], ref_norms, "grad norm")


def test_final_weights_equal_single_process_hf(run, ref):
    _, _, want = ref
    final = run["final"]
    assert set(final) == set(want), set(final) ^ set(want)
    for name, tensor in want.items():
        err = (final[name] - tensor).abs().max().item()
        assert err <= TOL * max(tensor.abs().max().item(), 1.0), f"{name}: max abs diff {err}"
    # The last stage's copy (exported as lm_head.weight) is the first stage's embedding, bit for bit.
    assert torch.equal(final["lm_head.weight"], final["model.embed_tokens.weight"])


def test_the_two_copies_stay_bit_identical_after_every_step(run):
    r = run["result"]
    assert r["initial_copies_equal"]
    for run_name, steps in (("fp32", STEPS), ("universal", STEPS - SAVED_AT), ("bf16", BF16_STEPS)):
        assert r[run_name]["copies_equal"] == [True] * steps, run_name
        assert r[run_name]["moved"] == [True] * steps, f"{run_name}: the tied weight must train"
    assert r["bf16"]["optimizer"] == "BF16_Optimizer"
    assert all(np.isfinite(r["bf16"]["losses"]))


def test_resume_at_tp1_pp2_dp4_through_universal_continues_the_loss_curve(run):
    r = run["result"]
    u = r["universal"]
    assert u["start"] == SAVED_AT and u["via_universal"] and u["copies_equal_after_load"]
    print("universal", u["losses"], "\nreference", r["fp32"]["losses"][SAVED_AT:])
    close(u["losses"], r["fp32"]["losses"][SAVED_AT:], "loss after the universal resume")
    close(u["grad_norms"], r["fp32"]["grad_norms"][SAVED_AT:], "grad norm after the universal resume")


def test_activation_checkpointing_gives_the_same_numbers(run):
    r = run["result"]
    assert r["activation_checkpointing"]["losses"] == pytest.approx(r["fp32"]["losses"][:2], rel=1e-6)
    assert r["activation_checkpointing"]["grad_norms"] == pytest.approx(r["fp32"]["grad_norms"][:2], rel=1e-6)
    assert r["activation_checkpointing"]["copies_equal"] == [True, True]


def test_packed_sft_through_threed_train_equals_single_process_hf(run):
    """threed.train on packed chat data from its random init (seed 1234: `random_hf_state`, the tied weight drawn
    once) against HF's tied model trained on each example alone (tests/reference.py's sft_reference)."""
    from sft_worker import sft_config

    cfg = sft_config(run["chat"], pack=True, steps=SFT_STEPS)
    cfg = RunConfig(model=tied_model_config(), parallel=cfg.parallel, train=cfg.train, data=cfg.data)
    state = random_hf_state(cfg.model, cfg.train.seed)
    assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    losses, norms, valid, _ = sft_reference(tied_hf_model(), cfg)
    got = run["result"]["sft"]
    print("3D", got["losses"], got["grad_norms"], got["evals"], "\nref", losses, norms, valid)
    close(got["losses"], losses, "SFT loss")
    close(got["grad_norms"], norms, "SFT grad norm")
    (ev,) = got["evals"]
    assert abs(ev["loss"] - valid) <= TOL * valid


def test_export_of_the_resumed_run_loads_tied_in_transformers(run, ref, tmp_path):
    """The run resumed at tp1 pp2 dp4 saved step 10: `threed export` gives an HF folder with no lm_head.weight that
    AutoModelForCausalLM loads tied, holding the single-process reference's final weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from threed.cli.main import main

    out = tmp_path / "hf"
    assert main(["export", "--ckpt", str(run["out"] / "save"), "--out", str(out), "--quiet"]) == 0
    stored = {k for f in out.glob("*.safetensors") for k in load_file(f)}
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    _, _, want = ref
    for name, tensor in model.state_dict().items():
        err = (tensor - want[name]).abs().max().item()
        assert err <= TOL * max(want[name].abs().max().item(), 1.0), f"{name}: max abs diff {err}"
