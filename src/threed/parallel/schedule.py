"""The pipeline schedule, `--pipeline-schedule 1f1b | zb-h1`: in which order each stage runs its forward (F),
input-gradient (B) and weight-gradient (W) passes, and what that order costs in time and held activations.

    1f1b   DeepSpeed's TrainSchedule: p - 1 - s warm-up forwards on stage s, then one forward, one backward; the
           backward computes both gradients. Every stage idles (p - 1) / (gas + p - 1) of the step.
    zb-h1  Zero Bubble's ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): the same F and B
           order and the same messages, but B computes only the input gradient (what the stage before waits for)
           and stage s defers its weight gradients by s micro-batches, W(j) running after B(j + s). The deferred
           W fill the cool-down, where 1F1B stages wait for gradients; the bubble falls from (p-1)(F+B+W) to about
           (p-1)(F+B-W). Stage s holds at most p micro-batches (p - s in flight plus s awaiting W): no stage
           holds more than 1F1B's first stage.
    1f1b with --vpp V > 1: Megatron's interleaved 1F1B (Narayanan et al. 2021, section 2.2). Rank r holds V chunks,
           virtual stages r, pp + r, ..., each 1/V of its layers; a micro-batch goes through all pp x V virtual
           stages in turn, so it crosses the ranks V times. The warm-up is longer (`interleaved_order`), the bubble
           falls to (p - 1) / (V gas + p - 1), the sends between stages grow V-fold, and rank 0 holds
           p (1 + (p - 1) / (p V)) stage micro-batches of activations, not p (`held_per_chunk`).

Why ZB-H1 and not DeepSpeed's DualPipeV: see docs/schedules-and-memory.md. Why on DeepSpeed's engine: the F/B
order and every send and receive are DeepSpeed's own TrainSchedule, so ZB-H1 cannot deadlock where 1F1B does not;
the W passes are local and slot in between, and its sends do not wait for the receiver, so that a stage runs its W
instead (`threed.parallel.zero_bubble`). The weight-gradient split is `threed.model.wgrad`, on megatron-core's
Column/RowParallelLinear.

The pure part (orders, `held`, `simulate`, all per chunk) needs no torch: the memory model, the step-time model and
the planner use it. The DeepSpeed part, the engine, is `threed.parallel.zero_bubble`.
"""

from __future__ import annotations

import functools
import typing

from threed.config import ParallelConfig

# The names are the flag's choices (ParallelConfig.pipeline_schedule), listed once there.
SCHEDULES: tuple[str, ...] = typing.get_args(typing.get_type_hints(ParallelConfig)["pipeline_schedule"])


def weight_delay(schedule: str, pp: int, stage: int) -> int:
    """By how many micro-batches stage `stage` defers its weight gradients (0: W runs right after its B)."""
    return stage if schedule == "zb-h1" else 0


def stage_order(schedule: str, pp: int, gas: int, stage: int) -> list[tuple[str, int]]:
    """The passes of one stage in the order it runs them: ("F", j), ("B", j), ("W", j) for micro-batch j. Under
    1f1b "B" is the whole backward (no "W" entries). The F/B order is 1F1B's under every schedule."""
    warmup = min(pp - 1 - stage, gas)
    fb: list[tuple[str, int]] = [("F", j) for j in range(warmup)]
    for k in range(gas - warmup):
        fb += [("F", warmup + k), ("B", k)]
    fb += [("B", k) for k in range(gas - warmup, gas)]
    if schedule == "1f1b":
        return fb
    delay = weight_delay(schedule, pp, stage)
    order: list[tuple[str, int]] = []
    next_w = 0
    for kind, j in fb:
        order.append((kind, j))
        if kind == "B":
            # W(i) is due once B(i + delay) has run; the last B releases every W still pending.
            last = j if j == gas - 1 else j - delay
            order += [("W", i) for i in range(next_w, last + 1)]
            next_w = max(next_w, last + 1)
    return order


def interleaved_order(pp: int, vpp: int, gas: int, stage: int) -> list[tuple[str, int, int]]:
    """("F" | "B", micro-batch, chunk) in the order pipeline rank `stage` runs them under interleaved 1F1B (`--vpp`),
    as megatron-core 0.16.1's forward_backward_pipelining_with_interleaving does (tests/unit/test_schedule_vpp.py
    compares it with megatron's own get_schedule_table and convert_schedule_table_to_order):
      - the micro-batches go in groups of pp (megatron's microbatch_group_size_per_vp_stage, default pp): each
        group through chunk 0, then through chunk 1, ..., then the next group; backward takes the same table with
        the chunks reversed (the last chunk's backward first);
      - warm-up: 2 (pp - 1 - stage) + (vpp - 1) pp forwards, then one forward, one backward, then the cool-down.
    At vpp 1 it is 1F1B's order (`stage_order`), chunk 0, as megatron runs its non-interleaved schedule."""
    if vpp == 1:
        return [(kind, j, 0) for kind, j in stage_order("1f1b", pp, gas, stage)]
    group = pp
    table = [
        (j, c) for first in range(0, gas, group) for c in range(vpp) for j in range(first, min(first + group, gas))
    ]
    total = len(table)
    warmup = min(total, 2 * (pp - 1 - stage) + (vpp - 1) * group)
    forward = [("F", j, c) for j, c in table]
    backward = [("B", j, vpp - 1 - c) for j, c in table]
    order = forward[:warmup]
    for k in range(warmup, total):
        order += [forward[k], backward[k - warmup]]
    return order + backward[total - warmup :]


