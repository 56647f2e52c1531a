"""Faults on 2 gloo ranks (tp1 pp2, fp32; tests/ranks/ckpt_worker.py): kill -9 of one rank or of every rank at points of
a save, then the same command resumes, and the losses and final weights are bit-identical to an uninterrupted
run; a diverging run stops with exit 3 naming the step and the last good checkpoint and saves nothing after it;
--skip-nonfinite skips the batch; the watchdog prints every rank's stacks and exits 4. --async-save: kills in its
background writer (after a file, and part way through one), a bug in the writer (every rank exits 5, one line), and
the host memory its copies take against the memory model's figure.

`make test` runs the reference (in the session's 2-rank launch, tests/ranks/rank_pool.py) and the checks on its
checkpoint; the kill points, divergence, --skip-nonfinite and the watchdog are marked slow (`make test-slow`). A run
whose kill or exit status is the point (the killed run, divergence, the watchdog) is a torchrun of its own, whose exit
status and output the test judges; a run that must simply succeed (the resume after a kill, --skip-nonfinite) runs
in the session's 2-rank launch (`pooled`), which spares each such run two ranks' start-up (~15 s each on 2 busy
cores). tests/unit/test_checkpoint_guard.py checks the guard's skip / stop / time-budget logic without ranks."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from helpers import RANKS
from threed.parallel.launch import torchrun_command

WORKER = str(RANKS / "ckpt_worker.py")
RUN = ["--pp", "2", "--steps", "6", "--save-interval", "2"]


def worker(nproc: int, out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        torchrun_command(nproc, WORKER, ["--out", str(out), *args]),
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
    )


def pooled(rank_pool, nproc: int, out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`worker`'s run in the session's launch of `nproc` ranks, for a run that must succeed: its stdout is what the
    ranks printed, and a failure raises RanksFailed with the worker's traceback and the output's tail."""
    return rank_pool.run(nproc, WORKER, ["--out", str(out), *args], timeout=timeout)


def losses(out: Path) -> dict[int, float]:
    """Loss per step; a resumed run rewrites the steps after its checkpoint (the last line of a step wins)."""
    by_step: dict[int, float] = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        rec = json.loads(line)
        by_step[rec["step"]] = rec["loss"]
    return by_step


def weights(out: Path, nproc: int = 2) -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"weights_rank{r}.pt") for r in range(nproc)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, rank_pool):
    """The uninterrupted run, in the session's 2-rank launch (the fault tests judge their own runs' exit status)."""
    root = tmp_path_factory.mktemp("reference")
    out, save = root / "out", root / "save"
    rank_pool.run(2, WORKER, ["--out", str(out), "--save", str(save), *RUN, "--record-io"], timeout=240)
    return {"losses": losses(out), "weights": weights(out), "save": save, "out": out}


@pytest.fixture(scope="module")
def async_reference(tmp_path_factory, rank_pool):
    """The same run saving with --async-save."""
    root = tmp_path_factory.mktemp("async_reference")
    out, save = root / "out", root / "save"
    rank_pool.run(2, WORKER, ["--out", str(out), "--save", str(save), *RUN, "--async-save", "--record-io"], timeout=240)
    return {"losses": losses(out), "weights": weights(out), "save": save, "out": out}


KILLS = [
    "file1:4:1",  # rank 1, after its first file of the step-4 save
    pytest.param("latest:4:0", marks=pytest.mark.slow),  # after the manifest, before `latest`: step 4 is used
    pytest.param("file1:4:all", marks=pytest.mark.slow),  # every rank after its first file
    pytest.param("ds:4:0", marks=pytest.mark.slow),  # every file written, rank 0 killed before the manifest
    pytest.param("prune:4:0", marks=pytest.mark.slow),  # after `latest`, before pruning
    pytest.param("file1:2:all", marks=pytest.mark.slow),  # the very first save: no checkpoint yet, starts over
    # --async-save: killed inside the background writer, after its first file of the step-4 save, while training
    # has gone on to step 5 (the worker holds background writes until the next step)
    pytest.param("async:file1:4:1", marks=pytest.mark.slow),
    pytest.param("async:file1:4:all", marks=pytest.mark.slow),
    # --async-save: killed inside the background writer part way through a file (its first bytes flushed, the file
    # under its staging name), on one rank and on every rank
    pytest.param("async:mid:4:1", marks=pytest.mark.slow),
    pytest.param("async:mid:4:all", marks=pytest.mark.slow),
]


