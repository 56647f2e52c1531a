"""Resume at another tp, pp and dp with the same command, optimizer state kept, through DeepSpeed's universal
checkpoint: an uninterrupted fp32 run at tp2 pp2 dp2 (8 ranks) saves at step 2 and goes on to step 4; a copy of
its save directory holding only step 2 (a job requeued on another node count) resumes at another layout and must
continue the loss curve within 1e-5. Batches are fixed synthetic samples in a dp-independent global order
(tests/ranks/ckpt_worker.py), and the global batch (8) is the same at every layout: gas = 8 / dp.

`make test` runs (tp1 pp1 dp1), which changes all three; (tp1 pp2 dp4) and (tp2 pp1 dp2) are slow."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import RANKS
from test_checkpoint_faults import losses, pooled

TOL = 1e-5
RUN = ["--steps", "4", "--save-interval", "2", "--global-batch", "8"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, rank_pool):
    root = tmp_path_factory.mktemp("universal")
    argv = ["--out", str(root / "out"), "--save", str(root / "save"), "--tp", "2", "--pp", "2", *RUN]
    rank_pool.run(8, str(RANKS / "ckpt_worker.py"), argv, timeout=400)  # the session's 8-rank launch
    # What a job killed after its step-2 checkpoint leaves behind.
    requeued = root / "at_step2"
    shutil.copytree(root / "save", requeued)
    shutil.rmtree(requeued / "global_step4")
    (requeued / "latest").write_text("global_step2")
    return {"losses": losses(root / "out"), "save": requeued}


@pytest.mark.parametrize(
    "tp,pp,dp",
    [
        (1, 1, 1),
        pytest.param(1, 2, 4, marks=pytest.mark.slow),
        pytest.param(2, 1, 2, marks=pytest.mark.slow),
    ],
)
def test_resume_at_another_layout_continues_the_loss_curve(reference, tp, pp, dp, tmp_path, rank_pool):
    save, out = tmp_path / "save", tmp_path / "out"
    shutil.copytree(reference["save"], save)
    # In the session's launch of tp * pp * dp ranks (8: the reference's own): a resume needs the checkpoint on disk,
    # not processes of its own, and an 8-rank torchrun costs ~2 min of CPU in start-up alone
    argv = ["--save", str(save), "--tp", str(tp), "--pp", str(pp), *RUN]
    p = pooled(rank_pool, tp * pp * dp, out, *argv, timeout=400)
    assert p.returncode == 0, p.stdout[-4000:]
    assert "was written at tp=2, pp=2, dp=2 fp32" in p.stdout and "resuming through a universal checkpoint" in p.stdout
    assert f"to a universal checkpoint in {save}/universal/global_step2-from-tp2pp2dp2fp32" in p.stdout
    result = json.loads((out / "result.json").read_text())
    assert result["start"] == 2 and result["universal"]
    assert result["client_state"] == {"consumed_samples": 16}
    got, want = losses(out), reference["losses"]
    print("universal", got, "\nreference", want)
    assert sorted(got) == [3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= TOL * abs(want[step]), f"step {step}: {got[step]} vs {want[step]}"
    # The run saved at its new layout and dropped the conversion; a restart now resumes natively.
    assert (save / "latest").read_text() == "global_step4"
    assert not list((save / "universal").iterdir())
    manifest = json.loads((save / "global_step4" / "threed_manifest.json").read_text())
    assert manifest["layout"] == {"tp": tp, "pp": pp, "dp": dp}
