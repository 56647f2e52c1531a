"""Issue 39's guard and checkpoint cases, one row each, with a variant of each that the issue does not list: a resume
onto new data (and onto a dataset rewritten in place), a divergence right after a data change (and a non-finite
step after a schedule change), the dead-gradient hint (and the weight-jump one), non-finite weights loaded by
--init-from (and inf by --load), EFBIG during a save (and a real `ulimit -f` during `threed convert` and `threed
preprocess`), an empty `latest` under --init-from (and under `threed export`).

Each row: the exit status (2 for a refusal, 3 for a divergence, 5 for a failed save: the run's own status for it,
0 for a healthy resume), exactly one line naming the problem and the fix, no traceback, and nothing lost on disk
(the sandbox unchanged, `latest` kept, no output left half-written). Refusals come before training: the guard rows
replay the guard in this process; the load rows build a tiny engine and stop before step 1."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch

from helpers import fake_checkpoint, checkpoint_config, own_world_env, tiny_train, tiny_train_argv, write_dataset
from test_bad_inputs import run_cli, snapshot
from threed.checkpoint import save as ckpt
from threed.config import RunControlConfig
from threed.train import guard

LIMIT = 16 * 1024  # the per-file size limit (`ulimit -f 16`) of the EFBIG rows: below every file they write


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A corpus; a one-step run (a full checkpoint) and copies with a NaN / an inf in a block's layer file; a tiny
    HF model, its conversion, and a copy of it whose `latest` is empty."""
    from threed.cli.main import main

    w = tmp_path_factory.mktemp("sweep4")
    corpus = write_dataset(w / "data" / "corpus", np.random.default_rng(0).integers(0, 500, 20000), 512)
    p = tiny_train(corpus, w / "run", "--steps", "1")
    assert p.returncode == 0, p.stderr[-3000:]
    for name, value, layer in (("run_nan", float("nan"), 2), ("run_inf", float("inf"), 3)):
        shutil.copytree(w / "run", w / name)
        poke(w / name / "global_step1", layer, value)
    assert main(["make-tiny-hf", "--out", str(w / "hf"), "--like", "tiny"]) == 0
    argv = ["convert", "--hf", str(w / "hf"), "--tp", "1", "--pp", "1", "--out", str(w / "ckpt")]
    assert main(argv + ["--make-vocab-size-divisible-by", "32", "--quiet"]) == 0
    shutil.copytree(w / "ckpt", w / "ckpt_empty_latest")
    (w / "ckpt_empty_latest" / "latest").write_text("")
    return w


def poke(step_dir: Path, layer: int, value: float) -> None:
    """Put `value` into the first weight of layer file `layer`, keeping the manifest's record of its size true."""
    f = step_dir / f"layer_{layer:02d}-model_00-model_states.pt"
    sd = torch.load(f, map_location="cpu", weights_only=True)
    name = next(k for k, v in sd.items() if isinstance(v, torch.Tensor) and torch.is_floating_point(v))
    sd[name].view(-1)[0] = value
    torch.save(sd, f)
    manifest = json.loads((step_dir / "threed_manifest.json").read_text())
    manifest["files"][f.name] = f.stat().st_size
    (step_dir / "threed_manifest.json").write_text(json.dumps(manifest))


# ----------------------------------------------------------------------------------------------- the guard, replayed


class Engine:
    """What the guard reads of a DeepSpeed engine: the step it resumed at, whether a step was applied, the module."""

    def __init__(self, module: torch.nn.Module | None = None, step: int = 40) -> None:
        self.global_steps = step
        if module is not None:
            self.module = module

    def was_step_applied(self) -> bool:
        return True


def identity(data: str = "/d/easy", lr: float = 3e-3, content: str = "sha256:a") -> dict:
    return {
        "data": {"split": "100,0,0", "blend": [[None, data, content]]},
        "schedule": {"kind": "cosine", "lr": lr, "min_lr": 3e-5, "warmup_steps": 0, "decay_end": 100},
        "init": None,
    }


