"""Interleaved 1F1B (`--vpp`): the order each rank runs its (F/B, micro-batch, chunk) passes equals megatron-core
0.16.1's own schedule table, called here (threed.parallel.schedule must not import megatron); the round-robin chunks
of `RunDims`; and the rules a config at vpp > 1 can break, each refused in one line before anything is built."""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
from pathlib import Path
from types import SimpleNamespace

import pytest

from threed.cli.flags import parse_run_config
from threed.config import ConfigError, ParallelConfig, RunConfig, TrainConfig
from threed.convert.resolve import model_config
from threed.model.spec import pipeline_layers
from threed.parallel.dims import resolve_dims
from threed.parallel.schedule import (
    chunks_before_backward,
    draw,
    held,
    held_per_chunk,
    interleaved_order,
    simulate,
    stage_order,
)

ROOT = Path(__file__).resolve().parents[2]


def megatron_order(pp: int, vpp: int, gas: int, stage: int) -> list[tuple[str, int, int]]:
    """megatron-core's interleaved order for rank `stage`: its warm-up count (get_pp_rank_microbatches, on a stand-in
    for its p2p communicator), its table (get_schedule_table) and the F/B interleave of that table that its CUDA-graph
    capture uses (convert_schedule_table_to_order: c + 1 for chunk c's F, -(c + 1) for its B)."""
    from megatron.core.pipeline_parallel import schedules  # megatron-core: heavy, the reference only
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order  # megatron-core, as above

    group = pp  # ModelConfig.microbatch_group_size_per_vp_stage: None means pp
    comm = SimpleNamespace(
        pp_group=SimpleNamespace(size=lambda: pp, rank=lambda: stage), virtual_pipeline_model_parallel_size=vpp
    )
    _, _, warmup, _ = schedules.get_pp_rank_microbatches(gas, vpp, group, p2p_communicator=comm)
    table = schedules.get_schedule_table(gas, vpp, group)
    signed = convert_schedule_table_to_order(warmup, vpp, table)
    # Each chunk runs its micro-batches in table order, forward and backward alike (FIFO per chunk).
    next_index = {("F", c): iter(j for j, cc in table if cc == c) for c in range(vpp)}
    next_index.update({("B", c): iter(j for j, cc in table if cc == c) for c in range(vpp)})
    out = []
    for x in signed:
        kind, chunk = ("F", x - 1) if x > 0 else ("B", -x - 1)
        out.append((kind, next(next_index[(kind, chunk)]), chunk))
    return out


# (pp, vpp, micro-batches) megatron takes: gas a multiple of pp (its group size), from one group to several, with
# warm-ups that cover all micro-batches (pp 4, vpp 4, gas 4) and ones that do not.
CASES = [(pp, vpp, k * pp) for pp, vpp, k in itertools.product((2, 3, 4, 8), (2, 3, 4), (1, 2, 3))] + [
    (2, 2, 16),
    (4, 2, 32),
    (16, 2, 32),
]


def test_the_grid_is_large_enough() -> None:
    assert len(CASES) >= 20


@pytest.mark.parametrize("pp, vpp, gas", CASES)
def test_order_equals_megatron_core(pp: int, vpp: int, gas: int) -> None:
    for stage in range(pp):
        ours = interleaved_order(pp, vpp, gas, stage)
        assert ours == megatron_order(pp, vpp, gas, stage), (pp, vpp, gas, stage)
        # every (micro-batch, chunk) once forward and once backward, the backward after the forward
        assert sorted(ours) == sorted((k, j, c) for k in "BF" for j in range(gas) for c in range(vpp))
        assert all(ours.index(("F", j, c)) < ours.index(("B", j, c)) for j in range(gas) for c in range(vpp))


def test_pp2_vpp2_gas4_by_hand() -> None:
    # Rank 0: warm-up 2 x 1 + 1 x 2 = 4 forwards (group 0 through chunk 0, then chunk 1), then 1F1B; the first
    # backward is chunk 1's (the last virtual stage's) of micro-batch 0.
    assert interleaved_order(2, 2, 4, 0) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1), ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0),
        ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0),
    ]  # fmt: skip


def test_vpp1_is_1f1b() -> None:
    for pp, gas, s in itertools.product((1, 2, 4), (1, 3, 8), range(4)):
        if s < pp:
            assert interleaved_order(pp, 1, gas, s) == [(k, j, 0) for k, j in stage_order("1f1b", pp, gas, s)]


def _cfg(model: str = "tiny", gas: int = 4, **parallel) -> RunConfig:
    return RunConfig(
        model=model_config(model), parallel=ParallelConfig(**parallel), train=TrainConfig(grad_accum_steps=gas)
    )


