"""threed.memory against the tensors real engines allocate, its terms at real Llama shapes, and `threed plan`.

Three runs (1, 4 and 8 CPU ranks: tp x pp x dp = 1x1x1, 1x4x1, 2x2x2) of tests/ranks/memory_worker.py, each in a launch
that has run nothing else; the one-rank run also measures the CPU activation peak of one micro-batch, the 4-rank run
also builds a 2x1x2 engine with --lora-rank (issue 38: only the adapters hold gradients and optimizer state).
"""

from __future__ import annotations

import json

import pytest

from helpers import RANKS
from threed.config import ConfigError
from threed.memory.model import (
    GB,
    block_bytes_per_token,
    estimate,
    reduce_copy_bytes,
    stage_activations,
    stage_params,
    stages,
)
from threed.plan.planner import Hardware, plan
from threed.model.spec import parameter_count
from threed.convert.resolve import model_config

LAYOUTS = {"1x1x1": (1, "1x1"), "1x4x1": (4, "1x4"), "2x2x2": (8, "2x2")}
STATIC_TOL = 0.02
LORA_LAYOUT = "2x1"  # tp 2 pp 1 dp 2 with --lora-rank, in the 4-rank launch: adapters over TP, their optimizer over DP
LORA_TOL = 0.10  # issue 38's bound for the LoRA estimate (the terms agree far closer: checked at STATIC_TOL too)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("memory")
    for name, (ranks, layout) in LAYOUTS.items():
        extra = ["--activations"] if ranks == 1 else []
        extra += ["--lora-layouts", LORA_LAYOUT] if ranks == 4 else []  # in the same launch: no start of its own
        # the gc cross-check counts every tensor of the process but those earlier requests of the launch left
        args = ["--out", str(out), "--layouts", layout, *extra]
        rank_pool.run(ranks, str(RANKS / "memory_worker.py"), args, timeout=900)
    results = {
        name: [json.loads(p.read_text()) for p in sorted(out.glob(f"static_{name}_rank*.json"))] for name in LAYOUTS
    }
    lora = [json.loads(p.read_text()) for p in sorted(out.glob("static_lora_*_rank*.json"))]
    return {"static": results, "lora": lora, "activations": json.loads((out / "activations.json").read_text())}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_static_bytes_match_engine_tensors(measured, layout: str) -> None:
    ranks = measured["static"][layout]
    assert len(ranks) == LAYOUTS[layout][0]
    for r in ranks:
        m, p = r["measured"], r["predicted"]
        assert r["optimizer"] == "BF16_Optimizer"
        assert r["parts"] == r["predicted_parts"], "threed.memory must split stages as the engine does"
        everything = m["model_states"] + m.get("buffers", 0) + m["unaccounted"]
        print(
            f"{layout} rank {r['rank']} stage {r['stage']}: model states {m['model_states']} B measured, "
            f"{p['model_states']:.0f} predicted; all live tensors {everything} measured, {p['static']:.0f} "
            f"predicted; largest unaccounted {m['largest_unaccounted'][:2]}"
        )
        # Parameters + fp32 grads + fp32 master + AdamW state, walked on the engine and its BF16_Optimizer.
        assert abs(p["model_states"] - m["model_states"]) <= STATIC_TOL * m["model_states"]
        assert abs(p["weights"] - m["weights"]) <= STATIC_TOL * m["weights"]
        assert abs(p["grads"] - m["grads"]) <= STATIC_TOL * m["grads"]
        # Every tensor the garbage collector sees after a step (RoPE caches, p2p buffers, anything the last stage
        # kept): nothing large may be left out of the model.
        assert abs(p["static"] - everything) <= STATIC_TOL * everything


def test_lora_static_bytes_match_engine_tensors(measured) -> None:
    """Under --lora-rank only the adapters have a gradient, an fp32 master and AdamW state (counted element by
    element on the engine), and the memory model's static bytes match the engine's tensors."""
    ranks = measured["lora"]
    assert len(ranks) == 4 and all(r["layout"] == [2, 1, 2] for r in ranks)
    for r in ranks:
        m, p, n = r["measured"], r["predicted"], r["counts"]
        dp = r["layout"][2]
        print(f"lora rank {r['rank']} stage {r['stage']}: {n}; model states {m['model_states']} B measured, "
              f"{p['model_states']:.0f} predicted")  # fmt: skip
        assert r["optimizer"] == "BF16_Optimizer"
        assert n["adapters"] == p["adapters"] > 0, "the model's adapter count is the engine's"
        assert n["base_trainable"] == 0 and n["base_grads"] == 0, "a frozen base weight has a gradient"
        # fp32 gradients, master and AdamW state: the adapters' (padded to 2 x dp), nothing else; ZeRO-1 over dp
        assert n["adapters"] <= n["fp32_grads"] < n["adapters"] + 2 * dp
        assert n["master"] * dp == n["fp32_grads"] and n["adam"] == 2 * n["master"]
        # the adapters' own terms, as close as a full fine-tune's
        assert abs(p["grads"] - m["grads"]) <= STATIC_TOL * m["grads"]
        assert abs(p["optimizer"] - m["master"] - m["adam"]) <= STATIC_TOL * (m["master"] + m["adam"])
        everything = m["model_states"] + m.get("buffers", 0) + m["unaccounted"]
        # issue 38's bound on the model states (the measurement counts the adapters' int64 row indices among them,
        # the model among the buffers: 2% of this tiny model); every live tensor as tight as a full fine-tune's
        assert abs(p["model_states"] - m["model_states"]) <= LORA_TOL * m["model_states"]
        assert abs(p["static"] - everything) <= STATIC_TOL * everything


