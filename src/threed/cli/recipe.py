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
    bare      Megatron's store_true flags: the bare flag when true, nothing when false
    words     `FLAG W1 W2 ...`: the value split into words (DATA: a prefix, or a blend "WEIGHT PREFIX ...")
    env       not a recipe's: set by the environment (slurm/common.sh), passed as `FLAG VALUE`
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Literal

from threed.config import flag_name
from threed.cli.flags import config_field

Form = Literal["layout", "value", "bare", "words", "env"]


@dataclass(frozen=True)
class RecipeVar:
    name: str  # the shell variable
    field: str  # "section.field" of RunConfig; "model" is --model
    form: Form = "value"

    @property
    def flag(self) -> str:
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
    RecipeVar("SKIP_NONFINITE", "control.skip_nonfinite"),
    RecipeVar("EXIT_DURATION", "control.exit_duration_in_mins", "env"),
)


def by_name(name: str) -> RecipeVar:
    return next(v for v in RECIPE_VARS if v.name == name)


def table() -> list[str]:
    return [f"{v.name} {v.form} {v.flag}" for v in RECIPE_VARS]


if __name__ == "__main__":
    sys.stdout.write("\n".join(table()) + "\n")
