"""Saving a training checkpoint so that a kill at any moment leaves a loadable directory: DeepSpeed writes the
files, every rank flushes them to disk and reports what it wrote, and rank 0 publishes the manifest and then
`latest` (threed.checkpoint.manifest says why that order is crash-safe; the flush makes it hold through a power
cut or a node crash too, not only a killed process).

    saved = save(engine, cfg, rank, client_state={"consumed_samples": n})   # every rank
    guard.saved(saved.seconds)      # threed.train.guard keeps room for one more save in --exit-duration-in-mins

Every save first checks the weights it is about to write (`check_weights`: finite, none larger than --max-weight
in magnitude; one pass over this rank's parameters, cheap beside the I/O). A diverged model is refused with exit
3 before anything is written, so `latest` keeps naming the last sane checkpoint.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from threed.atomic import fsync_dir, fsync_file, write_atomic
from threed.checkpoint.format import ADAPTERS_ONLY, LATEST, RUN_JSON, free_bytes, read_latest
from threed.checkpoint.lora_base import LORA_BASE, MODULE_ATTR
from threed.checkpoint.manifest import prune, remove_checkpoint, write_manifest
from threed.config import RunConfig
from threed.errors import torch_write_failed, write_failure
from threed.parallel.distributed import is_multi_rank
from threed.units import human_bytes


EXIT_DIVERGED = 3  # threed.train.guard's exit status for a run that diverged (re-exported there)


EXIT_SAVE_FAILED = 5  # a checkpoint could not be written (a full disk, ...): the previous one stays `latest`


class SaveFailed(SystemExit):
    """A save that could not be written (OSError on any rank): every rank exits EXIT_SAVE_FAILED (the reason was
    printed once, by rank 0)."""


class SaveRefused(SystemExit):
    """A save of weights that are not finite or absurdly large: every rank exits EXIT_DIVERGED, nothing written
    (the reason was printed once, by rank 0)."""


def local_parameters(engine) -> list[torch.Tensor]:
    """This rank's model parameters (its pipeline stage's TP shards), the weights a checkpoint holds."""
    module = getattr(engine, "module", None)
    return [p.detach() for p in module.parameters()] if module is not None else []


def weight_norm(engine) -> float:
    """The L2 norm of this rank's weights, accumulated in fp32 without a copy of any parameter; inf or nan when
    a weight is not finite (or past fp32's range). One pass over the parameters: cheap beside a step."""
    params = local_parameters(engine)
    if not params:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(p, dtype=torch.float32) for p in params])
    return float(torch.linalg.vector_norm(norms))


def max_abs_weight(engine) -> float:
    """The largest weight magnitude on this rank; nan when a weight is nan, inf when one is inf."""
    params = local_parameters(engine)
    if not params:
        return 0.0
    ends = [torch.aminmax(p) for p in params if p.numel()]  # nan propagates; faster than abs().amax() on CPU
    return float(torch.stack([torch.maximum(lo.abs(), hi.abs()).float() for lo, hi in ends]).max()) if ends else 0.0


def check_weights(engine, cfg: RunConfig, rank: int) -> None:
    """Every rank, before a save writes anything: refuse (exit 3, one line from rank 0) when any rank holds a
    non-finite weight or one larger than --max-weight in magnitude."""
    limit = cfg.control.max_weight
    worst = max_abs_weight(engine)
    mine = (worst, rank) if not math.isfinite(worst) or (limit and worst > limit) else None
    views = [mine]
    if is_multi_rank():
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, mine)
    bad = [v for v in views if v is not None]
    if not bad:
        return
    value, where = next((v for v in bad if not math.isfinite(v[0])), max(bad))
    what = (
        f"a non-finite weight ({value})"
        if not math.isfinite(value)
        else f"a weight of magnitude {value:.3g} (--max-weight {limit:g})"
    )
    if rank == 0:
        save = cfg.checkpoint.save
        latest = read_latest(save) if save else None
        last = f"{save}/{latest}" if latest is not None else f"none yet in {save}"
        print(
            f"threed: error: refusing to save step {engine.global_steps}: rank {where} holds {what}: the run "
            f"diverged; nothing was written. Last good checkpoint: {last}. "
            f"{'Resume from it' if latest is not None else 'Start again'} with a lower --lr or more "
            f"--warmup-steps",
            file=sys.stderr,
            flush=True,
        )
    raise SaveRefused(EXIT_DIVERGED)