def replay(save: Path, now: dict, losses: list[tuple[float, float]], module=None, **control) -> tuple[int, str]:
    """40 easy steps (loss ~0.3) saved with `identity()`, then a resume with identity `now` that sees `losses`:
    the exit status (3 when the guard stopped it) and what the guard said."""
    ctl = RunControlConfig(watchdog_factor=0, **control)
    first = guard.RunGuard(ctl, str(save), 0, Engine(step=0), None, None, identity())
    for step in range(1, 41):
        first.after_step(step, 0.3 + 0.01 * (step % 3), 0.3)
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        g = guard.RunGuard(ctl, str(save), 0, Engine(module), None, None, now)
        g.load_state(first.state())
        try:
            for step, (loss, norm) in enumerate(losses, start=41):
                g.after_step(step, loss, norm)
        except SystemExit as e:
            return int(e.code), said.getvalue()
    return 0, said.getvalue()


def falling(start: float, n: int = 60) -> list[tuple[float, float]]:
    return [(start - 0.03 * i, 1.0) for i in range(n)]


def guard_row(now: dict, losses: list, module=None, **control) -> Callable:
    def run(w: Path, tmp: Path, capsys) -> tuple[int, str]:
        (tmp / "latest").write_text("global_step40")
        rc, out = replay(tmp, now, losses, module=module, **control)
        assert (tmp / "latest").read_text() == "global_step40"  # a stop saves nothing
        return rc, out

    return run


def jumping(w: Path, tmp: Path, capsys) -> tuple[int, str]:
    """A resume onto new data whose second step multiplies the weights by 1e6 (a step that blew them up)."""
    torch.manual_seed(0)
    net = torch.nn.Linear(16, 16, bias=False)
    original = guard.RunGuard.after_step

    def after_step(self, step, loss, norm, *a, **k):
        if step == 42:
            with torch.no_grad():
                net.weight.mul_(1e6)
        return original(self, step, loss, norm, *a, **k)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(guard.RunGuard, "after_step", after_step)
        return guard_row(identity(data="/d/hard"), [(6.0, 1.0)] * 2, module=net)(w, tmp, capsys)


# --------------------------------------------------------------------------------------------- commands on the world


def threed(args: list[str], limit: int = 0) -> subprocess.CompletedProcess[str]:
    """`threed ARGS` in a process of its own (a world of its own), under a per-file size limit of `limit` bytes
    when given (a real EFBIG: Python ignores SIGXFSZ, so the write fails instead of killing the process)."""
    return subprocess.run(
        [sys.executable, "-m", "threed.cli", *args],
        env=own_world_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None,
    )


def train_row(*flags: str) -> Callable:
    """`threed train` (its own process) of the tiny preset on the corpus; its output."""

    def run(w: Path, tmp: Path, capsys) -> tuple[int, str]:
        given = [f.replace("{w}", str(w)) for f in flags]
        argv = tiny_train_argv(str(w / "data" / "corpus"), tmp / "save", "--steps", "3", *given)
        argv += ["--data-cache-path", str(tmp / "cache")]  # the index caches of this run: not in the sandbox
        p = threed(argv)
        out = p.stdout + p.stderr
        assert "step 1/" not in out, out[-3000:]  # refused before training
        assert not (tmp / "save" / "latest").exists()
        return p.returncode, out

    return run


def cli_row(*argv: str, absent: str = "") -> Callable:
    def run(w: Path, tmp: Path, capsys) -> tuple[int, str]:
        rc, out = run_cli(w, [a.replace("{t}", str(tmp)) for a in argv], capsys)
        assert not absent or not (tmp / absent).exists()
        return rc, out

    return run


def limited_row(*argv: str) -> Callable:
    """`threed ARGV` in its own process under a per-file size limit of LIMIT bytes (a real EFBIG)."""

    def run(w: Path, tmp: Path, capsys) -> tuple[int, str]:
        args = [a.replace("{w}", str(w)).replace("{t}", str(tmp)) for a in argv]
        p = threed(args, LIMIT)
        assert list(tmp.iterdir()) == [], "output left behind"
        return p.returncode, p.stdout + p.stderr

    return run


class Writer:
    def save(self, state_dict, path, *a, **k):
        torch.save(state_dict, path)


