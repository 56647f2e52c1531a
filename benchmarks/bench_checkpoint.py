"""What a checkpoint save costs the run (issue 37), measured in one process on one model: a real DeepSpeed engine
(tp1 pp1, fp32 unless --dtype bf16, ZeRO-1, one rank) built through `threed.engine.build.build_engine`, saved through
`threed.checkpoint.save.save`, as `threed train` saves. Prints, for one run:

- the checkpoint's size and one training step's time (median, no save);
- a durable save (every file and directory fsynced before the manifest and `latest` name them, as threed saves)
  against the same save with the flushes turned off (what threed did before): median seconds each and the ratio,
  saves interleaved. Between saves the page cache is flushed (`os.sync`, not timed), so no save pays for the
  previous one's write-back;
- `--async-save`'s saves (threed.checkpoint.async_save): the seconds training was blocked (the host copy) against
  the durable synchronous save's, and the seconds until each was published, training going on meanwhile;
- the step time of runs of --every steps that save once (not at all, asynchronously, synchronously), interleaved
  over --rounds rounds, against not saving.

    .venv/bin/python benchmarks/bench_checkpoint.py [--hidden 1024 --layers 8 --vocab 32000 --repeats 3]
        [--rounds 2 --every 10]
    python benchmarks/bench_checkpoint.py --model llama3.2-1b --dtype bf16 --json save.json   # tools/gpu_check.sh

`--json FILE` (the save phase of tools/gpu_check.sh, docs/gpu.md) measures once each instead, the least a budget
allows: one durable synchronous save's seconds (all of them blocking training), one asynchronous save's blocked
seconds, its host copy (bytes, seconds copying, seconds allocating the buffers: pinned on CUDA, so the GB/s is the
pinned device-to-host copy's) against the memory model's host-copy figure for the rank, and the seconds until it was
published; FILE is rewritten after each measurement, so a cut leaves what finished.

The default shape (0.156B parameters) makes a checkpoint of 2.3 GiB (16 B per parameter: the fp32 weights in the
layer files, ZeRO's fp32 master copy and AdamW's two moments in the optimizer shard). What a CPU with a local disk
cannot show: a cluster's parallel file system, whose fsync goes to remote servers, and many ranks writing at once.
On a CUDA device the same script measures the pinned device-to-host copy (`threed.parallel.device_policy` pins
there).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def build(a: argparse.Namespace, save_dir: str):
    """The engine, its runtime, the resolved config and a batch iterator: one rank, fp32, micro-batch 1."""
    import torch

    from threed.config import CheckpointConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
    from threed.convert.resolve import model_config
    from threed.engine.build import build_engine
    from threed.engine.resolved import resolve
    from threed.parallel.distributed import init_distributed

    torch.set_num_threads(a.threads)
    rt = init_distributed()
    model = (
        model_config(a.model)
        if a.model
        else ModelConfig(
            name="bench-ckpt",
            vocab_size=a.vocab,
            hidden_size=a.hidden,
            num_layers=a.layers,
            num_heads=a.hidden // 64,
            num_kv_heads=max(1, a.hidden // 256),
            ffn_hidden_size=a.hidden * 11 // 4,
            max_position_embeddings=a.seq,
        )
    )
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(tp=1, pp=1),
        train=TrainConfig(dtype=a.dtype, micro_batch_size=1, global_batch_size=1, seq_length=a.seq, steps=10**6),
        checkpoint=CheckpointConfig(save=save_dir, keep_last=1),
    )
    run = resolve(cfg, rt.world_size)
    engine = build_engine(run, rt).engine
    gen = torch.Generator().manual_seed(0)

    def batches():
        while True:
            tokens = torch.randint(0, model.vocab_size, (1, a.seq + 1), generator=gen)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return engine, rt, cfg, batches()


def no_flushes():
    """Turn off the flushes of the files DeepSpeed writes and of their directories (what threed saved before issue
    37: only the manifest, the run config and `latest` were fsynced); returns what puts them back."""
    import threed.checkpoint.save as ckpt

    real = ckpt.fsync_file, ckpt.fsync_dir
    ckpt.fsync_file = ckpt.fsync_dir = lambda path: None

    def restore() -> None:
        ckpt.fsync_file, ckpt.fsync_dir = real

    return restore


def timed_save(engine, cfg, rt, durable: bool) -> float:
    """One save's wall time on this rank; the page cache is flushed afterwards, untimed."""
    from threed.checkpoint.save import save

    restore = None if durable else no_flushes()
    try:
        t0 = time.perf_counter()
        save(engine, cfg, rt.rank, {"consumed_samples": engine.global_steps})
        seconds = time.perf_counter() - t0
    finally:
        if restore is not None:
            restore()
    os.sync()
    return seconds


