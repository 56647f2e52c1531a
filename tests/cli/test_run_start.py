"""How a run starts and ends on its save directory: one run per directory (threed.checkpoint.lock: a second run is
refused, a dead job's lock does not block), a stale STOP file, a finished run, `--steps 0`, a changed batch
shape on resume, a damaged manifest, and Ctrl-C saving like SIGTERM."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import decide, SRC, checkpoint_config, fake_checkpoint, own_world_env, tiny_train, tiny_train_argv
from threed.checkpoint import lock as lockmod
from threed.checkpoint.format import RUN_JSON
from threed.checkpoint.lock import LOCK_NAME, SaveDirBusy, SaveLock
from threed.checkpoint.manifest import find_resumable
from threed.checkpoint.start import remove_stale_stop
from threed.config import RunConfig

# ------------------------------------------------------------------------------------------ the lock, in process


def test_second_lock_is_refused_naming_the_holder_and_released_lock_is_free(tmp_path):
    first = SaveLock(str(tmp_path))
    first.acquire()
    with pytest.raises(SaveDirBusy) as e:
        SaveLock(str(tmp_path)).acquire()
    msg = str(e.value)
    assert f"pid {os.getpid()} on {socket.gethostname()}" in msg and str(tmp_path / LOCK_NAME) in msg
    assert "touch" in msg and "choose another --save" in msg
    first.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # empty: nobody holds it
    with SaveLock(str(tmp_path)) as again:
        again.acquire()
        assert again.held
    assert not again.held


def hold_lock_in_a_process(save: Path) -> subprocess.Popen:
    code = (
        "import sys, time; from threed.checkpoint.lock import SaveLock; SaveLock(sys.argv[1]).acquire(); "
        "print('held', flush=True); time.sleep(120)"
    )
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(save)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_killed_holders_lock_does_not_block(tmp_path):
    holder = hold_lock_in_a_process(tmp_path)
    with pytest.raises(SaveDirBusy, match=f"pid {holder.pid} "):
        SaveLock(str(tmp_path)).acquire()
    holder.kill()  # SIGKILL: no exit path of ours runs; the kernel drops the flock
    holder.wait()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == holder.pid  # the dead job's record is left
    with SaveLock(str(tmp_path)) as lock:
        lock.acquire()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_flock_held_by_this_jobs_dead_incarnation_is_waited_for_then_refused(tmp_path, monkeypatch):
    """A node that died keeps its NFS lock until the lease runs out: a requeue waits for it, and says so."""
    holder = hold_lock_in_a_process(tmp_path)
    try:
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        (tmp_path / LOCK_NAME).write_text(json.dumps({**record, "job": "4242"}))  # as the requeued job wrote it
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        lines: list[str] = []
        with pytest.raises(SaveDirBusy, match="still locked after 1 s although it was written by this Slurm job"):
            SaveLock(str(tmp_path), wait_seconds=1).acquire(lines.append)
        assert len(lines) == 1 and "waiting up to 1 s" in lines[0]
    finally:
        holder.kill()
        holder.wait()


@pytest.fixture
def no_flock(monkeypatch):
    """A file system without flock (NFS without a lock daemon, Lustre without -o flock)."""

    def refuse(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lockmod.fcntl, "flock", refuse)


def test_without_flock_the_record_is_the_lock(tmp_path, no_flock, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    path = tmp_path / LOCK_NAME
    first = SaveLock(str(tmp_path))
    first.acquire()
    with pytest.raises(SaveDirBusy, match="no flock, so if that run is gone, delete the lock file"):
        SaveLock(str(tmp_path)).acquire()
    first.release()
    assert not path.exists()
    # Another host: cannot be checked from here, refused.
    other = {"host": "node-elsewhere", "pid": 1, "job": "17", "started": "2025-01-01T00:00:00"}
    path.write_text(json.dumps(other))
    with pytest.raises(SaveDirBusy, match="pid 1 on node-elsewhere, Slurm job 17"):
        SaveLock(str(tmp_path)).acquire()
    # The same Slurm job, requeued (on another node): its earlier incarnation is dead.
    monkeypatch.setenv("SLURM_JOB_ID", "17")
    lines: list[str] = []
    with SaveLock(str(tmp_path)) as lock:
        lock.acquire(lines.append)
        assert "taking over the stale lock" in lines[0] and "this Slurm job (17)" in lines[0]
    # This host, a pid that no longer exists.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    path.write_text(json.dumps({**other, "host": socket.gethostname(), "pid": dead.pid, "job": None}))
    with SaveLock(str(tmp_path)) as lock:
        lock.acquire(lines.append)
        assert f"its process {dead.pid} on" in lines[-1]


# ------------------------------------------------------------------------------------------ start, without ranks


def test_stale_stop_is_removed_with_a_line(tmp_path):
    assert remove_stale_stop(str(tmp_path)) is None
    (tmp_path / "STOP").touch()
    line = remove_stale_stop(str(tmp_path))
    assert "removed a stale" in line and str(tmp_path / "STOP") in line
    assert not (tmp_path / "STOP").exists()


def test_a_finished_run_is_said_and_nothing_is_converted(tmp_path):
    fake_checkpoint(tmp_path / "run", 10)
    plan = decide(
        checkpoint_config(tmp_path / "run"), world_size=1
    )  # steps=10; dp 1 vs 1: native, but it would not matter
    assert plan.finished and "is at step 10 and --steps is 10: the run has finished" in plan.finished
    assert not plan.universal
    assert "raise --steps" in plan.describe()
    assert not decide(
        checkpoint_config(tmp_path / "run"), world_size=2
    ).universal  # another dp: still nothing converted


def test_a_changed_batch_shape_on_resume_is_a_warning(tmp_path):
    run = tmp_path / "run"
    fake_checkpoint(run, 4)
    recorded = checkpoint_config(run).to_dict()
    (run / RUN_JSON).write_text(json.dumps(recorded))
    assert not [n for n in decide(checkpoint_config(run), world_size=2).notes if "warning" in n]
    changed = RunConfig.from_dict({**recorded, "train": {**recorded["train"], "seq_length": 64, "micro_batch_size": 2}})
    notes = [n for n in decide(changed, world_size=2).notes if "warning" in n]
    assert len(notes) == 1, notes
    assert "--seq-length 32 -> 64, --micro-batch-size 1 -> 2, global batch 1 -> 2" in notes[0]


def test_a_damaged_manifest_is_named_in_a_warning(tmp_path):
    fake_checkpoint(tmp_path, 2)
    d4 = fake_checkpoint(tmp_path, 4)
    (d4 / "threed_manifest.json").write_text('{"files": {"a')
    found, warnings = find_resumable(str(tmp_path))
    # `latest` names global_step4: its file counts still vouch for it, and the warning says what was damaged.
    assert found.tag == "global_step4" and not found.verified
    assert len(warnings) == 1 and f"{d4 / 'threed_manifest.json'} is damaged: it is not valid JSON" in warnings[0]
    (tmp_path / "latest").write_text("global_step2")
    found, warnings = find_resumable(str(tmp_path))
    assert found.tag == "global_step2"
    assert len(warnings) == 1 and "is damaged" in warnings[0] and "skipping that checkpoint" in warnings[0]


# ------------------------------------------------------------------------------------------ `threed train` runs


# `threed train`, each step slowed to 0.1 s: a run that is certainly still training when the test acts on it, on a
# busy machine too (without the sleep, 3,000 tiny steps can be over before a second run has started).
SLOW_TRAIN = (
    "import sys, time; import threed.train.loop as t; batches = t.step_batches; "
    "t.step_batches = lambda *a: (time.sleep(0.1), batches(*a))[1]; from threed.cli.main import main; "
    "sys.exit(main(sys.argv[1:]))"
)


def start_long_run(data: str, save: Path, log: Path) -> subprocess.Popen:
    """`threed train` for far more steps than a test waits for, its output in a file (a pipe nobody reads would
    block it), returned once the engine is built and training (the lock is held from before that)."""
    cmd = [
        sys.executable,
        "-c",
        SLOW_TRAIN,
        *tiny_train_argv(data, save, "--steps", "3000", "--log-interval", "100000"),
    ]
    env = own_world_env()
    p = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 240
    while "threed: world" not in log.read_text():
        assert p.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return p


def test_steps_0_is_refused_before_anything(tiny_corpus, tmp_path):
    p = tiny_train(tiny_corpus, tmp_path / "save", "--steps", "0")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line]  # (library start-up noise aside)
    assert errors == [
        "threed: configuration error: --steps 0 trains nothing (it is the total step count to train "
        "to); give --steps N >= 1, or check a configuration without building it with `threed "
        "check-config`"
    ]
    assert not (tmp_path / "save").exists()


@pytest.mark.slow  # four runs in a row (~75 s); each rule has its fast test above
def test_second_run_refused_first_saves_on_ctrl_c_stale_stop_then_finished(tiny_corpus, tmp_path):
    save, log = tmp_path / "save", tmp_path / "first.log"
    first = start_long_run(tiny_corpus, save, log)
    try:
        # A second run on the same directory: refused in one line naming the holder and the fix, nothing written.
        second = tiny_train(tiny_corpus, save, "--steps", "3")
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert "Traceback" not in second.stderr
        lines = [line for line in second.stderr.splitlines() if "error" in line]
        assert len(lines) == 1 and f"is in use by another run (pid {first.pid} on " in lines[0], second.stderr
        assert "`touch" in lines[0] and "choose another --save" in lines[0]
        assert first.poll() is None  # the first is unharmed: still training
        # Ctrl-C saves like SIGTERM: the first run saves at the step boundary and exits 0.
        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    out = log.read_text()
    assert "Ctrl-C: saving a checkpoint at the end of this step" in out and "Traceback" not in out
    assert "stop requested: saved step" in out
    step = int((save / "latest").read_text().removeprefix("global_step"))
    assert (save / LOCK_NAME).read_text() == ""  # released at the end

    # A STOP left behind (as a run stopped by STOP leaves it) is removed with a line; a batch change is a warning.
    (save / "STOP").touch()
    p = tiny_train(tiny_corpus, save, "--steps", str(step + 1), "--micro-batch-size", "2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"removed a stale {save / 'STOP'}" in p.stdout and not (save / "STOP").exists()
    assert "stop requested" not in p.stdout and (save / "latest").read_text() == f"global_step{step + 1}"
    warnings = [line for line in p.stdout.splitlines() if "warning: resuming" in line]
    assert len(warnings) == 1 and "--micro-batch-size 1 -> 2, global batch 1 -> 2" in warnings[0]

    # The same command again: the run has finished; one line, exit 0, nothing built or written.
    before = sorted((f.name, f.stat().st_mtime_ns) for f in save.rglob("*"))
    p = tiny_train(tiny_corpus, save, "--steps", str(step + 1), "--micro-batch-size", "2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"is at step {step + 1} and --steps is {step + 1}: the run has finished" in p.stdout
    assert "threed: world" not in p.stdout and "Traceback" not in p.stderr
    assert sorted((f.name, f.stat().st_mtime_ns) for f in save.rglob("*")) == before


def test_a_killed_runs_lock_does_not_block_the_requeue(tiny_corpus, tmp_path):
    save = tmp_path / "save"
    first = start_long_run(tiny_corpus, save, tmp_path / "first.log")
    os.killpg(first.pid, signal.SIGKILL)  # a dead job: no exit path of ours runs
    first.wait()
    assert json.loads((save / LOCK_NAME).read_text())["pid"] == first.pid
    p = tiny_train(tiny_corpus, save, "--steps", "2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert (save / "latest").read_text() == "global_step2"
    assert (save / LOCK_NAME).read_text() == ""
