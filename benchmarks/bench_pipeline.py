"""Pipeline efficiency: the same model and global batch at pp=1 (one process) and pp=2 (two processes), one thread
per rank, fp32, gas 16, through `threed.engine.build.build_engine` with synthetic batches and the metrics writer on at
log interval 1 (stdout, metrics.jsonl, TensorBoard). Prints the speedup pp1/pp2 divided by the ideal
pp·gas/(gas+pp−1), the per-stage idle fractions next to the ideal bubble, each stage's compute time and their
spread (slowest / fastest: 1F1B runs at the slowest stage's pace), and what the logging cost.

    .venv/bin/python benchmarks/bench_pipeline.py [--partition balanced] [--gas 16] [--repeats 3] [--steps 8]
    .venv/bin/python benchmarks/bench_pipeline.py --partition measured [--layers 16]
    .venv/bin/python benchmarks/bench_pipeline.py --schedule zb-h1      # the pp2 run under ZB-H1

`--schedule` is the pp2 run's --pipeline-schedule; `benchmarks/bench_schedule.py` compares the schedules (pp2 and
pp4, gas = 2·pp) with this file's worker.

`--partition measured` first runs `threed profile-layers` in this process (one thread, as the ranks) on the
benchmark's model and uses the `costs:...` method it prints for both runs.

Each configuration runs 2 warm-up steps, then `repeats` chunks of `steps` steps; a chunk's time is its mean step
time and the reported time the median chunk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden_size=704,
    max_position_embeddings=256,
)


def bench_model(layers: int, vocab: int = MODEL["vocab_size"]):
    """The benchmark's ModelConfig at `--layers` blocks and a `--vocab` vocabulary."""
    from threed.config import ModelConfig

    return ModelConfig(name="bench", **{**MODEL, "num_layers": layers, "vocab_size": vocab})


def measured_partition(a: argparse.Namespace) -> str:
    """`threed profile-layers` on the benchmark's model, micro-batch and sequence, one thread (as each rank runs):
    prints its table and returns its `costs:...` method."""
    from threed.config import ParallelConfig, RunConfig, TrainConfig
    from threed.plan.profile import profile_layers, report

    cfg = RunConfig(
        model=bench_model(a.layers, a.vocab),
        parallel=ParallelConfig(tp=1, pp=2),
        train=TrainConfig(dtype="fp32", micro_batch_size=a.micro, seq_length=a.seq),
    )
    profile = profile_layers(cfg, threads=1)
    print("\n".join(report(profile, cfg)), flush=True)
    return profile.method


def worker(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from threed.config import MetricsConfig, ParallelConfig, RunConfig, TrainConfig
    from threed.parallel.distributed import init_distributed
    from threed.engine.build import build_engine
    from threed.engine.resolved import resolve
    from threed.metrics.writer import RunMetrics
    from threed.metrics.stages import StageTimer

    import torch.distributed as dist

    rt = init_distributed()
    steps = 2 + a.repeats * a.steps
    cfg = RunConfig(
        model=bench_model(a.layers, a.vocab),
        parallel=ParallelConfig(
            tp=1,
            pp=a.pp,
            vpp=a.vpp if a.pp > 1 else 1,
            partition_method=a.partition,
            pipeline_schedule=a.schedule if a.pp > 1 else "1f1b",
        ),
        train=TrainConfig(
            dtype="fp32",
            micro_batch_size=a.micro,
            grad_accum_steps=a.gas,
            seq_length=a.seq,
            steps=steps,
            log_interval=1,
        ),
        metrics=MetricsConfig(tensorboard_dir=str(Path(a.out) / f"pp{a.pp}" / "tensorboard")),
    )
    run = resolve(cfg, rt.world_size)
    built = build_engine(run, rt)
    engine = built.engine
    reads = engine.is_first_stage() or engine.is_last_stage()
    gen = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, a.vocab, (a.micro, a.seq + 1), generator=gen)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    it = batches() if reads else None
    metrics = RunMetrics(cfg, run.dims, engine, rt, built.ds_config)
    chunks, queues, idle = [], [], []
    step = 0
    for chunk in range(-1, a.repeats):  # chunk -1: the warm-up steps
        if chunk >= 0 and a.wait_quiet:
            wait_for_quiet(rt.rank == 0, a.wait_quiet)
        queue: list[int] = []
        sampling = threading.Event()
        if rt.rank == 0:
            threading.Thread(target=sample_run_queue, args=(queue, sampling), daemon=True).start()
        records = []
        t0 = time.perf_counter()
        for _ in range(2 if chunk < 0 else a.steps):
            loss = engine.train_batch(data_iter=it).item()
            step += 1
            record = metrics.step(step, loss)
            if record is not None:
                records.append(record)
        sampling.set()
        if rt.rank == 0:
            queue.append(run_queue())  # at least one reading, however short the chunk
        if chunk >= 0:
            chunks.append((time.perf_counter() - t0) / a.steps)
            queues.append(statistics.mean(queue) if queue else 0.0)
            idle.append(
                {k: statistics.mean(r[k] for r in records) for k in records[0] if k.startswith(("stage", "pipeline/"))}
                if records
                else {}
            )
    in_logging, in_gather = metrics.overhead_s, metrics.collective_s
    metrics.close()

    # What train.py's per-step stop check (a 1-float all-reduce over the world) costs here.
    flag = torch.zeros(1)
    t0 = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    stop_check = (time.perf_counter() - t0) / 50

    # The instruction wrappers' own cost, which overhead_s does not see: a wrapped no-op against a bare one,
    # times the instructions this stage runs per step.
    timer = StageTimer(engine, rt.device)
    bare, wrapped = (lambda eng: None), timer._timed(lambda eng: None, "compute")
    timer._active = True
    n = 20000
    t0 = time.perf_counter()
    for _ in range(n):
        bare(engine)
    t1 = time.perf_counter()
    for _ in range(n):
        wrapped(engine)
    per_call = max(0.0, (time.perf_counter() - t1) - (t1 - t0)) / n
    calls = sum(len(cmds) for cmds in engine._train_schedule())  # the schedule's instructions, W passes too
    result = {
        "chunks": chunks,
        "queues": queues,
        "stage": engine.stage_id,
        "writer": metrics.is_writer,
        "logging_s_per_step": in_logging / step,
        "wrapper_s_per_step": per_call * calls,
        "gather_s_per_step": in_gather / step,
        "stop_check_s": stop_check,
        "idle": idle,
        "loss": loss,
    }
    Path(a.out, f"pp{a.pp}_{a.schedule}_v{a.vpp}_rank{rt.rank}.json").write_text(json.dumps(result))


