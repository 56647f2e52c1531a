"""Ctrl-C under torchrun with several ranks (issue 19): `threed train --nproc-per-node 2 --pp 2 ...`, the README's
form, gets SIGINT as a terminal delivers it, to the whole process group (the launcher and both ranks at once, and
torchrun forwards its own copy to the ranks). The run must end as one Ctrl-C of a one-process run does
(tests/cli/test_run_start.py): one "saving a checkpoint" line, a checkpoint of the step it stopped at, exit 0, no
traceback from any rank or from torchrun's agent, and the save directory's lock released."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import own_world_env, tiny_train_argv
from threed.checkpoint.lock import LOCK_NAME


def test_ctrl_c_on_two_pipeline_ranks_saves_once_and_exits_0(tiny_corpus, tmp_path):
    save, log = tmp_path / "save", tmp_path / "run.log"
    flags = ("--nproc-per-node", "2", "--pp", "2", "--steps", "100000", "--log-interval", "1")
    cmd = [sys.executable, "-m", "threed.cli", *tiny_train_argv(tiny_corpus, save, *flags)]
    env = own_world_env("TORCHELASTIC_RUN_ID")
    # A session of its own: its process group is the launcher and its ranks, as a terminal's foreground job.
    p = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while "step 2/" not in log.read_text():  # training, with 100,000 steps to go
            assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGINT)
        status = p.wait(timeout=240)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    out = log.read_text()
    assert status == 0, out[-4000:]
    assert out.count("Ctrl-C: saving a checkpoint at the end of this step") == 1, out[-4000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-4000:]
    stopped = [line for line in out.splitlines() if line.startswith("stop requested: saved step ")]
    assert len(stopped) == 1, out[-4000:]
    step = int(stopped[0].removeprefix("stop requested: saved step ").split()[0])
    assert 2 <= step < 100000
    assert (save / "latest").read_text() == f"global_step{step}"
    assert (save / f"global_step{step}").is_dir()
    assert (save / LOCK_NAME).read_text() == ""  # released by rank 0 on its way out