@dataclass(frozen=True)
class Saved:
    path: str  # the save directory (--save)
    tag: str
    seconds: float  # how long the save took on this rank, barriers included


def save(engine, cfg: RunConfig, rank: int, client_state: Optional[dict] = None) -> Saved:
    """Every rank calls this. `client_state` (e.g. the consumed-sample count) is stored in the checkpoint and
    returned in `Built.client_state` on resume.

    Order, so that a kill at any moment leaves a loadable directory: a leftover directory of the same tag (an
    earlier save cut short) is removed; every rank writes its files (DeepSpeed, without its own `latest`) and
    flushes each to disk, then the directories naming them (so a power cut cannot leave a manifest vouching for
    contents still in the page cache); a barrier; rank 0 writes the run config, the manifest (every file and its
    size as the rank that wrote it sees it), then `latest`, each atomically (flushed too); then old checkpoints
    are pruned (`--keep-last`). Before all of it, the weights are checked (`check_weights`): a diverged model is
    refused with exit 3 and nothing is written."""
    step_dir, t0 = begin_save(engine, cfg, rank)
    meta = describe(engine, cfg, client_state)
    written, failed = write_files(engine, cfg, rank, step_dir, client_state, recording_writes)
    fsync_dirs(written, step_dir)
    settle(cfg, rank, step_dir, written_sizes(written, step_dir), failed, meta, t0)
    return Saved(path=str(step_dir.parent), tag=step_dir.name, seconds=time.time() - t0)


def begin_save(engine, cfg: RunConfig, rank: int) -> tuple[Path, float]:
    """Every rank, before a save writes anything: the weights checked (exit 3 when diverged), a leftover directory
    of the same tag (an earlier save cut short) removed, a barrier. Returns the tag directory and the start time."""
    assert cfg.checkpoint.save
    check_weights(engine, cfg, rank)
    step_dir = Path(cfg.checkpoint.save) / f"global_step{engine.global_steps}"
    t0 = time.time()
    if rank == 0 and step_dir.exists():
        remove_checkpoint(step_dir)
    if is_multi_rank():
        dist.barrier()
    return step_dir, t0


def write_files(engine, cfg: RunConfig, rank: int, step_dir: Path, client_state: Optional[dict], recorder):
    """DeepSpeed's save of every file of this rank into `step_dir`, through `recorder(engine)` (a context manager
    around its checkpoint engine that yields the list of what it took: `recording_writes`, or the asynchronous
    save's host copies). Returns (that list, None) or, when the write failed, (what was taken, the failure)."""
    failed: Optional[tuple[str, str]] = None
    taken: list = []
    try:
        with recorder(engine) as taken:
            engine.save_checkpoint(
                str(step_dir.parent),
                tag=step_dir.name,
                save_latest=False,
                client_state={"threed_run": cfg.to_dict(), "threed_client": dict(client_state or {})},
                exclude_frozen_parameters=adapters_only(engine, cfg),
            )
    except (OSError, RuntimeError) as e:  # a full disk, a quota, a vanished mount: said once, by rank 0, in settle
        if isinstance(e, RuntimeError) and not torch_write_failed(e):
            raise  # a bug: its traceback
        failed = write_error(e, step_dir, rank)
        if is_multi_rank():
            dist.barrier()  # DeepSpeed's save ends in a barrier, where the ranks that wrote their files now wait
    return taken, failed


