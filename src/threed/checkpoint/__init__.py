"""The DeepSpeed checkpoint layout this repo writes and reads: what a checkpoint directory holds, whether it can be
loaded at a run's layout, and saving one (with the run config beside it for `threed export` / `threed verify`)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from threed.config import ConfigError, RunConfig

RUN_CONFIG_NAME = "threed_run.json"


def has_checkpoint(path: Optional[str]) -> bool:
    return bool(path) and (Path(path) / "latest").is_file()


@dataclass(frozen=True)
class CheckpointLayout:
    tag: str
    tp: int  # files per pipeline layer
    model_parallel_files: int  # mp_rank_XX files = pp x tp
    optimizer_files: int  # ZeRO optimizer shards = dp x pp x tp (0 for converted, weights-only checkpoints)


def checkpoint_layout(path: str) -> CheckpointLayout:
    tag = (Path(path) / "latest").read_text().strip()
    step_dir = Path(path) / tag
    if not step_dir.is_dir():
        raise ConfigError(f"{path}/latest names {tag!r}, but {step_dir} does not exist: the checkpoint is incomplete")
    return CheckpointLayout(
        tag=tag, tp=len(list(step_dir.glob("layer_00-model_*-model_states.pt"))),
        model_parallel_files=len(list(step_dir.glob("mp_rank_*_model_states.pt"))),
        optimizer_files=len(list(step_dir.glob("*zero_pp_rank_*_optim_states.pt"))))


def check_layout(path: str, cfg: RunConfig, world_size: int, full_resume: bool) -> None:
    """DeepSpeed would try to merge or split layer files of another TP size with GPT-2 Megatron key names and
    fail deep inside (or mis-load): refuse a layout mismatch up front, naming both layouts and the fix."""
    lay = checkpoint_layout(path)
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


def save(engine, cfg: RunConfig, rank: int, client_state: Optional[dict] = None) -> str:
    """Every rank calls this. `client_state` (e.g. the consumed-sample count) is stored in the checkpoint and
    returned by DeepSpeed's `load_checkpoint` on resume."""
    assert cfg.checkpoint.save
    engine.save_checkpoint(cfg.checkpoint.save, client_state={"threed_run": cfg.to_dict(), **(client_state or {})})
    if rank == 0:
        # The run config beside the checkpoint lets `threed export` / `threed verify` rebuild the model.
        path = Path(cfg.checkpoint.save) / RUN_CONFIG_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cfg.to_dict(), indent=1))
        os.replace(tmp, path)
    dist.barrier()
    return cfg.checkpoint.save
