"""Multi-rank scenarios for tests/ranks/test_metrics.py, run under torchrun; each rank writes its results as JSON.

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/metrics_worker.py train --out /tmp/m   # tp2 pp2 dp2
    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/metrics_worker.py bubble --out /tmp/m  # pp2 gas 2/16

Batches are synthetic (random token ids from a generator seeded by the DP rank), so first and last stage of a
replica read the same samples and a rebuilt run reads the same ones again.
"""

from __future__ import annotations

import argparse
import time

from threed.config import MetricsConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
from threed.train.engine import build_engine
from threed.metrics.writer import RunMetrics
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
    engine = build_engine(cfg, rt).engine
    metrics = RunMetrics(cfg, engine, rt)
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
        engine = build_engine(cfg, rt).engine
        it = batches_for(engine, cfg)
        engine.train_batch(data_iter=it)
        runs[gas] = {
            "engine": engine,
            "it": it,
            "metrics": RunMetrics(cfg, engine, rt, start_iteration=1),
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


if __name__ == "__main__":
    raise SystemExit(run_worker({"train": train, "bubble": bubble}))