class FailingEngine:
    """What threed.checkpoint.save reads of an engine; its save writes one file, then fails with EFBIG."""

    def __init__(self) -> None:
        self.module, self.global_steps, self.checkpoint_engine = torch.nn.Linear(4, 4), 6, Writer()

    def save_checkpoint(self, save_dir, tag, **kw) -> None:
        Path(save_dir, tag).mkdir(parents=True, exist_ok=True)
        self.checkpoint_engine.save({"w": self.module.weight}, f"{save_dir}/{tag}/layer_01-model_00-model_states.pt")
        raise OSError(errno.EFBIG, "File too large", f"{save_dir}/{tag}/mp_rank_00_model_states.pt")


def efbig_save(w: Path, tmp: Path, capsys) -> tuple[int, str]:
    save = tmp / "ck"
    fake_checkpoint(save, 4)
    said = io.StringIO()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**40, hard))  # a limit in force (1 TiB: never reached here)
    try:
        with contextlib.redirect_stderr(said), pytest.raises(SystemExit) as e:
            ckpt.save(FailingEngine(), checkpoint_config(save), 0)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert (save / "latest").read_text() == "global_step4"  # the previous checkpoint stays the one to resume
    return int(e.value.code), said.getvalue()


HARD = identity(data="/d/hard")
ROWS = [
    # (id, run, exit status, the one line: a regex)
    (
        "resume-onto-new-harder-data",  # issue: the loss higher but falling is not a divergence
        guard_row(HARD, falling(6.0)),
        0,
        r"^threed: the resume at step 40 changed the training data \(/d/easy -> /d/hard\): the loss-spike check "
        r"starts a new window",
    ),
    (
        "resume-onto-data-rewritten-in-place",  # variant: same path, another sidecar fingerprint
        guard_row(identity(content="sha256:b"), falling(6.0)),
        0,
        r"changed the training data \(the content of /d/easy changed \(its fingerprint\)\)",
    ),
    (
        "divergence-right-after-a-data-change",  # issue: still stopped, and the change named as the cause
        guard_row(HARD, [(6.0, 1.0)] * 12 + [(60.0, 9.0)] * 3, spike_confirm_steps=3),
        3,
        r"^threed: error: the run diverged at step 55: loss 60.0000 .*The resume at step 40 changed the training "
        r"data \(/d/easy -> /d/hard\), the likely cause: Resume from it with the previous data, or check the new",
    ),
    (
        "non-finite-right-after-an-lr-change",  # variant: another check, another change
        guard_row(identity(lr=1.0), [(float("nan"), 1.0)], skip_nonfinite=0),
        3,
        r"^threed: error: non-finite loss nan .*The resume at step 40 changed the learning-rate schedule \(--lr "
        r"0.003 -> 1\), the likely cause: Resume from it with the previous learning-rate schedule",
    ),
    (
        "dead-gradient-hint",  # issue: the hint said to raise --dead-grad-norm, which makes the check stricter
        guard_row(identity(), [(5.0, 0.0)]),
        3,
        r"gradient norm 0 on a step with loss tokens .*if the run was healthy, lower --dead-grad-norm: the check stops "
        r"a step whose gradient norm is at most it",
    ),
    (
        "weight-jump-hint",  # variant: the other threshold check, whose flag is raised
        jumping,
        3,
        r"the step multiplied the weight norm by 1e\+06 .*if the run was healthy, raise --weight-jump-factor",
    ),
    (
        "init-from-nan-weights",  # issue: told to lower the learning rate
        train_row("--init-from", "{w}/run_nan"),
        2,
        r"^threed: configuration error: checkpoint .*/run_nan/global_step1 holds non-finite weights \(nan in \S+ of "
        r"layer_02-model_00-model_states.pt\).*Start from an earlier checkpoint",
    ),
    (
        "load-inf-weights",  # variant: --load, inf
        train_row("--load", "{w}/run_inf"),
        2,
        r"^threed: configuration error: checkpoint .*/run_inf/global_step1 holds non-finite weights \(inf in \S+ of "
        r"layer_03-model_00-model_states.pt\)",
    ),
    (
        "efbig-during-a-save",  # issue: said as a full disk ("Free space on --save's file system")
        efbig_save,
        5,
        r"^threed: error: saving step 6 failed: rank 0: File too large \(EFBIG\) writing .*a per-file size limit "
        r"stopped the write.*Raise the per-file size limit \(now 1,099,511,627,776 bytes.*then run the same command",
    ),
    (
        "efbig-during-convert",  # variant: a real `ulimit -f` under torch's own writer
        limited_row("convert", "--hf", "{w}/hf", "--tp", "1", "--pp", "1", "--out", "{t}/out", "--quiet"),
        2,
        r"^threed convert: error: .*\(EFBIG\).*raise the per-file size limit \(now 16,384 bytes",
    ),
    (
        "empty-latest-init-from",  # issue: reported as missing layer files
        cli_row(
            "train",
            "--model",
            "tiny",
            "--data-path",
            "{w}/data/corpus",
            "--split",
            "100,0,0",
            "--seq-length",
            "32",
            "--steps",
            "2",
            "--init-from",
            "{w}/ckpt_empty_latest",
            "--save",
            "{t}/save",
            absent="save",
        ),
        2,
        r"init_from=.*ckpt_empty_latest: .*ckpt_empty_latest/latest is empty: it names no checkpoint .*`echo "
        r"global_step0 > .*/latest`\) or delete it",
    ),
    (
        "empty-latest-export",  # variant: another command reading `latest`
        cli_row("export", "--ckpt", "{w}/ckpt_empty_latest", "--out", "{t}/hf", absent="hf"),
        2,
        r"ckpt_empty_latest/latest is empty: it names no checkpoint .* or delete it",
    ),
]


