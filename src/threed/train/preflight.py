"""Every check `threed train` runs before it builds anything, in one place, so that `threed check-config --paths`
runs the very same ones and its exit status means "the run would start".

    check_config(cfg, world)    the flags alone: ranges, layout, batch arithmetic, recompute, stage partition;
                                returns the run resolved once (threed.engine.resolved), which training hands down
    check_run(run)              then what is on disk and installed: the metrics sinks (a writable
                                --tensorboard-dir, wandb installed for --wandb-project), --generate-prompts and
                                --harness-interval's tokenizer, every dataset (paths,
                                duplicate prefixes, validation splits, .bin/.idx, sidecars, vocabulary, cache),
                                --lora-init-from's PEFT folder (rank, targets, shapes of this base)

`threed train` runs check_run on rank 0 before any dataset, lock, save directory or engine exists (all ranks stop
with its one line); the checkpoint directories are decided next by `threed.checkpoint.start`, whose
`decide_start` / `check_save_dir` check-config calls without side effects. Nothing here creates a file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from threed.atomic import unwritable
from threed.config import ConfigError, RunConfig, TrainConfig
from threed.errors import ThreedError
from threed.data.splits import DataSplits
from threed.engine.resolved import ResolvedRun, resolve
from threed.metrics.sinks import check_metrics_config, tensorboard_directory


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
    check_sample_inputs(run.cfg)
    # torch, megatron: threed.data.checks imports them (check-config without --paths runs without either)
    from threed.data.checks import check_data

    if run.cfg.lora.lora_init_from:  # --lora-init-from: the folder, its rank, targets and shapes, before any build
        from threed.convert.lora import read_peft  # torch, safetensors: heavy, as above

        read_peft(run.cfg.lora.lora_init_from, run.cfg.model, run.cfg.lora)

    notes: list[str] = []
    splits = check_data(run.cfg, notes)
    return RunCheck(splits, notes)


def check_metrics_sinks(cfg: RunConfig) -> None:
    """wandb installed for --wandb-project, and a TensorBoard directory that can be made: before the engine, the
    lock or the save directory, so that a refusal leaves nothing behind."""
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
    why = unwritable(existing)
    if why == "not writable":
        raise ConfigError(f"{name} is not writable ({existing} does not let this user write); {fix}")
    if why:
        raise ConfigError(f"{name}: {_shown(existing)} has no free space; {fix}")


def check_sample_inputs(cfg: RunConfig) -> None:
    """What --generate-interval / --harness-interval read, before anything is built: --generate-prompts a UTF-8
    JSONL file, and an HF tokenizer for the harness (lm-eval's requests are HF tokenizer calls, so a sentencepiece
    .model would stop the run at its first harness step, or at the engine's start)."""
    t = cfg.train
    if not t.generate_interval and not t.harness_interval:
        return
    # torch (threed.train.samples imports it; check_run's data checks do too), transformers: only with these flags
    from threed.generate.prompts import read_prompts
    from threed.train.samples import run_tokenizer

    if t.generate_interval:
        try:
            read_prompts(None, t.generate_prompts, "--generate-prompts")
        except ThreedError as e:  # said as the configuration error it is
            raise ConfigError(str(e)) from None
    tok = run_tokenizer(cfg)
    if t.harness_interval and Path(tok).is_file() and Path(tok).suffix == ".model":
        raise ConfigError(
            f"--harness-interval needs an HF tokenizer (lm-eval's requests are HF tokenizer calls), and the run's "
            f"tokenizer {tok} is a sentencepiece .model: `threed export` writes an HF one (tokenizer.json) from it; "
            f"pass that as --tokenizer, or drop --harness-interval / --harness-tasks"
        )


def _shown(p: Path) -> str:
    return str(p) if str(p) != "." else "the working directory"
