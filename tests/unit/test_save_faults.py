"""A save that cannot be written, and the start's free-space check (issue 29, faults): in one process, with the disk
made full by faking the free-space query or by making the writer fail the way a full disk makes it fail (an
OSError with ENOSPC, or torch's C++ writer's RuntimeError that carries no errno). Each must end with one line
naming the error and the torn directory, exit 5, and `latest` still naming the previous checkpoint. The same on
a real, small tmpfs: tests/cli/test_run_faults.py."""

from __future__ import annotations

import dataclasses
import errno
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import decide, checkpoint_config, fake_checkpoint
from threed.checkpoint import save as ckpt
from threed.checkpoint.format import MANIFEST_NAME, checkpoint_bytes
from threed.checkpoint.start import check_save_dir
from threed.config import ConfigError

ONE = checkpoint_bytes(checkpoint_config())  # one tiny checkpoint at tp1 pp2, fp32


def free_space(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - free, free))


def check(save, **ck) -> None:
    cfg = checkpoint_config(save, **ck)
    check_save_dir(cfg, decide(cfg, 2))


def test_keep_last_needs_room_for_n_plus_1_checkpoints(tmp_path, monkeypatch):
    free_space(monkeypatch, int(2.5 * ONE))
    check(tmp_path / "a")  # keep all: the next save needs one checkpoint
    check(tmp_path / "b", keep_last=1)  # 2 at once, none there yet: 2 of 2.5
    with pytest.raises(ConfigError) as e:
        check(tmp_path / "c", keep_last=3)  # 4 at once, none there: 4 needed, 2.5 free
    msg = str(e.value)
    assert "--keep-last 3 holds 4 checkpoints at once (the next is written before the oldest is pruned)" in msg
    assert "4 more than the 0 complete one(s) there" in msg and "lower --keep-last" in msg
    assert "\n" not in msg
    resumed = tmp_path / "d"
    for step in (2, 4):  # two complete checkpoints already hold their space: 2 more needed
        fake_checkpoint(resumed, step)
    check(resumed, keep_last=3)


