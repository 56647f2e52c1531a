"""Recipe variables <-> config fields: the one table `recipes/launch.sh` reads.

A recipe (recipes/*.sh) is shell: `VAR=${VAR-value}` lines holding what differs from the launcher's defaults. Each
variable stands for one RunConfig field, and the launcher passes it as that field's training flag
(`threed.config.flag_name`), so a recipe, `threed train` and `threed check-config` cannot name a setting
differently. The launcher runs `python -m threed.cli.recipe` once and reads its lines:

    NAME FORM FLAG          e.g.  MICRO layout --micro-batch-size    SEQUENCE_PARALLEL bare --sequence-parallel

FORM says how the launcher passes it:
    layout    always passed; the launcher checks it and does the batch arithmetic with it first
              (DP = WORLD / (TP x PP x CP), GAS from GLOBAL: train_batch_size = MICRO x GAS x DP)
    value     `FLAG VALUE` when set and not empty; empty: no flag, training's default
    bare      Megatron's store_true flags: the bare flag when true (or 1), nothing when false (or 0)
    words     `FLAG W1 W2 ...`: the value split into words (DATA: a prefix, or a blend "WEIGHT PREFIX ...";
              LORA_TARGETS: "q k v o gate up down")
    env       not a recipe's: set by the environment (slurm/common.sh), passed as `FLAG VALUE`
    job       not training's: the slurm job's (slurm/common.sh), which after training submits `threed eval-harness
              --load SAVE FLAG VALUE ...` as a job of its own (HARNESS_TASKS -> --tasks); the launcher's dry run
              prints that sbatch command and passes nothing to `threed train`, so training never waits for scores

`python -m threed.cli.recipe --check NAME=VALUE ...` checks the values the launcher is about to pass, by the
type and choices of each variable's flag: a bad one is one line naming the VARIABLE (`PIPELINE_SCHEDULE=zb-h2 is
not one of 1f1b, zb-h1`), exit 2, instead of argparse's usage dump about a flag the user never typed. DATA may be
a single prefix with spaces in its path (the launcher passes it as one word); a blend cannot hold one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from threed.config import field_meta, flag_name
from threed.cli.flags import config_field, field_value_error

Form = Literal["layout", "value", "bare", "words", "env", "job"]


@dataclass(frozen=True)
class RecipeVar:
    name: str  # the shell variable
    field: str  # "section.field" of RunConfig; "model" is --model
    form: Form = "value"
    job_flag: str = ""  # form "job": the `threed eval-harness` flag (the field only checks the value)

    @property
    def flag(self) -> str:
        if self.form == "job":
            return self.job_flag
        if self.field == "model":
            return "--model"
        return flag_name(config_field(*self.field.split(".")))


# In the order recipes list them (tests/cli/test_recipes.py checks each recipe keeps it).
RECIPE_VARS: tuple[RecipeVar, ...] = (
    RecipeVar("MODEL", "model", "layout"),
    RecipeVar("TP", "parallel.tp", "layout"),
    RecipeVar("PP", "parallel.pp", "layout"),
    RecipeVar("CP", "parallel.cp", "layout"),
    RecipeVar("PIPELINE_SCHEDULE", "parallel.pipeline_schedule"),
    RecipeVar("VPP", "parallel.vpp"),
    RecipeVar("MICRO", "train.micro_batch_size", "layout"),
    RecipeVar("GAS", "train.grad_accum_steps", "layout"),
    RecipeVar("GLOBAL", "train.global_batch_size", "layout"),
    RecipeVar("SEQ", "train.seq_length", "layout"),
    RecipeVar("LR", "train.lr"),
    RecipeVar("MIN_LR", "train.min_lr"),
    RecipeVar("WARMUP", "train.warmup_steps"),
    RecipeVar("STEPS", "train.steps", "layout"),
    RecipeVar("DTYPE", "train.dtype"),
    RecipeVar("ACT_CKPT", "train.activation_checkpointing"),
    RecipeVar("SEQUENCE_PARALLEL", "parallel.sequence_parallel", "bare"),
    RecipeVar("RECOMPUTE_GRANULARITY", "train.recompute_granularity"),
    RecipeVar("RECOMPUTE_METHOD", "train.recompute_method"),
    RecipeVar("RECOMPUTE_NUM_LAYERS", "train.recompute_num_layers"),
    RecipeVar("DATA", "data.data_path", "words"),
    RecipeVar("SPLIT", "data.split"),
    RecipeVar("DATA_CACHE_PATH", "data.data_cache_path"),
    RecipeVar("PACK", "data.pack"),
    RecipeVar("EVAL_INTERVAL", "train.eval_interval"),
    RecipeVar("EVAL_ITERS", "train.eval_iters"),
    RecipeVar("TOKENIZER", "data.tokenizer"),
    RecipeVar("INIT_FROM", "checkpoint.init_from"),
    RecipeVar("LOAD", "checkpoint.load"),
    RecipeVar("SAVE", "checkpoint.save"),
    RecipeVar("SAVE_INTERVAL", "checkpoint.save_interval"),
    RecipeVar("LOG_INTERVAL", "train.log_interval"),
    RecipeVar("KEEP_LAST", "checkpoint.keep_last"),
    RecipeVar("ASYNC_SAVE", "checkpoint.async_save", "bare"),
    RecipeVar("SKIP_NONFINITE", "control.skip_nonfinite"),
    # LoRA fine-tuning (recipes/*_lora_sft.sh): the base frozen, adapters of this rank on LORA_TARGETS' linears
    RecipeVar("LORA_RANK", "lora.lora_rank"),
    RecipeVar("LORA_ALPHA", "lora.lora_alpha"),
    RecipeVar("LORA_TARGETS", "lora.lora_targets", "words"),
    RecipeVar("HARNESS_TASKS", "train.harness_tasks", "job", "--tasks"),
    RecipeVar("HARNESS_LIMIT", "train.harness_limit", "job", "--limit"),
    RecipeVar("EXIT_DURATION", "control.exit_duration_in_mins", "env"),
)


def by_name(name: str) -> RecipeVar:
    return next(v for v in RECIPE_VARS if v.name == name)


def table() -> list[str]:
    return [f"{v.name} {v.form} {v.flag}" for v in RECIPE_VARS]


def is_dataset(prefix: str) -> bool:
    return os.path.isfile(prefix + ".bin") or os.path.isfile(prefix + ".idx")


def data_words(value: str) -> Optional[list[str]]:
    """How the launcher passes DATA (recipes/launch.sh does the same in bash): one word when the whole value names
    a dataset (a path with spaces works), else its words (a prefix, or a blend WEIGHT PREFIX ...); None when a
    dataset path with spaces is part of a blend (split, it names nothing)."""
    if value.strip() and is_dataset(value.strip()):
        return [value.strip()]
    words = value.split()
    for i in range(len(words)):
        for j in range(i + 2, len(words) + 1):
            if is_dataset(" ".join(words[i:j])):
                return None
    return words


def value_error(var: RecipeVar, value: str) -> Optional[str]:
    """One line naming the variable when `value` is not one its flag takes, else None (empty: no flag)."""
    if not value or var.field == "model" or var.form == "bare":  # bare: the launcher's own true/false check
        return None
    if var.form == "words" and var.name == "DATA":  # LORA_TARGETS' words: its field's own check below
        if data_words(value) is None:
            return (
                f"{var.name}={value!r} holds a path with spaces inside a blend: {var.name} is split at spaces into "
                f"WEIGHT PREFIX words; link the data to a path without spaces (ln -s), or give one prefix alone"
            )
        return None
    why = field_value_error(*var.field.split("."), value)
    if why is None:
        return job_range_error(var, value)
    return f"{var.name}={value} {why} (it becomes {var.flag} {value}); fix {var.name}, or leave it empty for no flag"


def job_range_error(var: RecipeVar, value: str) -> Optional[str]:
    """A job variable's number below its field's range (HARNESS_LIMIT=0): training never reads it, so no training
    check would say so, and every harness job would refuse it, after every save."""
    if var.form != "job":
        return None
    least = field_meta(config_field(*var.field.split("."))).at_least
    try:
        low = float(value) < least
    except ValueError:  # not a number: a text field (HARNESS_TASKS)
        return None
    if not low:
        return None
    return (
        f"{var.name}={value} is below {least:g}: every harness job (threed eval-harness {var.flag} {value}) would "
        f"refuse it after every save; set {var.name} to {least:g} or more, or leave it empty for no limit"
    )


def check(assignments: Sequence[str]) -> int:
    """`--check NAME=VALUE ...`: the first bad value as one `threed launch: error:` line and exit 2, else 0."""
    for a in assignments:
        name, _, value = a.partition("=")
        error = value_error(by_name(name), value)
        if error:
            print(f"threed launch: error: {error}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        sys.exit(check(sys.argv[2:]))
    sys.stdout.write("\n".join(table()) + "\n")