def test_megatrons_other_names_say_the_same() -> None:
    """Megatron's --virtual-pipeline-model-parallel-size and --num-virtual-stages-per-pipeline-rank are --vpp;
    --num-layers-per-virtual-pipeline-stage N sets vpp = blocks / (pp x N), so every reader finds it in vpp."""
    base = ["--model", "tiny", "--pp", "2", "--grad-accum-steps", "4"]
    for flag in ("--vpp", "--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank"):
        assert parse_run_config([*base, flag, "2"]).parallel.vpp == 2
    cfg = parse_run_config([*base, "--num-layers-per-virtual-pipeline-stage", "1"])
    assert cfg.parallel.vpp == 2 and RunConfig.from_dict(cfg.to_dict()) == cfg
    assert parse_run_config([*base, "--num-layers-per-virtual-pipeline-stage", "2"]).parallel.vpp == 1


def test_chunks_round_robin() -> None:
    # tiny: 4 blocks; pp 2 x vpp 2 = 4 virtual stages of one block each; virtual stage k = chunk c x pp + rank r.
    cfg = _cfg(tp=1, pp=2, vpp=2)
    cfg.validate(2)
    dims = resolve_dims(cfg, 2)
    layers = [la.kind if la.kind != "block" else f"b{la.block}" for la in pipeline_layers(cfg.model)]
    assert dims.vpp == 2 and len(dims.bounds) == 5
    names = [[layers[a:b] for a, b in dims.chunks(r)] for r in range(2)]
    assert names == [[["embedding", "b0"], ["b2"]], [["b1"], ["b3", "final_norm", "lm_head"]]]
    assert dims.stages(cfg.model) == "0: embedding + block 0, block 2 | 1: block 1, block 3 + final_norm + lm_head"
    # vpp 1: one chunk per rank, today's bounds
    one = resolve_dims(_cfg(tp=1, pp=2), 2)
    assert [one.chunks(r) for r in range(2)] == [[(one.bounds[0], one.bounds[1])], [(one.bounds[1], one.bounds[2])]]
    assert len(one.bounds) == 3


@pytest.mark.parametrize(
    "parallel, gas, message",
    [
        ({"pp": 1, "vpp": 2}, 4, r"^--vpp 2 needs pp > 1 .*use --pipeline-model-parallel-size 2 or more$"),
        ({"pp": 2, "vpp": 2, "pipeline_schedule": "zb-h1"}, 4, r"^--vpp 2 with --pipeline-schedule zb-h1 is not built"),
        ({"pp": 2, "vpp": 3}, 4, r"^--vpp 3 cuts the 4 blocks into pp x vpp = 6 virtual stages .*use --vpp 1 or 2$"),
        ({"pp": 2, "vpp": 2}, 3, r"^--vpp 2: interleaved 1F1B runs the micro-batches in groups of pp = 2 .*3 micro"),
    ],
)
def test_refusals(parallel: dict, gas: int, message: str) -> None:
    world = parallel["pp"]
    with pytest.raises(ConfigError, match=message) as e:
        _cfg(gas=gas, tp=1, **parallel).validate(world)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("pp, vpp, gas", [(2, 2, 4), (4, 2, 8), (4, 2, 32), (4, 4, 32), (8, 2, 16), (16, 2, 32)])
def test_simulated_bubble_is_interleaved_theory(pp: int, vpp: int, gas: int) -> None:
    """Narayanan et al. 2021: the bubble of interleaved 1F1B is (pp - 1) / (vpp gas + pp - 1) of the step (1F1B's at
    vpp 1); the simulation of megatron's order, with chunk c of rank 0 waiting for chunk c - 1 of rank pp - 1, finds
    it for uneven F and B too."""
    for f, b in ((1.0, 1.0), (1.0, 2.0)):
        step, idle = simulate("1f1b", pp, gas, f, b, 0.5, vpp)
        theory = (pp - 1) / (vpp * gas + pp - 1)
        assert idle == pytest.approx((theory,) * pp, rel=1e-9)
        assert step == pytest.approx((gas + (pp - 1) / vpp) * (f + b + 0.5), rel=1e-12)
    # the numbers: the 64-node 70B recipe's pp 4, gas 32: 8.6% -> 4.5% at vpp 2, 2.3% at vpp 4
    assert [round(max(simulate("1f1b", 4, 32, 1, 1, 1, v)[1]), 3) for v in (1, 2, 4)] == [0.086, 0.045, 0.023]


