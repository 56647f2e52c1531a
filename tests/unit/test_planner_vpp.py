"""Interleaved 1F1B (`--vpp`) in the memory model, the step-time model and the planner: each rank's chunks, rank 0's
extra micro-batches against Megatron's factor (derived from the schedule's per-chunk counts, not written in), the
bubble over v and the v-fold sends, and the planner's choice: v > 1 for the 64-node 70B recipe's shape, not for the
4-node one. Pure functions at 70B shapes, no engine."""

from __future__ import annotations

import re

import pytest

from threed.cli.main import main
from threed.convert.resolve import model_config
from threed.memory.model import estimate, stages
from threed.plan.layout import interleave_verdict
from threed.plan.planner import Hardware, plan, recipe_lines
from threed.plan.steptime import pass_times

M70 = model_config("llama3.1-70b")
TP, PP, SEQ = 8, 4, 8192


def test_each_rank_holds_its_chunks() -> None:
    for vpp in (2, 4):
        ranks = stages(M70, PP, TP, SEQ, None, vpp)
        assert [len(st.chunks) for st in ranks] == [vpp] * PP
        assert [c.index for c in ranks[1].chunks] == list(range(1, PP * vpp, PP))  # virtual stage c x pp + r
        assert all(st.blocks == sum(c.blocks for c in st.chunks) for st in ranks)
        assert sum(st.blocks for st in ranks) == M70.num_layers
        # the embedding in chunk 0 of rank 0, the head in the last chunk of the last rank, nowhere else
        firsts = [(st.index, i) for st in ranks for i, c in enumerate(st.chunks) if c.first]
        lasts = [(st.index, i) for st in ranks for i, c in enumerate(st.chunks) if c.last]
        assert firsts == [(0, 0)] and lasts == [(PP - 1, vpp - 1)]
        assert [st.first for st in ranks] == [True, False, False, False] and ranks[-1].last
    # vpp 1: no chunks, the stage is its own one part
    assert all(st.chunks == () and st.parts == (st,) for st in stages(M70, PP, TP, SEQ))


@pytest.mark.parametrize("vpp", [2, 4])
def test_first_stage_activations_follow_megatrons_factor(vpp: int) -> None:
    """Korthikanti et al. (2022): interleaving multiplies the first stage's activations by 1 + (p - 1) / (p v). The
    model finds it from the schedule's per-chunk counts and what one micro-batch keeps in each chunk; what it adds
    (each chunk keeps its own received input and output, v of them per micro-batch) moves it by about 1%."""
    one = estimate(M70, TP, PP, 16, 1, 32, SEQ, False, sequence_parallel=True)
    many = estimate(M70, TP, PP, 16, 1, 32, SEQ, False, sequence_parallel=True, vpp=vpp)
    factor = 1 + (PP - 1) / (PP * vpp)
    assert many[0].activations / one[0].activations == pytest.approx(factor, rel=0.015)
    # the weights, gradients and optimizer shard are the rank's: the same blocks as at vpp 1 (balanced either way)
    assert [m.stage.blocks for m in many] == [m.stage.blocks for m in one]
    assert [m.model_states for m in many] == [m.model_states for m in one]
    # later ranks warm up less: rank 0 stays the heaviest
    assert max(many, key=lambda m: m.activations) is many[0]


def test_interleaving_costs_one_send_per_chunk() -> None:
    """Each micro-batch crosses from every chunk to the next virtual stage: vpp sends forward and back where 1F1B has
    one. With free links the passes are 1F1B's (the same blocks per rank, a chunk a v-th of them)."""
    hw = Hardware(nodes=64, gpus_per_node=8, gpu_memory_gb=80)
    f1, b1, w1 = pass_times(M70, hw, TP, PP, 16, 1, SEQ, False, True)
    for vpp in (2, 4):
        fv, bv, wv = pass_times(M70, hw, TP, PP, 16, 1, SEQ, False, True, vpp=vpp)
        p2p = 2 * SEQ * M70.hidden_size / TP / (hw.network_gbps * 1e9)  # stages 128 ranks apart: across nodes
        assert (fv - f1, bv - b1, wv - w1) == pytest.approx(((vpp - 1) * p2p, (vpp - 1) * p2p, 0.0), rel=1e-9)
    free = Hardware(nodes=64, gpus_per_node=8, gpu_memory_gb=80, nvlink_gbps=1e15, network_gbps=1e15)
    assert pass_times(M70, free, TP, PP, 16, 1, SEQ, False, True, vpp=2) == pytest.approx(
        pass_times(M70, free, TP, PP, 16, 1, SEQ, False, True), rel=1e-9
    )


def _plan(nodes: int):
    return plan(M70, Hardware(nodes, 8, 80), SEQ, 512, tp=TP, pp=PP, micro=1, sequence_parallel=True)


def test_planner_interleaves_at_64_nodes_not_at_4() -> None:
    """The 70B recipe (tp8 pp4 SP, global batch 512): at 64 nodes, dp 16 and gas 32, 1F1B idles 8.6% of the step,
    4.5% at v 2 and 2.3% at v 4, for a few extra sends and rank 0's extra micro-batches, which fit: v > 1. At 4 nodes,
    gas 512, the bubble is 0.6%: what v would save is about what its sends cost, v 2 does not fit, and v 1 stays."""
    best, every = _plan(64)
    plain = next(la for la in every if la.vpp == 1 and la.schedule == "1f1b" and la.recompute == best.recompute)
    assert best.vpp > 1 and best.schedule == "1f1b" and best.fits and best.gas == 32
    assert best.step_s < plain.step_s and best.memory.peak > plain.memory.peak
    bubbles = {la.vpp: round(la.bubble, 3) for la in every if la.schedule == "1f1b" and la.recompute == best.recompute}
    assert bubbles == {1: 0.086, 2: 0.045, 4: 0.023}
    assert f"VPP=${{VPP-{best.vpp}}}" in recipe_lines("llama3.1-70b", best, 512, SEQ)
    assert interleave_verdict(best, every).startswith(f"vpp {best.vpp}: bubble 8.6% -> ")
    best4, every4 = _plan(4)
    assert best4.vpp == 1 and best4.gas == 512
    assert interleave_verdict(best4, every4).startswith("vpp 1: vpp ")
    assert not any(line.startswith("VPP") for line in recipe_lines("llama3.1-70b", best4, 512, SEQ))


def test_plan_and_memory_commands_take_vpp(capsys) -> None:
    argv = "plan --model llama3.1-70b --nodes 64 --gpu-memory 80 --seq-length 8192 --global-batch-size 512 --tp 8 "
    assert main((argv + "--pp 4 --micro-batch-size 1 --sequence-parallel true --vpp 2").split()) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^ +\d+ +8 +1 +4 ", line)]
    assert rows and all(re.search(r" 1f1b +2 ", line) for line in rows), out
    assert re.search(r"^interleaving: vpp 2: the only one searched", out, re.M), out
    memory = "memory --model llama3.1-70b --tp 8 --pp 4 --dp 16 --micro-batch-size 1 --grad-accum-steps 32 "
    assert main((memory + "--seq-length 8192 --sequence-parallel --vpp 2").split()) == 0
    out = capsys.readouterr().out
    assert re.search(r"bubble 4\.5%", out) and "(stage 0 of 4, 2 chunks, 2.27B params;" in out, out
    assert main((memory + "--seq-length 8192 --sequence-parallel --vpp 3").split()) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(r"threed memory: --vpp 3 cuts the 80 blocks into pp x vpp = 12 virtual stages .*", err), err
