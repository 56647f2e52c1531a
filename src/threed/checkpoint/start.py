"""Where a run starts, decided before anything expensive: resume (natively or through a universal checkpoint),
weights only, or random init; and whether the save directory can take a checkpoint at all.

    decision = start(cfg, dims, rank)   # every rank, before the model is built (threed.engine.build); dims:
                                        # the run's resolved dimensions (threed.parallel.dims)

`decide_start` only reads the file system (threed check-config calls it too); `start` runs it on rank 0, then does
what it decided (`--overwrite`, the universal conversion) and gives every rank the same `StartDecision`.

The rules (each refusal names the flag that would make it go ahead):
- `--save` holding a complete checkpoint: resume from it (a requeued job), even if `--load` / `--init-from` name
  another directory (those are for the first start). With `--auto-resume false` that is refused, because
  training from scratch would overwrite and roll back the run; `--overwrite true` deletes its checkpoints first.
- `--save` with checkpoints but none complete while `latest` exists: refused (a short or missing file is more
  likely a file-system problem than a run to throw away); `--overwrite true` starts over.
- `--load DIR`: resume from its newest complete checkpoint; `--init-from DIR`: its weights, at any tp / pp (at
  another layout than it was written at, each rank reads its shards' slices out of it: threed.convert.into_stage).
- A resume at another tp, pp, dp or dtype converts the checkpoint to a universal one once (rank 0) and loads that;
  so does one at the same tp and pp whose --partition-method puts layers on other stages (DeepSpeed's optimizer
  shards are per stage: a native load failed on tensor sizes).
- A resume whose checkpoint is already at --steps or beyond has nothing to train: one line, and the run ends (exit
  0) before anything is converted or built (`StartDecision.finished`).
- A resume at another --seq-length, --micro-batch-size or global batch than the run recorded in threed_run.json is
  a warning, not a refusal: changing the batch on resume can be deliberate.

Before anything is written to --save, rank 0 takes the save directory's lock (threed.checkpoint.lock: one run per
directory; a dead job's lock never blocks). A `STOP` file already in --save at that point was left by a run that
stopped (the file is only ever read, never removed, by the run it stops): it is removed with a line saying so,
because a requeue after a STOP is exactly the next run that should train, and refusing would make every such
restart a manual step. A STOP meant for this run is one created after it started.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

import torch.distributed as dist

from threed.checkpoint import universal
from threed.checkpoint.format import (
    CONVERT_MANIFEST,
    RUN_JSON,
    CheckpointError,
    check_loadable,
    check_model,
    checkpoint_bytes,
    empty_latest,
    free_bytes,
    holds_adapters_only,
    list_tags,
    read_latest,
    read_model_config,
    read_run_json,
)
from threed.checkpoint.lock import SaveLock
from threed.checkpoint.lora_base import base_of, check_base, open_base, recorded_base
from threed.checkpoint.manifest import Found, clear_run, find_resumable, read_manifest, save_dir_contents
from threed.config import CheckpointConfig, ModelConfig, RunConfig
from threed.parallel.dims import RunDims
from threed.parallel.partition import describe, resolve_partition
from threed.parallel.distributed import is_multi_rank
from threed.errors import ConfigError
from threed.units import human_bytes

T = TypeVar("T")


@dataclass
class StartDecision:
    mode: str = "fresh"  # fresh | resume | weights
    source: Optional[Found] = None
    universal: bool = False  # load through a universal checkpoint (set once converted)
    repartition: str = ""  # same tp/pp, other stages (--partition-method): why `universal` is set, for the log
    other_layout: str = ""  # weights written at another tp / pp ("tp=1 pp=2"): read slice by slice (into_stage)
    load_dir: Optional[str] = None  # what engine.load_checkpoint gets
    tag: Optional[str] = None
    clear_save: bool = False  # --overwrite: delete the run in --save before starting
    notes: list[str] = field(default_factory=list)  # log lines for rank 0
    finished: Optional[str] = None  # a resume with nothing left to train: the line that says so
    lora_base: Optional[dict] = None  # a LoRA run: the base its adapters belong to (threed.checkpoint.lora_base)
    # a resume of an adapter-only LoRA checkpoint: the frozen base is read from lora_base's path and tag
    adapters_only: bool = False

    def describe(self) -> str:
        if self.finished:
            return self.finished
        if self.mode == "fresh":
            return "random init"
        what = "resumed from" if self.mode == "resume" else "weights from"
        via = " via a universal checkpoint" if self.universal else ""
        via = via or (f" (written at {self.other_layout}, read slice by slice)" if self.other_layout else "")
        return f"{what} {self.source.path}/{self.source.tag}{via}"


def dtype_of(found: Found) -> str:
    """The training dtype a checkpoint was written in."""
    dtype = found.manifest.get("dtype")
    if dtype:
        return dtype
    # Older checkpoints: DeepSpeed's BF16_Optimizer names its shards bf16_zero_pp_rank_*.
    step_dir = Path(found.path) / found.tag
    return "bf16" if any(step_dir.glob("bf16_zero_pp_rank_*")) else "fp32"


def _recorded_model(found: Found) -> Optional[ModelConfig]:
    if found.manifest.get("model"):
        return RunConfig.from_dict({"model": found.manifest["model"]}).model
    return read_model_config(found.path)


def _find(path: str, what: str, notes: list[str]) -> Found:
    if not os.path.lexists(path):  # a typo, or a directory not mounted here: not the same as an empty one
        raise ConfigError(
            f"{what}={path} does not exist; check the path (a typo, or a file system not mounted on this "
            f"node?): pass the directory that `threed train --save` or `threed convert --out` wrote"
        )
    if not Path(path).is_dir() or (read_latest(path) is None and not list_tags(path)):
        raise ConfigError(
            f"{what}={path} holds no DeepSpeed checkpoint (no 'latest' file); pass the directory "
            f"that `threed train --save` or `threed convert --out` wrote"
        )
    found, warnings = find_resumable(path)
    notes.extend(warnings)
    empty = empty_latest(path)
    if found is None:
        raise ConfigError(
            f"{what}={path}: {empty}"
            if empty
            else f"{what}={path} holds no complete checkpoint ({'; '.join(warnings) or 'none found'})"
        )
    if empty:
        notes.append(f"warning: {empty}; using the newest complete checkpoint there, {found.tag}")
    return found


def decide_start(cfg: RunConfig, dims: RunDims) -> StartDecision:
    """Pure: reads the file system, changes nothing, raises ConfigError with the fix. `dims`: this run's layout,
    batch and stages, resolved once (threed.parallel.dims), against which a checkpoint's are compared."""
    ck = cfg.checkpoint
    decision = StartDecision()
    save_found = _run_in_save(ck, decision)
    _choose_source(ck, save_found, decision)
    if decision.source is None:
        return decision
    found = decision.source
    check_model(found.path, _recorded_model(found), cfg.model)
    decision.load_dir, decision.tag = found.path, found.tag
    if decision.mode == "weights":
        _plan_weights(cfg, found, decision)
    else:
        _plan_resume(cfg, found, dims, decision)
    if cfg.lora.lora_rank and not decision.finished:
        decision.lora_base = _lora_base(cfg, found, decision)
    return decision


