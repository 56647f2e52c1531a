"""--async-save in one process (issue 37; threed.checkpoint.async_save), with a stand-in for DeepSpeed's engine that
writes its files through `checkpoint_engine.save` as DeepSpeed does: the host copy is an exact, independent copy
(views and shared storages kept, the file torch.save writes of it byte for byte the same); the background write
publishes only at a step boundary that finds it finished, every file fsynced before `latest` moves; a failed
background write ends the run at the next boundary with one line naming the file, `latest` unchanged; a pending
save is waited for with a line saying so, by the divergence guard's stop too; a bug in the writer ends the run as a
failed write does; `threed memory` and `threed check-config` report the host memory of the copies per node, the
refusal's own figure. The multi-rank run, its tensors
against a synchronous save's and its resume: tests/ranks/test_checkpoint_faults.py."""

from __future__ import annotations

import errno
import io
import json
import os
import threading
from pathlib import Path

import pytest
import torch

from helpers import checkpoint_config, fake_checkpoint
from threed.checkpoint import async_save as asv
from threed.checkpoint.format import MANIFEST_NAME
from threed.config import CheckpointConfig, ConfigError, ParallelConfig, RunConfig, RunControlConfig, TrainConfig
from threed.convert.resolve import model_config
from threed.train import guard
from threed.units import human_bytes


def test_host_copy_is_independent_and_saves_the_same_bytes():
    flat = torch.arange(12, dtype=torch.float32)
    state = {
        "views": [flat[:4].view(2, 2), flat[4:]],  # two views of one storage: saved once, as torch.save does
        "param": torch.nn.Parameter(torch.ones(3)),
        "half": torch.zeros(2, dtype=torch.bfloat16),
        "meta": {"lr": 0.1, "names": ("a", "b"), "step": 7},
    }
    buffers = asv.HostBuffers(pin=False)
    copy = asv.host_copy(state, buffers)
    assert copy["views"][0].untyped_storage().data_ptr() == copy["views"][1].untyped_storage().data_ptr()
    assert copy["views"][0].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
    assert isinstance(copy["param"], torch.nn.Parameter) and copy["half"].dtype == torch.bfloat16
    assert copy["meta"] == state["meta"] and copy["meta"] is not state["meta"]

    def saved(obj) -> bytes:
        out = io.BytesIO()
        torch.save(obj, out)  # the zip format: DeepSpeed's default (checkpoint.use_node_local_storage aside)
        return out.getvalue()

    assert saved(copy) == saved(state)
    flat.add_(1)  # training goes on: the copy keeps what was saved
    assert torch.equal(copy["views"][1], torch.arange(4, 12, dtype=torch.float32))
    assert buffers.nbytes() == 12 * 4 + 3 * 4 + 2 * 2  # one buffer per storage


def test_buffers_are_reused_from_one_save_to_the_next():
    buffers = asv.HostBuffers(pin=False)
    state = {"w": torch.ones(8), "b": torch.zeros(2)}
    buffers.start()
    first = asv.host_copy(state, buffers)
    buffers.end()
    buffers.start()
    second = asv.host_copy(state, buffers)
    buffers.end()
    assert second["w"].data_ptr() == first["w"].data_ptr() and len(buffers.pool) == 2


class Writer:
    """DeepSpeed's checkpoint engine as the save uses it: torch.save, or a failure for the named file."""

    def __init__(self, fail_on: str = "", gate: threading.Event | None = None) -> None:
        self.fail_on, self.gate = fail_on, gate

    def save(self, state_dict, path, *a, **k):
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail_on and self.fail_on in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        torch.save(state_dict, path)


class Engine:
    """What the save reads of a DeepSpeed engine; `save_checkpoint` writes a layer file and a model-state file."""

    def __init__(self, writer: Writer) -> None:
        self.module, self.global_steps = torch.nn.Linear(4, 4), 6
        self.checkpoint_engine = writer

    def save_checkpoint(self, save_dir, tag, client_state, **kw) -> None:
        Path(save_dir, tag).mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save(self.module.state_dict(), f"{save_dir}/{tag}/layer_01-model_00-model_states.pt")
        self.checkpoint_engine.save({"client": client_state}, f"{save_dir}/{tag}/mp_rank_00_model_states.pt")


def saver(save: Path, lines: list) -> asv.AsyncSaver:
    return asv.AsyncSaver(checkpoint_config(save, async_save=True), 0, "cpu", lines.append)


