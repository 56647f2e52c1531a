"""Shared plumbing for the converters: the error type, atomic output directories, dtype names, progress bars.

with atomic_output_dir("ckpt/llama3-8b-tp8", force=False) as tmp:
    ...write everything under tmp...      # renamed to ckpt/llama3-8b-tp8 only when the block succeeds
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from pathlib import Path
from typing import Iterator, Optional

import torch
from tqdm import tqdm

from threed.atomic import atomic_dir
from threed.config import ConfigError
from threed.units import human_bytes


class ConvertError(ConfigError):
    """A bad source, checkpoint or output path. The message names the file / tensor and the fix."""


DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """'keep' / None -> None (keep each tensor's own dtype); 'bf16' / 'fp32' / 'fp16' -> the torch dtype."""
    if name in (None, "keep"):
        return None
    if name not in DTYPES:
        raise ConvertError(f"unknown dtype {name!r}: use one of keep, {', '.join(DTYPES)}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}.get(dtype, str(dtype).replace("torch.", ""))


def progress(total: int, desc: str, enabled: bool = True):
    """A bytes progress bar (tqdm: bytes/s, unit-scaled) on stderr."""

    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=not enabled,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )


def refuse_existing(out: str | os.PathLike, force: bool) -> None:
    """An existing `out` without --force is refused before anything is read (a converter's first check), and
    again by atomic_output_dir when it is about to be written."""
    if Path(out).exists() and not force:
        raise ConvertError(f"{Path(out).absolute()} already exists; choose a new --out or pass --force")


def check_free_space(out: str | os.PathLike, needed: int) -> None:
    """Room for `needed` bytes beside `out` (its parent folder, made here if missing: the output is built there
    and renamed into place)."""
    parent = Path(out).absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(parent).free
    if needed > free:
        raise ConvertError(f"{parent} has {human_bytes(free)} free, the output needs about {human_bytes(needed)}")


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside `out`; rename it to `out` when the block succeeds, delete it
    when the block fails. A crash, a bad tensor or Ctrl-C never leaves a half-written `out` that a later
    `threed train --init-from` could mistake for a checkpoint."""
    refuse_existing(out, force)
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:  # with --force an existing `out` is moved aside first, deleted only at the end
        yield tmp
