"""The guard and the checkpoint module inside `threed train` itself (one process, fp32, the tiny preset): a run that
diverges stops with exit 3 naming the step and the last good checkpoint and saves nothing more; a run that reaches
--exit-duration-in-mins saves and exits 0, and the same command then resumes from that checkpoint; --async-save
says each save's blocked time and time-to-publish on separate fields, and its checkpoints resume."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from helpers import tiny_train, tiny_train_argv


def test_divergence_exits_3_and_keeps_the_last_good_checkpoint(tiny_corpus, tmp_path):
    save = tmp_path / "save"
    p = tiny_train(tiny_corpus, save, "--steps", "4", "--save-interval", "1", "--lr", "1e30", "--min-lr", "1e29")
    assert p.returncode == 3, p.stdout[-2000:] + p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if "threed: error" in line]
    assert len(errors) == 1 and "Traceback" not in p.stderr
    # Step 1 at lr ~1e30 already makes the weights non-finite (issue 19: that step used to be saved and named
    # "last good"): the guard stops at once, before the save, and names no checkpoint.
    assert "the run diverged at step 1: the step made the weights non-finite; stopping without saving" in errors[0]
    assert f"Last good checkpoint: none yet in {save}. Start again with a lower --lr" in errors[0]
    assert not (save / "latest").exists() and not list(save.glob("global_step*"))


def test_exit_duration_saves_exits_0_and_the_same_command_resumes(tiny_corpus, tmp_path):
    save = tmp_path / "save"
    # A budget of 0.0001 min is spent at once: the first step's end saves and exits.
    p = tiny_train(tiny_corpus, save, "--steps", "3", "--exit-duration-in-mins", "0.0001")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "--exit-duration-in-mins 0.0001 is near" in p.stderr and "saving and exiting" in p.stderr
    assert (save / "latest").read_text() == "global_step1"
    p = tiny_train(tiny_corpus, save, "--steps", "3")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"resumed from {save} at step 1" in p.stdout
    assert (save / "latest").read_text() == "global_step3"


def test_config_error_under_torchrun_is_one_line_from_rank_0(tiny_corpus, tmp_path):
    """torchrun (the README's own command) prints its own summary of the failed ranks; ours is one line."""
    from threed.parallel.launch import torchrun_command

    cmd = torchrun_command(
        2,
        "threed.train",
        ["--model", "tiny", "--data-path", tiny_corpus, "--steps", "-1", "--save", str(tmp_path / "save")],
    )
    p = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert out.count("threed: configuration error: --steps must be >= 0, got -1") == 1, out[-3000:]
    assert "exitcode  : 2" in out and "src/threed/" not in out  # torchrun's traceback only, none of ours
    assert not (tmp_path / "save").exists()


def test_async_save_logs_blocked_and_published_times_and_resumes(tiny_corpus, tmp_path):
    save = tmp_path / "save"
    p = tiny_train(tiny_corpus, save, "--steps", "4", "--save-interval", "2", "--async-save")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    for step in (2, 4):
        assert f"checkpoint step {step}: training blocked " in p.stdout, p.stdout[-2000:]
        published = (
            rf"saved checkpoint step {step} to {save} \| training blocked [0-9.]+ s \| published after [0-9.]+ s"
        )
        assert re.search(published, p.stdout), p.stdout[-2000:]
    assert (save / "latest").read_text() == "global_step4"
    p = tiny_train(tiny_corpus, save, "--steps", "5", "--async-save")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"resumed from {save} at step 4" in p.stdout
    assert (save / "latest").read_text() == "global_step5"


def test_a_resume_trains_at_the_lr_its_command_names(tiny_corpus, tmp_path, capsys, own_process_group):
    """The divergence guard says "resume with a lower --lr": the resumed steps must use it (DeepSpeed's load restores
    the checkpoint's learning rate; threed.engine.optimizer.apply_schedule puts the command's back). Two resumes of
    one checkpoint at --lr 1e-3 and 1e-4 (min-lr a tenth of each: the same schedule factor) log lrs ten times apart
    and train to different weights; the run that wrote the checkpoint used neither (3e-3)."""
    from threed.cli.main import main

    first = tmp_path / "first"
    assert main(tiny_train_argv(tiny_corpus, first, "--steps", "2", "--lr", "3e-3", "--min-lr", "3e-4")) == 0
    got = {}
    for lr in ("1e-3", "1e-4"):
        save = tmp_path / lr
        shutil.copytree(first, save)
        capsys.readouterr()
        flags = ["--steps", "4", "--lr", lr, "--min-lr", f"{float(lr) / 10:g}", "--log-interval", "1"]
        assert main(tiny_train_argv(tiny_corpus, save, "--load", str(save), *flags)) == 0
        steps = re.findall(r"^step (\d)/4 \| loss ([0-9.]+) \| lr ([0-9.e+-]+)", capsys.readouterr().out, re.M)
        got[lr] = {int(s): (float(loss), float(rate)) for s, loss, rate in steps}
    assert sorted(got["1e-3"]) == [3, 4], got
    assert got["1e-3"][3][1] == pytest.approx(10 * got["1e-4"][3][1], rel=1e-3), got
    assert got["1e-3"][3][0] == got["1e-4"][3][0]  # the same weights at step 3's forward: the checkpoint's
    assert got["1e-3"][4][0] != got["1e-4"][4][0], got  # step 3's update differed
