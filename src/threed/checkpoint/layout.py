"""The DeepSpeed pipeline checkpoint layout: what a checkpoint directory holds and whether a run can load it.

    <dir>/latest                          the tag of the newest complete checkpoint (written last, atomically)
    <dir>/threed_run.json                 the run config (model, layout) for `threed export` / `threed verify`
    <dir>/global_step<N>/layer_XX-model_YY-model_states.pt     weights of pipeline layer XX, TP rank YY
    <dir>/global_step<N>/mp_rank_MM_model_states.pt            one per stage x TP rank (step, client state, ...)
    <dir>/global_step<N>/*zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO-1 optimizer shards (dp x pp x tp)
    <dir>/global_step<N>/threed_manifest.json                  every file above with its size (written last)

Layer file indices are positions in `threed.pipeline.pipeline_layers`, so they do not depend on pp; mp_rank and
optimizer files do. DeepSpeed itself loads a checkpoint only at the tp, pp and dp it was written at (at another
tp it merges/splits layer files with GPT-2 Megatron name rules and fails deep inside): `check_layout` says so up
front, and `threed.checkpoint.resume` converts to a universal checkpoint instead when the optimizer state is there.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

from threed.config import ConfigError, ModelConfig, RunConfig

LATEST = "latest"
RUN_CONFIG_NAME = "threed_run.json"
TAG_RE = re.compile(r"^global_step(\d+)$")
LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
MP_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


def read_latest(path: str | os.PathLike) -> Optional[str]:
    f = Path(path) / LATEST
    return f.read_text().strip() if f.is_file() else None


def has_checkpoint(path: Optional[str]) -> bool:
    return bool(path) and (Path(path) / LATEST).is_file()


def step_of(tag: str) -> Optional[int]:
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def list_tags(path: str | os.PathLike) -> list[str]:
    """Tag directories (`global_step<N>`) under `path`, newest step first."""
    p = Path(path)
    if not p.is_dir():
        return []
    tags = [d.name for d in p.iterdir() if d.is_dir() and TAG_RE.match(d.name)]
    return sorted(tags, key=lambda t: step_of(t) or 0, reverse=True)


@dataclass(frozen=True)
class CheckpointLayout:
    tag: str
    tp: int  # files per pipeline layer
    model_parallel_files: int  # mp_rank_XX files = pp x tp
    optimizer_files: int  # ZeRO optimizer shards = dp x pp x tp (0 for converted, weights-only checkpoints)
    layers: int = 0  # distinct layer indices with files

    @property
    def pp(self) -> int:
        return self.model_parallel_files // self.tp if self.tp else 0

    @property
    def dp(self) -> int:
        return self.optimizer_files // self.model_parallel_files if self.model_parallel_files else 0

    def describe(self) -> str:
        return f"tp={self.tp}, pp={self.pp}" + (f", dp={self.dp}" if self.optimizer_files else " (weights only)")


def layout_of_files(tag: str, names: list[str]) -> CheckpointLayout:
    ranks: dict[int, set[int]] = {}
    for name in names:
        m = LAYER_RE.match(name)
        if m:
            ranks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return CheckpointLayout(tag=tag, tp=len(ranks.get(0, ())), layers=len(ranks),
                            model_parallel_files=sum(1 for n in names if MP_RE.match(n)),
                            optimizer_files=sum(1 for n in names if OPTIM_RE.match(n)))


def checkpoint_layout(path: str | os.PathLike, tag: Optional[str] = None) -> CheckpointLayout:
    tag = tag or read_latest(path)
    if tag is None:
        raise ConfigError(f"{path} holds no DeepSpeed checkpoint (no 'latest' file); pass the directory that "
                          f"`threed train --save` or `threed convert --out` wrote")
    step_dir = Path(path) / tag
    if not step_dir.is_dir():
        raise ConfigError(f"{path}/latest names {tag!r}, but {step_dir} does not exist: the checkpoint is incomplete")
    return layout_of_files(tag, [f.name for f in step_dir.iterdir()])


def missing_files(layout: CheckpointLayout, names: list[str]) -> Optional[str]:
    """Why a checkpoint without a manifest (written before manifests existed, or by `threed convert`) is not
    complete, judged by its file counts; None when every layer has every TP rank and the shards divide."""
    ranks: dict[int, set[int]] = {}
    for name in names:
        m = LAYER_RE.match(name)
        if m:
            ranks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if not ranks or layout.tp == 0:
        return "no layer files"
    for idx in range(max(ranks) + 1):
        if ranks.get(idx, set()) != set(range(layout.tp)):
            have = sorted(ranks.get(idx, ()))
            missing = sorted(set(range(layout.tp)) - set(have))
            return f"layer_{idx:02d}-model_{missing[0] if missing else 0:02d}-model_states.pt is missing"
    if layout.model_parallel_files == 0 or layout.model_parallel_files % layout.tp:
        return f"{layout.model_parallel_files} mp_rank files for tp={layout.tp}"
    if layout.optimizer_files % layout.model_parallel_files:
        return (f"{layout.optimizer_files} optimizer shards is not a multiple of the "
                f"{layout.model_parallel_files} mp_rank files")
    return None


def check_layout(path: str, cfg: RunConfig, world_size: int, full_resume: bool, tag: Optional[str] = None) -> None:
    """Refuse a checkpoint DeepSpeed cannot load natively at this run's layout, naming both layouts and the fix.
    (A full resume at another layout goes through a universal checkpoint instead: threed.checkpoint.resume.)"""
    lay = checkpoint_layout(path, tag)
    tp, pp, dp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp(world_size)
    if lay.tp != tp or lay.model_parallel_files != tp * pp:
        written_pp = lay.model_parallel_files // max(lay.tp, 1)
        raise ConfigError(f"{path} ({lay.tag}) was written at tp={lay.tp}, pp={written_pp}; this run has tp={tp}, "
                          f"pp={pp}. Reshard it with `threed reshard --ckpt {path} --tp {tp} --pp {pp} --out NEW_DIR`, "
                          f"or run at its layout")
    if full_resume and lay.optimizer_files != tp * pp * dp:
        raise ConfigError(
            f"{path} ({lay.tag}) holds {lay.optimizer_files} optimizer shards; resuming at tp={tp} x pp={pp} x "
            f"dp={dp} needs {tp * pp * dp}. Resume with the original data-parallel size, or start from its "
            f"weights only with --init-from {path}")


_IGNORED_FIELDS = {"name", "init_std"}  # do not change the weights' layout


def check_model(path: str | os.PathLike, recorded: Optional[ModelConfig], model: ModelConfig) -> None:
    """The recorded model must equal the run's, or DeepSpeed reports a size mismatch deep in load_state_dict."""
    if recorded is None:
        return
    diffs = [f"{f.name} {getattr(recorded, f.name)} != {getattr(model, f.name)}" for f in fields(ModelConfig)
             if f.name not in _IGNORED_FIELDS and getattr(recorded, f.name) != getattr(model, f.name)]
    if diffs:
        raise ConfigError(f"checkpoint {path} holds another model than this run's ({'; '.join(diffs)}); pass "
                          f"--model {path} to train the model it holds")


def check_loadable(path: str | os.PathLike, model: ModelConfig, tp: int, pp: int, weights_only: bool = True) -> None:
    """Raise a ConfigError unless `path` holds `model` written at tp x pp (its layer files checked one by one).

    Used for weights-only loads (`--init-from`, `threed verify`) and by threed.engine before a native resume."""
    from threed.convert.ds_checkpoint import MANIFEST, TAG, open_checkpoint

    ck = open_checkpoint(path)
    check_model(path, ck.model, model)
    if (ck.tp, ck.pp) != (tp, pp):
        raise ConfigError(f"checkpoint {path} was written at tp={ck.tp} pp={ck.pp}; this run has tp={tp} "
                          f"pp={pp}. Reshard it: threed reshard --ckpt {path} --tp {tp} --pp {pp} --out NEW_DIR")
    if not weights_only and ck.tag == TAG and (Path(path) / MANIFEST).is_file():
        raise ConfigError(f"{path} is a converted checkpoint (weights only, no optimizer state): use it with "
                          f"--init-from, not --load or --save")
