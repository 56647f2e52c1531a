"""`threed plan` and the step-time model with the pipeline schedule as one more axis: the backward split into B (input
gradients) and W (weight gradients), ZB-H1 faster where the pipeline idles, the 1F1B bubble unchanged, and the
planner's choice (and its one phrase why) where ZB-H1 fits and where it does not. Pure functions of the memory and
step-time models (no engine)."""

from __future__ import annotations

import re

import pytest

from threed.convert.resolve import model_config
from threed.model.spec import matmul_parameters
from threed.cli.plan import main
from threed.plan.planner import Hardware, plan, recipe_lines
from threed.plan.layout import Layout, schedule_verdict
from threed.plan.steptime import Rates, pass_times, step_time

M70, M8 = model_config("llama3.1-70b"), model_config("llama3.1-8b")
HW = Hardware(nodes=4, gpus_per_node=8, gpu_memory_gb=80)
FLAT = Hardware(nodes=4, gpus_per_node=8, gpu_memory_gb=80, rates=Rates.flat(400))  # one rate, no per-micro cost


def test_backward_split_dgrad_equals_wgrad_attention_in_b() -> None:
    """One stage, tp 1 (no collectives, no p2p): F = 2 M + 4 s h per block, B = F + the attention scores'
    backward (another 4 s h), W = 2 M (M: matmul parameters; the LM head's too)."""
    seq, tokens, rate = 4096, 4096 * 2, FLAT.rates.mm_tflops * 1e12
    f, b, w = pass_times(M8, FLAT, 1, 1, 8, 2, seq, False)
    layers, h = M8.num_layers, M8.hidden_size
    m_blocks, m_head = layers * matmul_parameters(M8, "block"), matmul_parameters(M8, "lm_head")
    assert w == pytest.approx(tokens * 2 * (m_blocks + m_head) / rate, rel=1e-12)
    assert f == pytest.approx(tokens * (2 * (m_blocks + m_head) + layers * 4 * seq * h) / rate, rel=1e-12)
    assert b - f == pytest.approx(tokens * layers * 4 * seq * h / rate, rel=1e-12)
    # Every block recomputed: the blocks' forward (F less the LM head's) runs again in B; F and W are unchanged.
    f2, b2, w2 = pass_times(M8, FLAT, 1, 1, 8, 2, seq, True)
    assert (f2, w2) == (f, w) and b2 == pytest.approx(b + f - tokens * 2 * m_head / rate, rel=1e-12)


@pytest.mark.parametrize("sp", [False, True])
def test_zb_h1_faster_at_pp4_gas8(sp: bool) -> None:
    args = (M70, HW, 8, 4, 1, 1, 8, 8192, False, 0, sp)
    f, b, w = pass_times(M70, HW, 8, 4, 1, 1, 8192, False, sp)
    one, zb = step_time(*args), step_time(*args, schedule="zb-h1")
    assert one == pytest.approx((8 + 4 - 1) * (f + b + w), rel=1e-12)  # 1F1B: (gas + pp - 1) slowest micros
    # ZB-H1 fills the cool-down with the deferred W: about (pp - 1) W shorter, never more than (pp - 1)(F + B + W).
    assert one - 3 * (f + b + w) < zb < one - 0.5 * 3 * w
    assert step_time(M70, HW, 8, 1, 4, 1, 8, 8192, True, 0, sp, "zb-h1") == pytest.approx(
        step_time(M70, HW, 8, 1, 4, 1, 8, 8192, True, 0, sp)
    )  # one stage: nothing to fill


