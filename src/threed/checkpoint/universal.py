"""Resume at another tp, pp, dp (or dtype) through DeepSpeed's universal checkpoint, optimizer state included.

How each of our parameters is split over TP is `threed.model.spec.universal_checkpoint_info(model)`, derived from
the parameter table (the PipelineModule carries it as `universal_checkpoint_info`; DeepSpeed stores it in every
mp_rank file, and `ds_to_universal` reads it from there): norms replicated, row-parallel weights on dim 1, SwiGLU's
[gate_r; up_r] as two sub-parameters, the vocabulary padding cut to the true size and re-added for the new tp.
A LoRA run's names only its adapters (the frozen base has no optimizer state: threed.engine.lora reads it, on
resume, from the base an adapter-only checkpoint names, or from an older checkpoint's own layer files).

`convert` runs once per (checkpoint, old layout) on rank 0 and writes `<save>/universal/<tag>-from-<layout>/`,
which DeepSpeed loads with `"checkpoint": {"load_universal": true}`; it is deleted once a newer checkpoint exists.
DeepSpeed's `ds_to_universal` runs in a child process of its own (a clean process: no CUDA context, no process
group threads under its worker pool, its memory returned when it ends) with `conversion_workers` workers; the other
ranks wait for it outside any collective (threed.checkpoint.start). A conversion cut short (a killed job) leaves
only a hidden temporary directory, deleted by the next conversion, which starts over.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from threed.atomic import atomic_dir, write_atomic
from threed.checkpoint.format import MP_RE, UNIVERSAL_DIR, read_run_json
from threed.checkpoint.manifest import Found
from threed.errors import ConfigError
from threed.model.spec import is_adapter_pattern

DONE = "threed_universal.json"  # written last: a conversion cut short is redone, a finished one reused


def layout_name(found: Found, dtype: str) -> str:
    lay = found.layout
    return f"{found.tag}-from-tp{lay.tp}pp{lay.pp}dp{lay.dp}{dtype}"


def target(found: Found, root: Path, dtype: str) -> tuple[str, str]:
    """(load_dir, tag) that engine.load_checkpoint gets once `convert` has run."""
    return str(root / UNIVERSAL_DIR), layout_name(found, dtype)


MAX_EXTRACT_WORKERS = 16  # beyond this, the file system, not the CPUs, is the limit
MAX_MERGE_WORKERS = 8  # DeepSpeed: merging "is more memory intensive, use much fewer than --num_extract_workers"


def conversion_workers(cpus: int, shards: int, shard_bytes: int, memory_bytes: Optional[int]) -> tuple[int, int]:
    """(extract, merge) worker counts for ds_to_universal. An extract worker holds one ZeRO shard file in memory at
    a time, so at most half the free memory's worth of the largest shard; no more workers than CPUs or shards; a
    merge worker holds one parameter's slices, so half the extract workers (at least 1)."""
    extract = max(1, min(cpus, shards, MAX_EXTRACT_WORKERS))
    if memory_bytes and shard_bytes > 0:
        extract = max(1, min(extract, memory_bytes // 2 // shard_bytes))
    merge = max(1, min(extract // 2 or 1, MAX_MERGE_WORKERS))
    return extract, merge


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _free_memory() -> Optional[int]:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def clean_partial(out: Path) -> list[str]:
    """Delete what a conversion into `out` cut short left: its hidden temporary directories (`.<tag>.tmp-PID`,
    `.<tag>.old-PID`, threed.atomic's names) and `out` itself when its DONE file is missing. Returns their names."""
    removed = []
    for leftover in sorted(out.parent.glob(f".{out.name}.tmp-*")) + sorted(out.parent.glob(f".{out.name}.old-*")):
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover.name)
    if out.exists() and not (out / DONE).is_file():
        shutil.rmtree(out, ignore_errors=True)
        removed.append(out.name)
    return removed


def check_convertible(found: Found) -> None:
    """ds_to_universal needs `universal_checkpoint_info` in the mp_rank files (checkpoints saved before threed
    declared it lack it; a LoRA run's must name its adapters only, threed.model.spec.adapter_universal_patterns)
    and the optimizer shards."""
    step_dir = Path(found.path) / found.tag
    if not found.has_optimizer:
        raise ConfigError(
            f"{step_dir} holds weights only (no optimizer state), so it cannot be resumed at another "
            f"layout; start from its weights with --init-from {found.path}, or reshard it"
        )
    mp = sorted(f for f in step_dir.iterdir() if MP_RE.match(f.name))
    state = torch.load(mp[0], map_location="cpu", weights_only=False)
    info = state.get("universal_checkpoint_info")
    if not info:
        raise ConfigError(
            f"{step_dir} was saved without universal_checkpoint_info (by an older threed), so it can "
            f"only be resumed at its own layout ({found.layout.describe()}); or start from its weights "
            f"with --init-from {found.path}"
        )
    patterns = [p for v in info.values() if isinstance(v, list) for p in v if isinstance(p, str)]
    lora = ((read_run_json(Path(found.path)) or {}).get("lora") or {}).get("lora_rank")
    if lora and not all(is_adapter_pattern(p) for p in patterns):
        raise ConfigError(
            f"{step_dir} is a LoRA run's checkpoint saved by an older threed (its universal patterns name the "
            f"frozen base, which has no optimizer state, not the adapters), so it can only be resumed at its own "
            f"layout ({found.layout.describe()}); resume it there once and save again to move it"
        )


def convert(found: Found, root: Path, dtype: str, log: Callable[[str], None]) -> tuple[str, str]:
    """Convert `found` into `root/universal/` (once) and return (load_dir, tag) for engine.load_checkpoint. The
    conversion is built under a temporary name and renamed into place, its `threed_universal.json` written last;
    what an earlier conversion cut short left is deleted first (`clean_partial`)."""
    load_dir_s, tag = target(found, root, dtype)
    load_dir = Path(load_dir_s)
    out = load_dir / tag
    if (out / DONE).is_file():
        log(f"universal checkpoint {out} already exists (converted from {found.tag}); loading it")
        return str(load_dir), tag
    check_convertible(found)
    _make_load_dir(load_dir)
    removed = clean_partial(out)
    if removed:
        log(f"deleted what a conversion cut short left in {load_dir}: {', '.join(removed)}; converting again")
    src = Path(found.path) / found.tag
    extract, merge = _workers_for(src)
    t0 = time.time()
    log(
        f"converting {src} ({found.layout.describe()}) to a universal checkpoint in {out} ({extract} extract, "
        f"{merge} merge workers)"
    )
    with atomic_dir(out) as tmp:
        _run_ds_to_universal(found, src, tmp, extract, merge)
        (load_dir / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer at the temporary name
        write_atomic(
            tmp / DONE,
            json.dumps(
                {
                    "source": str(Path(found.path) / found.tag),
                    "layout": found.layout.describe(),
                    "seconds": round(time.time() - t0, 1),
                }
            ),
        )
    log(f"converted in {time.time() - t0:.1f} s")
    return str(load_dir), tag


def _make_load_dir(load_dir: Path) -> None:
    try:
        load_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"cannot write the universal checkpoint under {load_dir} ({e.strerror or e}); give a writable --save"
        ) from None


def _workers_for(src: Path) -> tuple[int, int]:
    """(extract, merge) workers for the checkpoint in `src`: by its optimizer shards, this host's CPUs and free
    memory (`conversion_workers`)."""
    shards = [f for f in src.iterdir() if f.name.endswith("optim_states.pt")]
    return conversion_workers(_cpus(), len(shards), max((f.stat().st_size for f in shards), default=0), _free_memory())


def _run_ds_to_universal(found: Found, src: Path, tmp: Path, extract: int, merge: int) -> None:
    """DeepSpeed's ds_to_universal from `src` into `tmp`, in a child process with its output in tmp/convert.log;
    a failure is one line with the log's last line."""
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(src),
        "--output_folder",
        str(tmp),
        "--num_extract_workers",
        str(extract),
        "--num_merge_workers",
        str(merge),
    ]
    # The conversion needs no GPU: keep it off rank 0's (no second CUDA context there).
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
    # DeepSpeed prints every step and a progress bar per tensor: keep that in a log file beside the output.
    with open(tmp / "convert.log", "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode != 0:
        tail = (tmp / "convert.log").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise ConfigError(
            f"converting {src} to a universal checkpoint failed (ds_to_universal exited "
            f"{proc.returncode}: {tail[0][-300:]}); resume at its own layout "
            f"({found.layout.describe()})"
        )
