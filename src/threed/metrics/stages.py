"""Per-stage pipeline timing: DeepSpeed's PipelineEngine instruction handlers wrapped on one engine instance, and
one all-gather per log interval that brings every rank's numbers to the metrics writer.

Each 1F1B instruction falls in one bucket:
  compute    LoadMicroBatch, ForwardPass, BackwardPass, and zb-h1's WeightPass (threed.parallel.zero_bubble)
  p2p        SendActivation, RecvActivation, SendGrad, RecvGrad (time blocked on the neighbouring stage), and the
             interleaved engine's Exchange (threed.parallel.interleaved: RecvActivation / RecvGrad wait there)
  dp-reduce  ReduceGrads, ReduceTiedGrads (ZeRO-1 gradient reduction over DP)
  optimizer  OptimizerStep
  loss-sync  DeepSpeed's loss averaging over DP and broadcast over the pipe (earlier stages wait there for the last
             stage to finish its optimizer step)
plus `iteration`, the wall time of the whole `train_batch`; what the buckets leave of it is schedule bookkeeping.
On CPU the host clock times each instruction; on CUDA events on the compute stream do (`StreamClock`): timing never
waits for NCCL's streams, so it cannot make ZB-H1's sends wait for their receivers.

The idle fraction of a stage is p2p / (compute + p2p): the share of the pipelined (forward/backward) phase a
stage spends waiting on its neighbours. With equal stages it is the bubble (pp-1)/(gas+pp-1), at --vpp v
(pp-1)/(v gas+pp-1); more means imbalance or slow transfers. Only `train_batch` is timed: `eval_batch` runs the
same handlers and is not counted.

At --vpp v > 1 each rank runs v chunks, and the interleaved engine's instructions name theirs (`chunk`): the
compute and the waits of each chunk are also counted apart (`chunk<c>/` keys). A chunk's idle fraction is the wait
for its inputs (RecvActivation / RecvGrad of the chunk) over the rank's compute + p2p, so a rank's chunks add up
to its idle fraction but for the posting of each tick's messages (Exchange, which serves every chunk at once): it
shows which chunk's inputs the rank waits for (the first chunk's at the start of the step, the last's at the end).
"""

from __future__ import annotations

import resource
import time
from types import MethodType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from threed.parallel.interleaved import Exchange
from threed.parallel.zero_bubble import WeightPass

BUCKETS = ("iteration", "compute", "p2p", "dp-reduce", "optimizer", "loss-sync")
# One row per rank in the all-gather: stage, steps in the window, the buckets (seconds), memory now and peak; then,
# at vpp > 1, CHUNK_BUCKETS of each chunk (every rank of a run has the same vpp, so the rows have one length).
ROW = ("stage", "steps", *BUCKETS, "mem-allocated-bytes", "mem-max-allocated-bytes")
CHUNK_BUCKETS = ("compute", "p2p")


def _instruction_buckets() -> dict[type, str]:
    from deepspeed.runtime.pipe import schedule as s  # deepspeed: heavy; `threed report` reads this module

    return {
        s.LoadMicroBatch: "compute",
        s.ForwardPass: "compute",
        s.BackwardPass: "compute",
        WeightPass: "compute",
        s.SendActivation: "p2p",
        s.RecvActivation: "p2p",
        s.SendGrad: "p2p",
        s.RecvGrad: "p2p",
        Exchange: "p2p",  # interleaved stages post a tick's sends and receives (their waits: RecvActivation / RecvGrad)
        s.ReduceGrads: "dp-reduce",
        s.ReduceTiedGrads: "dp-reduce",
        s.OptimizerStep: "optimizer",
    }