@pytest.mark.parametrize("sp", [False, True])
def test_1f1b_hides_backward_tp_collectives_behind_gemms_zb_h1_does_not(sp: bool) -> None:
    """megatron's 1F1B backward runs each column-parallel linear's input-gradient all-reduce (SP: reduce-scatter)
    beside its weight-gradient GEMM, and SP's re-gather beside its input-gradient GEMM: B + W is shorter than
    with every collective alone by exactly `hidden_behind_gemms`. ZB-H1's split backward hides nothing; F is the
    same under both. With free communication there is nothing to hide."""
    from threed.memory.model import stages
    from threed.plan.steptime import hidden_behind_gemms

    tp, pp, seq, tokens = 8, 4, 8192, 8192
    one = pass_times(M70, HW, tp, pp, 1, 1, seq, False, sp)
    zb = pass_times(M70, HW, tp, pp, 1, 1, seq, False, sp, "zb-h1")
    allreduce = 2 * (tp - 1) / tp * 2 * tokens * M70.hidden_size / (HW.nvlink_gbps * 1e9)
    slowest = max(stages(M70, pp, tp, seq), key=lambda st: (st.blocks, st.last))  # the LM head's stage
    hidden_b, hidden_w = hidden_behind_gemms(
        M70, tp, tokens, HW.rates.mm_tflops * 1e12, allreduce, sp, slowest.blocks, slowest.last
    )
    assert hidden_b > 0 and (hidden_w > 0) == sp
    assert one[0] == zb[0]
    assert one[1] == pytest.approx(zb[1] - hidden_b, rel=1e-12)
    regather = slowest.blocks * allreduce  # ZB-H1's W also re-gathers the row-parallel output gradients (SP)
    assert one[2] == pytest.approx(zb[2] - hidden_w - sp * regather, rel=1e-12)
    free = Hardware(nodes=4, gpus_per_node=8, gpu_memory_gb=80, nvlink_gbps=1e15, network_gbps=1e15)
    f1, b1, w1 = pass_times(M70, free, tp, pp, 1, 1, seq, False, sp)
    fz, bz, wz = pass_times(M70, free, tp, pp, 1, 1, seq, False, sp, "zb-h1")
    assert (f1, b1 + w1) == pytest.approx((fz, bz + wz), rel=1e-6)


def _layout(pp: int, gas: int, schedule: str, passes: tuple[float, float, float]) -> Layout:
    return Layout(8, pp, 1, 1, gas, None, None, 0.0, True, schedule=schedule, passes=passes)  # type: ignore[arg-type]


@pytest.mark.parametrize("pp, gas", [(2, 1), (4, 8), (8, 16), (4, 512), (1, 8)])
def test_bubble_from_the_schedule(pp: int, gas: int) -> None:
    passes = pass_times(M70, HW, 8, 4, 1, 1, 8192, False)
    assert _layout(pp, gas, "1f1b", passes).bubble == pytest.approx((pp - 1) / (gas + pp - 1), abs=1e-12)
    zb = _layout(pp, gas, "zb-h1", passes).bubble
    assert zb < (pp - 1) / (gas + pp - 1) if pp > 1 else zb == 0


