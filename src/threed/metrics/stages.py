"""Per-stage pipeline timing: DeepSpeed's PipelineEngine instruction handlers wrapped on one engine instance, and
one all-gather per log interval that brings every rank's numbers to the metrics writer.

Each 1F1B instruction falls in one bucket:
  compute    LoadMicroBatch, ForwardPass, BackwardPass, and zb-h1's WeightPass (threed.parallel.zero_bubble)
  p2p        SendActivation, RecvActivation, SendGrad, RecvGrad (time blocked on the neighbouring stage)
  dp-reduce  ReduceGrads, ReduceTiedGrads (ZeRO-1 gradient reduction over DP)
  optimizer  OptimizerStep
  loss-sync  DeepSpeed's loss averaging over DP and broadcast over the pipe (earlier stages wait there for the last
             stage to finish its optimizer step)
plus `iteration`, the wall time of the whole `train_batch`; what the buckets leave of it is schedule bookkeeping.

The idle fraction of a stage is p2p / (compute + p2p): the share of the pipelined (forward/backward) phase a
stage spends waiting on its neighbours. With equal stages it is the bubble (pp-1)/(gas+pp-1); more means imbalance
or slow transfers. Only `train_batch` is timed: `eval_batch` runs the same handlers and is not counted.
"""

from __future__ import annotations

import resource
import time
from types import MethodType
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from threed.parallel.zero_bubble import WeightPass

BUCKETS = ("iteration", "compute", "p2p", "dp-reduce", "optimizer", "loss-sync")
# One row per rank in the all-gather: stage, steps in the window, the buckets (seconds), memory now and peak.
ROW = ("stage", "steps", *BUCKETS, "mem-allocated-bytes", "mem-max-allocated-bytes")


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
    try:
        with open("/proc/self/statm") as f:  # pages: size resident shared ...
            now = int(f.read().split()[1]) * resource.getpagesize()
    except OSError:  # not Linux: the high-water mark is the best reading there is
        now = peak
    # ru_maxrss is refreshed lazily by the kernel and can trail the current reading for a moment.
    return float(now), max(peak, float(now))


class StageTimer:
    """Times this rank's pipeline instructions. `install` sets instance attributes that shadow the class's
    `_INSTRUCTION_MAP`, `_aggregate_total_loss` and `train_batch` with timed wrappers (nothing of DeepSpeed is
    patched, other engines are untouched); `uninstall` deletes them again."""

    def __init__(self, engine: Any, device: torch.device, instructions: bool = True):
        self.engine = engine
        self.device = device
        self.stage = int(engine.stage_id)
        # perf_counter reads the host clock; on CUDA the kernels run later, so each timed region is bracketed by
        # a synchronize or the time would land on whichever instruction happens to wait next.
        self.sync = device.type == "cuda"
        self.instructions = instructions
        self.totals = dict.fromkeys(BUCKETS, 0.0)
        self.steps = 0
        self.last_iteration = 0.0  # seconds of the latest train_batch (the step's iteration-time)
        self._active = False
        self._installed = False

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _timed(self, fn: Callable, bucket: str) -> Callable:
        totals = self.totals

        def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
            if not self._active:
                return fn(engine, *args, **kwargs)
            t0 = self._now()
            try:
                return fn(engine, *args, **kwargs)
            finally:
                totals[bucket] += self._now() - t0

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
            t0 = self._now()
            self._active = True
            try:
                return inner(*args, **kwargs)
            finally:
                self._active = False
                self.last_iteration = self._now() - t0
                self.totals["iteration"] += self.last_iteration
                self.steps += 1

        engine.train_batch = train_batch
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            self.engine.__dict__.pop("_INSTRUCTION_MAP", None)
            self.engine.__dict__.pop("train_batch", None)
            self.engine.__dict__.pop("_aggregate_total_loss", None)
            self._installed = False

    def row(self) -> list[float]:
        return [float(self.stage), float(self.steps), *(self.totals[b] for b in BUCKETS), *memory_bytes(self.device)]

    def reset(self) -> None:
        for b in BUCKETS:
            self.totals[b] = 0.0
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
    return out


def ideal_bubble(pp: int, gas: int) -> float:
    return (pp - 1) / (gas + pp - 1)
