"""Resume at another tp, pp, dp (or dtype) through DeepSpeed's universal checkpoint, optimizer state included.

How each of our parameters is split over TP is `threed.model.spec.universal_checkpoint_info(model)`, derived from
the parameter table (the PipelineModule carries it as `universal_checkpoint_info`; DeepSpeed stores it in every
mp_rank file, and `ds_to_universal` reads it from there): norms replicated, row-parallel weights on dim 1, SwiGLU's
[gate_r; up_r] as two sub-parameters, the vocabulary padding cut to the true size and re-added for the new tp.

`convert` runs once per (checkpoint, old layout) on rank 0 and writes `<save>/universal/<tag>-from-<layout>/`,
which DeepSpeed loads with `"checkpoint": {"load_universal": true}`; it is deleted once a newer checkpoint exists.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Callable

import torch

from threed.atomic import atomic_dir, write_atomic
from threed.checkpoint.format import MP_RE, UNIVERSAL_DIR
from threed.checkpoint.manifest import Found
from threed.errors import ConfigError

DONE = "threed_universal.json"  # written last: a conversion cut short is redone, a finished one reused


def layout_name(found: Found, dtype: str) -> str:
    lay = found.layout
    return f"{found.tag}-from-tp{lay.tp}pp{lay.pp}dp{lay.dp}{dtype}"


def check_convertible(found: Found) -> None:
    """ds_to_universal needs `universal_checkpoint_info` in the mp_rank files (checkpoints saved before threed
    declared it lack it) and the optimizer shards."""
    step_dir = Path(found.path) / found.tag
    if not found.has_optimizer:
        raise ConfigError(f"{step_dir} holds weights only (no optimizer state), so it cannot be resumed at another "
                          f"layout; start from its weights with --init-from {found.path}, or reshard it")
    mp = sorted(f for f in step_dir.iterdir() if MP_RE.match(f.name))
    state = torch.load(mp[0], map_location="cpu", weights_only=False)
    if not state.get("universal_checkpoint_info"):
        raise ConfigError(f"{step_dir} was saved without universal_checkpoint_info (by an older threed), so it can "
                          f"only be resumed at its own layout ({found.layout.describe()}); or start from its weights "
                          f"with --init-from {found.path}")


def convert(found: Found, root: Path, dtype: str, log: Callable[[str], None]) -> tuple[str, str]:
    """Convert `found` into `root/universal/` (once) and return (load_dir, tag) for engine.load_checkpoint. The
    conversion is built under a temporary name and renamed into place, its `threed_universal.json` written last."""
    from deepspeed.checkpoint import ds_to_universal  # deepspeed: heavy, only on the rank-0 conversion path

    load_dir = root / UNIVERSAL_DIR
    tag = layout_name(found, dtype)
    out = load_dir / tag
    if (out / DONE).is_file():
        log(f"universal checkpoint {out} already exists (converted from {found.tag}); loading it")
        return str(load_dir), tag
    check_convertible(found)
    try:
        load_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot write the universal checkpoint under {load_dir} ({e.strerror or e}); give a "
                          f"writable --save") from None
    t0 = time.time()
    log(f"converting {Path(found.path) / found.tag} ({found.layout.describe()}) to a universal checkpoint in {out}")
    with atomic_dir(out) as tmp:
        args = argparse.Namespace(input_folder=str(Path(found.path) / found.tag), output_folder=str(tmp),
                                  num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=False)
        try:
            # DeepSpeed prints every step and a progress bar per tensor: keep that in a log file beside the output.
            with open(tmp / "convert.log", "w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
                ds_to_universal.main(args)
        except Exception as e:
            raise ConfigError(f"converting {found.path}/{found.tag} to a universal checkpoint failed: "
                              f"{type(e).__name__}: {e}; resume at its own layout ({found.layout.describe()})") from e
        (load_dir / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer at the temporary name
        write_atomic(tmp / DONE, json.dumps({"source": str(Path(found.path) / found.tag),
                                             "layout": found.layout.describe(),
                                             "seconds": round(time.time() - t0, 1)}))
    log(f"converted in {time.time() - t0:.1f} s")
    return str(load_dir), tag
