"""Multi-rank checkpoint scenarios for tests/ranks/test_checkpoint*.py, run under torchrun. The loop is threed.train's
(build_engine, RunGuard.after_step, threed.checkpoint.save.save with a consumed-sample count), fed fixed synthetic
batches whose global order does not depend on dp: global batch k is samples [k*G, (k+1)*G), sample i drawn from
a generator seeded with i, and each dp rank takes its contiguous slice (Megatron's order).

    torchrun --nproc-per-node 4 tests/ranks/ckpt_worker.py --out OUT --save SAVE --tp 1 --pp 2 --steps 6 \
        --save-interval 2

Rank 0 appends `{"step", "loss", "norm"}` lines to OUT/losses.jsonl as it goes (a killed run leaves the steps it
finished), every rank writes its local weights to OUT/weights_rank<R>.pt at the end, and OUT/result.json holds
the start step and the client state a resume received. --record-io makes every rank log each os.fsync (the path
its descriptor names, when it returned) and os.replace (its target, when it began) to OUT/io_rank<R>.jsonl:
the order test_checkpoint_faults.py checks (every file flushed before `latest` names its checkpoint).
--async-save saves through threed.checkpoint.async_save as `threed train --async-save` does (the pending save polled
at every step boundary, waited for before the next save and at the end); its background writes wait until
training has taken the next step, so a copy sharing memory with the live state would write that step's values.
--lr-jump-step N sets the optimizer's lr
to --lr-jump from step N on (a finite blow-up after sane, saved steps).
Fault injection (--kill WHERE:STEP[:RANK]) makes the chosen rank (or every rank: RANK=all) SIGKILL itself at a
point of the save of step STEP:
  file1   after its first file of DeepSpeed's save      ds      after DeepSpeed's save, before the manifest
  latest  rank 0, after the manifest, before `latest`   prune   rank 0, after `latest`, before pruning
  mid     (--async-save) in the background writer, part way through its first file of the save: the bytes so far
          flushed, the file still under its staging name
--writer-bug STEP:RANK makes the chosen rank's background writer (--async-save) raise a ValueError, not an OSError,
at its first file of the save of step STEP (a bug in the writer); the worker then records each rank's exit status
in OUT/exit_rank<R>.json and returns, so a shared launch goes on. --async-save also records, after the save of
step 2, the bytes each rank copied into host memory beside the memory model's and the refusal's figures for it
(OUT/host_copy_rank<R>.json).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch

import threed.checkpoint.save as ckpt
from threed.checkpoint.async_save import AsyncSaver, copy_bytes
from threed.checkpoint.save import SaveFailed
from threed.config import CheckpointConfig, ModelConfig, ParallelConfig, RunConfig, RunControlConfig, TrainConfig
from threed.parallel.distributed import Runtime
from worker_setup import build_engine
from threed.train.guard import RunGuard
from worker_setup import local_weights, reads_data, run_worker, write_json

MODEL = ModelConfig(
    name="ckpt-test",
    vocab_size=200,
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=176,
    max_position_embeddings=64,
    make_vocab_size_divisible_by=16,
)
SEQ = 16


def sample(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, MODEL.vocab_size, (SEQ + 1,), generator=g)


def batches(step: int, micro: int, gas: int, dp: int, dp_rank: int):
    """Micro-batches from global step `step` on, for this dp rank: (inputs, labels) pairs, gas per step."""
    glob = micro * gas * dp
    while True:
        first = step * glob + dp_rank * micro * gas
        for j in range(gas):
            rows = torch.stack([sample(first + j * micro + b) for b in range(micro)])
            yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        step += 1


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


MIDWAY = 16 * 1024  # bytes of a file written before `mid` kills: every file of the model here is larger


class KilledMidway:
    """A file object torch.save writes into: once MIDWAY bytes are in, they are flushed to disk and the process
    SIGKILLs itself, in the middle of the file (torch.save writes a record at a time)."""

    def __init__(self, path: str) -> None:
        self.f, self.n = open(path, "wb"), 0

    def write(self, data) -> int:
        n = self.f.write(data)
        self.n += n
        if self.n >= MIDWAY:
            self.f.flush()
            os.fsync(self.f.fileno())
            kill_self()
        return n

    def flush(self) -> None:
        self.f.flush()


def install_writer_bug(spec: str, engine, rank: int) -> None:
    """--writer-bug STEP:RANK: the checkpoint engine's writer raises a ValueError for that rank's first file of
    step STEP (under --async-save only the background thread calls it: the copy swaps it out)."""
    step, who = spec.split(":")
    original, fired = engine.checkpoint_engine.save, []

    def save(state_dict, path, *a, **k):
        if int(who) == rank and f"global_step{step}" in str(path) and not fired:
            fired.append(path)
            raise ValueError("injected bug in the writer")
        return original(state_dict, path, *a, **k)

    engine.checkpoint_engine.save = save


def install_kill(spec: str, engine, rank: int) -> None:
    where, step, who = (spec.split(":") + ["all"])[:3]
    step_n = int(step)
    mine = who == "all" or int(who) == rank

    def at_save() -> bool:
        return engine.global_steps == step_n and mine

    if where == "mid":
        original_save = engine.checkpoint_engine.save

        def save_midway(state_dict, path, *a, **k):
            if mine and f"global_step{step_n}" in str(path):  # the background writer's first file of the step
                return original_save(state_dict, KilledMidway(str(path)), *a, **k)
            return original_save(state_dict, path, *a, **k)

        engine.checkpoint_engine.save = save_midway
    elif where == "file1":
        original = engine.checkpoint_engine.save

        def save(state_dict, path, *a, **k):
            out = original(state_dict, path, *a, **k)
            if mine and f"global_step{step_n}" in str(path):  # by the path: --async-save writes steps later
                kill_self()
            return out

        engine.checkpoint_engine.save = save
    elif where == "ds":
        original_manifest = ckpt.write_manifest

        def write_manifest(*a, **k):
            if at_save():
                kill_self()
            return original_manifest(*a, **k)

        ckpt.write_manifest = write_manifest
    elif where in ("latest", "prune"):
        original_atomic, original_prune = ckpt.write_atomic, ckpt.prune

        def write_atomic(path, text):
            if where == "latest" and path.name == "latest" and at_save():
                kill_self()
            return original_atomic(path, text)

        def prune(*a, **k):
            if where == "prune" and at_save():
                kill_self()
            return original_prune(*a, **k)

        ckpt.write_atomic, ckpt.prune = write_atomic, prune
    else:
        raise SystemExit(f"unknown kill point {where}")


def hold_writes(engine) -> threading.Event:
    """Make the checkpoint engine's writes (the background thread's, under --async-save) wait until the returned
    event is set: the worker sets it after each training step and clears it before each save."""
    stepped = threading.Event()
    write = engine.checkpoint_engine.save

    def held(state_dict, path, *a, **k):
        if not stepped.wait(120):
            raise SystemExit("the held write waited 120 s for a training step")
        return write(state_dict, path, *a, **k)

    engine.checkpoint_engine.save = held
    return stepped


def record_io(out: Path, rank: int):
    """Log every os.fsync and os.replace of this process until the returned function is called, which puts the
    real ones back (a shared launch runs other workers after this one) and writes OUT/io_rank<R>.jsonl."""
    real_fsync, real_replace = os.fsync, os.replace
    events: list[dict] = []

    def fsync(fd):
        real_fsync(fd)
        events.append({"ns": time.monotonic_ns(), "op": "fsync", "path": os.readlink(f"/proc/self/fd/{fd}")})

    def replace(src, dst, *a, **k):
        events.append({"ns": time.monotonic_ns(), "op": "replace", "path": os.path.realpath(dst)})
        return real_replace(src, dst, *a, **k)

    def done() -> None:
        os.fsync, os.replace = real_fsync, real_replace
        (out / f"io_rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))

    os.fsync, os.replace = fsync, replace
    return done


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--save")
    p.add_argument("--load")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1, help="virtual stages per pipeline rank (interleaved 1F1B)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-interval", type=int, default=2)
    p.add_argument("--keep-last", type=int, default=0)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--partition-method", default="balanced")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--kill")
    p.add_argument("--writer-bug", help="STEP:RANK: that rank's background writer raises at step STEP's save")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--record-io", action="store_true", help="log os.fsync and os.replace calls (see the docstring)")
    p.add_argument("--poison-step", type=int, default=0, help="make the loss NaN at this step")
    p.add_argument("--lr-jump-step", type=int, default=0, help="from this step on, the optimizer's lr is --lr-jump")
    p.add_argument("--lr-jump", type=float, default=1e3)
    p.add_argument("--skip-nonfinite", type=int, default=0)
    p.add_argument("--sleep-step", type=int, default=0, help="rank 0 sleeps 30 s in this step (watchdog)")
    p.add_argument("--watchdog-min-seconds", type=float, default=600.0)
    p.add_argument("--exit-duration-in-mins", type=float, default=0.0)


def main(a: argparse.Namespace, rt: Runtime) -> None:
    cfg = RunConfig(
        model=MODEL,
        parallel=ParallelConfig(tp=a.tp, pp=a.pp, vpp=a.vpp, partition_method=a.partition_method),
        train=TrainConfig(
            dtype=a.dtype,
            micro_batch_size=a.micro,
            global_batch_size=a.global_batch,
            seq_length=SEQ,
            steps=a.steps,
            lr=a.lr,
            min_lr=a.lr / 10,
            warmup_steps=2,
            grad_clip=a.grad_clip,
            zero_stage=a.zero_stage,
        ),
        checkpoint=CheckpointConfig(
            save=a.save, load=a.load, save_interval=a.save_interval, keep_last=a.keep_last, async_save=a.async_save
        ),
        control=RunControlConfig(
            skip_nonfinite=a.skip_nonfinite,
            watchdog_factor=3.0,
            watchdog_min_seconds=a.watchdog_min_seconds,
            exit_duration_in_mins=a.exit_duration_in_mins,
        ),
    )
    built = build_engine(cfg, rt)
    engine = built.engine
    out = a.out
    if a.kill:
        install_kill(a.kill, engine, rt.rank)
    if a.writer_bug:
        install_writer_bug(a.writer_bug, engine, rt.rank)
    if a.poison_step and engine.is_last_stage():
        head = engine.module.forward_funcs[-1]
        head.register_forward_hook(lambda m, i, o: o * float("nan") if engine.global_steps + 1 == a.poison_step else o)
    if a.sleep_step and rt.rank == 0:
        first = engine.module.forward_funcs[0]

        def slow(m, i, o):
            if engine.global_steps + 1 == a.sleep_step:
                import time

                time.sleep(30)
            return o

        first.register_forward_hook(slow)
    dp, dp_rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    micro, gas, glob = cfg.train.resolve_batch(dp)
    start = engine.global_steps
    if rt.rank == 0:
        write_json(
            out / "result.json",
            {
                "start": start,
                "client_state": built.client_state,
                "resumed_from": built.resumed_from,
                "universal": bool(built.decision and built.decision.universal),
            },
        )
    it = batches(start, micro, gas, dp, dp_rank) if reads_data(engine) else None
    guard = RunGuard(cfg.control, cfg.checkpoint.save, rt.rank, engine, None, rt.device)
    recorded = record_io(out, rt.rank) if a.record_io else None
    saver = AsyncSaver(cfg, rt.rank, rt.device, print) if a.async_save and a.save else None
    stepped = hold_writes(engine) if saver is not None else None
    try:
        train(a, cfg, rt, engine, it, guard, saver, stepped, start, glob)
    except SaveFailed as e:  # --writer-bug: every rank's exit status, recorded; a shared launch goes on
        if not a.writer_bug:
            raise
        write_json(out / f"exit_rank{rt.rank}.json", {"code": e.code})
        guard.close()
        return
    if recorded is not None:
        recorded()
    guard.close()  # its watchdog thread: a shared launch (tests/ranks/rank_pool.py) runs other workers after this one
    torch.save(local_weights(engine, cfg.model), out / f"weights_rank{rt.rank}.pt")


def record_host_copy(out: Path, cfg: RunConfig, rank: int, world: int, saver: AsyncSaver) -> None:
    """The bytes this rank's last save copied into host memory, beside the memory model's figure for the rank and
    the one the refusal computes (threed.checkpoint.async_save.copy_bytes)."""
    from threed.memory.model import host_copy_bytes  # the memory model: only this record reads it

    p, mine = cfg.parallel, range(rank, rank + 1)
    dp = world // (p.tp * p.pp * p.cp)
    model = host_copy_bytes(
        cfg.model, p.tp, p.pp, dp, cfg.train.seq_length, mine, p.cp, p.vpp, p.partition_method, cfg.train.dtype
    )
    figures = {"copied": saver.buffers.copied, "model": model, "refusal": copy_bytes(cfg, world, mine)}
    write_json(out / f"host_copy_rank{rank}.json", figures)


def train(a, cfg: RunConfig, rt: Runtime, engine, it, guard, saver, stepped, start: int, glob: int) -> None:
    """The steps, each followed by the guard, the pending save's poll and the save when due (as threed.train's)."""
    out = a.out
    for step in range(start, cfg.train.steps):
        if a.lr_jump_step and step + 1 >= a.lr_jump_step:  # a finite blow-up after sane steps (the scheduler sets
            for group in engine.optimizer.param_groups:  # the lr after the optimizer step: this one is used)
                group["lr"] = a.lr_jump
        loss = engine.train_batch(data_iter=it).item()
        if stepped is not None:
            stepped.set()
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        if rt.rank == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step + 1, "loss": loss, "norm": norm}) + "\n")
        late = guard.after_step(step + 1, loss, norm)
        if saver is not None:
            saver.poll()
        if a.save and (late or (step + 1) % a.save_interval == 0 or step + 1 == cfg.train.steps):
            client = {"consumed_samples": (step + 1) * glob}
            if saver is not None:
                saver.finish("the next save")
                stepped.clear()
                saver.save(engine, client)
                if step + 1 == 2:
                    record_host_copy(out, cfg, rt.rank, rt.world_size, saver)
            else:
                guard.saved(ckpt.save(engine, cfg, rt.rank, client).seconds)
        if late:
            break
    if saver is not None:
        stepped.set()  # no step follows the last save
        saver.finish("the end")


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
