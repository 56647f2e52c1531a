"""Multi-rank scenarios for tests/ranks/test_metrics.py, run under torchrun; each rank writes its results as JSON.

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/metrics_worker.py train --out /tmp/m  # tp2 pp2 dp2
    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/metrics_worker.py bubble --out /tmp/m  # pp2 gas 2/16
    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/metrics_worker.py zb_timing --out /tmp/m  # pp2 zb-h1

Batches are synthetic (random token ids from a generator seeded by the DP rank), so first and last stage of a
replica read the same samples and a rebuilt run reads the same ones again.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Any, Iterator
from unittest import mock

import torch

from threed.config import MetricsConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
import threed.engine.build as engine_module
from worker_setup import build_engine
from threed.metrics.stages import HostClock, StageTimer, StreamClock
from threed.metrics.writer import RunMetrics
from threed.parallel.dims import resolve_dims
from worker_setup import rank_json, reads_data, run_worker, synthetic_batches

TINY = ModelConfig(
    name="metrics-tiny",
    vocab_size=256,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=176,
    max_position_embeddings=128,
    make_vocab_size_divisible_by=32,
)
# Big enough (~50 ms per micro-batch and stage) that the wake-up latency of each send/recv on a loaded machine
# (milliseconds) stays small against the compute it separates.
# A small vocabulary keeps the LM head light, so the two stages are nearly equal and the idle time is the bubble.
BUBBLE = ModelConfig(
    name="metrics-bubble",
    vocab_size=128,
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=352,
    max_position_embeddings=128,
    make_vocab_size_divisible_by=32,
)


def batches_for(engine, cfg: RunConfig):
    """Synthetic batches seeded by the DP rank, for the stages that read data."""
    if not reads_data(engine):
        return None
    return synthetic_batches(
        cfg.model.vocab_size,
        cfg.train.micro_batch_size,
        cfg.train.seq_length,
        seed=engine.grid.get_data_parallel_rank(),
    )


def train(args: argparse.Namespace, rt: Runtime) -> None:
    """3 steps with every sink on, then the same 3 steps on a fresh engine with no metrics at all."""
    out = args.out
    cfg = RunConfig(
        model=TINY,
        parallel=ParallelConfig(tp=2, pp=2),
        train=TrainConfig(
            dtype="fp32", micro_batch_size=2, grad_accum_steps=2, seq_length=32, steps=3, lr=1e-3, warmup_steps=1
        ),
        metrics=MetricsConfig(tensorboard_dir=str(out / "run" / "tensorboard")),
    )
    built = build_engine(cfg, rt)
    engine = built.engine
    metrics = RunMetrics(cfg, resolve_dims(cfg, rt.world_size), engine, rt, built.ds_config)
    it = batches_for(engine, cfg)
    logged, records, step_times = [], [], []
    for step in range(cfg.train.steps):
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=it).item()
        step_times.append(time.perf_counter() - t0)
        logged.append(loss)
        record = metrics.step(step + 1, loss)
        if record is not None:
            records.append(record)
    metrics.validation(cfg.train.steps, logged[-1] + 0.5, {"web": logged[-1] + 0.25, "code": logged[-1] + 0.75})
    metrics.close()
    overhead = metrics.overhead_s

    engine = build_engine(cfg, rt).engine
    it = batches_for(engine, cfg)
    plain = [engine.train_batch(data_iter=it).item() for _ in range(cfg.train.steps)]
    rank_json(
        out,
        "train",
        {
            "logged": logged,
            "plain": plain,
            "records": records,
            "writer": metrics.is_writer,
            "overhead_s": overhead,
            "step_times": step_times,
        },
    )


def bubble(args: argparse.Namespace, rt: Runtime) -> None:
    """pp2 at gas 2 and gas 16, steps alternating between the two engines so that a change in machine load hits
    both alike: the per-stage idle fraction, the wall clock measured outside the engine, and the CPU time used."""
    steps = 5  # step 1 warms up (buffers, tensor-meta exchange) and is not in the numbers
    runs = {}
    for gas in (2, 16):
        cfg = RunConfig(
            model=BUBBLE,
            parallel=ParallelConfig(tp=1, pp=2),
            train=TrainConfig(
                dtype="fp32", micro_batch_size=2, grad_accum_steps=gas, seq_length=128, steps=steps, log_interval=steps
            ),
        )
        built = build_engine(cfg, rt)
        engine = built.engine
        it = batches_for(engine, cfg)
        engine.train_batch(data_iter=it)
        runs[gas] = {
            "engine": engine,
            "it": it,
            "metrics": RunMetrics(
                cfg, resolve_dims(cfg, rt.world_size), engine, rt, built.ds_config, start_iteration=1
            ),
            "wall": 0.0,
            "cpu": 0.0,
        }
    for step in range(1, steps):
        for run in runs.values():
            t0, c0 = time.perf_counter(), time.process_time()
            loss = run["engine"].train_batch(data_iter=run["it"]).item()
            run["wall"] += time.perf_counter() - t0
            run["cpu"] += time.process_time() - c0
            run["record"] = run["metrics"].step(step + 1, loss)
    results = {}
    for gas, run in runs.items():
        run["metrics"].close()
        # The stage numbers live on the writer rank only; every rank reports its own clocks.
        results[f"gas{gas}"] = {
            "record": run["record"],
            "wall_per_step": run["wall"] / (steps - 1),
            "cpu_per_step": run["cpu"] / (steps - 1),
            "stage": run["engine"].stage_id,
        }
    rank_json(args.out, "bubble", results)


class FakeEvent:
    """torch.cuda.Event on CPU: the host clock when recorded (a CPU "stream" has run its work by then). Waiting for
    it waits for nothing else: an event is one stream's."""

    def __init__(self, enable_timing: bool = False):
        self.t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        return (end.t - self.t) * 1000.0