def launch(a: argparse.Namespace, pp: int, out: str) -> list[dict]:
    from threed.parallel.launch import run_ranks

    args = [
        "--worker",
        "--pp",
        str(pp),
        "--out",
        out,
        "--gas",
        str(a.gas),
        "--micro",
        str(a.micro),
        "--seq",
        str(a.seq),
        "--repeats",
        str(a.repeats),
        "--steps",
        str(a.steps),
        "--partition",
        a.partition,
        "--layers",
        str(a.layers),
        "--vocab",
        str(a.vocab),
        "--schedule",
        a.schedule,
        "--vpp",
        str(a.vpp),
        "--wait-quiet",
        str(a.wait_quiet),
    ]
    run_ranks(pp, os.path.abspath(__file__), args, env={"OMP_NUM_THREADS": "1"}, timeout=1800)
    return [json.loads(Path(out, f"pp{pp}_{a.schedule}_v{a.vpp}_rank{r}.json").read_text()) for r in range(pp)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--pp", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--gas", type=int, default=16)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--partition",
        default="balanced",
        help="--partition-method for both runs, or `measured`: threed profile-layers' costs:... method",
    )
    p.add_argument("--layers", type=int, default=MODEL["num_layers"], help="transformer blocks (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=MODEL["vocab_size"], help="vocabulary (default: %(default)s)")
    p.add_argument("--schedule", default="1f1b", choices=("1f1b", "zb-h1"), help="--pipeline-schedule of the pp2 run")
    p.add_argument("--vpp", type=int, default=1, help="--vpp of the pp2 run (interleaved stages)")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0,
        metavar="SECONDS",
        help="on a shared machine: before each chunk wait up to SECONDS for the run queue to empty, and "
        "count only chunks that ran alone",
    )
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    if a.partition == "measured":
        a.partition = measured_partition(a)
    queue: list[int] = []
    sampling = threading.Event()
    threading.Thread(target=sample_run_queue, args=(queue, sampling), daemon=True).start()
    with tempfile.TemporaryDirectory() as out:
        one = launch(a, 1, out)
        two = launch(a, 2, out)
    sampling.set()
    # With --wait-quiet, a chunk counts only if the run queue stayed within this run's own ranks (+1 for the
    # launcher and the sampler); without it, every chunk counts.
    clean1 = [i for i, q in enumerate(one[0]["queues"]) if not a.wait_quiet or q <= 2] or list(range(a.repeats))
    clean2 = [i for i, q in enumerate(two[0]["queues"]) if not a.wait_quiet or q <= 3] or list(range(a.repeats))
    one_chunks = [one[0]["chunks"][i] for i in clean1]
    two_chunks = [max(r["chunks"][i] for r in two) for i in clean2]  # a step ends on the slower rank
    t1, t2 = statistics.median(one_chunks), statistics.median(two_chunks)
    ideal = 2 * a.gas / (a.gas + 1)
    speedup = t1 / t2
    best = min(one_chunks) / min(two_chunks)
    every = statistics.median(one[0]["chunks"]) / statistics.median(
        max(r["chunks"][i] for r in two) for i in range(a.repeats)
    )
    writer = next(r for r in two if r["writer"])

    def stage_means(w: dict, clean: list[int]) -> dict[str, float]:
        return {k: statistics.mean(w["idle"][i][k] for i in clean) for k in w["idle"][clean[0]]}

    idle, idle1 = stage_means(writer, clean2), stage_means(one[0], clean1)
    print(
        f"model hidden {MODEL['hidden_size']}, {a.layers} layers, vocab {a.vocab}, seq "
        f"{a.seq}, fp32, micro {a.micro} x gas {a.gas}, 1 thread per rank, partition {a.partition}, "
        f"pp2 schedule {a.schedule}"
    )

    def chunk_list(runs: list[dict]) -> str:
        return ", ".join(
            f"{max(r['chunks'][i] for r in runs) * 1000:.0f} (run queue {runs[0]['queues'][i]:.1f})"
            for i in range(a.repeats)
        )

    print(
        f"pp1 {t1 * 1000:.0f} ms/step, chunks {chunk_list(one)}; pp2 {t2 * 1000:.0f} ms/step, chunks "
        f"{chunk_list(two)}" + (f"; counted: pp1 {clean1}, pp2 {clean2}" if a.wait_quiet else "")
    )
    print(
        f"speedup {speedup:.3f} / ideal {ideal:.3f} = {speedup / ideal * 100:.1f}% of ideal "
        f"(best chunks: {best / ideal * 100:.1f}%"
        + (f"; all chunks, quiet or not: {every / ideal * 100:.1f}%" if a.wait_quiet else "")
        + ")"
    )
    print(
        "pp2 idle per stage: "
        + ", ".join(f"stage {s} {idle[f'stage{s}/idle-fraction'] * 100:.1f}%" for s in range(2))
        + f" (ideal bubble {idle['pipeline/ideal-bubble'] * 100:.1f}%)"
    )
    for name, st, n in (("pp1", idle1, 1), ("pp2", idle, 2)):
        print(
            f"{name} ms/step per stage: "
            + " | ".join(
                f"stage {s}: "
                + " ".join(
                    f"{k} {st[f'stage{s}/{k}-time'] * 1000:.0f}"
                    for k in ("compute", "p2p-wait", "dp-reduce", "optimizer", "loss-sync", "iteration")
                )
                for s in range(n)
            )
        )
    compute = [idle[f"stage{s}/compute-time"] for s in range(2)]
    print(
        "pp2 compute per stage: "
        + ", ".join(f"stage {s} {c * 1000:.0f} ms" for s, c in enumerate(compute))
        + f"; spread (slowest / fastest) {max(compute) / min(compute):.3f}"
    )
    for name, runs, t in (("pp1", one, t1), ("pp2", two, t2)):
        worst = max(r["logging_s_per_step"] + r["wrapper_s_per_step"] for r in runs)
        gather = max(r["gather_s_per_step"] for r in runs)
        print(
            f"{name} logging cost (log interval 1, all sinks): {worst * 1000:.2f} ms/step = "
            f"{worst / t * 100:.2f}% of step time (all-gather {gather * 1000:.2f} ms); a stop-check all-reduce "
            f"{max(r['stop_check_s'] for r in runs) * 1000:.2f} ms"
        )
    print(f"losses pp1 {one[0]['loss']:.6f} pp2 {writer['loss']:.6f}")
    if queue:
        cores = os.cpu_count() or 1
        mean = statistics.mean(queue)
        print(
            f"run queue during the runs: mean {mean:.1f}, max {max(queue)} on {cores} cores"
            + (" -- other work competed for the cores: times are inflated, pp2 most" if mean > cores + 0.5 else "")
        )
    return 0


def run_queue() -> int:
    with open("/proc/stat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("procs_running"))


def wait_for_quiet(polls: bool, max_wait: float) -> None:
    """Rank 0 waits until at most 2 threads are runnable (itself and one more) for 3 s in a row, then releases the
    others, which sleep in a broadcast meanwhile (and so do not count)."""
    import torch
    import torch.distributed as dist

    if polls:
        deadline, quiet_since = time.monotonic() + max_wait, None
        while time.monotonic() < deadline:
            if run_queue() <= 2:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since >= 3:
                    break
            else:
                quiet_since = None
            time.sleep(0.25)
    dist.broadcast(torch.zeros(1), src=0)


def sample_run_queue(out: list[int], stop: threading.Event) -> None:
    """Runnable threads on the machine (Linux /proc/stat procs_running), once a second: this benchmark's own ranks
    count, so more than the core count means someone else's work shared the cores."""
    while not stop.wait(0.5):
        try:
            out.append(run_queue())
        except OSError:
            return


if __name__ == "__main__":
    sys.exit(main())