def _plan(capsys, *args: str) -> str:
    code = main(
        ["--model", "llama3.1-8b", "--nodes", "1", "--gpu-memory", "80", "--seq", "8192", "--global-batch", "64", *args]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_plan_picks_zb_h1_where_it_fits_and_is_faster(capsys) -> None:
    """8B at pp 2 on GPUs with room for tp 1 (96 GB): no TP collectives, so ZB-H1's smaller bubble is all it
    changes. (On 80 GB only tp >= 2 fits, where 1F1B hides its backward's TP all-reduces behind the weight-gradient
    GEMMs and ZB-H1 cannot: there its 1.4% smaller bubble saves less than that, and 1F1B is picked.)"""
    best, every = plan(M8, Hardware(1, 8, 96), 8192, 64, pp=2, vpp=1)  # interleaving: test_planner_vpp.py
    assert best.schedule == "zb-h1" and best.fits
    twin = next(
        la
        for la in every
        if la.schedule == "1f1b"
        and (la.tp, la.dp, la.micro, la.sp, la.recompute) == (best.tp, best.dp, best.micro, best.sp, best.recompute)
    )
    assert twin.fits and best.step_s < twin.step_s and best.bubble < twin.bubble
    assert "PIPELINE_SCHEDULE=${PIPELINE_SCHEDULE-zb-h1}" in recipe_lines("llama3.1-8b", best, 64, 8192)
    out = _plan(capsys, "--pp", "2", "--gpu-memory", "96", "--vpp", "1")
    said = re.search(r"^pipeline schedule: zb-h1: bubble (\d+\.\d)% -> (\d+\.\d)%$", out, re.M)
    assert said, out
    assert float(said[1]) == round(100 * twin.bubble, 1) and float(said[2]) == round(100 * best.bubble, 1)
    assert "PIPELINE_SCHEDULE=${PIPELINE_SCHEDULE-zb-h1}" in out.splitlines()
    assert re.search(r"^ +1 +\d+ +1 +2 .* zb-h1 ", out, re.M), out  # the table's first row names it (cp 1)


def test_plan_keeps_1f1b_where_zb_h1_does_not_fit(capsys) -> None:
    """70B at tp8 pp4 without SP, 8k tokens, on GPUs with room for 1F1B's heaviest stage (stage 0: 20 blocks, 4 in
    flight) but not for ZB-H1's (stage 2: 21 blocks, 2 in flight and 2 awaiting W): ZB-H1 fits only by recomputing
    a block, which costs more than its smaller bubble saves; the planner keeps 1F1B and says so. At gas 18 (bubble
    14.3%): with 1F1B's backward hiding TP collectives that ZB-H1's cannot, plain ZB-H1 is faster only where the
    bubble is that large (at gas 512 it is slower, fitting or not)."""
    hw = Hardware(nodes=4, gpus_per_node=8, gpu_memory_gb=109.5)
    best, every = plan(M70, hw, 8192, 18, tp=8, pp=4, micro=1, sequence_parallel=False)
    assert best.schedule == "1f1b" and best.fits
    plain_zb = [la for la in every if la.schedule == "zb-h1" and not la.recompute.granularity]
    assert plain_zb and not any(la.fits for la in plain_zb)
    assert min(la.step_s for la in plain_zb) < best.step_s
    verdict = schedule_verdict(best, every)
    assert verdict.startswith("1f1b: zb-h1 fits only recomputing"), verdict
    assert all(not line.startswith("PIPELINE_SCHEDULE") for line in recipe_lines("llama3.1-70b", best, 18, 8192))


def test_plan_picks_zb_h1_where_the_bubble_is_large() -> None:
    """70B on 64 nodes (tp8 pp4 SP, dp 16) at global batch 128: gas 8, a 1F1B bubble of 27%. Under SP a micro-batch
    awaiting W keeps 1/tp of its linears' tensors (threed.model.wgrad), so ZB-H1 fits as 1F1B does and its smaller
    bubble wins. (At the recipe's 512, gas 32 and an 8.6% bubble, it no longer does: 1F1B's backward hides its TP
    reduce-scatters and re-gathers behind the weight-gradient GEMMs, ZB-H1's B and W run them alone.) At 4 nodes
    (gas 512, a 0.6% bubble) that and its W passes' re-gathers cost more than the bubble it saves: 1F1B, and the
    verdict says why."""
    best, every = plan(
        M70,
        Hardware(nodes=64, gpus_per_node=8, gpu_memory_gb=80),
        8192,
        128,
        tp=8,
        pp=4,
        micro=1,
        sequence_parallel=True,
        vpp=1,  # interleaving (4 chunks, a 2.3% bubble at this gas) beats both: tests/unit/test_planner_vpp.py
    )
    twin = next(la for la in every if la.schedule == "1f1b" and la.recompute == best.recompute and la.sp)
    assert (best.schedule, best.dp, best.gas) == ("zb-h1", 16, 8) and best.fits and best.step_s < twin.step_s
    assert twin.bubble == pytest.approx(3 / 11) and best.bubble < twin.bubble / 2
    assert best.memory.peak <= twin.memory.peak * 1.01
    best4, every4 = plan(M70, HW, 8192, 512, tp=8, pp=4, micro=1, sequence_parallel=True, vpp=1)
    assert best4.schedule == "1f1b"
    assert schedule_verdict(best4, every4).startswith("1f1b: zb-h1 is slower here")


def test_plan_schedule_restriction(capsys) -> None:
    out = _plan(capsys, "--pp", "2", "--pipeline-schedule", "1f1b")
    assert " zb-h1 " not in out and "pipeline schedule: 1f1b: the only schedule searched" in out