@pytest.mark.slow  # fault injection (~30-90 s each): make test-slow
@pytest.mark.parametrize("kill", KILLS)
def test_kill_during_save_then_same_command_resumes_bit_identical(reference, kill, tmp_path, rank_pool):
    save, out = tmp_path / "save", tmp_path / "out"
    mode = ["--async-save"] if kill.startswith("async:") else []
    killed = worker(2, out, "--save", str(save), *RUN, *mode, "--kill", kill.removeprefix("async:"))
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout, killed.stdout[-3000:]
    if kill.startswith("async:mid:"):  # the kill came mid-file: a torn file under a staging name, none in place
        torn = [f for f in (save / "global_step4").glob(".threed-writing-*/*") if f.is_file()]
        assert torn and all(f.stat().st_size >= 16 * 1024 for f in torn), torn
        assert not any((save / "global_step4" / f.name).exists() for f in torn), torn
        assert (save / "latest").read_text() == "global_step2"
    # The same command, in the session's launch: what resumes is the checkpoint on disk, not the processes
    resumed = pooled(rank_pool, 2, out, "--save", str(save), *RUN, *mode)
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    start = json.loads((out / "result.json").read_text())["start"]
    expected_start = {
        "file1:4:1": 2,
        "latest:4:0": 4,
        "file1:4:all": 2,
        "ds:4:0": 2,
        "prune:4:0": 4,
        "file1:2:all": 0,
        "mid:4:1": 2,
        "mid:4:all": 2,
    }[kill.removeprefix("async:")]
    assert start == expected_start, resumed.stdout[-3000:]
    if expected_start == 2:
        assert "skipping checkpoint" in resumed.stdout and "global_step4" in resumed.stdout
    assert losses(out) == reference["losses"]
    for got, want in zip(weights(out), reference["weights"]):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (save / "latest").read_text() == "global_step6"


def test_manifest_names_every_file_of_every_rank_with_its_size(reference):
    step_dir = reference["save"] / "global_step6"
    manifest = json.loads((step_dir / "threed_manifest.json").read_text())
    on_disk = {f.name: f.stat().st_size for f in step_dir.iterdir() if f.name != "threed_manifest.json"}
    assert manifest["files"] == on_disk and len(on_disk) == 7 + 2 + 2  # layers, mp_rank x pp, optimizer shards
    assert manifest["layout"] == {"tp": 1, "pp": 2, "dp": 1} and manifest["client_state"] == {"consumed_samples": 48}


@pytest.mark.parametrize("run", ["reference", "async_reference"])
def test_every_file_and_directory_is_flushed_before_latest_names_it(run, request):
    """Issue 37, durability: between one move of `latest` and the next, some rank fsynced every file the new
    checkpoint's manifest names, its tag directory and the save directory, all before `latest` was replaced (a power
    cut after it must not find a file the manifest vouches for still in the page cache). Both ranks' logs share
    one clock (CLOCK_MONOTONIC). The same of --async-save's background writes, which fsync each file in a staging
    folder beside it and rename it into place."""
    ran = request.getfixturevalue(run)
    save = ran["save"].resolve()
    events = [json.loads(line) for r in (0, 1) for line in (ran["out"] / f"io_rank{r}.jsonl").open()]
    events.sort(key=lambda e: e["ns"])
    moves = [e["ns"] for e in events if e["op"] == "replace" and e["path"] == str(save / "latest")]
    tags = ["global_step2", "global_step4", "global_step6"]
    assert len(moves) == len(tags), moves
    for begin, end, tag in zip([0, *moves], moves, tags):
        flushed = {e["path"] for e in events if e["op"] == "fsync" and begin < e["ns"] < end}
        files = json.loads((save / tag / "threed_manifest.json").read_text())["files"]
        assert len(files) == 11  # every layer, mp_rank and optimizer file of both ranks
        renamed = {e["path"] for e in events if e["op"] == "replace" and begin < e["ns"] < end}
        staged = {str(Path(p).parent.parent / Path(p).name) for p in flushed if Path(p).parent.name.startswith(".")}
        durable = flushed | (staged & renamed)
        unflushed = [name for name in files if str(save / tag / name) not in durable]
        assert not unflushed, f"{tag}: not fsynced before `latest` named it: {unflushed}"
        assert str(save / tag) in flushed and str(save) in flushed, tag