def async_saves(engine, saver, it, repeats: int) -> tuple[list[float], list[float]]:
    """`repeats` asynchronous saves through `saver`, each followed by training steps until it is published (polled
    at each step boundary, as a run does): the seconds each blocked training and the seconds until each was
    published. The first save allocates the saver's host buffers (first touch of every page); the later ones reuse
    them, as every save after a run's first does."""
    blocked, published = [], []
    for _ in range(repeats):
        engine.train_batch(data_iter=it)
        blocked.append(saver.save(engine, {"consumed_samples": engine.global_steps}))
        done = None
        while done is None:
            engine.train_batch(data_iter=it)
            done = saver.poll()
        published.append(done.seconds)
        os.sync()
    return blocked, published


def step_rate(engine, cfg, rt, it, steps: int, every: int, how: str, async_saver) -> float:
    """Mean seconds per step over `steps` steps saving every `every` steps (at its middle: steps every/2, ...,
    so each save's background write falls inside the window) `how` ("none", "sync", "async": through
    `async_saver`, the one saver of the whole bench, as a run has one); what the last save leaves to write after the
    window is not timed, nor the page cache's write-back (`os.sync` after)."""
    from threed.checkpoint.save import save

    saver = async_saver if how == "async" else None
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        engine.train_batch(data_iter=it)
        if saver is not None:
            saver.poll()
        if how != "none" and i % every == every // 2:
            client = {"consumed_samples": engine.global_steps}
            if saver is not None:
                saver.finish("the next save")
                saver.save(engine, client)
            else:
                save(engine, cfg, rt.rank, client)
    seconds = (time.perf_counter() - t0) / steps
    if saver is not None:
        saver.finish("the end")
    os.sync()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="rounds of the step-rate runs (0: none)")
    p.add_argument("--every", type=int, default=10, help="steps of each step-rate run, which saves once")
    p.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory in it; default: /tmp)")
    p.add_argument("--model", default=None, help="a preset (llama3.2-1b) instead of --hidden / --layers / --vocab")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--json", type=Path, default=None, help="one save of each kind, the figures into this file")
    a = p.parse_args()
    root = tempfile.mkdtemp(prefix="bench-ckpt-", dir=a.dir)
    try:
        engine, rt, cfg, it = build(a, str(Path(root) / "save"))
        if a.json:
            one_save_each(a.json, engine, cfg, rt, it)
            return
        from threed.checkpoint.async_save import AsyncSaver

        # One saver for the whole bench, as a run has one: its host buffers, allocated by its first save, are
        # reused by every later one (a saver per step-rate run would pay the first touch of 2 GB at every save).
        saver = AsyncSaver(cfg, rt.rank, rt.device, lambda line: None)
        report_saves(a, engine, cfg, rt, it, saver)
        if a.rounds:
            report_rates(a, engine, cfg, rt, it, saver)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def one_save_each(path: Path, engine, cfg, rt, it) -> None:
    """--json: one durable synchronous save, then one asynchronous save (a step between: a new tag), each
    checkpoint removed once measured (the disk holds one at a time); `path` rewritten after each figure."""
    import json

    from threed.checkpoint.async_save import AsyncSaver, copy_bytes
    from threed.checkpoint.manifest import directory_bytes

    engine.train_batch(data_iter=it)
    step_dir = Path(cfg.checkpoint.save) / f"global_step{engine.global_steps}"
    params = sum(q.numel() for q in engine.module.parameters())
    out = {"model": cfg.model.name, "params": params, "dtype": cfg.train.dtype, "device": str(rt.device)}
    out["sync_save_s"] = round(timed_save(engine, cfg, rt, durable=True), 3)
    out["checkpoint_bytes"] = directory_bytes(step_dir)
    shutil.rmtree(step_dir)
    path.write_text(json.dumps(out, indent=1))
    engine.train_batch(data_iter=it)
    saver = AsyncSaver(cfg, rt.rank, rt.device, lambda line: None)
    blocked = saver.save(engine, {"consumed_samples": engine.global_steps})
    b = saver.buffers
    out.update(
        async_blocked_s=round(blocked, 3),
        blocked_ratio=round(blocked / out["sync_save_s"], 4),
        host_copy_bytes=b.copied,
        model_host_copy_bytes=copy_bytes(cfg, 1, range(1)),
        host_copy_s=round(b.copy_s, 4),
        host_alloc_s=round(b.alloc_s, 3),
        host_copy_gbps=round(b.copied / max(b.copy_s, 1e-9) / 1e9, 2),
        pinned=b.pin,
    )
    path.write_text(json.dumps(out, indent=1))
    done = saver.finish("the end")
    out["async_published_s"] = round(done.seconds, 3) if done else None
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


