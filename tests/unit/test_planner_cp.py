"""Context parallelism (CP) as one more axis of the memory model, the step-time model and `threed plan` (issue 27):
each rank's tokens are s / cp, the gathered K/V and the CP collectives are counted as threed.model.context makes
them, ZeRO-1 shards over dp x cp, and the two 128K plans list CP layouts faster than any without. Pure functions of
the models, plus one CPU probe of the CP attention's saved tensors (no engine)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from threed.cli.memory import main as memory_main
from threed.cli.plan import main as plan_main
from threed.config import ConfigError
from threed.memory.model import (
    BF16,
    activation_ratio,
    block_bytes_per_token,
    context_parallel_bytes,
    estimate,
    kv_row_bytes,
    stage_activations,
    stages,
)
from threed.convert.resolve import model_config
from threed.model.context import attend_prefix, chunk_index
from threed.plan.layout import context_parallel_verdict
from threed.plan.planner import MIN_CP_TOKENS, Hardware, plan, recipe_lines
from threed.plan.steptime import Rates, cp_collective_s, pass_times, step_time

M70, M8 = model_config("llama3.1-70b"), model_config("llama3.1-8b")
NODE = Hardware(nodes=1, gpus_per_node=8, gpu_memory_gb=80)
FREE_LINKS = dataclasses.replace(NODE, nvlink_gbps=1e15, network_gbps=1e15)  # collectives cost ~nothing


# ------------------------------------------------------------------------------------------------ memory model


def test_gathered_kv_is_the_whole_rows_k_and_v() -> None:
    """CUDA (varlen): each of the rank's two query chunks keeps a copy of its key prefix, (2cp+1) of 2cp chunks of
    the row for K and V each; CPU: the gathered row itself plus SDPA's chunk x prefix mask in bf16."""
    seq, micro, tp = 65536, 2, 4
    row = 2 * BF16 * micro * seq * M8.num_kv_heads * M8.head_dim // tp
    assert kv_row_bytes(M8, tp, seq, micro) == row
    assert context_parallel_bytes(M8, tp, 1, seq, micro) == 0
    for cp in (2, 4, 8):
        assert context_parallel_bytes(M8, tp, cp, seq, micro, "cuda") == row * (2 * cp + 1) // (2 * cp)
        c = seq // (2 * cp)
        assert context_parallel_bytes(M8, tp, cp, seq, micro, "cpu") == row + BF16 * c * (2 * cp + 1) * c