def rank_order(schedule: str, pp: int, gas: int, stage: int, vpp: int = 1) -> list[tuple[str, int, int]]:
    """(pass, micro-batch, chunk) of pipeline rank `stage` in the order it runs them: `interleaved_order` at vpp > 1
    (1f1b only: config validation refuses zb-h1 with chunks), else `stage_order`, every pass on chunk 0."""
    if vpp > 1:
        assert schedule == "1f1b", schedule
        return interleaved_order(pp, vpp, gas, stage)
    return [(kind, j, 0) for kind, j in stage_order(schedule, pp, gas, stage)]


def held_per_chunk(schedule: str, pp: int, gas: int, stage: int, vpp: int = 1) -> list[tuple[tuple[int, ...], int]]:
    """After each pass of rank `stage`: (per chunk, the micro-batches forwarded through it and not yet through its B;
    micro-batches through B awaiting W). A chunk's micro-batch holds that chunk's activations: the memory model
    weighs each chunk's count by what one micro-batch keeps there (threed.memory)."""
    live, waiting = [0] * vpp, 0
    out = []
    for kind, _, chunk in rank_order(schedule, pp, gas, stage, vpp):
        if kind == "F":
            live[chunk] += 1
        elif kind == "B":
            live[chunk] -= 1
            waiting += schedule != "1f1b"
        else:
            waiting -= 1
        out.append((tuple(live), waiting))
    return out


def held(schedule: str, pp: int, gas: int, stage: int, vpp: int = 1) -> list[tuple[int, int]]:
    """(micro-batches forwarded and not yet through B, micro-batches through B awaiting W) after each pass of the
    stage: the first holds a micro-batch's whole activations, the second only what its W needs (the linears'
    inputs and output gradients; threed.memory). At vpp > 1 the first counts chunk micro-batches, each 1/vpp of a
    stage's micro-batch when the chunks are alike (`held_per_chunk` tells them apart)."""
    return [(sum(live), waiting) for live, waiting in held_per_chunk(schedule, pp, gas, stage, vpp)]


def held_before_backward(schedule: str, pp: int, gas: int, stage: int, vpp: int = 1) -> list[tuple[int, int]]:
    """`held` just before each B of the stage (the micro-batch about to go through B among those in flight): what
    the backward's transients come on top of."""
    return [(sum(live), waiting) for _, live, waiting in chunks_before_backward(schedule, pp, gas, stage, vpp)]


def chunks_before_backward(
    schedule: str, pp: int, gas: int, stage: int, vpp: int = 1
) -> list[tuple[int, tuple[int, ...], int]]:
    """`held_per_chunk` just before each B of rank `stage`, with the chunk that B runs on: (chunk, live per chunk,
    awaiting W)."""
    before = [((0,) * vpp, 0), *held_per_chunk(schedule, pp, gas, stage, vpp)]
    order = rank_order(schedule, pp, gas, stage, vpp)
    return [(chunk, live, waiting) for (kind, _, chunk), (live, waiting) in zip(order, before) if kind == "B"]


@functools.lru_cache(maxsize=1024)
def distinct_before_backward(
    schedule: str, pp: int, gas: int, stage: int, vpp: int = 1
) -> tuple[tuple[int, tuple[int, ...], int], ...]:
    """`chunks_before_backward` with each (chunk, live per chunk, awaiting W) once, in first-seen order: what the
    memory model takes the most of (a 70B plan asks it thousands of times, of gas up to hundreds of B passes that
    hold only a few distinct counts)."""
    return tuple(dict.fromkeys(chunks_before_backward(schedule, pp, gas, stage, vpp)))


def pass_costs(schedule: str, f: float, b: float, w: float, vpp: int = 1) -> dict[str, float]:
    """What one pass of one chunk costs: a v-th of the stage's; under 1f1b B is the whole backward (b + w)."""
    return {"F": f / vpp, "B": (b + w if schedule == "1f1b" else b) / vpp, "W": w / vpp}


