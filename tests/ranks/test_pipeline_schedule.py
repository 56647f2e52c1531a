"""`--pipeline-schedule zb-h1` (issue 20): Zero Bubble's ZB-H1 on DeepSpeed's pipeline engine, against DeepSpeed's
1F1B. The schedule itself (its orders, what each stage holds, its idle time in unit costs) is checked without
ranks; the numbers with two runs, tp2 pp2 dp2 (8 ranks) and tp1 pp4 (4 ranks), fp32, HF's gqa31 weights,
6 steps: losses, gradient norms, final weights and evaluation equal 1F1B's, a checkpoint written under one
schedule resumes under the other, and bf16, sequence parallelism, recompute, packed rows and a tied model change
nothing either.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import RANKS, model_config, write_dataset
from threed.config import ConfigError, ParallelConfig, RunConfig, TrainConfig
from threed.parallel import zero_bubble
from threed.parallel.schedule import held, simulate, stage_order

REL = 1e-6


def passes(order, kind):
    return [j for k, j in order if k == kind]


@pytest.mark.parametrize("pp,gas", [(2, 4), (4, 8), (4, 3), (3, 7), (8, 16), (4, 1), (1, 4)])
def test_zb_h1_order_is_1f1b_plus_deferred_weight_passes(pp, gas) -> None:
    for stage in range(pp):
        zb, ref = stage_order("zb-h1", pp, gas, stage), stage_order("1f1b", pp, gas, stage)
        assert [x for x in zb if x[0] != "W"] == ref, "the F/B order (and so every message) is 1F1B's"
        assert passes(zb, "W") == list(range(gas)), "every micro-batch's W once, first in first out"
        for j in range(gas):
            assert zb.index(("W", j)) > zb.index(("B", j))
        # stage s holds up to pp micro-batches: 1F1B's first stage, never more
        most = max(live + waiting for live, waiting in held("zb-h1", pp, gas, stage))
        assert most == min(pp, gas)
        assert max(live for live, _ in held("1f1b", pp, gas, stage)) == min(pp - stage, gas)


@pytest.mark.parametrize("pp,gas", [(2, 4), (4, 8), (8, 16), (4, 32)])
def test_zb_h1_halves_the_idle_time_in_unit_costs(pp, gas) -> None:
    step_1f1b, idle_1f1b = simulate("1f1b", pp, gas)
    step_zb, idle_zb = simulate("zb-h1", pp, gas)
    bubble = (pp - 1) / (gas + pp - 1)
    assert idle_1f1b == pytest.approx([bubble] * pp)
    assert step_1f1b == pytest.approx(3 * (gas + pp - 1))
    # ZB-H1's bubble is (pp - 1)(F + B - W): a third of 1F1B's (pp - 1)(F + B + W) when the three are equal
    assert step_zb == pytest.approx(3 * gas + (pp - 1))
    assert max(idle_zb) <= max(idle_1f1b) / 2


@pytest.mark.parametrize("pp,gas", [(2, 4), (4, 8), (4, 3), (3, 5), (4, 1), (1, 3)])
def test_deepspeed_commands_are_1f1b_with_weight_passes(pp, gas) -> None:
    """ZeroBubbleSchedule keeps every command of DeepSpeed's TrainSchedule in place (so it cannot deadlock where
    1F1B does not); its WeightPass commands follow `stage_order`, never before a step's SendGrad, and all before
    the gradient reductions."""
    from deepspeed.runtime.pipe import schedule as ds

    engine = zero_bubble.ZeroBubbleEngine
    for stage in range(pp):
        fake = type("Engine", (), dict(micro_batches=gas, num_stages=pp, stage_id=stage))()
        zb = [list(cmds) for cmds in engine._train_schedule(fake)]
        ref = [list(cmds) for cmds in ds.TrainSchedule(micro_batches=gas, stages=pp, stage_id=stage)]
        assert [[repr(c) for c in s if not isinstance(c, zero_bubble.WeightPass)] for s in zb] == [
            [repr(c) for c in s] for s in ref
        ]
        flat = [c for s in zb for c in s]
        assert [c.kwargs["micro_batch"] for c in flat if isinstance(c, zero_bubble.WeightPass)] == list(range(gas))
        last_w = max(i for i, c in enumerate(flat) if isinstance(c, zero_bubble.WeightPass))
        assert last_w < next(i for i, c in enumerate(flat) if isinstance(c, ds.ReduceTiedGrads))
        for step in zb:
            kinds = [type(c).__name__ for c in step]
            if "SendGrad" in kinds and "WeightPass" in kinds:
                assert kinds.index("SendGrad") < kinds.index("WeightPass")
        # W(j) right after the step that ran B(j + stage) (or the last B)
        b_steps = {}
        for i, step in enumerate(zb):
            for c in step:
                if isinstance(c, ds.BackwardPass):
                    b_steps[len(b_steps)] = i
        for i, step in enumerate(zb):
            for c in step:
                if isinstance(c, zero_bubble.WeightPass):
                    j = c.kwargs["micro_batch"]
                    released_by = min(j + stage, gas - 1)
                    assert i in (b_steps[released_by], b_steps[released_by] + 1), (stage, j, i)


def test_zb_h1_needs_stages_to_fill() -> None:
    cfg = RunConfig(
        model=model_config("gqa31"), parallel=ParallelConfig(pipeline_schedule="zb-h1"), train=TrainConfig(steps=1)
    )
    with pytest.raises(ConfigError, match="pipeline-schedule zb-h1 needs pp > 1"):
        cfg.validate(world_size=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("schedule_data")
    return write_dataset(out / "random", np.random.default_rng(0).integers(0, 200, 5000), 200)


@pytest.fixture(scope="module")
def run_schedule(tmp_path_factory, rank_pool, data):
    """schedule_worker.py on `world` ranks with `args`, on the module's data: every rank's results."""

    def run(world: int, args: list[str]) -> list[dict]:
        out = tmp_path_factory.mktemp("schedule")
        argv = ["--out", str(out), "--data", data, *args]
        rank_pool.run(world, str(RANKS / "schedule_worker.py"), argv, timeout=1200)
        return [json.loads((out / f"schedule_rank{r}.json").read_text()) for r in range(world)]

    return run


@pytest.fixture(scope="module")
def tp2pp2(run_schedule) -> list[dict]:
    return run_schedule(8, ["--tp", "2", "--pp", "2", "--gas", "4,8", "--variants", "sp_block1,packed"])


@pytest.fixture(scope="module")
def tp2pp2_more(run_schedule) -> list[dict]:
    return run_schedule(8, ["--tp", "2", "--pp", "2", "--gas", "", "--variants", "bf16,uniform1,selective,tied"])


@pytest.fixture(scope="module")
def tp1pp4(run_schedule) -> list[dict]:
    return run_schedule(4, ["--tp", "1", "--pp", "4", "--gas", "8,3", "--variants", "tied"])


@pytest.fixture(scope="module")
def tp2pp4(run_schedule) -> list[dict]:
    """TP without sequence parallelism: DeepSpeed partitions the activations between stages (pipe_partitioned), and
    the middle stages keep W passes across received gradients."""
    return run_schedule(8, ["--tp", "2", "--pp", "4", "--gas", "8", "--variants", ""])


def assert_same_run(got: dict, want: dict, what: str, rel: float = REL) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=rel), f"{what}: losses"
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=rel), f"{what}: gradient norms"
    if "weights" in want:
        for name, (total, size) in want["weights"].items():
            assert abs(got["weights"][name][0] - total) <= rel * size, f"{what}: final weight {name}"
        if want["eval"] is not None:  # (packed rows: no evaluation)
            assert got["eval"] == pytest.approx(want["eval"], rel=rel), f"{what}: evaluation loss"


def check_parity(ranks: list[dict], runs: list[str]) -> None:
    for rank, r in enumerate(ranks):
        for run in runs:
            one, zb = r[run.replace("SCHED", "1f1b")], r[run.replace("SCHED", "zb-h1")]
            assert one["class"] == "LeanPipelineEngine" and zb["class"] == "ZeroBubbleEngine"
            assert one["grad_norms"][0] > 0.5, "a run that learns something"
            assert_same_run(zb, one, f"rank {rank} {run}")
            assert zb["deferred_per_micro_batch"] == zb["split_linears"] > 0, (
                f"rank {rank} {run}: every Column/RowParallelLinear of the stage defers its weight gradient"
            )
            assert one["deferred_per_micro_batch"] == 0, "1F1B defers nothing"


@pytest.mark.parametrize("gas", [4, 8])
def test_tp2_pp2_dp2_same_run_under_zb_h1(tp2pp2, gas) -> None:
    check_parity(tp2pp2, [f"SCHED_gas{gas}"])


@pytest.mark.parametrize("variant", ["sp_block1", "packed"])
def test_zb_h1_with_sequence_parallel_recompute_and_packed_rows(tp2pp2, variant) -> None:
    check_parity(tp2pp2, [f"{variant}_SCHED"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bf16", "uniform1", "selective", "tied"])
def test_zb_h1_with_other_switches(tp2pp2_more, variant) -> None:
    """bf16 too gives 1F1B's numbers exactly: each weight gradient is the same matmul, added into the fp32
    accumulator by the same hook, in the same micro-batch order."""
    check_parity(tp2pp2_more, [f"{variant}_SCHED"])


@pytest.mark.parametrize("gas", [8, 3])
def test_tp1_pp4_same_run_under_zb_h1(tp1pp4, gas) -> None:
    check_parity(tp1pp4, [f"SCHED_gas{gas}"])


def test_tp1_pp4_tied_model(tp1pp4) -> None:
    check_parity(tp1pp4, ["tied_SCHED"])


@pytest.mark.slow
def test_tp2_pp4_same_run_under_zb_h1(tp2pp4) -> None:
    check_parity(tp2pp4, ["SCHED_gas8"])
    for rank, r in enumerate(tp2pp4):
        whole = r["1f1b_gas8"]
        want = {"losses": whole["losses"][3:], "grad_norms": whole["grad_norms"][3:]}
        assert_same_run(r["1f1b_then_zb-h1"], want, f"rank {rank} 1f1b -> zb-h1")


@pytest.mark.parametrize("fixture", ["tp2pp2", "tp1pp4"])
@pytest.mark.parametrize("saved,resumed", [("1f1b", "zb-h1"), ("zb-h1", "1f1b")])
def test_checkpoint_resumes_under_the_other_schedule(request, fixture, saved, resumed) -> None:
    """Saved at step 3 under one schedule, resumed under the other: steps 4-6 as in the uninterrupted run."""
    ranks = request.getfixturevalue(fixture)
    gas = 4 if fixture == "tp2pp2" else 8
    for rank, r in enumerate(ranks):
        whole = r[f"{saved}_gas{gas}"]
        got = r[f"{saved}_then_{resumed}"]
        want = {"losses": whole["losses"][3:], "grad_norms": whole["grad_norms"][3:]}
        assert_same_run(got, want, f"rank {rank} {saved} -> {resumed}")


def test_weight_passes_count_as_compute_in_the_stage_metrics() -> None:
    """threed.metrics.stages times every instruction of the engine's own map: a W pass is compute, so the idle
    fraction (p2p / (compute + p2p)) of a zb-h1 stage is its waits, not its weight gradients."""
    from deepspeed.runtime.pipe import schedule as ds

    from threed.metrics.stages import _instruction_buckets

    engine = zero_bubble.ZeroBubbleEngine
    buckets = _instruction_buckets()
    assert buckets[zero_bubble.WeightPass] == buckets[ds.BackwardPass] == "compute"
    assert set(engine._INSTRUCTION_MAP) <= set(buckets), "every instruction of the zb-h1 engine is timed"


def test_weight_pass_is_one_autograd_call_with_one_gradient_alive_at_a_time(monkeypatch) -> None:
    """A W pass hands the micro-batch's deferred weight gradients to autograd in one call (not one per linear),
    in the order its B met the linears, and each reaches its weight's AccumulateGrad (DeepSpeed's hook: add to the
    fp32 accumulator, free the bf16 .grad) before the next one is computed: one gradient alive at a time."""
    import torch

    from threed.model.wgrad import DeferredWeightGrads

    weights = [torch.nn.Parameter(torch.zeros(3, 2)) for _ in range(4)]
    fp32 = [torch.zeros(3, 2, dtype=torch.float64) for _ in weights]
    events: list[tuple[str, int, int]] = []

    def alive() -> int:
        return sum(w.grad is not None for w in weights)

    def hook(i: int):
        def accumulate(p: torch.Tensor) -> None:
            events.append(("acc", i, alive()))
            fp32[i] += p.grad
            p.grad = None

        return accumulate

    def compute(i: int) -> torch.Tensor:
        events.append(("W", i, alive()))
        return torch.full((3, 2), float(i + 1))

    for i, w in enumerate(weights):
        w.register_post_accumulate_grad_hook(hook(i))
    queue = DeferredWeightGrads()
    for _ in range(2):  # two micro-batches: two groups, first in first out
        with queue.deferring():
            for i, w in enumerate(weights):
                queue.put((w, lambda i=i: compute(i)))
    calls = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: (calls.append(1), backward(*a, **k))[1])
    queue.run_oldest()
    assert len(calls) == 1 and queue.pending() == 1
    assert events == [e for i in range(4) for e in (("W", i, 0), ("acc", i, 1))]
    queue.run_oldest()
    assert len(calls) == 2 and queue.pending() == 0
    assert [float(f[0, 0]) for f in fp32] == [2.0, 4.0, 6.0, 8.0]
