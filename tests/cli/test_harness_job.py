"""HARNESS_TASKS / HARNESS_LIMIT in a recipe (issue 28): the slurm job submits `threed eval-harness --load SAVE` as a
job of its own (slurm/eval_harness.sh) each time training stops with a new checkpoint, so training never waits for
scores. The launcher's dry run prints the exact sbatch line (and passes no training flag for them); a recipe whose
harness job could not run is refused there in one line; slurm/common.sh, run with stand-in srun / sbatch /
scontrol on PATH, submits that line once per saved step.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/cli/test_harness_job.py
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from test_recipes import REPO, launch, train_argv

HARNESS = {"HARNESS_TASKS": "arc_easy,hellaswag", "HARNESS_LIMIT": "200"}


def harness_job(out: str) -> list[str] | None:
    m = re.search(r"^harness job: (.*)$", out, re.M)
    return shlex.split(m[1]) if m else None


def test_dry_run_prints_the_harness_sbatch_line():
    out = launch("llama31_8b", {"GPUS_PER_NODE": "8", "SAVE": "/ckpt/llama 8b", **HARNESS})
    assert out.returncode == 0, out.stderr
    assert harness_job(out.stdout) == [
        "sbatch", "--parsable", "--nodes=1", "--gres=gpu:8", "slurm/eval_harness.sh", "--load", "/ckpt/llama 8b",
        "--tasks", "arc_easy,hellaswag", "--nproc-per-node", "8", "--tp", "2", "--pp", "2", "--dtype", "bf16",
        "--limit", "200",
    ]  # fmt: skip
    argv = " ".join(train_argv(out.stdout))
    assert "--tasks" not in argv and "--harness" not in argv and "--limit" not in argv  # not training's flags
    plain = launch("llama31_8b", {"GPUS_PER_NODE": "8"})
    assert plain.returncode == 0 and harness_job(plain.stdout) is None


def test_harness_job_fills_one_node_at_the_checkpoint_layout():
    """DP fills the node (8 ranks at TP x PP = 2 x 2: dp 2); a CPU run asks for no GPUs."""
    # TOKENIZER: tiny.sh's is a sentencepiece .model, which the harness job would refuse (and the launcher does)
    out = launch("tiny", {"GPUS_PER_NODE": "8", "DEVICE": "cpu", "HARNESS_TASKS": "tiny_mc", "TOKENIZER": ""})
    assert out.returncode == 0, out.stderr
    job = harness_job(out.stdout)
    assert job[job.index("--nproc-per-node") + 1] == "8" and "--gres=none" in job and "--limit" not in job


def test_harness_job_of_a_layout_larger_than_a_node_fits_one_node():
    """70B at TP 8 x PP 4 (32 GPUs) trains on 4 nodes; its scores come from one node at TP 8 x PP 1 (eval-harness reads
    the checkpoint at any layout), in the run's dtype; TP 4 x PP 8 scores at TP 4 x PP 2; on nodes of 6 GPUs TP 8 x PP 4
    scores at TP 4 (the largest divisor of 8 that fits: it divides the heads) x PP 1 on 4 of them."""
    cases = [
        ({}, ["8", "1", "8"]),
        ({"TP": "4", "PP": "8"}, ["4", "2", "8"]),
        ({"GPUS_PER_NODE": "6", "NNODES": "16", "GLOBAL": "96"}, ["4", "1", "4"]),
    ]
    for env, layout in cases:
        out = launch("llama31_70b", {"GPUS_PER_NODE": "8", "NNODES": "4", "SAVE": "/ckpt/70b", **HARNESS, **env})
        assert out.returncode == 0, out.stderr
        job = harness_job(out.stdout)
        assert [job[job.index(f) + 1] for f in ("--tp", "--pp", "--nproc-per-node", "--dtype")] == layout + ["bf16"]


def test_harness_job_that_could_not_run_is_refused_in_one_line():
    cases = [
        ("llama31_8b", {"SAVE": ""}, "HARNESS_TASKS=arc_easy,hellaswag needs SAVE"),
        ("llama31_8b", {"HARNESS_LIMIT": "lots"}, "HARNESS_LIMIT=lots is not a whole number"),
    ]
    for recipe, env, message in cases:
        out = launch(recipe, {"GPUS_PER_NODE": "8", **HARNESS, **env})
        err = out.stderr.strip()
        assert out.returncode == 2 and message in err and "\n" not in err, (recipe, err)


STUBS = {
    # srun: the training "runs" and saves the step the test asks for
    "srun": 'echo "global_step$FAKE_SAVED_STEP" > "$SAVE/latest"',
    "sbatch": 'echo "$*" >> "$FAKE_LOG/sbatch.txt"; echo 4242',
    "scontrol": '[ "$1" = show ] && [ "$2" = hostnames ] && echo node0; exit 0',
    "squeue": "exit 1",
}


def slurm_job(tmp_path: Path, step: int) -> subprocess.CompletedProcess[str]:
    """slurm/train.sh on tiny (DEVICE=cpu) with the stand-ins first on PATH; the training saves `step`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env = {
        **base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_NNODES": "1",
        "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_NAME": "tiny", "THREED_ROOT": str(REPO), "GPUS_PER_NODE": "4",
        "DEVICE": "cpu", "SAVE": str(tmp_path / "ckpt"), "LOG_DIR": str(tmp_path / "logs"), "FAKE_LOG": str(tmp_path),
        "FAKE_SAVED_STEP": str(step), "HARNESS_TASKS": "tiny_mc", "HARNESS_LIMIT": "20",
        "TOKENIZER": "",  # tiny.sh's sentencepiece .model: the launcher refuses it with HARNESS_TASKS
    }  # fmt: skip
    return subprocess.run(
        ["bash", str(REPO / "slurm" / "train.sh"), "recipes/tiny.sh"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip


def test_slurm_job_submits_the_harness_once_per_saved_step(tmp_path):
    first = slurm_job(tmp_path, 150)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "submitted harness job 4242 (threed eval-harness of step 150)" in first.stdout
    calls = (tmp_path / "sbatch.txt").read_text().splitlines()
    assert calls == [
        f"--parsable --nodes=1 --gres=none slurm/eval_harness.sh --load {tmp_path / 'ckpt'} --tasks tiny_mc "
        "--nproc-per-node 4 --tp 2 --pp 2 --dtype bf16 --limit 20"
    ]
    again = slurm_job(tmp_path, 150)  # a requeued start that saved nothing new
    assert again.returncode == 0 and "submitted harness job" not in again.stdout
    later = slurm_job(tmp_path, 160)
    assert "eval-harness of step 160" in later.stdout
    assert len((tmp_path / "sbatch.txt").read_text().splitlines()) == 2


def test_eval_harness_script_runs_threed_eval_harness():
    """The harness job's script is `threed eval-harness` with the sbatch line's arguments (a refusal shows its line)."""
    env = {**os.environ, "SLURM_SUBMIT_DIR": str(REPO), "DEVICE": "cpu"}
    out = subprocess.run(
        ["bash", str(REPO / "slurm" / "eval_harness.sh"), "--load", "/nonexistent", "--tasks", "x"],
        env=env, capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert "threed eval-harness: error:" in out.stderr and "/nonexistent" in out.stderr