class DeviceWideClock(HostClock):
    """What StageTimer did before: a device-wide torch.cuda.synchronize before every host-clock reading."""

    def mark(self) -> float:
        torch.cuda.synchronize()
        return time.perf_counter()


class WaitedOnce:
    """A send's Work that may be waited for more than once: gloo's wait() waits for one more completion at each
    call, and both the fake synchronize below and the engine (before the gradient reductions) wait for it."""

    def __init__(self, work: Any):
        self.work, self.done = work, False

    def wait(self) -> bool:
        if not self.done:
            self.work.wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or self.work.is_completed()


@contextlib.contextmanager
def fake_cuda(engine) -> Iterator[list[int]]:
    """torch.cuda's timing calls on CPU. The device-wide synchronize waits for every send the ZB-H1 engine has in
    flight, as CUDA's does (NCCL's send kernels run on the device), and counts them: the sends a timing wrapper
    made wait."""
    waited = [0]

    def synchronize(device: Any = None) -> None:
        pending = engine.__dict__.get("_threed_sends", [])
        waited[0] += len(pending)
        pending[:] = [(w if isinstance(w, WaitedOnce) else WaitedOnce(w), t) for w, t in pending]
        for work, _ in pending:
            work.wait()

    with (
        mock.patch.object(torch.cuda, "Event", FakeEvent),
        mock.patch.object(torch.cuda, "current_stream", lambda device=None: None),
        mock.patch.object(torch.cuda, "synchronize", synchronize),
    ):
        yield waited


def zb_timing(args: argparse.Namespace, rt: Runtime) -> None:
    """pp2 ZB-H1: one step with the stage timer off, one with it on and the CUDA clock (StreamClock, its torch.cuda
    calls faked on CPU), one with a device-wide synchronize around each instruction (the timer before, as a
    control): how many in-flight sends a timing wrapper waited for in each. And how often build_engine reset the
    peak-memory counters on this rank."""
    resets: list[str] = []
    real_reset = engine_module.reset_peak_memory
    with mock.patch.object(engine_module, "reset_peak_memory", lambda d: (resets.append(str(d)), real_reset(d))[1]):
        cfg = RunConfig(
            model=TINY,
            parallel=ParallelConfig(tp=1, pp=2, pipeline_schedule="zb-h1"),
            train=TrainConfig(dtype="fp32", micro_batch_size=1, grad_accum_steps=4, seq_length=32, steps=4),
        )
        engine = build_engine(cfg, rt).engine
    it = batches_for(engine, cfg)
    engine.train_batch(data_iter=it)  # the first step exchanges tensor shapes: not timed
    results: dict[str, Any] = {"peak_resets": resets, "class": type(engine).__name__}
    for name, clock in (("off", None), ("stream_clock", StreamClock(rt.device)), ("device_wide", DeviceWideClock())):
        timer = StageTimer(engine, rt.device, clock=clock) if clock is not None else None
        with fake_cuda(engine) as waited:
            if timer is not None:
                timer.install()
            try:
                engine.train_batch(data_iter=it)
            finally:
                if timer is not None:
                    timer.uninstall()
        results[name] = {"sends_waited": waited[0], "totals": timer.totals if timer is not None else None}
    rank_json(args.out, "zb_timing", results)


if __name__ == "__main__":
    raise SystemExit(run_worker({"train": train, "bubble": bubble, "zb_timing": zb_timing}))