def test_activation_estimate_against_cpu_peak(measured) -> None:
    """A reported comparison (the CPU composite RMSNorm and unfused SwiGLU are modelled), not a tight bound."""
    for case, r in measured["activations"].items():
        ratio = r["estimate_cpu_kernels"] / r["measured"]
        print(
            f"activations {case}: measured CPU peak {r['measured'] / 1e6:.2f} MB, estimate with CPU kernels "
            f"{r['estimate_cpu_kernels'] / 1e6:.2f} MB (ratio {ratio:.3f}), with CUDA kernels "
            f"{r['estimate_cuda_kernels'] / 1e6:.2f} MB"
        )
        assert 0.8 <= ratio <= 1.25


# --- the terms at real shapes (pure functions) ---


def test_stage_params_add_up_to_the_padded_model() -> None:
    for name, tp, pp, seq in (("llama3.1-70b", 8, 4, 8192), ("llama3.1-405b", 8, 16, 8192), ("llama2-7b", 2, 2, 4096)):
        m = model_config(name)
        matrices = norms = 0
        for st in stages(m, pp, tp, seq):
            mat, nrm = stage_params(m, tp, st)
            matrices, norms = matrices + mat * tp, norms + nrm
        padding = 2 * (m.padded_vocab_size(tp) - m.vocab_size) * m.hidden_size
        assert matrices + norms == parameter_count(m) + padding


def test_block_activation_terms_at_70b_shapes() -> None:
    m = model_config("llama3.1-70b")  # h 8192, 64 heads, 8 KV heads of 128, ffn 28672
    h, kv, f, a = 8192, 8 * 128, 28672, 64
    attention = (2 * (h + 2 * kv) + 2 * h + 2 * kv + 2 * h + 4 * a) // 8
    # CUDA: fused RMSNorm (bf16 input + fp32 rstd + bf16 output kept by the next linear), fused SwiGLU (3f).
    assert block_bytes_per_token(m, 8, "cuda") == 2 * (4 * h + 4) + attention + 3 * f * 2 // 8
    # CPU: composite RMSNorm (fp32 input, rstd, fp32 normalised, bf16 output), megatron's unfused SwiGLU (5f).
    assert block_bytes_per_token(m, 8, "cpu") == 2 * (10 * h + 4) + attention + 5 * f * 2 // 8


def test_model_state_terms_at_405b_shapes() -> None:
    m = model_config("llama3.1-405b")
    mems = estimate(m, 8, 16, 2, 1, 256, 4096, True)
    for mem in mems:
        n = mem.params
        assert n == sum(stage_params(m, 8, mem.stage))
        assert 2 * n <= mem.weights <= 2 * (n + 8)  # bf16, each group padded to 2 x dp elements
        assert mem.grads == 2 * mem.weights  # fp32 accumulation buffer: not sharded by ZeRO-1
        assert abs(mem.optimizer - 12 * n / 2) <= 64  # fp32 master + exp_avg + exp_avg_sq over dp 2
    assert mems[0].stage.first and mems[-1].stage.last
    assert 3.0e9 < max(x.params for x in mems) < 3.6e9  # 126 blocks over 16 stages, tp 8


def test_in_flight_micro_batches_and_checkpointing() -> None:
    m = model_config("llama3.1-70b")
    st = stages(m, 4, 8, 8192)
    act = {
        (s.index, ckpt, gas): stage_activations(m, 8, 4, s, 1, gas, 8192, ckpt)
        for s in st
        for ckpt in (False, True)
        for gas in (1, 64)
    }
    for ckpt in (False, True):
        # 1F1B: stage 0 holds 4 micro-batches at gas 64 and 1 at gas 1; the last stage 1 either way.
        assert act[0, ckpt, 64] > 3 * act[0, ckpt, 1]
        assert act[3, ckpt, 64] == act[3, ckpt, 1]
    assert all(act[s, True, 64] < act[s, False, 64] / 3 for s in range(4))