def _lora_base(cfg: RunConfig, found: Found, decision: StartDecision) -> Optional[dict]:
    """A LoRA run's base: a start from weights names them (from a LoRA run's checkpoint, the base that one names);
    a resume keeps the one its checkpoint names and refuses an --init-from that is another base (said, not
    ignored). An adapter-only checkpoint (threed.checkpoint.format.ADAPTERS_ONLY) is resumed on the base it names,
    read from --init-from when given (a base that moved), else from where it was recorded: checked here, before
    anything is built."""
    where = f"{found.path}/{found.tag}"
    if decision.mode != "resume":
        if holds_adapters_only(Path(found.path) / found.tag):
            raise ConfigError(
                f"--init-from {found.path}: {where} holds only LoRA adapters (its base is elsewhere); export them "
                f"(`threed export --lora --ckpt {found.path} --out PEFT`) and start from its base with --init-from "
                f"BASE --lora-init-from PEFT"
            )
        return base_of(found.path, found.tag)
    recorded = recorded_base(found.manifest)
    given = cfg.checkpoint.init_from
    other = given and os.path.abspath(given) != os.path.abspath(found.path)
    if recorded is not None and holds_adapters_only(Path(found.path) / found.tag):
        check_same_adapters(cfg, found)
        fix = (
            "put the base back there, or give where it is now with --init-from BASE"
            if not other
            else f"give the base those adapters were trained on with --init-from (or drop it to use {recorded['path']})"
        )
        base = open_base(recorded, where, fix, path=given if other else None)
        decision.adapters_only = True
        return {**recorded, "path": str(base.path.absolute())}
    if other:
        fix = (
            f"resume without --init-from (the checkpoint holds its own base), or train adapters for {given} "
            f"in a new --save"
        )
        check_base(recorded, given, where, fix)
    return recorded