def memory_bytes(device: torch.device) -> tuple[float, float]:
    """(allocated now, peak allocated) for this process. CUDA: the caching allocator's counters (Megatron's
    mem-allocated-bytes / mem-max-allocated-bytes). CPU: the resident set size now and its high-water mark."""
    if device.type == "cuda":
        return float(torch.cuda.memory_allocated(device)), float(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux reports KiB
    now = resident_bytes()
    if now is None:  # not Linux: the high-water mark is the best reading there is
        now = peak
    # ru_maxrss is refreshed lazily by the kernel and can trail the current reading for a moment.
    return float(now), max(peak, float(now))


def resident_bytes() -> Optional[float]:
    """This process's resident set size now (Linux's /proc/self/statm), None where there is no such file."""
    try:
        with open("/proc/self/statm") as f:  # pages: size resident shared ...
            return float(int(f.read().split()[1]) * resource.getpagesize())
    except OSError:
        return None


def reset_peak_memory(device: torch.device) -> None:
    """Start this rank's peak-memory window (what `memory_bytes` reports as the peak) now. threed.engine.build calls
    it on every rank once the engine is built: DeepSpeed's BF16_Optimizer resets CUDA's peak counters while it
    initialises, on rank 0 only (`see_memory_usage(force=True)`), so the ranks' peaks would otherwise cover
    different windows. CPU: the resident high-water mark, reset through /proc/self/clear_refs (Linux); where that
    cannot be written the peak stays the process's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "reset the peak resident set size to the current one" (proc(5))
    except OSError:
        pass


class HostClock:
    """CPU (gloo): an instruction runs on the host, so the host clock times it. A mark is a perf_counter reading."""

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def settle(self, last: float) -> None:
        """Nothing to wait for: every mark was taken when its work had happened."""


class StreamClock:
    """CUDA: a mark is a CUDA event recorded on the current (compute) stream, so a span is the time the stream took
    from one mark to the next, kernels and waits included (a receive's wait for NCCL is on that stream).

    Never a device-wide synchronize: that waits for every stream, NCCL's included, so the kernel of a send still in
    flight (ZB-H1's sends do not wait for their receiver, threed.parallel.zero_bubble) would block the host at every
    timed instruction, as a blocking send does: a timed run would run another schedule than an untimed one. The host
    waits once per step, at its end, for the compute stream's last event (`settle`)."""

    def __init__(self, device: torch.device):
        self.device = device

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1000.0  # milliseconds; both events have completed (`settle`)

    def settle(self, last: Any) -> None:
        last.synchronize()  # this event only: the compute stream's work up to it, not the other streams'


def clock_for(device: torch.device) -> HostClock | StreamClock:
    return StreamClock(device) if device.type == "cuda" else HostClock()


class StageTimer:
    """Times this rank's pipeline instructions. `install` sets instance attributes that shadow the class's
    `_INSTRUCTION_MAP`, `_aggregate_total_loss` and `train_batch` with timed wrappers (nothing of DeepSpeed is
    patched, other engines are untouched); `uninstall` deletes them again. Each timed instruction records two marks
    of `clock` (`clock_for(device)` by default); they become seconds at the end of each `train_batch`, so timing
    adds no wait inside a step (see StreamClock)."""

    def __init__(self, engine: Any, device: torch.device, instructions: bool = True, clock: Any = None):
        self.engine = engine
        self.device = device
        self.stage = int(engine.stage_id)
        self.clock = clock if clock is not None else clock_for(device)
        self.instructions = instructions
        self.totals = dict.fromkeys(BUCKETS, 0.0)
        # at vpp > 1 (a chunked StagedPipelineModule), each chunk's CHUNK_BUCKETS; none at vpp 1
        chunks = int(getattr(engine.module, "vpp", 1)) if hasattr(engine, "module") else 1
        self.chunk_totals = [dict.fromkeys(CHUNK_BUCKETS, 0.0) for _ in range(chunks if chunks > 1 else 0)]
        self.steps = 0
        self.last_iteration = 0.0  # seconds of the latest train_batch (the step's iteration-time)
        # (bucket, the instruction's chunk or None, start mark, end mark) of this step
        self._spans: list[tuple[str, Optional[int], Any, Any]] = []
        self._active = False
        self._installed = False

    def _timed(self, fn: Callable, bucket: str) -> Callable:
        spans, clock = self._spans, self.clock

        def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return fn(engine, *args, **kwargs)
            start = clock.mark()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                spans.append((bucket, kwargs.get("chunk"), start, clock.mark()))

        return run

    def install(self) -> None:
        engine = self.engine
        if self.instructions:
            buckets = _instruction_buckets()
            engine._INSTRUCTION_MAP = {
                cmd: self._timed(fn, buckets[cmd]) if cmd in buckets else fn
                for cmd, fn in type(engine)._INSTRUCTION_MAP.items()
            }
            # An instance attribute shadows the method; DeepSpeed calls it as self._aggregate_total_loss().
            engine._aggregate_total_loss = MethodType(
                self._timed(type(engine)._aggregate_total_loss, "loss-sync"), engine
            )
        inner = engine.train_batch

        def train_batch(*args: Any, **kwargs: Any) -> Any:
            start = self.clock.mark()
            self._active = True
            try:
                return inner(*args, **kwargs)
            finally:
                self._active = False
                self._end_step(start)

        engine.train_batch = train_batch
        self._installed = True

    def _end_step(self, start: Any) -> None:
        """The step's marks -> seconds per bucket (after the one wait for the step's last mark)."""
        end = self.clock.mark()
        self.clock.settle(end)
        for bucket, chunk, a, b in self._spans:
            seconds = self.clock.seconds(a, b)
            self.totals[bucket] += seconds
            if chunk is not None and self.chunk_totals and bucket in CHUNK_BUCKETS:
                self.chunk_totals[chunk][bucket] += seconds
        self._spans.clear()
        self.last_iteration = self.clock.seconds(start, end)
        self.totals["iteration"] += self.last_iteration
        self.steps += 1

    def uninstall(self) -> None:
        if self._installed:
            self.engine.__dict__.pop("_INSTRUCTION_MAP", None)
            self.engine.__dict__.pop("train_batch", None)
            self.engine.__dict__.pop("_aggregate_total_loss", None)
            self._installed = False

    def row(self) -> list[float]:
        chunks = [c[b] for c in self.chunk_totals for b in CHUNK_BUCKETS]
        return [
            float(self.stage),
            float(self.steps),
            *(self.totals[b] for b in BUCKETS),
            *memory_bytes(self.device),
            *chunks,
        ]

    def reset(self) -> None:
        for b in BUCKETS:
            self.totals[b] = 0.0
        for c in self.chunk_totals:
            for b in CHUNK_BUCKETS:
                c[b] = 0.0
        self.steps = 0


def gather_rows(timer: StageTimer, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The one collective per log interval: every rank's row, gathered everywhere ([world, len(ROW)], fp64)."""
    row = torch.tensor(timer.row(), dtype=torch.float64, device=device)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return row.unsqueeze(0).cpu()
    out = torch.empty(world * row.numel(), dtype=torch.float64, device=device)
    all_gather_into()(out, row, group=group)
    return out.view(world, -1).cpu()


def all_gather_into() -> Callable:
    """torch's all-gather into one tensor: 2.13 renamed all_gather_into_tensor (deprecated there, with a warning per
    call) to all_gather_single, which 2.11 does not have. Asked of torch.distributed, not of its version."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def per_stage(rows: torch.Tensor, pp: int, timed: bool = True) -> dict[str, float]:
    """Per-stage scalars from the gathered rows: memory is the max over the stage's ranks (the GPU that runs out
    first), times (only when `timed`: the instructions were timed) are per-step means over the stage's ranks."""
    col = {name: i for i, name in enumerate(ROW)}
    out: dict[str, float] = {}
    for stage in range(pp):
        mine = rows[rows[:, col["stage"]] == stage]
        if not len(mine):
            continue
        steps = mine[:, col["steps"]].clamp(min=1)
        mean = {b: float((mine[:, col[b]] / steps).mean()) for b in BUCKETS}
        busy = mean["compute"] + mean["p2p"]
        p = f"stage{stage}/"
        out[p + "mem-allocated-bytes"] = float(mine[:, col["mem-allocated-bytes"]].max())
        out[p + "mem-max-allocated-bytes"] = float(mine[:, col["mem-max-allocated-bytes"]].max())
        if not timed:
            continue
        out[p + "compute-time"] = mean["compute"]
        out[p + "p2p-wait-time"] = mean["p2p"]
        out[p + "dp-reduce-time"] = mean["dp-reduce"]
        out[p + "optimizer-time"] = mean["optimizer"]
        out[p + "loss-sync-time"] = mean["loss-sync"]
        out[p + "iteration-time"] = mean["iteration"]
        out[p + "idle-fraction"] = mean["p2p"] / busy if busy > 0 else 0.0
        out.update(per_chunk(mine[:, len(ROW) :] / steps[:, None], busy, p))
    return out


def per_chunk(columns: torch.Tensor, busy: float, prefix: str) -> dict[str, float]:
    """The chunk keys of one stage (vpp > 1; none at vpp 1, whose rows have no chunk columns): per-step CHUNK_BUCKETS
    of each chunk (`columns`: the stage's ranks' rows, chunk columns only), means over the ranks, and the chunk's
    idle fraction, its wait over the rank's compute + p2p (`busy`)."""
    out: dict[str, float] = {}
    for c in range(columns.shape[1] // len(CHUNK_BUCKETS)):
        mean = {b: float(columns[:, c * len(CHUNK_BUCKETS) + i].mean()) for i, b in enumerate(CHUNK_BUCKETS)}
        q = f"{prefix}chunk{c}/"
        out[q + "compute-time"] = mean["compute"]
        out[q + "p2p-wait-time"] = mean["p2p"]
        out[q + "idle-fraction"] = mean["p2p"] / busy if busy > 0 else 0.0
    return out


def ideal_bubble(pp: int, gas: int, vpp: int = 1) -> float:
    """The idle fraction of equal stages under 1F1B, interleaved over `vpp` chunks per rank (--vpp; Narayanan et
    al. 2021): (pp - 1) / (vpp gas + pp - 1), what `threed.parallel.schedule.simulate` finds in unit costs."""
    return (pp - 1) / (vpp * gas + pp - 1)