def test_a_background_save_is_published_at_a_boundary_after_every_file_is_flushed(tmp_path, monkeypatch):
    save, lines, events = tmp_path / "ck", [], []
    fake_checkpoint(save, 4)
    gate = threading.Event()
    engine, s = Engine(Writer(gate=gate)), saver(save, lines)
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (real_fsync(fd), events.append(os.readlink(f"/proc/self/fd/{fd}"))))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(f"replace {b}"), real_replace(a, b)))
    weights = engine.module.weight.detach().clone()
    blocked = s.save(engine, {"consumed_samples": 48})
    assert blocked >= 0 and s.pending is not None
    with torch.no_grad():
        engine.module.weight.add_(1)  # the next step, while the files are written
    assert s.poll() is None and (save / "latest").read_text() == "global_step4"  # still writing: nothing named
    gate.set()
    s.pending.done.wait(30)
    done = s.poll()
    assert done is not None and done.step == 6 and done.seconds >= done.blocked
    assert (save / "latest").read_text() == "global_step6"
    step_dir = save / "global_step6"
    assert torch.equal(torch.load(step_dir / "layer_01-model_00-model_states.pt")["weight"], weights)
    manifest = json.loads((step_dir / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"layer_01-model_00-model_states.pt", "mp_rank_00_model_states.pt"}
    assert manifest["client_state"] == {"consumed_samples": 48} and "blocked_seconds" in manifest
    moved = events.index(f"replace {save / 'latest'}")
    flushed = events[:moved]
    staged = step_dir / f".threed-writing-{os.getpid()}"
    for name in manifest["files"]:  # written in a staging folder, fsynced, renamed into place: all before `latest`
        assert str(staged / name) in flushed and f"replace {step_dir / name}" in flushed, name
    assert str(step_dir) in flushed and str(save) in flushed
    assert sorted(p.name for p in step_dir.iterdir()) == sorted(
        [*manifest["files"], MANIFEST_NAME]
    )  # nothing staged left


def test_a_failed_background_write_ends_the_run_at_the_next_boundary_naming_the_file(tmp_path, capsys):
    save, lines = tmp_path / "ck", []
    fake_checkpoint(save, 4)
    s = saver(save, lines)
    s.save(Engine(Writer(fail_on="mp_rank_00")), {})
    s.pending.done.wait(30)
    with pytest.raises(SystemExit) as e:
        s.poll()
    assert e.value.code == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (
        "No space left on device (ENOSPC)" in err[0]
        and f"writing {save}/global_step6/mp_rank_00_model_states.pt" in err[0]
    )
    assert f"`latest` still names {save}/global_step4" in err[0]
    assert (save / "latest").read_text() == "global_step4"


def test_a_copy_that_fails_ends_the_run_as_a_synchronous_save_does(tmp_path, capsys):
    """DeepSpeed's own directory making fails inside the blocking part: no background write starts; exit 5, one
    line, `latest` unchanged."""
    save = tmp_path / "ck"
    fake_checkpoint(save, 4)
    engine = Engine(Writer())

    def denied(*a, **k):
        raise OSError(errno.EACCES, "Permission denied", str(save / "global_step6"))

    engine.save_checkpoint = denied
    s = saver(save, [])
    with pytest.raises(SystemExit) as e:
        s.save(engine, {})
    assert e.value.code == 5 and s.pending is None and s.thread is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"Permission denied (EACCES) writing {save}/global_step6" in err[0], err
    assert (save / "latest").read_text() == "global_step4"


def test_finish_waits_for_a_pending_save_with_a_line(tmp_path):
    save, lines = tmp_path / "ck", []
    gate = threading.Event()
    s = saver(save, lines)
    s.save(Engine(Writer(gate=gate)), {})
    threading.Timer(0.5, gate.set).start()
    done = s.finish("exiting")
    assert lines == ["waiting for the checkpoint of step 6 to be written before exiting"]
    assert done.step == 6 and (save / "latest").read_text() == "global_step6" and s.pending is None
    assert s.finish("exiting") is None and lines == [lines[0]]  # nothing pending: no wait, no line


def test_host_memory_that_cannot_hold_the_copy_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(asv, "available_memory", lambda: 1000)
    with pytest.raises(ConfigError) as e:
        saver(tmp_path / "ck", [])
    msg = str(e.value)
    assert msg.startswith("--async-save keeps a host copy of each rank's share of a checkpoint: about ")
    assert f"which has {human_bytes(1000)} of memory available" in msg
    assert "turn --async-save off" in msg and "\n" not in msg


def test_the_divergence_stop_publishes_a_pending_save_and_names_it(tmp_path, capsys):
    """threed.train.guard with the loop's `settle_saves`: the exit 3 of a diverged run (every rank, the same step)
    first publishes the pending save, whose weights were checked when it began, and names it as the last good one."""
    save, lines = tmp_path / "ck", []
    fake_checkpoint(save, 4)
    gate = threading.Event()
    engine, s = Engine(Writer(gate=gate)), saver(save, lines)
    g = guard.RunGuard(RunControlConfig(watchdog_factor=0), str(save), 0, engine, None)
    g.settle_saves = lambda: s.finish("exiting (the run diverged)")
    s.save(engine, {})
    threading.Timer(0.3, gate.set).start()
    with pytest.raises(SystemExit) as e:
        g.after_step(7, float("nan"), float("inf"))
    assert e.value.code == 3 and (save / "latest").read_text() == "global_step6"
    assert lines == ["waiting for the checkpoint of step 6 to be written before exiting (the run diverged)"]
    assert f"Last good checkpoint: {save}/global_step6. Resume from it" in capsys.readouterr().err


def test_the_background_writer_yields_the_cpu_to_training():
    """The writer thread's own nice value goes up (Linux keeps one per thread); the training thread's stays."""
    seen = {}

    def writer():
        me = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, me)
        asv.yield_cpu()
        seen["before"], seen["after"] = before, os.getpriority(os.PRIO_PROCESS, me)

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=writer)
    t.start()
    t.join()
    assert seen["after"] == min(19, seen["before"] + asv.WRITER_NICE)  # 19: the lowest priority there is
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main