@functools.lru_cache(maxsize=256)
def _pass_order(schedule: str, pp: int, gas: int, vpp: int) -> tuple[tuple[int, str, int, int, tuple, tuple], ...]:
    """Every pass of a step as (rank, pass, micro-batch, chunk, its key, the key it waits for or ()), in an order
    where each pass comes after what it waits for and after the passes before it on its rank: ranks taken in turn,
    each running its passes in its order (`rank_order`) until one's input is not there yet. Which passes can run
    depends on what has run, not on what the passes cost, so `timeline` reuses one order for every cost (the
    planner asks for thousands of costs of a few shapes)."""
    orders = [rank_order(schedule, pp, gas, s, vpp) for s in range(pp)]
    last = pp * vpp - 1
    done: set[tuple] = set()
    out = []
    at = [0] * pp
    while len(out) < sum(len(o) for o in orders):
        progressed = False
        for s in range(pp):
            while at[s] < len(orders[s]):
                kind, j, chunk = orders[s][at[s]]
                k = chunk * pp + s  # the virtual stage
                if kind == "F":
                    dep = ("F", k - 1, j) if k > 0 else ()
                elif kind == "B":
                    dep = ("B", k + 1, j) if k < last else ("F", k, j)
                else:
                    dep = ()
                if dep and dep not in done:
                    break
                done.add((kind, k, j))
                out.append((s, kind, j, chunk, (kind, k, j), dep))
                at[s] += 1
                progressed = True
        assert progressed, "schedule deadlocks"
    return tuple(out)


def timeline(
    schedule: str, pp: int, gas: int, f: float = 1.0, b: float = 1.0, w: float = 1.0, vpp: int = 1
) -> list[list[tuple[str, int, int, float, float]]]:
    """Per rank, its passes as (pass, micro-batch, chunk, start, end) when every rank runs its passes in its order
    (`rank_order`) as soon as their input is there and messages are free. A pass waits for the same micro-batch on
    the virtual stage before it (F) or after it (B; the last virtual stage's B for its own F): virtual stage c x pp + r
    is chunk c of rank r, so chunk c of rank 0 waits for chunk c - 1 of rank pp - 1 (`_pass_order`)."""
    cost = pass_costs(schedule, f, b, w, vpp)
    finish: dict[tuple, float] = {}
    lanes: list[list[tuple[str, int, int, float, float]]] = [[] for _ in range(pp)]
    clock = [0.0] * pp
    for s, kind, j, chunk, key, dep in _pass_order(schedule, pp, gas, vpp):
        start = max(clock[s], finish[dep] if dep else 0.0)
        clock[s] = start + cost[kind]
        finish[key] = clock[s]
        lanes[s].append((kind, j, chunk, start, clock[s]))
    return lanes


@functools.lru_cache(maxsize=4096)
def simulate(
    schedule: str,
    pp: int,
    gas: int,
    f: float = 1.0,
    b: float = 1.0,
    w: float = 1.0,
    vpp: int = 1,
) -> tuple[float, tuple[float, ...]]:
    """(step time, each stage's idle fraction) of one step when every stage takes f, b and w per micro-batch for
    its F, B and W passes and messages are free (`timeline`). Under 1f1b a backward costs b + w. At vpp > 1 each
    chunk costs 1/vpp of them."""
    # `timeline`'s clock without its lanes: the planner simulates every layout it weighs.
    cost = pass_costs(schedule, f, b, w, vpp)
    finish: dict[tuple, float] = {}
    clock, busy = [0.0] * pp, [0] * pp
    for s, kind, _, _, key, dep in _pass_order(schedule, pp, gas, vpp):
        clock[s] = max(clock[s], finish[dep] if dep else 0.0) + cost[kind]
        finish[key] = clock[s]
        busy[s] += cost[kind]  # in each rank's order, as a sum over its lane would add them
    step = max(clock)
    return step, tuple(1 - x / step for x in busy)


def draw(schedule: str, pp: int, gas: int, vpp: int = 1, per_unit: int = 4) -> list[str]:
    """A text timeline of one step in unit costs (F = B = W = 1; a chunk a v-th of that), `per_unit` characters per
    unit: each pass is its letter and micro-batch, `F3--`, then dashes to its length; chunk 0's passes in capitals,
    a later chunk's in small letters; idle time blank. For docs/schedules-and-memory.md (tools/gen_timelines.py)."""
    lanes = timeline(schedule, pp, gas, 1.0, 1.0, 1.0, vpp)
    step, idle = simulate(schedule, pp, gas, 1.0, 1.0, 1.0, vpp)
    width = round(step * per_unit)
    name = "1f1b" if vpp == 1 else f"1f1b --vpp {vpp}"
    name = schedule if schedule != "1f1b" else name
    lines = [f"{name}, pp {pp}, gas {gas}: {step:g} units, each rank idle {max(idle):.0%}"]
    for r, lane in enumerate(lanes):
        row = [" "] * width
        for kind, j, chunk, start, end in lane:
            a, z = round(start * per_unit), round(end * per_unit)
            cell = (kind if chunk == 0 else kind.lower()) + str(j % 10)
            row[a:z] = list((cell + "-" * (z - a))[: z - a])
        lines.append(f"rank {r} |{''.join(row)}|")
    return lines