def test_cpu_count_matches_what_cp_attention_keeps_for_backward() -> None:
    """Run one rank's two query chunks (cp 2, rank 0) through threed.model.context's attention against a
    gathered row, in bf16, and sum the storages autograd keeps: the model's CPU count of q, the chunks' outputs,
    the logsumexp, the gathered K/V and the masks, to the byte."""
    cfg = dataclasses.replace(M8, hidden_size=128, num_heads=8, num_kv_heads=2)  # head_dim 16
    cp, rank, seq, b = 2, 0, 256, 1
    h, d, c = cfg.hidden_size, cfg.head_dim, seq // (2 * cp)
    q = torch.randn(2 * c, b, cfg.num_heads, d, dtype=torch.bfloat16, requires_grad=True)
    k_row, v_row = (torch.randn(seq, b, cfg.num_kv_heads, d, dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for held, j in enumerate(chunk_index(cp, rank)):
            end = (j + 1) * c
            attend_prefix(q[held * c : (held + 1) * c], k_row[:end], v_row[:end])
    tokens = seq * b // cp
    q_out_lse = (BF16 * h + BF16 * h + 4 * cfg.num_heads) * tokens  # q, the chunks' outputs, logsumexp
    assert sum(kept.values()) == q_out_lse + context_parallel_bytes(cfg, 1, cp, seq, b, "cpu")


def test_activations_scale_with_one_over_cp_plus_the_gathered_kv() -> None:
    """One stage, no recompute: at cp the per-token terms are those of seq / cp tokens (the attention's without
    the QKV output and local k, which the all-gather frees), plus the gathered K/V of every block."""
    seq, tp, cp = 131072, 8, 4
    st = stages(M8, 1, tp, seq)[0]
    at = {c: stage_activations(M8, tp, 1, st, 1, 4, seq, False, sequence_parallel=True, cp=c) for c in (1, cp)}
    assert at[cp] < at[1] / 2
    per_token = block_bytes_per_token(M8, tp, "cuda", True, cp=cp)
    assert per_token < block_bytes_per_token(M8, tp, "cuda", True)
    blocks = st.blocks * (per_token * seq // cp + 8 * seq // cp * M8.head_dim)
    assert at[cp] > blocks + st.blocks * context_parallel_bytes(M8, tp, cp, seq, 1)
    # Halving the sequence at cp 1 gives the same per-token terms as cp 2, less the gathered K/V.
    half = stage_activations(M8, tp, 1, st, 1, 4, seq // 2, False, sequence_parallel=True)
    two = stage_activations(M8, tp, 1, st, 1, 4, seq, False, sequence_parallel=True, cp=2)
    assert two > half * 0.9 and two < half * 1.5


def test_activation_ratio_is_the_models_factor() -> None:
    """The factor a CP engine's measured CPU peaks will be checked against: one stage's activations at cp over
    cp 1, as `stage_activations` counts them on CPU (the mask included)."""
    seq, st = 8192, stages(M8, 2, 1, 8192)[0]
    at = [stage_activations(M8, 1, 2, st, 1, 4, seq, False, "cpu", cp=c) for c in (2, 1)]
    assert activation_ratio(M8, 1, 2, 0, 1, 4, seq, 2) == at[0] / at[1]
    assert 0.5 < at[0] / at[1] < 0.75  # half the tokens, plus the gathered K/V and the chunk x prefix masks


def test_zero1_shards_over_dp_times_cp() -> None:
    """CP ranks hold the same weights and reduce gradients with the DP ranks: the optimizer shard of cp 2 x dp 1 is
    that of cp 1 x dp 2; weights and grads do not shrink."""
    seq = 32768
    cp2 = estimate(M70, 8, 4, 1, 1, 8, seq, True, sequence_parallel=True, cp=2)
    dp2 = estimate(M70, 8, 4, 2, 1, 8, seq, True, sequence_parallel=True)
    one = estimate(M70, 8, 4, 1, 1, 8, seq, True, sequence_parallel=True)
    for a, b, c in zip(cp2, dp2, one):
        assert a.optimizer == b.optimizer < c.optimizer * 0.51
        assert a.weights == b.weights and a.grads == c.grads


# --------------------------------------------------------------------------------------------- step-time model


def test_cp_divides_compute_and_adds_one_kv_exchange_per_block_each_way() -> None:
    """One stage, tp 1: with free links cp 2 halves every pass's compute (the zigzag chunks balance causal work)
    and keeps the per-micro-batch cost whole (each rank runs every micro-batch); with real links F adds one
    all-gather per block and B one reduce-scatter per block, plus one more all-gather per recomputed block."""
    seq, cp = 65536, 2
    flat = dataclasses.replace(FREE_LINKS, rates=Rates.flat(400))  # no per-micro-batch cost
    for one, two in zip(*(pass_times(M8, flat, 1, 1, 4, 1, seq, False, cp=c) for c in (1, cp))):
        assert two == pytest.approx(one / cp, rel=1e-6)
    free1, free2 = (pass_times(M8, FREE_LINKS, 1, 1, 4, 1, seq, False, cp=c) for c in (1, cp))
    c = FREE_LINKS.rates.micro_s
    assert c > 0 and sum(free2) == pytest.approx((sum(free1) - c) / cp + c, rel=1e-6)
    x = cp_collective_s(M8, NODE, 1, cp, seq, 1)
    assert x == pytest.approx((cp - 1) / cp * kv_row_bytes(M8, 1, seq, 1) / (NODE.nvlink_gbps * 1e9))
    f, b, w = pass_times(M8, NODE, 1, 1, 4, 1, seq, False, cp=cp)
    layers = M8.num_layers
    assert f - free2[0] == pytest.approx(layers * x, rel=1e-6) and w == pytest.approx(free2[2], rel=1e-6)
    assert b - free2[1] == pytest.approx(layers * x, rel=1e-6)
    f_rc, b_rc, _ = pass_times(M8, NODE, 1, 1, 4, 1, seq, True, cp=cp)
    free_rc = pass_times(M8, FREE_LINKS, 1, 1, 4, 1, seq, True, cp=cp)
    assert b_rc - free_rc[1] == pytest.approx(2 * layers * x, rel=1e-6)


def test_cp_group_crosses_nodes_when_tp_times_cp_exceeds_a_node() -> None:
    """megatron-core's order tp-cp-dp-pp: a CP group spans tp x cp ranks; inside a node it runs at NVLink, across
    nodes at the network share."""
    hw = Hardware(nodes=8, gpus_per_node=8, gpu_memory_gb=80)
    inside, across = cp_collective_s(M70, hw, 2, 4, 65536, 1), cp_collective_s(M70, hw, 4, 4, 65536, 1)
    # tp 4 halves each rank's K/V heads; the rest is the link.
    assert across / inside == pytest.approx(hw.nvlink_gbps / hw.network_gbps / 2)
    assert cp_collective_s(M70, hw, 8, 1, 65536, 1) == 0.0


def test_gradient_reduction_runs_over_dp_times_cp() -> None:
    """With the passes fixed, the step differs between cp 2 x dp 1 and cp 1 x dp 1 only by the DP all-reduce and
    the optimizer shard: the same as dp 2 x cp 1."""
    passes = (1.0, 1.0, 1.0)
    args = (M70, NODE, 8, 1)
    cp2 = step_time(*args, 1, 1, 4, 8192, False, 10**9, passes=passes, cp=2)
    dp2 = step_time(*args, 2, 1, 4, 8192, False, 10**9, passes=passes)
    one = step_time(*args, 1, 1, 4, 8192, False, 10**9, passes=passes)
    assert cp2 == pytest.approx(dp2) and cp2 != pytest.approx(one)


# ---------------------------------------------------------------------------------------------------- planner


@pytest.mark.parametrize(
    "model,nodes,batch",
    [(M70, 8, 32), (M8, 1, 16)],
    ids=["70b-8-nodes", "8b-1-node"],
)
def test_128k_plans_pick_cp_and_beat_every_layout_without(model, nodes, batch) -> None:
    """The issue's two 128K commands: fitting CP layouts are listed, the best has cp > 1 and a faster predicted
    step than the best without CP, and the one-line verdict names both."""
    best, every = plan(model, Hardware(nodes=nodes, gpus_per_node=8, gpu_memory_gb=80), 131072, batch)
    fitting = [la for la in every if la.fits]
    plain = next(la for la in fitting if la.cp == 1)
    assert best.cp > 1 and best.step_s < plain.step_s
    assert all(131072 % (2 * la.cp * (la.tp if la.sp else 1)) == 0 for la in every)
    assert sum(la.cp > 1 for la in fitting) >= 3
    assert best.tp * best.cp * best.pp * best.dp == nodes * 8
    verdict = context_parallel_verdict(best, every)
    assert verdict.startswith(f"context parallelism: cp{best.cp}: {best.step_s:.1f} s/step against {plain.step_s:.1f}")
    assert f"CP={best.cp}" in " ".join(recipe_lines(model.name, best, batch, 131072)).replace("${CP-", "")


def test_70b_128k_recomputes_a_smaller_share_with_cp() -> None:
    """Today's best recomputes every block; with CP the best recomputes a smaller share of its blocks."""
    best, every = plan(M70, Hardware(nodes=8, gpus_per_node=8, gpu_memory_gb=80), 131072, 32)
    plain = next(la for la in every if la.fits and la.cp == 1)
    assert plain.act_ckpt and best.recomputed / best.blocks < 1
    assert "recompute" in context_parallel_verdict(best, every)


def test_short_sequences_search_no_cp_unless_named() -> None:
    """Below MIN_CP_TOKENS per rank the search leaves CP out (its constant TFLOP/s would reward ever thinner
    micro-batches); --cp names a degree all the same."""
    _, every = plan(M8, NODE, 8192, 64, pp=2)
    assert {la.cp for la in every} == {1}
    _, named = plan(M8, NODE, 8192, 64, pp=2, cp=2)
    assert {la.cp for la in named} == {2} and 8192 // 2 < MIN_CP_TOKENS


def test_plan_refuses_a_cp_the_world_cannot_take() -> None:
    with pytest.raises(ConfigError, match=r"^--cp 3 does not divide the world of 8 GPUs .*divides 8$"):
        plan(M8, NODE, 131064, 16, cp=3)


def test_plan_refuses_a_cp_the_sequence_cannot_take() -> None:
    with pytest.raises(ConfigError, match=r"^seq_length 131072 is not a multiple of 2·cp = 2·3 = 6 ") as e:
        plan(M70, Hardware(nodes=3, gpus_per_node=8, gpu_memory_gb=80), 131072, 24, cp=3)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"2·cp·tp = 2·2·8 = 32"):
        plan(M70, Hardware(nodes=8, gpus_per_node=8, gpu_memory_gb=80), 65552, 32, cp=2, tp=8, sequence_parallel=True)


def test_plan_command_prints_the_cp_column_and_verdict(capsys) -> None:
    argv = ["--model", "llama3.1-8b", "--nodes", "1", "--gpu-memory", "80", "--seq", "131072", "--global-batch", "16"]
    assert plan_main(argv) == 0
    out = capsys.readouterr().out
    assert " cp " in out.splitlines()[1]  # the table's header
    verdict = [line for line in out.splitlines() if line.startswith("context parallelism: ")]
    assert len(verdict) == 1 and "for the best layout without CP" in verdict[0]
    assert "CP=${CP-" in out


def test_memory_command_takes_cp(capsys) -> None:
    base = ["--model", "llama3.1-8b", "--tp", "4", "--pp", "1", "--dp", "1", "--micro-batch-size", "1"]
    base += ["--grad-accum-steps", "16", "--seq-length", "131072", "--sequence-parallel"]
    gb = {}
    for cp in (1, 2):
        assert memory_main([*base, "--cp", str(cp)]) == 0
        gb[cp] = float(capsys.readouterr().out.split()[0].lstrip("~"))
    assert gb[2] < gb[1] * 0.6
    assert memory_main([*base, "--cp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert "2·cp·tp = 2·3·4 = 24" in err and "\n" not in err