def check_same_adapters(cfg: RunConfig, found: Found) -> None:
    """A resume of an adapter-only checkpoint loads its layer files not strictly (the base is absent from them):
    adapters of another rank, alpha or targets than the run recorded are refused here, in one line, instead."""
    theirs = (read_run_json(Path(found.path)) or {}).get("lora") or {}
    mine = cfg.lora
    pairs = (
        ("--lora-rank", theirs.get("lora_rank"), mine.lora_rank),
        ("--lora-alpha", float(theirs.get("lora_alpha") or 0), float(mine.lora_alpha)),
        ("--lora-targets", sorted(theirs.get("lora_targets") or ()), sorted(mine.lora_targets)),
    )
    diffs = [f"{flag} {a} (the checkpoint's) != {b}" for flag, a, b in pairs if a != b]
    if diffs:
        raise ConfigError(
            f"resuming {found.path}/{found.tag} with other LoRA adapters than it holds ({'; '.join(diffs)}); resume "
            f"with its own --lora-* flags"
        )


def _run_in_save(ck: CheckpointConfig, decision: StartDecision) -> Optional[Found]:
    """The complete checkpoint a run already left in --save (a requeued job resumes from it), or None; refuses what
    would overwrite a run or hide a file-system problem, unless --overwrite (then marks --save for clearing)."""
    if not (ck.save and Path(ck.save).is_dir() and (list_tags(ck.save) or read_latest(ck.save))):
        return None
    save_found, warnings = find_resumable(ck.save)
    if ck.overwrite:
        decision.clear_save = True
        decision.notes.append(f"--overwrite true: deleting the checkpoints in {ck.save} and starting over")
        return None
    if save_found is not None and not ck.auto_resume:
        raise ConfigError(
            f"--save {ck.save} already holds a checkpoint of a run ({save_found.tag}); --auto-resume false "
            f"would train from scratch and overwrite it. Resume it (drop --auto-resume false), choose a new "
            f"--save, or pass --overwrite true to delete its checkpoints and start over"
        )
    empty = empty_latest(ck.save)
    if save_found is None and empty:
        raise ConfigError(f"--save {ck.save}: {empty}, or pass --overwrite true to start over")
    if save_found is None and read_latest(ck.save) is not None:
        raise ConfigError(
            f"--save {ck.save} holds no complete checkpoint ({'; '.join(warnings)}); restore the "
            f"missing files, or pass --overwrite true to delete them and start over"
        )
    decision.notes.extend(warnings)
    if empty:  # the save's own manifests vouch for the newest complete one; the next save rewrites `latest`
        decision.notes.append(f"warning: {empty}; resuming from the newest complete checkpoint, {save_found.tag}")
    return save_found


def _choose_source(ck: CheckpointConfig, save_found: Optional[Found], decision: StartDecision) -> None:
    """The mode and source: --save's own run first (--load / --init-from are for the first start, said so when
    they name another directory), then --load, then --init-from; none of them: random init."""
    if save_found is not None:
        decision.mode, decision.source = "resume", save_found
        for flag, value in (("--load", ck.load), ("--init-from", ck.init_from)):
            if value and os.path.abspath(value) != os.path.abspath(ck.save):
                decision.notes.append(
                    f"{flag} {value} is not used: --save {ck.save} already holds this run's "
                    f"checkpoint {save_found.tag}, so the run resumes from it"
                )
    elif ck.load:
        decision.mode, decision.source = "resume", _find(ck.load, "load", decision.notes)
    elif ck.init_from:
        decision.mode, decision.source = "weights", _find(ck.init_from, "init_from", decision.notes)


