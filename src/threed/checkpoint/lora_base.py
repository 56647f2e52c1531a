"""The base a LoRA run's adapters belong to, named in every checkpoint it saves (its manifest's `lora_base`: the
path and tag it started from, and a fingerprint of its weights), so that adapters are never put on another base
without a word: a resume given another `--init-from`, and `threed generate / eval-harness --lora CKPT --load BASE`
with a BASE that is not the one the adapters were trained on, are refused in one line before any engine is built.

    identity(path, tag)          {"path", "tag", "fingerprint"} of a checkpoint used as a base
    recorded_base(manifest)      what a LoRA checkpoint's manifest names (None: saved before bases were named)
    check_base(recorded, given)  one ConfigError line when `given` is not that base
    open_base(recorded, ...)     the base an adapter-only checkpoint names, opened; one line if gone or changed

A LoRA run started from a base saves adapter-only checkpoints (threed.checkpoint.save: the layer files hold the
adapters, the optimizer shards their state: ~2.9 GB for 70B at rank 16, not ~140 GB more of frozen bf16), so every
reader takes the base from the one named here: a resume (threed.checkpoint.start checks the fingerprint on rank 0
before anything is built; threed.engine.lora loads it), `threed export --merge`, `threed generate / eval-harness
--lora`. A base that moved is given again with --init-from (a resume) or --load (generate, eval-harness): its
fingerprint must match. A LoRA run from random init names no base and saves its frozen weights with the adapters.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from threed.checkpoint.format import Checkpoint, CheckpointError, open_checkpoint, read_run_json
from threed.checkpoint.manifest import read_manifest
from threed.config import ModelConfig
from threed.errors import ConfigError
from threed.model.spec import is_adapter_key

LORA_BASE = "lora_base"  # the manifest's key (threed.checkpoint.save.describe)
MODULE_ATTR = "threed_lora_base"  # the PipelineModule's attribute holding it (set by threed.engine.lora)
PROBE = 4  # rows and columns of each tensor read into the fingerprint


def _model_identity(model: ModelConfig) -> dict[str, Any]:
    """The model's shape fields, as threed.checkpoint.format.check_model compares them (not its name)."""
    return {k: v for k, v in asdict(model).items() if k not in ("name", "init_std")}


def fingerprint(ck: Checkpoint) -> str:
    """sha256 of the model's shape and, for every stored layer, the first PROBE rows (x PROBE columns) of each base
    tensor of TP rank 0's file, as fp32 values. Cheap: one memory-mapped file per layer, a few KB read.

    The same at any tp / pp (rank 0 holds the first vocabulary rows, q head 0 of KV group 0, the first gate rows and
    the first input columns of a row-parallel weight at every tp) and for a LoRA checkpoint's own frozen base (its
    adapters are left out), so a resharded copy of a base is the same base. Catches: another model or shape, another
    pretrained or fine-tuned checkpoint, another random init, adapters merged into a base (a rank-r update moves
    every row), a dtype conversion (bf16 values are other weights). Misses: a base that differs only outside the
    probed rows and columns of every tensor (an edit of a few chosen weights)."""
    import torch  # heavy: only where layer files are read

    digest = hashlib.sha256(json.dumps(_model_identity(ck.model), sort_keys=True).encode())
    for layer in ck.layers:
        tensors = ck.load_rank(layer, 0)
        for key in sorted(k for k in tensors if not is_adapter_key(k)):
            t = tensors[key]
            probe = t[:PROBE, :PROBE] if t.dim() == 2 else t[:PROBE]
            digest.update(key.encode())
            digest.update(probe.to(torch.float32).contiguous().numpy().tobytes())
        del tensors  # unmaps the file
    return digest.hexdigest()


def identity(path: str | os.PathLike, tag: Optional[str] = None) -> dict[str, Any]:
    """How a checkpoint used as a LoRA base is named: its absolute path, its tag, its fingerprint."""
    ck = open_checkpoint(path, tag=tag)
    # absolute: an adapter-only checkpoint's resume reads the base from here, from whatever directory it runs in
    return {"path": os.path.abspath(path), "tag": ck.tag, "fingerprint": fingerprint(ck)}


def is_lora_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the run recorded beside the checkpoints trained LoRA adapters."""
    return bool(((read_run_json(Path(path)) or {}).get("lora") or {}).get("lora_rank"))


def recorded_base(manifest: Optional[dict]) -> Optional[dict[str, Any]]:
    """The base a LoRA checkpoint's manifest names, None when it names none (saved before bases were named, or a
    LoRA run from random init)."""
    base = (manifest or {}).get(LORA_BASE)
    return base if isinstance(base, dict) and base.get("fingerprint") else None


def base_of(path: str | os.PathLike, tag: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The base a checkpoint directory's adapters belong to: its manifest's (a LoRA run's checkpoint); for a
    checkpoint that is no LoRA run's, itself."""
    if not is_lora_checkpoint(path):
        return identity(path, tag)
    ck = open_checkpoint(path, tag=tag)
    return recorded_base(read_manifest(ck.step_dir))


def check_base(recorded: Optional[dict], given: str, adapters: str, fix: str) -> None:
    """One line when `given` (a base checkpoint, or a LoRA checkpoint: its own base) is not the base `recorded`
    names; nothing to check when nothing is recorded. `adapters`: where the adapters are; `fix`: what to do."""
    if recorded is None:
        return
    theirs = base_of(given)
    if theirs is None or theirs["fingerprint"] == recorded["fingerprint"]:
        return
    raise ConfigError(
        f"{given} is not the base the LoRA adapters of {adapters} were trained on: they name {recorded['path']} "
        f"({recorded['tag']}, fingerprint {recorded['fingerprint'][:12]}), {given} has fingerprint "
        f"{theirs['fingerprint'][:12]}; {fix}"
    )


def open_base(recorded: dict, adapters: str, fix: str, path: Optional[str] = None) -> Checkpoint:
    """The base an adapter-only LoRA checkpoint (`adapters`) names, at its recorded tag, read from `path` (where it
    is now; default: where it was recorded), its fingerprint checked: one ConfigError line naming the base and `fix`
    (what to do) when it is missing, unreadable or not the same weights. Cheap: a few KB per layer file."""
    where = path or recorded["path"]
    named = f"{recorded['path']} ({recorded['tag']}, fingerprint {recorded['fingerprint'][:12]})"
    try:
        ck = open_checkpoint(where, tag=recorded["tag"])
        theirs = fingerprint(ck)
    except (CheckpointError, ConfigError, OSError) as e:
        raise ConfigError(
            f"{adapters} holds only LoRA adapters, and its base {named} cannot be read from {where}: "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; {fix}"
        ) from None
    if theirs != recorded["fingerprint"]:
        raise ConfigError(
            f"{where} is not the base the LoRA adapters of {adapters} were trained on (they hold only adapters): "
            f"they name {named}, {where} ({recorded['tag']}) has fingerprint {theirs[:12]}; {fix}"
        )
    return ck