class Buggy(Writer):
    """A checkpoint engine whose writer has a bug (not an OSError)."""

    def save(self, state_dict, path, *a, **k):
        raise KeyError("a bug")


def test_a_bug_in_the_writer_ends_the_run_at_the_next_boundary_in_one_line(tmp_path, capsys):
    """Not an OSError: the writer's exception is reported, not raised on its own rank, and the boundary that finds
    the writer done ends the run (exit 5) with one line naming the file and where the exception was raised."""
    save, lines = tmp_path / "ck", []
    fake_checkpoint(save, 4)
    s = saver(save, lines)
    s.save(Engine(Buggy()), {})
    s.pending.done.wait(30)
    with pytest.raises(SystemExit) as e:
        s.poll()
    err = capsys.readouterr().err
    assert e.value.code == 5 and err.count("threed: error:") == 1 and "Traceback" not in err, err
    assert f"rank 0: the background writer failed writing {save}/global_step6/layer_01-model_00" in err, err
    assert "KeyError: 'a bug' (raised at test_async_save.py:" in err and "drop --async-save" in err, err
    assert (save / "latest").read_text() == "global_step4" and s.pending is None


def test_memory_and_check_config_report_the_refusals_host_copy_per_node(capsys):
    """`threed memory --async-save` and `threed check-config` print the host memory of the copies on the heaviest
    node: the figure the refusal computes for the ranks of that node (tp 2 x pp 2 x dp 2, 4 ranks per node)."""
    from threed.cli.main import main

    layout = "--model tiny --tp 2 --pp 2 --micro-batch-size 1 --grad-accum-steps 4 --seq-length 64".split()
    assert main(["memory", *layout, "--dp", "2", "--async-save", "--gpus-per-node", "4"]) == 0
    mem = capsys.readouterr().out
    argv = ["check-config", "--world", "8", *layout, "--save", "/nowhere", "--async-save", "--ranks-per-node", "4"]
    assert main(argv) == 0
    check = capsys.readouterr().out
    cfg = RunConfig(
        model=model_config("tiny"),
        parallel=ParallelConfig(tp=2, pp=2),
        train=TrainConfig(micro_batch_size=1, grad_accum_steps=4, seq_length=64),
        checkpoint=CheckpointConfig(save="/nowhere", async_save=True),
    )
    nodes = [asv.copy_bytes(cfg, 8, range(n, n + 4)) for n in (0, 4)]
    assert (
        min(nodes) > 0
    )  # each node holds one stage: its 4 ZeRO shards, and its weights twice (dp rank 0's 2 tp ranks)
    line = f"memory: host ~{human_bytes(max(nodes))} per node of 4 rank(s) for --async-save's checkpoint copies"
    assert line in mem and line in check, (mem, check)
