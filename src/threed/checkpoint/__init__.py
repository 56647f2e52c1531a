"""Checkpoints: the layout (`layout`), crash-safe saving with a manifest and `latest` written last (`manifest`),
where a run starts (`resume`), and resuming at another layout (`universal`).

    threed.checkpoint.save(engine, cfg, rank, client_state={"consumed_samples": n})   # every rank
    plan = threed.checkpoint.start(cfg, rt)       # every rank, before the model is built (threed.engine)
"""
from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch.distributed as dist

from threed.checkpoint.layout import (LATEST, RUN_CONFIG_NAME, CheckpointLayout, check_layout, check_loadable,
                                      checkpoint_layout, has_checkpoint, read_latest)
from threed.checkpoint.manifest import (clear_run, find_resumable, prune, remove_checkpoint, write_atomic,
                                        write_manifest)
from threed.checkpoint.resume import StartPlan, check_save_dir, checkpoint_bytes, plan_start
from threed.config import ConfigError, RunConfig

__all__ = ["CheckpointLayout", "StartPlan", "check_layout", "check_loadable", "checkpoint_bytes",
           "checkpoint_layout", "find_resumable", "has_checkpoint", "read_latest", "save", "start", "RUN_CONFIG_NAME"]

T = TypeVar("T")


def _is_multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def on_rank0(rank: int, fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and give every rank its result, or raise its ConfigError on every rank: one rank
    decides from the (shared) file system, so all ranks agree even when their views of it differ."""
    if not _is_multi_rank():
        return fn()
    payload: list[Any] = [None]
    if rank == 0:
        try:
            payload[0] = ("ok", fn())
        except ConfigError as e:
            payload[0] = ("error", str(e))
        except BaseException as e:
            dist.broadcast_object_list([("crash", f"{type(e).__name__}: {e}")], src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        raise ConfigError(value)
    if status == "crash":
        raise RuntimeError(f"rank 0 failed while preparing the checkpoint directory: {value}")
    return value


def start(cfg: RunConfig, rank: int, world_size: int, log: Optional[Callable[[str], None]] = None) -> StartPlan:
    """Where the run starts, checked and prepared on rank 0 before the model is built: the plan, the save
    directory (created, writable, room for a checkpoint), `--overwrite`, and the universal conversion. Every rank
    calls it; `log` (default: print) runs on rank 0 only."""
    log = log or (lambda m: print(m, flush=True))

    def prepare() -> StartPlan:
        plan = plan_start(cfg, world_size)
        check_save_dir(cfg, plan)
        for note in plan.notes:
            log(f"threed: {note}")
        if plan.clear_save:
            removed = clear_run(Path(cfg.checkpoint.save))
            log(f"threed: --overwrite true: removed {', '.join(removed) or 'nothing'} from {cfg.checkpoint.save}")
        if plan.universal:
            from threed.checkpoint.universal import convert
            from threed.checkpoint.resume import _dtype_of

            src = plan.source
            root = Path(cfg.checkpoint.save or src.path)
            log(f"threed: {src.path}/{src.tag} was written at {src.layout.describe()} {_dtype_of(src)}; this run "
                f"has tp={cfg.parallel.tp}, pp={cfg.parallel.pp}, dp={cfg.parallel.dp(world_size)} "
                f"{cfg.train.dtype}: resuming through a universal checkpoint (optimizer state kept)")
            plan.load_dir, plan.tag = convert(src, root, _dtype_of(src), lambda m: log(f"threed: {m}"))
        return plan

    return on_rank0(rank, prepare)


def save(engine, cfg: RunConfig, rank: int, client_state: Optional[dict] = None) -> str:
    """Every rank calls this. `client_state` (e.g. the consumed-sample count) is stored in the checkpoint and
    returned in `Built.client_state` on resume.

    Order, so that a kill at any moment leaves a loadable directory: a leftover directory of the same tag (an
    earlier save cut short) is removed; every rank writes its files (DeepSpeed, without its own `latest`); a
    barrier; rank 0 writes the run config, the manifest (every file and its size as the rank that wrote it sees
    it), then `latest`, each atomically; then old checkpoints are pruned (`--keep-last`)."""
    from threed.guard import saving

    ck = cfg.checkpoint
    assert ck.save
    save_dir = Path(ck.save)
    tag = f"global_step{engine.global_steps}"
    step_dir = save_dir / tag
    t0 = time.time()
    with saving():
        if rank == 0 and step_dir.exists():
            remove_checkpoint(step_dir)
        if _is_multi_rank():
            dist.barrier()
        with recording_writes(engine) as written:
            engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False, client_state={
                "threed_run": cfg.to_dict(), "threed_client": dict(client_state or {})})
        # Each rank reports the files it wrote, at the size it sees: on a network file system only the writer is
        # sure to see the final size. A few names per rank, so the gather stays small at any world size.
        mine = {Path(p).name: Path(p).stat().st_size for p in written if Path(p).parent == step_dir}
        views = [mine]
        if _is_multi_rank():
            views = [None] * dist.get_world_size()
            dist.all_gather_object(views, mine)
        if rank == 0:
            # The listing catches any file written another way; the writers' sizes win.
            files = {f.name: f.stat().st_size for f in step_dir.iterdir() if f.is_file()}
            for view in views:
                files.update(view)
            # The run config beside the checkpoint lets `threed export` / `threed verify` rebuild the model.
            write_atomic(save_dir / RUN_CONFIG_NAME, json.dumps(cfg.to_dict(), indent=1))
            dp = engine.grid.get_data_parallel_world_size() if hasattr(engine, "grid") else 1
            write_manifest(step_dir, files, {
                "step": engine.global_steps, "dtype": cfg.train.dtype, "model": cfg.to_dict()["model"],
                "layout": {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": dp},
                "client_state": _jsonable(client_state or {}), "save_seconds": round(time.time() - t0, 2)})
            write_atomic(save_dir / LATEST, tag)
            prune(save_dir, ck.keep_last, tag)
        if _is_multi_rank():
            dist.barrier()
    return str(save_dir)


@contextlib.contextmanager
def recording_writes(engine) -> Iterator[list[str]]:
    """The paths DeepSpeed's checkpoint engine writes on this rank during the block (it writes every layer,
    mp_rank and optimizer file through `checkpoint_engine.save`, and the file is complete when that returns)."""
    ce = engine.checkpoint_engine
    had_own = "save" in vars(ce)
    original = ce.save
    written: list[str] = []

    def save(state_dict, path, *args, **kwargs):
        out = original(state_dict, path, *args, **kwargs)
        written.append(str(path))
        return out

    ce.save = save
    try:
        yield written
    finally:
        if had_own:
            ce.save = original
        else:
            del ce.save


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = repr(v)
    return out