def report_rates(a: argparse.Namespace, engine, cfg, rt, it, saver) -> None:
    """Step rates without saving, saving asynchronously and synchronously: runs of --every steps saving once,
    interleaved over --rounds rounds (the machine's other load drifts), each the median of its rounds: printed."""
    runs: dict[str, list[float]] = {"none": [], "async": [], "sync": []}
    for _ in range(a.rounds):
        for how in runs:
            runs[how].append(step_rate(engine, cfg, rt, it, a.every, a.every, how, saver))
    rates = {how: statistics.median(r) for how, r in runs.items()}
    print(f"step time, runs of {a.every} steps saving once, median of {a.rounds} interleaved rounds:")
    for how, s in rates.items():
        spread = [round(x, 2) for x in runs[how]]
        print(f"  {how:5s} {s:.2f} s/step {spread}  ({s / rates['none'] - 1:+.1%} against no saves)")


def report_saves(a: argparse.Namespace, engine, cfg, rt, it, saver) -> None:
    """The size, a step, durable against unflushed synchronous saves, and asynchronous saves' blocked and
    time-to-publish seconds: printed."""
    from threed.checkpoint.manifest import directory_bytes
    from threed.units import human_bytes

    params = sum(q.numel() for q in engine.module.parameters())
    steps = []
    for _ in range(3):
        t0 = time.perf_counter()
        engine.train_batch(data_iter=it)
        steps.append(time.perf_counter() - t0)
    durable, plain = [], []
    for _ in range(a.repeats):
        engine.train_batch(data_iter=it)  # a new step: a new tag, as a run's saves
        durable.append(timed_save(engine, cfg, rt, durable=True))
        engine.train_batch(data_iter=it)
        plain.append(timed_save(engine, cfg, rt, durable=False))
    size = directory_bytes(Path(cfg.checkpoint.save) / f"global_step{engine.global_steps}")
    blocked, published = async_saves(engine, saver, it, max(2, a.repeats))
    step, d, n = statistics.median(steps[1:]), statistics.median(durable), statistics.median(plain)
    b, t = statistics.median(blocked[1:]), statistics.median(published)
    print(f"model: {params / 1e9:.3f}B parameters, fp32, one rank; checkpoint {human_bytes(size)}")
    print(f"step (no save): {step:.2f} s (median of {len(steps) - 1})")
    print(f"save, durable (fsync every file and directory): {d:.2f} s  {[round(x, 2) for x in durable]}")
    print(f"save, without the flushes (before issue 37):    {n:.2f} s  {[round(x, 2) for x in plain]}")
    print(f"durable / unflushed = {d / n:.2f}; added per save {d - n:+.2f} s ({size / d / 2**20:.0f} MiB/s durable)")
    print(
        f"async save: training blocked {b:.2f} s {[round(x, 2) for x in blocked[1:]]} (the host copy at "
        f"{size / b / 2**30:.1f} GiB/s, buffers reused); published after {t:.2f} s; the first save, allocating the "
        f"buffers: {blocked[0]:.2f} s"
    )
    print(f"async blocked / durable synchronous save = {b / d:.3f}")


if __name__ == "__main__":
    main()
