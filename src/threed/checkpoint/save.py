"""Saving a training checkpoint so that a kill at any moment leaves a loadable directory: DeepSpeed writes the
files, every rank reports what it wrote, and rank 0 publishes the manifest and then `latest` (threed.checkpoint
.manifest says why that order is crash-safe).

    saved = save(engine, cfg, rank, client_state={"consumed_samples": n})   # every rank
    guard.saved(saved.seconds)      # threed.guard keeps room for one more save in --exit-duration-in-mins
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch.distributed as dist

from threed.atomic import write_atomic
from threed.checkpoint.format import LATEST, RUN_JSON
from threed.checkpoint.manifest import prune, remove_checkpoint, write_manifest
from threed.config import RunConfig


@dataclass(frozen=True)
class Saved:
    path: str  # the save directory (--save)
    tag: str
    seconds: float  # how long the save took on this rank, barriers included


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def save(engine, cfg: RunConfig, rank: int, client_state: Optional[dict] = None) -> Saved:
    """Every rank calls this. `client_state` (e.g. the consumed-sample count) is stored in the checkpoint and
    returned in `Built.client_state` on resume.

    Order, so that a kill at any moment leaves a loadable directory: a leftover directory of the same tag (an
    earlier save cut short) is removed; every rank writes its files (DeepSpeed, without its own `latest`); a
    barrier; rank 0 writes the run config, the manifest (every file and its size as the rank that wrote it sees
    it), then `latest`, each atomically; then old checkpoints are pruned (`--keep-last`)."""
    ck = cfg.checkpoint
    assert ck.save
    save_dir = Path(ck.save)
    tag = f"global_step{engine.global_steps}"
    step_dir = save_dir / tag
    t0 = time.time()
    if rank == 0 and step_dir.exists():
        remove_checkpoint(step_dir)
    if _multi_rank():
        dist.barrier()
    with recording_writes(engine) as written:
        engine.save_checkpoint(str(save_dir), tag=tag, save_latest=False, client_state={
            "threed_run": cfg.to_dict(), "threed_client": dict(client_state or {})})
    # Each rank reports the files it wrote, at the size it sees: on a network file system only the writer is
    # sure to see the final size. A few names per rank, so the gather stays small at any world size.
    mine = {Path(p).name: Path(p).stat().st_size for p in written if Path(p).parent == step_dir}
    views = [mine]
    if _multi_rank():
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine)
    if rank == 0:
        # The listing catches any file written another way; the writers' sizes win.
        files = {f.name: f.stat().st_size for f in step_dir.iterdir() if f.is_file()}
        for view in views:
            files.update(view)
        # The run config beside the checkpoint lets `threed export` / `threed verify` rebuild the model.
        write_atomic(save_dir / RUN_JSON, json.dumps(cfg.to_dict(), indent=1))
        dp = engine.grid.get_data_parallel_world_size() if hasattr(engine, "grid") else 1
        write_manifest(step_dir, files, {
            "step": engine.global_steps, "dtype": cfg.train.dtype, "model": cfg.to_dict()["model"],
            "layout": {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": dp},
            "client_state": _jsonable(client_state or {}), "save_seconds": round(time.time() - t0, 2)})
        write_atomic(save_dir / LATEST, tag)
        prune(save_dir, ck.keep_last, tag)
    if _multi_rank():
        dist.barrier()
    return Saved(path=str(save_dir), tag=tag, seconds=time.time() - t0)


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