def tensors_equal(a, b, where: str = "") -> None:
    """Two loaded checkpoint files hold the same tensors and the same other values (the run config recorded in
    the model states says whether the save was asynchronous: that one entry is left out)."""
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            if k != "threed_run":
                tensors_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            tensors_equal(x, y, f"{where}[{i}]")
    elif type(a).__module__ == "builtins":
        assert a == b, where


def test_async_save_writes_what_a_synchronous_save_writes(reference, async_reference):
    """Issue 37, exact: the run saving asynchronously has the synchronous run's losses, and at every saved step its
    files hold the same tensors (on CPU the layer and optimizer files are the same bytes)."""
    assert async_reference["losses"] == reference["losses"]
    for tag in ("global_step2", "global_step4", "global_step6"):
        sync, asyn = reference["save"] / tag, async_reference["save"] / tag
        files = json.loads((sync / "threed_manifest.json").read_text())["files"]
        assert json.loads((asyn / "threed_manifest.json").read_text())["files"].keys() == files.keys()
        for name in files:
            a, b = torch.load(sync / name, weights_only=False), torch.load(asyn / name, weights_only=False)
            tensors_equal(a, b, f"{tag}/{name}")
            if not name.startswith("mp_rank"):
                assert (sync / name).read_bytes() == (asyn / name).read_bytes(), name


def test_resume_from_an_async_checkpoint_continues_bit_identical(reference, async_reference, tmp_path, rank_pool):
    """Resumed from the asynchronously written step-4 checkpoint (step 6's removed), the run continues the
    uninterrupted losses and ends with its weights, bit for bit."""
    import shutil

    save, out = tmp_path / "save", tmp_path / "out"
    shutil.copytree(async_reference["save"], save)
    shutil.rmtree(save / "global_step6")
    (save / "latest").write_text("global_step4")
    rank_pool.run(2, WORKER, ["--out", str(out), "--save", str(save), *RUN, "--async-save"], timeout=240)
    assert json.loads((out / "result.json").read_text())["start"] == 4
    assert losses(out) == {s: loss for s, loss in reference["losses"].items() if s > 4}
    for got, want in zip(weights(out), reference["weights"]):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_bug_in_the_background_writer_ends_every_rank_with_one_line(tmp_path, rank_pool):
    """Issue 37: rank 1's background writer raises a ValueError (not a failed write) at its first file of the
    step-4 save. Every rank ends at a later step boundary with exit 5 (no rank left waiting in a collective), rank 0
    says one line naming the rank, the file, the exception and where it was raised, nothing prints a traceback,
    and `latest` still names step 2."""
    save, out = tmp_path / "save", tmp_path / "out"
    run = ["--out", str(out), "--save", str(save), *RUN, "--async-save", "--writer-bug", "4:1"]
    p = rank_pool.run(2, WORKER, run, timeout=240)
    assert [json.loads((out / f"exit_rank{r}.json").read_text())["code"] for r in (0, 1)] == [5, 5]
    lines = [line for line in p.stdout.splitlines() if "threed: error: saving step 4 failed" in line]
    assert len(lines) == 1, p.stdout[-3000:]
    assert f"rank 1: the background writer failed writing {save}/global_step4/layer_" in lines[0], lines[0]
    assert "ValueError: injected bug in the writer (raised at ckpt_worker.py:" in lines[0], lines[0]
    assert f"`latest` still names {save}/global_step2" in lines[0] and "drop --async-save" in lines[0], lines[0]
    assert "Traceback" not in p.stdout, p.stdout[-3000:]
    assert (save / "latest").read_text() == "global_step2" and not (save / "global_step6").exists()


