"""Every recipe variable walks to its config field and back, through the one table (`threed.cli.recipe`) that
recipes/launch.sh reads: each variable names a real RunConfig field, no two name the same one, the launcher's dry run
passes each set variable as exactly that field's flag (the value arriving in the field when `threed train` parses
the command), and every flag the launcher passes comes from the table.

    .venv/bin/python -m pytest -q tests/cli/test_recipe_vars.py
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from threed.cli.flags import config_field, parse_run_config
from threed.cli.recipe import RECIPE_VARS, by_name, table
from threed.config import SECTIONS, RunConfig

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "recipes" / "launch.sh"

# Values unlike the launcher's and tiny.sh's defaults, in groups training accepts together (ACT_CKPT and the
# RECOMPUTE_* flags are two ways to say recompute; LOAD and INIT_FROM two ways to start; VPP > 1 is 1F1B's).
COMMON = {
    "MODEL": "tiny", "TP": "2", "PP": "2", "PIPELINE_SCHEDULE": "zb-h1", "VPP": "", "MICRO": "2", "GAS": "",
    "GLOBAL": "8", "SEQ": "64", "LR": "0.002", "MIN_LR": "0.0002", "WARMUP": "3", "STEPS": "7", "DTYPE": "fp32",
    "SEQUENCE_PARALLEL": "true", "DATA": "0.25 /data/a_text_document 0.75 /data/b_text_document",
    "SPLIT": "90,5,5", "DATA_CACHE_PATH": "/data/cache", "PACK": "false", "EVAL_INTERVAL": "5", "EVAL_ITERS": "2",
    "TOKENIZER": "/data/tokenizer.json", "SAVE": "/ckpt/save", "SAVE_INTERVAL": "5", "LOG_INTERVAL": "2",
    "KEEP_LAST": "2", "ASYNC_SAVE": "true", "SKIP_NONFINITE": "3", "EXIT_DURATION": "30",
    # the slurm job's (tests/cli/test_harness_job.py): no training flag
    "HARNESS_TASKS": "arc_easy", "HARNESS_LIMIT": "50",
    # CP 2: DP = 8 / (2 x 2 x 2) = 1, so GLOBAL 8 = MICRO 2 x GAS 4 x DP 1.
    "CP": "2",
}  # fmt: skip
GROUPS = [
    {**COMMON, "ACT_CKPT": "true", "INIT_FROM": "/ckpt/init"},
    {**COMMON, "ACT_CKPT": "false", "RECOMPUTE_GRANULARITY": "full", "RECOMPUTE_METHOD": "block",
     "RECOMPUTE_NUM_LAYERS": "1", "LOAD": "/ckpt/load", "PACK": "true", "ASYNC_SAVE": "1",
     "PIPELINE_SCHEDULE": "1f1b", "VPP": "2"},
    # LoRA: 1F1B and cp 1 (training refuses zb-h1 and CP with it); DP = 8 / (2 x 2) = 2, GAS 16 / (2 x 2) = 4
    {**COMMON, "CP": "1", "PIPELINE_SCHEDULE": "1f1b", "GLOBAL": "16", "INIT_FROM": "/ckpt/init", "LORA_RANK": "4",
     "LORA_ALPHA": "8", "LORA_TARGETS": "q v down"},
]  # fmt: skip


def test_the_table_names_real_fields_once() -> None:
    names = [v.name for v in RECIPE_VARS]
    fields = [v.field for v in RECIPE_VARS]
    assert len(set(names)) == len(names) and len(set(fields)) == len(fields)
    for v in RECIPE_VARS:
        if v.field != "model":
            section, name = v.field.split(".")
            assert section in SECTIONS and config_field(section, name).name == name
        assert by_name(v.name) is v
    # and back: the launcher reads exactly these lines
    out = subprocess.run([sys.executable, "-m", "threed.cli.recipe"], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == table()


def test_every_variable_is_walked() -> None:
    walked = set().union(*GROUPS)
    assert walked == {v.name for v in RECIPE_VARS}, "a table row the walk below does not set"


def _dry_run(env: dict[str, str]) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k not in {v.name for v in RECIPE_VARS} and not k.startswith("SLURM")}
    full = {**base, **env, "THREED_DRY_RUN": "1", "NNODES": "1", "GPUS_PER_NODE": "8"}
    out = subprocess.run(["bash", str(LAUNCH), str(REPO / "recipes" / "tiny.sh")], env=full, capture_output=True,
                         text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert out.returncode == 0, out.stderr
    command = shlex.split(re.search(r"^command: (.*)$", out.stdout, re.M)[1])
    return command[command.index("train") + 1 :]


def _field_value(cfg: RunConfig, field: str):
    if field == "model":
        return cfg.model.name
    section, name = field.split(".")
    return getattr(getattr(cfg, section), name)


def _expected(var: str, value: str):
    """What `threed train` makes of the value: the blend's words, the derived GAS, a bool or a number, else text."""
    if by_name(var).form == "words":  # DATA's blend, LORA_TARGETS' targets
        return tuple(value.split())
    if var == "GAS":  # empty: derived from GLOBAL, 8 = micro 2 x gas 4 x dp 1 (dp = 8 / (tp 2 x pp 2 x cp 2))
        return 4
    if value in ("true", "false") or by_name(var).form == "bare":  # a bare flag's 1 / 0 too
        return value in ("true", "1")
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            pass
    return value


@pytest.mark.parametrize("group", range(len(GROUPS)))
def test_each_variable_arrives_in_its_field(group: int) -> None:
    env = GROUPS[group]
    argv = _dry_run(env)
    cfg = parse_run_config(argv)
    for name, value in env.items():
        v = by_name(name)
        if v.form == "job":  # the harness job's flag (--tasks, --limit), never training's
            assert v.flag not in argv and value not in argv, f"{name}={value!r} reached `threed train`"
            continue
        if (value == "" and v.form != "layout") or (v.form == "bare" and value == "false"):
            assert v.flag not in argv, f"{name}={value!r} passes {v.flag}"
            continue
        assert v.flag in argv, f"{name}={value!r}: the launcher did not pass {v.flag}"
        assert _field_value(cfg, v.field) == _expected(name, value), (name, value, v.field)
    # ... and every flag it passed is a table row's
    flags = {a for a in argv if a.startswith("--")}
    assert flags <= {v.flag for v in RECIPE_VARS}, flags - {v.flag for v in RECIPE_VARS}