@pytest.mark.usefixtures("own_process_group")
@pytest.mark.parametrize("case,run,status,expected", ROWS, ids=[r[0] for r in ROWS])
def test_sweep4_guard_row(world, tmp_path, capsys, monkeypatch, case, run, status, expected):
    monkeypatch.setenv("RANK", "0")
    before = snapshot(world)
    rc, out = run(world, tmp_path, capsys)
    assert rc == status, f"{case}: exit {rc}\n{out[-3000:]}"
    assert "Traceback" not in out, f"{case}\n{out[-3000:]}"
    said = [line for line in out.splitlines() if re.search(expected, line)]
    assert len(said) == 1, f"{case}: {expected!r} not said once\n{out[-3000:]}"
    others = [line for line in out.splitlines() if re.search(r"\berror\b", line, re.I) and line not in said]
    assert not others, f"{case}: more than one error line: {others}"
    assert snapshot(world) == before, f"{case}: the sandbox changed"


def test_efbig_during_preprocess_is_a_file_size_limit_and_leaves_nothing(corpus, tmp_path):
    """Variant 2 of EFBIG: `threed preprocess` under a real `ulimit -f` (its own writer, not torch's)."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus["docs"] * 4))
    out = tmp_path / "out"
    out.mkdir()
    args = ["preprocess", "--input", str(docs), "--output-prefix", str(out / "p"), "--tokenizer", str(corpus["sp"])]
    p = threed([*args, "--quiet"], LIMIT)
    lines = [line for line in p.stderr.splitlines() if "error" in line]
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(lines) == 1, p.stderr[-3000:]
    assert "(EFBIG)" in lines[0] and "raise the per-file size limit (now 16,384 bytes" in lines[0], lines
    assert list(out.iterdir()) == []


def test_torch_writer_under_a_file_size_limit_is_named_efbig(tmp_path):
    """torch.save's C++ writer gives no errno: under a per-file size limit its RuntimeError is said as that limit."""
    code = (
        "import resource, torch, sys; from threed.errors import os_error_line; "
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({LIMIT}, {LIMIT}))\n"
        f"try:\n torch.save(torch.zeros(100000), {str(tmp_path / 'x.pt')!r})\n"
        "except RuntimeError as e:\n print(os_error_line(e))"
    )
    p = subprocess.run([sys.executable, "-c", code], env=own_world_env(), capture_output=True, text=True, timeout=120)
    assert "under a per-file size limit of 16,384 bytes: the limit (EFBIG)" in p.stdout, p.stdout + p.stderr
    assert "the disk is not full" in p.stdout


def test_an_empty_latest_in_save_resumes_from_the_newest_complete_checkpoint_saying_so(tmp_path):
    from helpers import decide

    save = tmp_path / "ck"
    fake_checkpoint(save, 4)
    (save / "latest").write_text("")
    decision = decide(checkpoint_config(save), 2)
    assert decision.mode == "resume" and decision.tag == "global_step4"
    said = [n for n in decision.notes if "latest is empty" in n]
    assert len(said) == 1 and said[0].endswith("resuming from the newest complete checkpoint, global_step4"), said