def adapters_only(engine, cfg: RunConfig) -> bool:
    """Whether this save leaves the frozen base out of the layer files (an adapter-only LoRA checkpoint): a LoRA run
    whose base is named (threed.engine.lora put it on the module), so that a resume can read the base from there. A
    LoRA run from random init has no base to read: it saves the frozen weights with the adapters."""
    return bool(cfg.lora.lora_rank and getattr(getattr(engine, "module", None), MODULE_ATTR, None))


def written_sizes(written: list[str], step_dir: Path) -> dict[str, int]:
    """Each file this rank wrote into `step_dir`, at the size it sees: on a network file system only the writer is
    sure to see the final size."""
    return {Path(p).name: Path(p).stat().st_size for p in written if Path(p).parent == step_dir}


def settle(cfg: RunConfig, rank: int, step_dir: Path, mine: dict, failed, meta: dict, t0: float, group=None) -> None:
    """Every rank, once its files are written (`mine`: name -> size) or failed: the ranks' reports gathered (a
    few names per rank, so the gather stays small at any world size); any failure ends the run (exit 5, one line);
    else rank 0 publishes (`publish`) and tells every rank whether that worked. `group`: the process group of
    these collectives (the asynchronous save's own gloo group; None: the default)."""
    step = meta["step"]
    views = [(mine, failed)]
    if is_multi_rank():
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, (mine, failed), group=group)
    failures = [f for _, f in views if f is not None]
    if failures:
        save_failed(cfg, rank, step, step_dir, failures[0])
    try:
        if rank == 0:
            publish(cfg, step_dir, {n: s for view, _ in views for n, s in view.items()}, meta, t0)
    except OSError as e:
        failed = write_error(e, step_dir, 0)
    verdict = [failed if rank == 0 else None]
    if is_multi_rank():  # also the save's closing barrier: no rank goes on before `latest` is written
        dist.broadcast_object_list(verdict, src=0, group=group)
    if verdict[0] is not None:
        save_failed(cfg, rank, step, step_dir, verdict[0])


LOW_SPACE = 64 * 2**20  # a file system with less free than this after a failed write is full
FREE_SPACE = "Free space on --save's file system (the torn directory too)"  # the fix of a full disk, the default


def write_error(e: Exception, step_dir: Path, rank: int) -> tuple[str, str]:
    """A failed checkpoint write on `rank`: (one clause naming its errno and the file where known, the fix), from
    threed.errors.write_failure (EFBIG is a per-file size limit, not a full disk). torch's writer gives no errno:
    without a file-size limit, a file system left (nearly) without free space says it was ENOSPC."""
    what, fix = write_failure(e, writing=True)
    if not isinstance(e, OSError) and not fix:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        try:
            free = free_bytes(step_dir if step_dir.exists() else step_dir.parent)
        except OSError:
            free = None
        if free is not None and free < LOW_SPACE:
            what = f"No space left on device (ENOSPC): {human_bytes(free)} free (torch's writer: {first})"
        else:
            what = f"torch's checkpoint writer failed: {first}"
    full = not fix or getattr(e, "errno", None) == errno.ENOSPC  # the default fix says where to free space
    return f"rank {rank}: {what}", FREE_SPACE if full else fix[0].upper() + fix[1:]


def save_failed(cfg: RunConfig, rank: int, step: int, step_dir: Path, failure: tuple[str, str]) -> None:
    """Every rank: a save that could not be written ends the run with EXIT_SAVE_FAILED and one line from rank 0
    naming the error, the torn directory and the fix (`write_error`). `latest` was not moved: it still names the
    previous checkpoint."""
    why, fix = failure
    if rank == 0:
        latest = read_latest(cfg.checkpoint.save)
        kept = f"{cfg.checkpoint.save}/{latest}" if latest is not None else "none (no checkpoint yet)"
        print(
            f"threed: error: saving step {step} failed: {why}. The torn directory {step_dir} is not a checkpoint; "
            f"`latest` still names {kept}. {fix}, then run the same command to resume",
            file=sys.stderr,
            flush=True,
        )
    raise SaveFailed(EXIT_SAVE_FAILED)