def test_a_torn_checkpoint_holding_the_space_is_named(tmp_path, monkeypatch):
    save = tmp_path / "ck"
    fake_checkpoint(save, 2)
    torn = fake_checkpoint(save, 4, complete=False)  # no manifest, and a file missing: a save cut short
    next(torn.glob("*optim_states.pt")).unlink()
    free_space(monkeypatch, ONE // 2)
    with pytest.raises(ConfigError) as e:
        check(save)
    msg = str(e.value)
    assert f"; {torn} is a torn checkpoint (a save cut short, not loadable) holding " in msg and "remove it" in msg
    assert str(save / "global_step2") not in msg  # a complete one is not torn


class Writer:
    """DeepSpeed's checkpoint engine as the save records it."""

    def save(self, state_dict, path, *a, **k):
        torch.save(state_dict, path)


class Engine:
    """What threed.checkpoint.save reads of a DeepSpeed engine; `save_checkpoint` writes one file, then `fail`."""

    def __init__(self, fail: Exception) -> None:
        self.module, self.global_steps, self.fail = torch.nn.Linear(4, 4), 6, fail
        self.checkpoint_engine = Writer()

    def save_checkpoint(self, save_dir, tag, **kw) -> None:
        Path(save_dir, tag).mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save({"w": self.module.weight}, f"{save_dir}/{tag}/layer_01-model_00-model_states.pt")
        raise self.fail


def failed_save(tmp_path, capsys, engine) -> str:
    """Run a save that fails; assert exit 5, one line, `latest` untouched; return the line."""
    save = tmp_path / "ck"
    fake_checkpoint(save, 4)
    with pytest.raises(SystemExit) as e:
        ckpt.save(engine, checkpoint_config(save), 0)
    assert e.value.code == ckpt.EXIT_SAVE_FAILED == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert (save / "latest").read_text() == "global_step4"
    assert (save / "global_step6").is_dir()  # the torn directory, left for the user (named in the line)
    assert (
        f"The torn directory {save}/global_step6 is not a checkpoint; `latest` still names {save}/global_step4"
        in (err[0])
    )
    return err[0]


def test_enospc_during_a_save_is_one_line_naming_it_and_the_torn_directory(tmp_path, capsys):
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ck/global_step6/mp_rank_00.pt"))
    line = failed_save(tmp_path, capsys, Engine(full))
    assert line.startswith("threed: error: saving step 6 failed: rank 0: No space left on device (ENOSPC) writing ")
    assert "mp_rank_00.pt" in line


def test_torch_writer_failure_on_a_full_disk_is_named_enospc(tmp_path, capsys, monkeypatch):
    """torch.save on a full file system raises RuntimeError("[enforce fail at inline_container.cc:672] . unexpected
    pos ...") with no errno: the free space left says what it was."""
    torn = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    engine = Engine(torn)
    real = shutil.disk_usage
    save_dir_full = {"now": False}

    def usage(p):
        return shutil._ntuple_diskusage(10**12, 10**12, 0) if save_dir_full["now"] else real(p)

    monkeypatch.setattr(shutil, "disk_usage", usage)
    original = engine.save_checkpoint

    def fill_then_fail(*a, **k):
        save_dir_full["now"] = True
        original(*a, **k)

    engine.save_checkpoint = fill_then_fail
    line = failed_save(tmp_path, capsys, engine)
    assert "rank 0: No space left on device (ENOSPC): 0.0 B free (torch's writer: [enforce fail" in line


def test_a_failed_manifest_write_keeps_latest(tmp_path, capsys, monkeypatch):
    engine = Engine(None)

    def write(save_dir, tag, **k):
        Path(save_dir, tag).mkdir(parents=True, exist_ok=True)
        engine.checkpoint_engine.save({}, f"{save_dir}/{tag}/layer_01-model_00-model_states.pt")

    engine.save_checkpoint = write

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", "threed_manifest.json.tmp")

    monkeypatch.setattr(ckpt, "write_manifest", full)
    line = failed_save(tmp_path, capsys, engine)
    assert "rank 0: No space left on device (ENOSPC) writing threed_manifest.json.tmp" in line


def test_a_runtime_error_that_is_not_a_write_keeps_its_traceback(tmp_path):
    with pytest.raises(RuntimeError, match="a bug"):
        ckpt.save(Engine(RuntimeError("a bug")), checkpoint_config(tmp_path / "ck"), 0)


def with_stages(step_dir: Path, stages: list[int]) -> None:
    """Record `stages` in a checkpoint's manifest, as a save does (threed.checkpoint.save.stage_bounds)."""
    m = json.loads((step_dir / MANIFEST_NAME).read_text())
    (step_dir / MANIFEST_NAME).write_text(json.dumps({**m, "stages": stages}))


def partitioned(save: Path, method: str):
    cfg = checkpoint_config(save)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, partition_method=method))


def test_a_resume_with_other_stages_goes_through_universal(tmp_path):
    """tp1 pp2 both times, but --partition-method moves blocks between the stages: DeepSpeed's per-stage optimizer
    shards no longer fit (a tensor-size traceback), a universal checkpoint loads by parameter name."""
    save = tmp_path / "ck"
    with_stages(fake_checkpoint(save, 4), [0, 2, 7])  # layers:1,3 (embedding + block 0 | blocks 1-3 + norm + head)
    same = partitioned(save, "layers:1,3")
    decision = decide(same, 2)
    assert decision.mode == "resume" and not decision.universal and decision.repartition == ""
    moved = partitioned(save, "layers:3,1")
    decision = decide(moved, 2)
    assert decision.universal and decision.repartition == (
        "stages 0: embedding + block 0 | 1: blocks 1-3 + final_norm + lm_head; this run's --partition-method "
        "layers:3,1 gives 0: embedding + blocks 0-2 | 1: block 3 + final_norm + lm_head"
    )


def test_stages_that_cannot_be_told_keep_the_native_resume(tmp_path):
    save = tmp_path / "ck"
    fake_checkpoint(save, 4)  # no stages in the manifest, no threed_run.json beside it (a converter's checkpoint)
    assert not decide(partitioned(save, "layers:3,1"), 2).universal