@pytest.mark.parametrize("pp, vpp, gas", [(2, 2, 4), (4, 2, 8), (4, 4, 32), (8, 2, 16), (8, 3, 24)])
def test_first_rank_holds_megatrons_count(pp: int, vpp: int, gas: int) -> None:
    """Rank 0 holds at most 2 (pp - 1) + (vpp - 1) pp + 1 chunk micro-batches: in a stage's micro-batches (each
    chunk 1/vpp of the stage), pp (1 + (pp - 1) / (pp vpp)), the factor of Korthikanti et al. (2022) for
    interleaving; rank r holds 2 r chunk micro-batches fewer (its warm-up is shorter)."""
    counts = [max(live for live, _ in held("1f1b", pp, gas, r, vpp)) for r in range(pp)]
    assert counts[0] / vpp == pytest.approx(pp * (1 + (pp - 1) / (pp * vpp)), rel=1e-12)
    assert counts == [2 * (pp - 1 - r) + (vpp - 1) * pp + 1 for r in range(pp)]
    # per chunk: the warm-up's forwards go through every chunk, the first chunk holds the most
    per_chunk = [max(live[c] for live, _ in held_per_chunk("1f1b", pp, gas, 0, vpp)) for c in range(vpp)]
    assert per_chunk[0] == max(per_chunk) and sum(per_chunk) >= counts[0]
    before = chunks_before_backward("1f1b", pp, gas, 0, vpp)
    assert len(before) == gas * vpp and all(live[c] >= 1 for c, live, _ in before)  # the B's own micro-batch


def test_vpp1_keeps_the_old_counts() -> None:
    """At vpp 1 the chunk-aware functions are the stage's: one chunk, the counts `held` always gave."""
    for schedule, pp, gas in itertools.product(("1f1b", "zb-h1"), (2, 4), (1, 4, 8)):
        for s in range(pp):
            per = held_per_chunk(schedule, pp, gas, s)
            assert [(live[0], w) for live, w in per] == held(schedule, pp, gas, s)
            assert max(live for live, _ in held(schedule, pp, gas, s)) == min(pp - s, gas)
        step, _ = simulate(schedule, pp, gas, 1.0, 1.0, 1.0)
        if schedule == "1f1b":
            assert step == (gas + pp - 1) * 3.0


def test_the_docs_timelines_are_current() -> None:
    """docs/schedules-and-memory.md's figure is what tools/gen_timelines.py draws from the schedule model today."""
    spec = importlib.util.spec_from_file_location("gen_timelines", ROOT / "tools" / "gen_timelines.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    text = gen.DOC.read_text()
    assert gen.BEGIN in text and text == gen.render(text), "stale: run `make docs` (tools/gen_timelines.py)"
    # the drawing is the timeline: rank 0 at pp 2, vpp 2, gas 4 starts with group 0 through chunk 0, then chunk 1
    assert draw("1f1b", 2, 4, 2)[1] == "rank 0 |F0F1f0f1F2  b0--F3b1--f2B0--f3B1--  b2--  b3--B2--B3--|"


def test_the_logged_ideal_bubble_is_the_simulated_one() -> None:
    """The metrics' `pipeline/ideal-bubble` (each stage's idle fraction is logged beside it) is the schedule model's
    idle fraction in unit costs, interleaved or not."""
    from threed.metrics.stages import ideal_bubble  # DeepSpeed and torch: heavy, only this test needs them

    for pp, gas, vpp in ((2, 4, 1), (2, 4, 2), (4, 32, 1), (4, 32, 2), (4, 32, 4), (8, 16, 2)):
        assert ideal_bubble(pp, gas, vpp) == pytest.approx(max(simulate("1f1b", pp, gas, 1, 1, 1, vpp)[1]), rel=1e-12)


def test_recompute_counts_blocks_per_virtual_stage() -> None:
    """Megatron's --recompute-num-layers N counts per virtual stage at vpp > 1; a refusal names the chunk."""
    recompute = dict(recompute_granularity="full", recompute_method="block")
    ok = RunConfig(
        model=model_config("tiny"),
        parallel=ParallelConfig(pp=2, vpp=2),
        train=TrainConfig(grad_accum_steps=4, recompute_num_layers=1, **recompute),
    )
    assert resolve_dims(ok, 2).recompute_phrase == "full, block: the first 1 of 1 blocks on each of 4 virtual stages"
    two = dataclasses.replace(ok, train=dataclasses.replace(ok.train, recompute_num_layers=2))
    with pytest.raises(ConfigError, match=r"^--recompute-method block --recompute-num-layers 2: virtual stage 0 "):
        resolve_dims(two, 2)