def describe(engine, cfg: RunConfig, client_state: Optional[dict]) -> dict:
    """What the manifest says of the save besides its files, read from the engine when the save begins (an
    asynchronous save publishes steps later, when the engine has moved on)."""
    dp = engine.grid.get_data_parallel_world_size() if hasattr(engine, "grid") else 1
    return {
        "step": engine.global_steps,
        "dtype": cfg.train.dtype,
        "model": cfg.to_dict()["model"],
        "layout": {"tp": cfg.parallel.tp, "pp": cfg.parallel.pp, "dp": dp},
        # which layers each stage held: a resume with another --partition-method goes through universal
        "stages": stage_bounds(engine),
        "client_state": _jsonable(client_state or {}),
        # a LoRA run: the base its adapters belong to (threed.checkpoint.lora_base; set on the module by
        # threed.engine.lora), so that the adapters are never put on another base
        **({LORA_BASE: getattr(getattr(engine, "module", None), MODULE_ATTR, None)} if cfg.lora.lora_rank else {}),
        # its layer files hold only the adapters: every reader takes the base from the one named above
        **({ADAPTERS_ONLY: True} if adapters_only(engine, cfg) else {}),
    }


def publish(cfg: RunConfig, step_dir: Path, files: dict, meta: dict, t0: float) -> None:
    """Rank 0, once every rank's files are written: the run config, the manifest, `latest`, then pruning."""
    save_dir, tag = step_dir.parent, step_dir.name
    # The listing catches any file written another way; the writers' sizes win.
    files = {**{f.name: f.stat().st_size for f in step_dir.iterdir() if f.is_file()}, **files}
    # The run config beside the checkpoint lets `threed export` / `threed verify` rebuild the model.
    write_atomic(save_dir / RUN_JSON, json.dumps(cfg.to_dict(), indent=1))
    write_manifest(step_dir, files, {**meta, "save_seconds": round(time.time() - t0, 2)})
    write_atomic(save_dir / LATEST, tag)
    prune(save_dir, cfg.checkpoint.keep_last, tag)


@contextlib.contextmanager
def recording_writes(engine) -> Iterator[list[str]]:
    """The paths DeepSpeed's checkpoint engine writes on this rank during the block (it writes every layer,
    mp_rank and optimizer file through `checkpoint_engine.save`, and the file is complete when that returns), each
    flushed to disk as soon as it is complete (an OSError of the flush is the save's, as a failed write is)."""
    original = engine.checkpoint_engine.save
    written: list[str] = []

    def save(state_dict, path, *args, **kwargs):
        out = original(state_dict, path, *args, **kwargs)
        fsync_file(path)
        written.append(str(path))
        return out

    with swapped_save(engine.checkpoint_engine, save):
        yield written


@contextlib.contextmanager
def swapped_save(checkpoint_engine, save) -> Iterator[None]:
    """DeepSpeed's `checkpoint_engine.save` replaced by `save` during the block (its own again afterwards, however
    the block ends)."""
    had_own = "save" in vars(checkpoint_engine)
    original = checkpoint_engine.save
    checkpoint_engine.save = save
    try:
        yield
    finally:
        if had_own:
            checkpoint_engine.save = original
        else:
            del checkpoint_engine.save


def fsync_dirs(written: list[str], step_dir: Path) -> None:
    """Flush the directories naming this rank's files (the tag directory, which DeepSpeed may nest files under)
    and the save directory naming the tag directory: a file's contents on disk are no use if its name is not."""
    for folder in sorted({Path(p).parent for p in written} | {step_dir, step_dir.parent}, reverse=True):
        fsync_dir(folder)


def stage_bounds(engine) -> Optional[list[int]]:
    """The pipeline's stage boundaries over its layer list (DeepSpeed's PipelineModule.parts), if it has them."""
    parts = getattr(getattr(engine, "module", None), "parts", None)
    return [int(b) for b in parts] if parts is not None else None


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        try:
            json.dumps(v)
            out[k] = v
        except (TypeError, ValueError):
            out[k] = repr(v)
    return out
