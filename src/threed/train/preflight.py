"""Every check `threed train` runs before it builds anything, in one place, so that `threed check-config --paths`
runs the very same ones and its exit status means "the run would start".

    check_config(cfg, world)    the flags alone: ranges, layout, batch arithmetic, recompute, stage partition;
                                returns the run resolved once (threed.engine.resolved), which training hands down
    check_run(run)              then what is on disk and installed: the metrics sinks (a writable
                                --tensorboard-dir, wandb installed for --wandb-project), every dataset (paths,
                                duplicate prefixes, validation splits, .bin/.idx, sidecars, vocabulary, cache)

`threed train` runs check_run on rank 0 before any dataset, lock, save directory or engine exists (all ranks stop
with its one line); the checkpoint directories are decided next by `threed.checkpoint.start`, whose
`decide_start` / `check_save_dir` check-config calls without side effects. Nothing here creates a file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from threed.config import ConfigError, RunConfig, TrainConfig
from threed.data.splits import DataSplits
from threed.engine.resolved import ResolvedRun, resolve


@dataclass
class RunCheck:
    """What the checks found: the data's splits, and lines for what could not be checked (said once, rank 0)."""

    splits: DataSplits
    notes: list[str] = field(default_factory=list)


def check_config(cfg: RunConfig, world: int) -> ResolvedRun:
    """The flags alone (no file read): every range, the layout at `world` ranks, the batch, recompute, the stages
    (a bad --partition-method costs:... is refused here, before any rank builds its stage); the resolved run."""
    return resolve(cfg, world)


def check_steps(train: TrainConfig) -> None:
    """`threed train --steps 0`: refused (check-config takes it: checking a configuration trains nothing)."""
    if train.steps == 0:
        raise ConfigError(
            "--steps 0 trains nothing (it is the total step count to train to); give --steps N >= 1, "
            "or check a configuration without building it with `threed check-config`"
        )


def check_run(run: ResolvedRun) -> RunCheck:
    """After check_config: the metrics sinks and the data, as ConfigError (one line naming the fix)."""
    check_metrics_sinks(run.cfg)
    # torch, megatron: threed.data.checks imports them (check-config without --paths runs without either)
    from threed.data.checks import check_data

    notes: list[str] = []
    splits = check_data(run.cfg, notes)
    return RunCheck(splits, notes)


def check_metrics_sinks(cfg: RunConfig) -> None:
    """wandb installed for --wandb-project, and a TensorBoard directory that can be made: before the engine, the
    lock or the save directory, so that a refusal leaves nothing behind."""
    # deepspeed: threed.metrics.writer imports it (the run's metrics writer; these are its own rules)
    from threed.metrics.writer import check_metrics_config, tensorboard_directory

    check_metrics_config(cfg.metrics)
    where = tensorboard_directory(cfg.metrics, cfg.checkpoint.save)
    if where is None:
        return
    name = f"--tensorboard-dir {where}" if cfg.metrics.tensorboard_dir else f"the TensorBoard directory {where}"
    fix = "choose a directory you can write to, or --tensorboard false"
    if where.exists() and not where.is_dir():
        raise ConfigError(f"{name} is a file, not a directory; {fix}")
    if not cfg.metrics.tensorboard_dir:
        return  # SAVE/tensorboard: the --save checks (threed.checkpoint.start) say what is wrong with --save
    existing = where
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{name}: {existing} is a file, not a directory; {fix}")
    st = os.statvfs(existing)
    if not os.access(existing, os.W_OK | os.X_OK) or st.f_flag & os.ST_RDONLY:
        raise ConfigError(f"{name} is not writable ({existing} does not let this user write); {fix}")
    if st.f_bavail * st.f_frsize == 0:
        raise ConfigError(f"{name}: {_shown(existing)} has no free space; {fix}")


def _shown(p: Path) -> str:
    return str(p) if str(p) != "." else "the working directory"