def _plan_weights(cfg: RunConfig, found: Found, decision: StartDecision) -> None:
    """--init-from: at another tp / pp each rank reads its slices out of the old files; a threed-written latest
    checkpoint is checked loadable as weights."""
    lay = found.layout
    if (lay.tp, lay.pp) != (cfg.parallel.tp, cfg.parallel.pp):
        # DeepSpeed loads weights only at the tp and pp they were written at; the slices this rank needs are
        # read out of the old TP files instead (threed.convert.into_stage), with no copy on disk
        decision.other_layout = f"tp={lay.tp} pp={lay.pp}"
        decision.notes.append(
            f"{found.path}/{found.tag} was written at tp={lay.tp} pp={lay.pp}; this run has "
            f"tp={cfg.parallel.tp} pp={cfg.parallel.pp}: each rank reads its shards' slices of it (no resharded "
            f"copy is written)"
        )
    if (Path(found.path) / RUN_JSON).is_file() or (Path(found.path) / CONVERT_MANIFEST).is_file():
        if found.tag == read_latest(found.path):
            check_loadable(found.path, cfg.model, lay.tp, lay.pp, weights_only=True)


def _plan_resume(cfg: RunConfig, found: Found, dims: RunDims, decision: StartDecision) -> None:
    """A resume: refused from weights only, finished when the checkpoint is at --steps already, warned about a
    changed batch shape; natively at the checkpoint's own layout, else through a universal checkpoint."""
    if not found.has_optimizer:
        raise ConfigError(
            f"{found.path} is a converted checkpoint (weights only, no optimizer state): use it with "
            f"--init-from, not --load or --save"
        )
    if found.step >= cfg.train.steps:
        decision.finished = (
            f"{found.path}/{found.tag} is at step {found.step} and --steps is "
            f"{cfg.train.steps}: the run has finished, nothing to train (raise --steps to "
            f"train further)"
        )
        return
    changed = changed_shape(cfg, found, dims)
    if changed:
        decision.notes.append(
            f"warning: resuming {found.path}/{found.tag} with {changed} (from the run recorded in "
            f"{found.path}/{RUN_JSON}); training continues from the samples consumed so far. "
            f"If that was not meant, resume with the recorded values"
        )
    lay = found.layout
    # ZeRO-1 shards the optimizer over DeepSpeed's data axis, dp x cp (threed.parallel.pipeline.make_topology): a run
    # whose dp x cp is the checkpoint's loads it natively whatever its cp; another count goes through universal.
    same = (lay.tp, lay.pp, lay.dp) == (dims.tp, dims.pp, dims.dp * dims.cp) and dtype_of(found) == cfg.train.dtype
    decision.repartition = moved_layers(cfg, found, dims) if same else ""
    decision.universal = not same or bool(decision.repartition)


def recorded_stages(cfg: RunConfig, found: Found) -> Optional[list[int]]:
    """The stage boundaries the checkpoint was written with: its manifest's (threed saves them), else resolved from
    the partition method of the run recorded beside it; None when neither says (a converter's checkpoint)."""
    manifest = read_manifest(Path(found.path) / found.tag) or {}
    if isinstance(manifest.get("stages"), list):
        return [int(b) for b in manifest["stages"]]
    try:
        run = read_run_json(Path(found.path))
        if not run or "train" not in run:
            return None
        was = RunConfig.from_dict(run)
        # over its virtual stages (--vpp): a run at another vpp holds other layers on each rank
        return resolve_partition(
            was.parallel.partition_method,
            cfg.model,
            found.layout.pp * was.parallel.vpp,
            was.train.seq_length,
            found.layout.tp,
        )
    except (CheckpointError, ConfigError, KeyError, TypeError, ValueError):
        return None


def moved_layers(cfg: RunConfig, found: Found, dims: RunDims) -> str:
    """At the checkpoint's own tp and pp, whether this run's --partition-method puts layers on other stages than the
    checkpoint's: DeepSpeed's optimizer shards are per stage, so a native load fails on tensor sizes; a universal
    checkpoint (by parameter name) loads at any partition. '' when the stages are the same or cannot be told."""
    was = recorded_stages(cfg, found)
    if was is None:
        return ""
    if was == list(dims.bounds):
        return ""
    return (
        f"stages {describe(was, cfg.model, found.layout.pp)}; this run's --partition-method "
        f"{cfg.parallel.partition_method} gives {dims.stages(cfg.model)}"
    )


