"""8-rank (tp=2, pp=2, dp=2) training against a single-process HuggingFace reference (tests/reference.py), bf16
against fp32, checkpoint save/resume, and the start-up group check. One run on 8 gloo ranks does them all."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import RANKS, learnable_tokens, model_config, write_dataset
from reference import gqa31_reference
from threed.convert.in_memory import random_hf_state

FP32_TOL = 1e-5
BF16_REL_TOL = 0.05  # bf16 activations/weights (fp32 master + accumulation) stay within 5% of the fp32 loss
BF16_STEPS = 20


@pytest.fixture(scope="module")
def run(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("train")
    rng = np.random.default_rng(0)
    data = write_dataset(out / "random", rng.integers(0, 200, 5000), 200)
    learn = write_dataset(out / "learn", learnable_tokens(40000), 200, doc_len=(400, 2000))
    rank_pool.run(
        8,
        str(RANKS / "dist_worker.py"),
        ["train", "--out", str(out), "--data", data, "--learnable", learn, "--bf16-steps", str(BF16_STEPS)],
        timeout=1200,
    )
    ranks = [json.loads((out / f"train_rank{r}.json").read_text()) for r in range(8)]
    return {"ranks": ranks, "data": data}


def test_fp32_3d_training_matches_single_process_hf(run):
    ref_losses, ref_norms = gqa31_reference(run["data"])
    got = run["ranks"][0]["fp32"]
    print("3D losses", got["losses"], "\nref losses", ref_losses)
    print("3D norms ", got["grad_norms"], "\nref norms ", ref_norms)
    assert max(ref_norms) > 0.5, "clipping must be active in this test (grad_clip=0.5)"
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert abs(a - b) <= FP32_TOL * abs(b), f"step {step + 1}: loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], ref_norms)):
        assert abs(a - b) <= FP32_TOL * abs(b), f"step {step + 1}: grad norm {a} vs reference {b}"


def test_fp32_3d_training_from_random_init_matches_single_process(run):
    """No HF weights: the 8-rank run's own random init (seed 1234) is `random_hf_state(model, 1234)`."""
    ref_losses, ref_norms = gqa31_reference(run["data"], state=random_hf_state(model_config("gqa31"), 1234))
    got = run["ranks"][0]["fp32_random"]
    print("3D losses", got["losses"], "\nref losses", ref_losses)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert abs(a - b) <= FP32_TOL * abs(b), f"step {step + 1}: loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], ref_norms)):
        assert abs(a - b) <= FP32_TOL * abs(b), f"step {step + 1}: grad norm {a} vs reference {b}"


def test_every_rank_agrees_on_loss(run):
    losses = {tuple(r["fp32"]["losses"]) for r in run["ranks"]}
    assert len(losses) == 1, "the loss is broadcast to every stage and replica"


def test_bf16_micro_gt1_gas_gt1_trains_close_to_fp32(run):
    r = run["ranks"][0]
    bf16, fp32 = r["learn_bf16"]["losses"], r["learn_fp32"]["losses"]
    print("bf16", bf16, "\nfp32", fp32)
    assert r["learn_bf16"]["optimizer"] == "BF16_Optimizer", "fp32 grad accumulation selects BF16_Optimizer"
    assert all(np.isfinite(bf16))
    assert bf16[-1] < bf16[0] - 1.0, "bf16 loss must fall"
    rel = max(abs(a - b) / b for a, b in zip(bf16, fp32))
    assert rel < BF16_REL_TOL, f"bf16 drifts {rel:.3f} from fp32 (tolerance {BF16_REL_TOL})"


def test_resume_is_bit_exact(run):
    for r in run["ranks"]:
        assert r["resume"]["step"] == 3
        assert r["resume"]["weights_equal"]
        assert r["resume"]["losses"] == r["fp32"]["losses"][3:]
        # The gradient norm too: it catches TP weights that lost megatron's `tensor_model_parallel` tag.
        assert r["resume"]["grad_norms"] == r["fp32"]["grad_norms"][3:]


def test_activation_checkpointing_gives_the_same_numbers(run):
    r = run["ranks"][0]
    assert r["activation_checkpointing"]["losses"] == pytest.approx(r["fp32"]["losses"][:2], rel=1e-6)
    assert r["activation_checkpointing"]["grad_norms"] == pytest.approx(r["fp32"]["grad_norms"][:2], rel=1e-6)


def test_megatron_groups_equal_deepspeed_grid(run):
    for rank, r in enumerate(run["ranks"]):
        tp_first = rank - rank % 2
        assert r["groups"]["tp"] == [tp_first, tp_first + 1]
        assert r["groups"]["pp"] == [rank % 4, rank % 4 + 4]
        assert r["groups"]["dp"] == [rank - (rank % 4 // 2) * 2, rank - (rank % 4 // 2) * 2 + 2]
        assert r["mismatch_detected"], f"rank {rank}: a grid in another rank order was not rejected"
