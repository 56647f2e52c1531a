"""`threed plan` with sequence parallelism and partial recompute (issue 18): the 70B flagship at tp8 pp4, 8k tokens,
fits without recomputing every block once SP is on; the step-time model charges recompute one forward per
recomputed block and SP the same ring bytes plus megatron's backward re-gather; the recipe lines carry both.
Pure functions of the memory and step-time models (no engine)."""

from __future__ import annotations

import pytest

from threed.convert.resolve import model_config
from threed.memory.model import GB, estimate, heaviest
from threed.memory.recompute import Recompute
from threed.model.spec import layer_training_flops
from threed.plan.planner import Hardware, full_recompute_verdict, plan, recipe_lines
from threed.plan.steptime import Rates, step_time

FLAGSHIP = dict(nodes=4, gpus_per_node=8, gpu_memory_gb=80)


@pytest.fixture(scope="module")
def flagship():
    return plan(model_config("llama3.1-70b"), Hardware(**FLAGSHIP), 8192, 512)


def test_sp_layouts_fit_without_full_recompute(flagship) -> None:
    best, every = flagship
    sp_light = [la for la in every if la.fits and la.sp and not la.act_ckpt]
    assert sp_light, "SP must bring 70B at 8k under 75 GB without recomputing every block"
    assert best.sp and not best.act_ckpt
    # 1F1B's (ZB-H1's, faster, come first and do not fit: tests/unit/test_planner_schedule.py)
    tp8pp4 = [la for la in every if (la.tp, la.pp, la.micro, la.schedule, la.vpp) == (8, 4, 1, "1f1b", 1)]
    plain = next(la for la in tp8pp4 if not la.sp and not la.recomputed)
    sp = next(la for la in tp8pp4 if la.sp and not la.recomputed)
    assert plain.memory.peak > 100 * GB and not plain.fits  # the issue's ~104 GB
    assert sp.fits and sp.memory.peak < plain.memory.peak - 30 * GB
    # Faster than the best layout that recomputes every block (the 224 s).
    assert best.step_s < min(la.step_s for la in every if la.fits and la.act_ckpt)
    assert full_recompute_verdict(every).startswith("full recomputation: not needed")


def test_fewest_recomputed_blocks_is_the_least_that_fits(flagship) -> None:
    _, every = flagship
    partial = [la for la in every if 0 < la.recomputed < la.blocks]
    assert partial
    for la in partial[:6]:
        assert la.fits
        fewer = heaviest(
            estimate(
                model_config("llama3.1-70b"),
                la.tp,
                la.pp,
                la.dp,
                la.micro,
                la.gas,
                8192,
                Recompute.first_blocks(la.recomputed - 1),
                sequence_parallel=la.sp,
                vpp=la.vpp,
            )
        )
        assert fewer.peak > Hardware(**FLAGSHIP).budget, la.name()


def test_recompute_adds_one_forward_per_recomputed_block() -> None:
    m = model_config("llama3.1-70b")
    flat = Rates.flat(400)  # one rate over the full square, no per-micro-batch cost: a block's FLOPs at one rate
    hw = Hardware(nodes=1, gpus_per_node=8, gpu_memory_gb=80, rates=flat, nvlink_gbps=1e12, network_gbps=1e12)
    args = (m, hw, 8, 1, 1, 1, 1, 8192)  # pp 1: one stage of 80 blocks, communication made free
    none, four = step_time(*args, False, 10**9), step_time(*args, Recompute.first_blocks(4), 10**9)
    every = step_time(*args, True, 10**9)
    block = 8192 * layer_training_flops(m, "block", 8192, 8) / (8 * flat.mm_tflops * 1e12)
    assert four - none == pytest.approx(4 * block / 3, rel=1e-6)
    assert every - none == pytest.approx(80 * block / 3, rel=1e-6)


def test_sp_communication_is_the_ring_bytes_plus_the_backward_regather() -> None:
    m = model_config("llama3.1-70b")
    hw = Hardware(nodes=1, gpus_per_node=8, gpu_memory_gb=80, rates=Rates.flat(1e12))  # compute made free
    args = (m, hw, 8, 1, 1, 1, 1, 8192, False, 0)
    allreduce = 2 * 7 / 8 * 2 * 8192 * 8192 / (hw.nvlink_gbps * 1e9)
    extra = step_time(*args, sequence_parallel=True) - step_time(*args)
    assert extra == pytest.approx((80 + 0.5) * allreduce, rel=1e-3)  # + a half all-reduce per re-gathered input
    assert step_time(m, hw, 1, 1, 1, 1, 1, 8192, False, 0, True) == step_time(m, hw, 1, 1, 1, 1, 1, 8192, False, 0)


def test_recipe_lines_carry_sp_and_partial_recompute(flagship) -> None:
    _, every = flagship
    partial = next(la for la in every if la.fits and 0 < la.recomputed < la.blocks)
    lines = recipe_lines("llama3.1-70b", partial, 512, 8192)
    assert f"SEQUENCE_PARALLEL=${{SEQUENCE_PARALLEL-{str(partial.sp).lower()}}}" in lines
    assert "ACT_CKPT=${ACT_CKPT-false}" in lines
    assert "RECOMPUTE_METHOD=${RECOMPUTE_METHOD-block}" in lines
    assert f"RECOMPUTE_NUM_LAYERS=${{RECOMPUTE_NUM_LAYERS-{partial.recomputed}}}" in lines


def test_plan_restricted_to_no_sp_needs_recompute(capsys) -> None:
    from threed.cli.plan import main

    code = main(
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
            "4",
            "--sequence-parallel",
            "false",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert " sp " in out.splitlines()[1] and "recompute" in out.splitlines()[1]
    best = next(line for line in out.splitlines() if line.startswith("best: "))
    assert "sequence parallel" not in best and "recomputing" in best
    assert "RECOMPUTE_GRANULARITY=${RECOMPUTE_GRANULARITY-full}" in out.splitlines()