def changed_shape(cfg: RunConfig, found: Found, dims: RunDims) -> str:
    """What a resume changes of the recorded run's sequence length and batch shape ('' when nothing, or when the
    run left no threed_run.json to compare with)."""
    try:
        run = read_run_json(Path(found.path))
    except CheckpointError:
        return ""
    if not run or "train" not in run:
        return ""  # a converter's manifest records no training shape
    try:
        recorded = RunConfig.from_dict(run)
        was = recorded.train
        # The layout's dp counts ZeRO shards, dp x cp: the recorded run's batch counts its dp alone.
        _, _, was_glob = was.resolve_batch(found.layout.dp // recorded.parallel.cp)
    except (ConfigError, KeyError, TypeError, ValueError):
        return ""
    diffs = [
        f"{flag} {a} -> {b}"
        for flag, a, b in (
            ("--seq-length", was.seq_length, cfg.train.seq_length),
            ("--micro-batch-size", was.micro_batch_size, cfg.train.micro_batch_size),
            ("global batch", was_glob, dims.global_batch),
        )
        if a != b
    ]
    return ", ".join(diffs)


def remove_stale_stop(save: Optional[str]) -> Optional[str]:
    """Remove a STOP file left in --save by a run that stopped; the line saying so, or None (module docstring)."""
    if not save:
        return None
    stop = Path(save) / "STOP"
    try:
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stop.stat().st_mtime))
        stop.unlink()
    except FileNotFoundError:
        return None
    return (
        f"removed a stale {stop} (written {written}, before this run started: a stopped run leaves it "
        f"behind); to stop this run, create it again"
    )


def check_save_space(cfg: RunConfig, decision: StartDecision, existing: Path) -> None:
    """Room on --save's file system for what the run will hold at once. `--keep-last N` writes checkpoint N + 1
    before pruning the oldest: N + 1 checkpoints at once, of which the complete ones already there need no new
    space; without it each save needs one more. A universal conversion needs one more. When a torn checkpoint (a
    save cut short, e.g. by a full disk) holds space, the line says so."""
    save, keep = Path(cfg.checkpoint.save), cfg.checkpoint.keep_last
    complete, torn = save_dir_contents(save) if save.is_dir() else (0, [])
    count = max(1, keep + 1 - complete) if keep else 1
    one = checkpoint_bytes(cfg)
    needed = one * (count + (1 if decision.universal else 0))
    free = free_bytes(existing)
    if needed <= free:
        return
    universal = " (plus its universal conversion)" if decision.universal else ""
    held = "".join(
        f"; {d} is a torn checkpoint (a save cut short, not loadable) holding {human_bytes(n)}: remove it"
        for d, n in torn
    )
    if keep:
        raise ConfigError(
            f"--save {save} has {human_bytes(free)} free; --keep-last {keep} holds {keep + 1} checkpoints at once "
            f"(the next is written before the oldest is pruned), {count} more than the {complete} complete one(s) "
            f"there: {human_bytes(needed)} at about {human_bytes(one)} each{universal}{held}. Free space, lower "
            f"--keep-last, or choose --save on a larger file system"
        )
    raise ConfigError(
        f"--save {save} has {human_bytes(free)} free; one checkpoint of {cfg.model.name} needs about "
        f"{human_bytes(needed)}{universal}{held}. Free space or choose --save on a larger file system"
    )


def check_save_dir(cfg: RunConfig, decision: StartDecision, create: bool = True) -> None:
    """Before the model is built: --save is a directory we can create and write, with room for a checkpoint
    (and for the universal conversion when one is planned). `create=False` (threed check-config) only looks:
    permissions instead of a test write, and nothing is created."""
    save = cfg.checkpoint.save
    if not save:
        return
    p = Path(save)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--save {save} is a file, not a directory; give a directory for the checkpoints")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"--save {save}: {existing} is a file, not a directory; choose another --save")
    if not create and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"--save {save} is not writable ({existing} does not let this user write); choose a "
            f"directory you can write to"
        )
    check_save_space(cfg, decision, existing)
    if not create:
        return
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".threed-write-test-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"x")
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"--save {save} is not writable ({e.strerror or e}); choose a directory you can write to"
        ) from None