def test_dp_all_reduce_copy_follows_deepspeed_buckets() -> None:
    assert reduce_copy_bytes([600_000_000, 100_000]) == 0  # each group alone in its bucket: reduced in place
    assert reduce_copy_bytes([100_000_000, 100_000]) == 4 * 100_100_000  # one bucket of two: flattened copy


# --- threed plan ---


def test_plan_picks_tp8_pp4_or_better_for_70b() -> None:
    m = model_config("llama3.1-70b")
    best, every = plan(m, Hardware(nodes=4, gpus_per_node=8, gpu_memory_gb=80), 8192, 512)
    tp8pp4 = [la for la in every if (la.tp, la.pp) == (8, 4) and la.fits]
    print(
        f"best: {best.name()} {best.step_s:.1f} s, {best.memory.peak / GB:.1f} GB; tp8 pp4: "
        f"{[(la.micro, la.sp, la.recomputed, round(la.step_s, 1)) for la in tp8pp4]}"
    )
    assert best.fits and best.memory.peak <= 75 * GB
    assert tp8pp4, "the 70B recipe's layout must fit"
    assert best.step_s <= min(la.step_s for la in tp8pp4)
    assert best.tp * best.pp * best.dp == 32 and 512 == best.micro * best.gas * best.dp
    # Without sequence parallelism nothing fits unrecomputed (the issue's ~104 GB); tests/unit/test_planner_sp.py has
    # SP.
    assert not any(la.fits for la in every if not la.sp and not la.recomputed), "70B at 8k needs SP or recompute"


def run_cli(capsys, *args: str, via_threed: bool = False) -> tuple[int, str, str]:
    """`threed plan ARGS` (through threed.cli when via_threed, else threed.plan.planner's own entry point)."""
    if via_threed:
        from threed.cli.main import main

        code = main(["plan", *args])
    else:
        from threed.cli.plan import main

        code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_recipe_lines(capsys) -> None:
    code, out, err = run_cli(
        capsys,
        "--model",
        "llama3.1-70b",
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--gpu-memory",
        "80",
        "--seq",
        "8192",
        "--global-batch",
        "512",
        via_threed=True,
    )
    assert code == 0, err
    for line in (
        "MODEL=${MODEL-llama3.1-70b}",
        "GAS=${GAS-}",
        "GLOBAL=${GLOBAL-512}",
        "SEQ=${SEQ-8192}",
        "SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL-true}",
        "ACT_CKPT=${ACT_CKPT-false}",
    ):
        assert line in out.splitlines(), out
    assert any(line.startswith("TP=${TP-") for line in out.splitlines())


@pytest.mark.parametrize(
    "args, words",
    [
        (
            [
                "--model",
                "llama3.1-405b",
                "--nodes",
                "1",
                "--gpu-memory",
                "80",
                "--seq",
                "8192",
                "--global-batch",
                "512",
            ],
            ["nothing fits", "llama3.1-405b", "GB per GPU", "more nodes"],
        ),
        (
            [
                "--model",
                "llama3.1-70b",
                "--nodes",
                "4",
                "--gpu-memory",
                "80",
                "--seq",
                "8192",
                "--global-batch",
                "512",
                "--tp",
                "8",
                "--pp",
                "1",
            ],
            ["nothing fits", "tp8 pp1"],
        ),
        (
            ["--model", "llama9", "--nodes", "1", "--gpu-memory", "80", "--seq", "8192", "--global-batch", "8"],
            ["unknown model 'llama9'"],
        ),
        (
            ["--model", "llama3-8b", "--nodes", "0", "--gpu-memory", "80", "--seq", "8192", "--global-batch", "8"],
            ["--nodes must be a positive number"],
        ),
        (
            ["--model", "llama3-8b", "--nodes", "1", "--gpu-memory", "80", "--seq", "-1", "--global-batch", "8"],
            ["--seq-length must be a positive number"],
        ),
        (
            ["--model", "llama2-7b", "--nodes", "1", "--gpu-memory", "80", "--seq", "8192", "--global-batch", "8"],
            ["max_position_embeddings 4096"],
        ),
    ],
)
def test_plan_refuses_with_one_line(capsys, args: list[str], words: list[str]) -> None:
    code, out, err = run_cli(capsys, *args)
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err


def test_plan_function_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="nothing fits"):
        plan(model_config("llama3.1-405b"), Hardware(nodes=1, gpus_per_node=8, gpu_memory_gb=80), 8192, 512)
