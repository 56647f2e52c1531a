"""threed.checkpoint without ranks: the manifest and `latest` (crash safety), the newest complete checkpoint on
load, --keep-last, where a run starts (resume / refuse / overwrite / universal), and the save-directory checks that
run before the model is built. Fake checkpoint directories stand in for DeepSpeed's files."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from helpers import decide, checkpoint_config, fake_checkpoint
from threed import atomic
from threed.checkpoint import manifest
from threed.model.spec import parameter_count
from threed.checkpoint.format import MANIFEST_NAME, read_latest
from threed.checkpoint.manifest import find_resumable, prune
from threed.checkpoint.format import checkpoint_bytes
from threed.checkpoint.start import check_save_dir
from threed.config import ConfigError
from threed.model.presets import PRESETS

TINY = PRESETS["tiny"]


def test_newest_complete_checkpoint_is_found(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4)
    found, warnings = find_resumable(str(tmp_path))
    assert (found.tag, found.step, found.verified, warnings) == ("global_step4", 4, True, [])
    assert (found.layout.tp, found.layout.pp, found.layout.dp) == (1, 2, 1)


def test_missing_or_short_file_falls_back_with_a_warning_naming_it(tmp_path):
    fake_checkpoint(tmp_path, 2)
    d4 = fake_checkpoint(tmp_path, 4)
    (d4 / "mp_rank_01_model_states.pt").unlink()
    found, warnings = find_resumable(str(tmp_path))
    assert found.tag == "global_step2"
    assert len(warnings) == 1 and "mp_rank_01_model_states.pt is missing" in warnings[0]
    fake_checkpoint(tmp_path, 6)
    layer = tmp_path / "global_step6" / "layer_03-model_00-model_states.pt"
    layer.write_bytes(layer.read_bytes()[:10])
    found, warnings = find_resumable(str(tmp_path))
    assert found.tag == "global_step2"
    assert "layer_03-model_00-model_states.pt is 10 bytes, the manifest says" in warnings[0] and "short" in warnings[0]


def test_save_cut_short_has_no_manifest_and_is_skipped(tmp_path):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, complete=False)  # every file, but the barrier never passed: no manifest
    found, warnings = find_resumable(str(tmp_path))
    assert found.tag == "global_step2"
    assert "global_step4: it has no threed_manifest.json" in warnings[0]


def test_complete_checkpoint_newer_than_latest_is_used(tmp_path):
    """A kill between the manifest and `latest`: the newer checkpoint is complete, so it is the resume point."""
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 4, latest=False)
    assert (tmp_path / "latest").read_text() == "global_step2"
    assert find_resumable(str(tmp_path))[0].tag == "global_step4"


def test_checkpoint_without_manifest_is_checked_by_file_counts(tmp_path):
    d = fake_checkpoint(tmp_path, 2, complete=False)
    (tmp_path / "latest").write_text("global_step2")  # an older threed / `threed convert` output
    found, _ = find_resumable(str(tmp_path))
    assert found.tag == "global_step2" and not found.verified
    (d / "layer_05-model_00-model_states.pt").unlink()
    found, warnings = find_resumable(str(tmp_path))
    assert found is None and "layer_05-model_00-model_states.pt is missing" in warnings[0]


def test_keep_last_prunes_old_and_unfinished_checkpoints(tmp_path):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    cut = fake_checkpoint(tmp_path, 5, complete=False)  # a save cut short, older than the current one
    (cut / "layer_02-model_00-model_states.pt").unlink()
    fake_checkpoint(tmp_path, 1, complete=False)  # an older threed's checkpoint: complete files, no manifest
    (tmp_path / "universal" / "global_step2-from-tp2pp2dp2fp32").mkdir(parents=True)
    removed = prune(tmp_path, keep_last=2, current="global_step6")
    assert sorted(removed) == [
        "global_step1",
        "global_step2",
        "global_step5",
        "universal/global_step2-from-tp2pp2dp2fp32",
    ]
    assert sorted(p.name for p in tmp_path.glob("global_step*")) == ["global_step4", "global_step6"]
    assert prune(tmp_path, keep_last=0, current="global_step6") == []  # 0 keeps every complete checkpoint
    fake_checkpoint(tmp_path, 3, complete=False)
    assert prune(tmp_path, keep_last=0, current="global_step6") == []  # a complete one without manifest stays


def test_write_atomic_leaves_no_temporary_file(tmp_path):
    atomic.write_atomic(tmp_path / "latest", "global_step3")
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]
    assert read_latest(tmp_path) == "global_step3"


# ------------------------------------------------------------------------------------------ where a run starts


def test_existing_run_is_resumed_and_other_sources_are_noted(tmp_path):
    fake_checkpoint(tmp_path / "run", 4)
    plan = decide(checkpoint_config(tmp_path / "run", init_from=str(tmp_path / "elsewhere")), world_size=2)
    assert (plan.mode, plan.tag, plan.universal) == ("resume", "global_step4", False)
    assert any("--init-from" in n and "resumes from it" in n for n in plan.notes)


def test_auto_resume_false_on_a_run_is_refused_naming_overwrite(tmp_path):
    fake_checkpoint(tmp_path / "run", 4)
    with pytest.raises(ConfigError, match="already holds a checkpoint.*--overwrite true"):
        decide(checkpoint_config(tmp_path / "run", auto_resume=False), world_size=2)
    plan = decide(checkpoint_config(tmp_path / "run", auto_resume=False, overwrite=True), world_size=2)
    assert plan.mode == "fresh" and plan.clear_save
    assert manifest.clear_run(tmp_path / "run") == ["global_step4"]
    assert not list((tmp_path / "run").iterdir())


def test_run_with_only_broken_checkpoints_is_refused_not_restarted(tmp_path):
    d = fake_checkpoint(tmp_path / "run", 4)
    (d / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(ConfigError, match="holds no complete checkpoint.*mp_rank_00_model_states.pt is missing"):
        decide(checkpoint_config(tmp_path / "run"), world_size=2)


def test_first_save_cut_short_starts_fresh(tmp_path):
    fake_checkpoint(tmp_path / "run", 2, complete=False)
    plan = decide(checkpoint_config(tmp_path / "run"), world_size=2)
    assert plan.mode == "fresh" and "never finished" in plan.notes[0]


def test_other_layout_or_dtype_resumes_through_a_universal_checkpoint(tmp_path):
    fake_checkpoint(tmp_path / "run", 4, tp=1, pp=2, dp=2)
    assert not decide(checkpoint_config(tmp_path / "run"), world_size=4).universal  # tp1 pp2 dp2: native
    assert decide(checkpoint_config(tmp_path / "run"), world_size=2).universal  # dp 1
    assert decide(checkpoint_config(tmp_path / "run", tp=2, pp=1), world_size=4).universal  # tp 2 pp 1 dp 2
    assert decide(checkpoint_config(tmp_path / "run", dtype="bf16"), world_size=4).universal  # dtype


def test_another_model_is_refused(tmp_path):
    fake_checkpoint(tmp_path / "run", 4)
    other = dataclasses.replace(checkpoint_config(tmp_path / "run"), model=dataclasses.replace(TINY, num_layers=2))
    with pytest.raises(ConfigError, match="holds another model.*num_layers 4 != 2"):
        decide(other, world_size=2)


def test_load_without_checkpoint_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="load=.*empty holds no DeepSpeed checkpoint"):
        decide(checkpoint_config(load=str(tmp_path / "empty")), world_size=2)
    # A path that does not exist is said so (a typo, an unmounted file system), not called an empty checkpoint.
    with pytest.raises(ConfigError, match="load=.*nothing does not exist; check the path") as e:
        decide(checkpoint_config(load=str(tmp_path / "nothing")), world_size=2)
    assert "holds no" not in str(e.value)


# ------------------------------------------------------------------------------------------ the save directory


def test_save_dir_is_created_and_probed(tmp_path):
    check_save_dir(checkpoint_config(tmp_path / "a" / "b"), decide(checkpoint_config(tmp_path / "a" / "b"), 2))
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())


def test_save_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_save_dir(checkpoint_config(tmp_path / "f"), decide(checkpoint_config(), 2))


def test_read_only_save_dir_is_refused(tmp_path, monkeypatch):
    def refuse(self, *a, **k):  # what a read-only mount or a directory of another user answers (root ignores chmod)
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(ConfigError, match=r"--save .*ck is not writable \(Permission denied\); choose a directory"):
        check_save_dir(checkpoint_config(tmp_path / "ck"), decide(checkpoint_config(), 2))


def test_too_little_free_space_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    with pytest.raises(ConfigError, match=r"has 1000\.0 B free; one checkpoint of tiny needs about"):
        check_save_dir(checkpoint_config(tmp_path / "ck"), decide(checkpoint_config(), 2))
    assert not (tmp_path / "ck").exists()


def test_checkpoint_size_estimate_matches_a_real_checkpoint_roughly():
    # tiny: 0.33M params (vocab 512 padded to 512): fp32 weights 4 B + optimizer 12 B per param.
    c = checkpoint_config(tp=2)
    n = parameter_count(TINY, 2)
    assert checkpoint_bytes(c) == n * 16
    assert checkpoint_bytes(dataclasses.replace(c, train=dataclasses.replace(c.train, dtype="bf16"))) == n * 14


def test_manifest_records_every_file_with_its_size(tmp_path):
    d = fake_checkpoint(tmp_path, 2)
    m = json.loads((d / MANIFEST_NAME).read_text())
    assert set(m["files"]) == {p.name for p in d.iterdir() if p.name != MANIFEST_NAME}
    assert all(m["files"][p.name] == p.stat().st_size for p in d.iterdir() if p.name != MANIFEST_NAME)
