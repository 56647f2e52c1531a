"""A resume at the same tp and pp with another --partition-method (issue 29): DeepSpeed's optimizer shards are per
pipeline stage, so a native load failed with a tensor-size traceback. threed sees the stages moved (the manifest
records them) and resumes through a universal checkpoint, optimizer state kept: the loss curve continues as if
the partition had never changed (2 gloo ranks, pp2, fp32; tests/ranks/ckpt_worker.py, both runs in the session's
2-rank launch: each must simply succeed). Slow (`make test-slow`): tests/unit/test_save_faults.py checks the decision
itself without ranks."""

from __future__ import annotations

import json
import shutil

import pytest

from test_checkpoint_faults import losses, pooled

TOL = 1e-5
RUN = ["--pp", "2", "--steps", "4", "--save-interval", "2"]


@pytest.mark.slow  # two runs and a universal conversion
def test_resume_with_another_partition_goes_through_universal_and_continues(tmp_path, rank_pool):
    ref_save, ref_out = tmp_path / "ref", tmp_path / "ref_out"
    p = pooled(rank_pool, 2, ref_out, "--save", str(ref_save), *RUN, "--partition-method", "layers:1,3")
    assert p.returncode == 0, p.stdout[-4000:]
    manifest = json.loads((ref_save / "global_step2" / "threed_manifest.json").read_text())
    assert manifest["stages"] == [0, 2, 7]  # embedding + block 0 | blocks 1-3 + norm + head
    save = tmp_path / "requeued"
    shutil.copytree(ref_save, save)  # what a job stopped after its step-2 checkpoint leaves behind
    shutil.rmtree(save / "global_step4")
    (save / "latest").write_text("global_step2")
    out = tmp_path / "out"
    p = pooled(rank_pool, 2, out, "--save", str(save), *RUN, "--partition-method", "layers:3,1")
    assert p.returncode == 0, p.stdout[-4000:]
    assert "Traceback" not in p.stdout
    lines = [line for line in p.stdout.splitlines() if "resuming through a universal checkpoint" in line]
    assert len(lines) == 1, p.stdout[-3000:]
    assert (
        "was written with stages 0: embedding + block 0 | 1: blocks 1-3 + final_norm + lm_head; this run's "
        in (lines[0])
    )
    result = json.loads((out / "result.json").read_text())
    assert result["start"] == 2 and result["universal"]
    ref, got = losses(ref_out), losses(out)
    for step in (3, 4):
        assert abs(got[step] - ref[step]) <= TOL * abs(ref[step]), (step, got[step], ref[step])