# ------------------------------------------------------------------------------------------ on every rank


def on_rank0(rank: int, fn: Callable[[], T]) -> T:
    """Run `fn` on rank 0 only and give every rank its result, or raise its ConfigError on every rank: one rank
    decides from the (shared) file system, so all ranks agree even when their views of it differ."""
    if not is_multi_rank():
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


def start(
    cfg: RunConfig,
    dims: RunDims,
    rank: int,
    log: Optional[Callable[[str], None]] = None,
    lock: Optional[SaveLock] = None,
) -> StartDecision:
    """Where the run starts, checked and prepared on rank 0 before the model is built: the decision, the save
    directory (created, writable, room for a checkpoint), its lock (`lock`, taken on rank 0 before anything is
    written to --save; the caller releases it on every exit path), a stale STOP file, `--overwrite`, and the
    universal conversion. A finished run (`decision.finished`) is said in one line and nothing is prepared. Every
    rank calls it; `log` (default: print) runs on rank 0 only."""
    log = log or (lambda m: print(m, flush=True))

    def prepare() -> StartDecision:
        decision = decide_start(cfg, dims)
        if decision.finished:  # nothing is written, converted or built
            for note in decision.notes + [decision.finished]:
                log(f"threed: {note}")
            return decision
        check_save_dir(cfg, decision)
        if lock is not None:  # before anything of the run is written to --save
            lock.acquire(lambda m: log(f"threed: {m}"))
        for note in decision.notes:
            log(f"threed: {note}")
        stale = remove_stale_stop(cfg.checkpoint.save)
        if stale:
            log(f"threed: {stale}")
        if decision.clear_save:
            removed = clear_run(Path(cfg.checkpoint.save))
            log(f"threed: --overwrite true: removed {', '.join(removed) or 'nothing'} from {cfg.checkpoint.save}")
        if decision.universal:
            src = decision.source
            layout = (
                f"with {decision.repartition}"
                if decision.repartition
                else f"at {src.layout.describe()} {dtype_of(src)}; this run has tp={dims.tp}, "
                f"pp={dims.pp}, dp={dims.dp * dims.cp} {cfg.train.dtype}"
            )
            log(
                f"threed: {src.path}/{src.tag} was written {layout}: resuming through a universal checkpoint "
                f"(optimizer state kept)"
            )
            decision.load_dir, decision.tag = universal.target(src, _universal_root(cfg, src), dtype_of(src))
        return decision

    decision = on_rank0(rank, prepare)
    if decision.universal:
        src = decision.source
        # Hours at scale (3.4 TB of I/O for 70B): rank 0 converts while the others wait outside any collective.
        on_rank0_patiently(
            rank,
            lambda: universal.convert(src, _universal_root(cfg, src), dtype_of(src), lambda m: log(f"threed: {m}")),
        )
    return decision


def _universal_root(cfg: RunConfig, src: Found) -> Path:
    return Path(cfg.checkpoint.save or src.path)


# Longer than any job's time limit: the job's own limit (or torchrun, when rank 0 dies) ends a wait that never ends.
PATIENT = timedelta(days=7)
_patient_calls = [0]  # a fresh store key per call: a process may start more than once (tests)


def on_rank0_patiently(rank: int, fn: Callable[[], Any], timeout: timedelta = PATIENT) -> None:
    """Run `fn` on rank 0 while every other rank waits for it on the process group's store (torchrun's TCPStore)
    with its own `timeout`, not in a collective: a collective would time out after --dist-timeout-minutes, and a
    universal conversion can take longer. rank 0's ConfigError is raised on every rank, its crash as a
    RuntimeError."""
    if not is_multi_rank():
        fn()
        return
    _patient_calls[0] += 1
    key = f"threed/rank0_patiently/{_patient_calls[0]}"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        try:
            fn()
        except ConfigError as e:
            store.set(key, "error\n" + str(e))
            raise
        except BaseException as e:
            store.set(key, f"crash\n{type(e).__name__}: {e}")
            raise
        store.set(key, "ok\n")
        return
    store.wait([key], timeout)
    status, _, value = store.get(key).decode().partition("\n")
    if status == "error":
        raise ConfigError(value)
    if status == "crash":
        raise RuntimeError(f"rank 0 failed while converting the checkpoint: {value}")