def test_the_memory_models_host_copy_is_what_async_save_copies(async_reference):
    """Issue 37: the host memory the memory model counts for --async-save on each rank (threed.memory.model,
    what `threed memory` and `threed check-config` report) is within 10% of the bytes the rank's save of step 2
    copied, and the refusal's figure (threed.checkpoint.async_save.copy_bytes) is the model's."""
    for r in (0, 1):
        got = json.loads((async_reference["out"] / f"host_copy_rank{r}.json").read_text())
        assert got["refusal"] == got["model"] > 0, got
        assert abs(got["model"] / got["copied"] - 1) < 0.10, got


def test_truncated_file_falls_back_to_the_previous_checkpoint(reference, tmp_path):
    from threed.checkpoint.manifest import find_resumable

    save = tmp_path / "save"
    import shutil

    shutil.copytree(reference["save"], save)
    layer = save / "global_step6" / "layer_03-model_00-model_states.pt"
    layer.write_bytes(layer.read_bytes()[:1000])
    found, warnings = find_resumable(str(save))
    assert found.tag == "global_step4"
    assert "layer_03-model_00-model_states.pt is 1000 bytes" in warnings[0]


@pytest.mark.slow  # fault injection (~30-90 s each): make test-slow
def test_divergence_stops_loudly_without_saving(tmp_path):
    save, out = tmp_path / "save", tmp_path / "out"
    p = worker(2, out, "--save", str(save), *RUN, "--poison-step", "3")
    assert p.returncode != 0
    assert "exitcode  : 3" in p.stdout, p.stdout[-3000:]
    lines = [line for line in p.stdout.splitlines() if "threed: error: non-finite" in line]
    assert len(lines) == 1, p.stdout[-3000:]  # once, from rank 0
    assert "at step 3" in lines[0] and f"Last good checkpoint: {save}/global_step2" in lines[0]
    assert "--skip-nonfinite" in lines[0]
    assert (save / "latest").read_text() == "global_step2"
    assert sorted(d.name for d in save.glob("global_step*")) == ["global_step2"]


@pytest.mark.slow
def test_skip_nonfinite_skips_the_batch_and_goes_on(reference, tmp_path, rank_pool):
    out = tmp_path / "out"
    p = pooled(rank_pool, 2, out, *RUN, "--poison-step", "3", "--skip-nonfinite", "1")
    assert p.returncode == 0, p.stdout[-3000:]
    assert p.stdout.count("the optimizer step was skipped (weights unchanged); 1 of --skip-nonfinite 1") == 1
    got = losses(out)
    assert got[2] == reference["losses"][2] and got[3] != got[3]  # step 3's loss is NaN
    assert all(got[s] == got[s] for s in (4, 5, 6))  # and training goes on from unchanged weights


@pytest.mark.slow  # fault injection (~30-90 s each): make test-slow
def test_watchdog_prints_every_ranks_stacks_and_exits(tmp_path):
    t0 = time.time()
    p = worker(2, tmp_path / "out", *RUN, "--sleep-step", "3", "--watchdog-min-seconds", "3")
    assert p.returncode != 0
    assert time.time() - t0 < 60
    for rank in (0, 1):
        assert f"threed: watchdog: rank {rank}: step 3 has run for" in p.stdout, p.stdout[-3000:]
    assert "exitcode  : 4" in p.stdout
    assert 'File "' in p.stdout and "Thread 0x" in p.stdout  # faulthandler's dump of every thread
    # (Whether rank 0's own dump, "in slow", makes it out depends on which watchdog fires first: under load the
    # waiting rank's can, and torchrun then stops rank 0 mid-dump. Not asserted, to keep the test deterministic.)
