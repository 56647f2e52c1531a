"""One vocabulary: `threed memory`, `threed plan` and `threed check-config` take training's flag names (and Megatron's
aliases), generated from the same config metadata as `threed train`; the earlier short names still work and mean
the same; and the three agree on the memory estimate of one layout.

    .venv/bin/python -m pytest -q tests/cli/test_vocabulary.py
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from threed.cli import memory as memory_cli
from threed.cli import plan as plan_cli
from threed.cli.flags import add_run_flags
from threed.cli.main import main

REPO = Path(__file__).resolve().parents[2]
LAYOUT = "--model llama3.1-70b --tp 8 --pp 4 --sequence-parallel".split()
PLAN = "plan --model llama3.1-70b --gpu-memory 80".split()


def run(capsys, *argv: str) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_plan_takes_trainings_flags_and_the_old_names_alike(capsys) -> None:
    new = run(capsys, *PLAN, *"--nodes 4 --tp 8 --pp 4 --micro-batch-size 1 --seq-length 8192".split(),
              *"--global-batch-size 512 --sequence-parallel true".split())  # fmt: skip
    old = run(capsys, *PLAN, *"--nodes 4 --tp 8 --pp 4 --micro 1 --seq 8192 --global-batch 512".split(),
              *"--sequence-parallel true".split())  # fmt: skip
    assert new == old and "best: tp8 pp4" in new, new
    # Megatron's names too (the config's aliases)
    parallel = "--nodes 4 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 4".split()
    batch = "--micro-batch-size 1 --seq-length 8192 --global-batch-size 512 --sequence-parallel true".split()
    megatron = run(capsys, *PLAN, *parallel, *batch)
    assert megatron == new


def test_memory_check_config_and_plan_agree_on_one_layout(capsys) -> None:
    batch = "--micro-batch-size 1 --grad-accum-steps 256 --seq-length 8192".split()
    full = run(capsys, "memory", *LAYOUT, "--dp", "2", *batch)
    old = run(capsys, "memory", *LAYOUT, *"--dp 2 --micro 1 --gas 256 --seq 8192".split())
    mem = full.splitlines()[0]  # the estimate; the predicted step and its rates follow
    assert full == old and mem.startswith("~"), full
    check = run(capsys, "check-config", "--world", "64", *LAYOUT, *batch)
    assert re.search(r"^memory: (.*)$", check, re.M)[1] == mem
    assert "world 64 = tp 8 x pp 4 x dp 2, global batch 512 = micro 1 x gas 256 x dp 2" in check
    plan = run(capsys, *PLAN, *"--nodes 8 --tp 8 --pp 4 --micro-batch-size 1 --seq-length 8192".split(),
               *"--global-batch-size 512 --sequence-parallel true --activation-checkpointing false".split(),
               *"--pipeline-schedule 1f1b --vpp 1".split())  # fmt: skip
    best = re.search(r"^best: (.*)$", plan, re.M)[1]
    assert best.startswith("tp8 pp4 dp2, micro 1 x gas 256, sequence parallel, without recompute"), best
    assert best.endswith(mem), (best, mem)


def _options(build) -> dict[str, argparse.Action]:
    p = argparse.ArgumentParser()
    build(p)
    return {a.dest: a for a in p._actions}


@pytest.mark.parametrize("build", [memory_cli.add_arguments, plan_cli.add_arguments], ids=["memory", "plan"])
def test_shared_flags_are_trainings_own(build) -> None:
    train = _options(add_run_flags)
    theirs = _options(build)
    shared = [d for d in theirs if "." in d]
    assert {"train.seq_length", "train.micro_batch_size", "parallel.tp", "parallel.pp"} <= set(shared)
    for dest in shared:
        ours, trains = theirs[dest], train[dest]
        assert ours.option_strings[: len(trains.option_strings)] == trains.option_strings, dest
        assert ours.type is trains.type and ours.choices == trains.choices, dest


def test_the_entry_points_users_script_against_still_run() -> None:
    """`python -m threed.memory` (old short names included) and `python -m threed.train` survive the move."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    def python_m(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, env=env, timeout=120)

    mem = python_m("threed.memory", *LAYOUT, *"--dp 2 --micro 1 --gas 256 --seq 8192".split())
    assert mem.returncode == 0 and mem.stdout.startswith("~") and "GB/GPU" in mem.stdout, mem.stderr
    train = python_m("threed.train", "--help")
    assert train.returncode == 0 and "--micro-batch-size" in train.stdout, train.stderr
    assert "--tensor-model-parallel-size" in train.stdout
    bad = python_m("threed.train", "--model", "tiny", "--tp", "3")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "Traceback" not in bad.stderr
