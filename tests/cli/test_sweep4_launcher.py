"""Issue 39's launcher / command-line cases, each beside a variant the issue does not list (another recipe variable,
another old module path, another command): old `python -m` paths, the launcher's harness-job checks, slurm scripts
outside Slurm, `threed plan`'s sequence-parallel rule, a flag given by its other command's name, hand-edited data
sidecars. Each row: the exit status, exactly one stderr line that names the problem and the fix (a regex), no
traceback, and the sandbox (and the SAVE it names) untouched. The summaries at cp 2 multiply to their world.

Fast: the launcher's dry runs import no torch, `python -m` refusals happen while Python locates the module, and the
in-process rows only parse (the sidecar rows import torch once, for `check-config --paths`).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/cli/test_sweep4_launcher.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, SRC_ENV
from test_recipes import launch

CHECK = ["check-config", "--world", "1", "--model", "tiny", "--seq-length", "32", "--steps", "2"]
PLAN = ["plan", "--model", "llama3-8b", "--nodes", "1", "--gpu-memory", "80", "--seq-length", "4096"]
HARNESS_8B = {"GPUS_PER_NODE": "8", "SAVE": "{w}/save", "HARNESS_TASKS": "arc_easy"}
# Hand edits of a sidecar's fields (None: the field removed), one dataset prefix each in the sandbox.
SIDECAR_EDITS = {
    "version_text": ("version", "2"),
    "bytes_missing": ("bin.bytes", None),
    "version_newer": ("version", 99),
    "bytes_text": ("bin.bytes", "123"),
    "version_missing": ("version", None),
    "vocab_hash_number": ("tokenizer.vocab_sha256", 12345),
}

ROWS = [
    # --- 1. old module paths: each points at the `threed` sub-command (or the new path that runs), exit 2
    ("m-planner", ("m", "threed.planner", ["--model", "llama31-8b"]), 2, r"threed\.planner moved to threed\.plan"
     r"\.planner, a library module, not a command; run `threed plan \.\.\.` instead"),
    ("m-check-config", ("m", "threed.check_config", CHECK[1:]), 2, r"run `threed check-config \.\.\.` instead"),
    ("m-plan-planner", ("m", "threed.plan.planner", []), 2, r"threed\.plan\.planner is a library module.*threed plan"),
    ("m-cli-check-config", ("m", "threed.cli.check_config", CHECK[1:]), 2, r"is a library module.*threed check-config"),
    # variants: another command's old path, a library path, an old path whose new one runs, a module under one
    ("m-report", ("m", "threed.report", []), 2, r"moved to threed\.metrics\.report.*`threed report \.\.\.`"),
    ("m-flags", ("m", "threed.flags", []), 2, r"threed\.flags moved to threed\.cli\.flags.*`threed --help`"),
    ("m-launch", ("m", "threed.launch", []), 2, r"moved to threed\.parallel\.launch; run `python -m threed\.parallel"),
    ("m-commands-convert", ("m", "threed.commands.convert", []), 2, r"moved to threed\.cli\.convert.*`threed convert"),
    # --- 2. the launcher's harness job (dry runs) and the slurm scripts outside Slurm
    ("launch-harness-limit-0", ("launch", "llama31_8b", {**HARNESS_8B, "HARNESS_LIMIT": "0"}), 2,
     r"HARNESS_LIMIT=0 is below 1: every harness job .* would refuse it.*set HARNESS_LIMIT to 1 or more"),
    ("launch-harness-limit-negative-70b",
     ("launch", "llama31_70b", {**HARNESS_8B, "NNODES": "4", "HARNESS_LIMIT": "-3"}), 2,
     r"HARNESS_LIMIT=-3 is below 1"),
    ("launch-harness-limit-alone", ("launch", "llama31_8b", {"GPUS_PER_NODE": "8", "HARNESS_LIMIT": "200"}), 0,
     r"warning: HARNESS_LIMIT=200 without HARNESS_TASKS does nothing.*set HARNESS_TASKS=a,b .*or unset HARNESS_LIMIT"),
    ("launch-harness-limit-tasks-cleared",
     ("launch", "tiny", {"HARNESS_TASKS": "", "HARNESS_LIMIT": "20", "TOKENIZER": ""}), 0,
     r"warning: HARNESS_LIMIT=20 without HARNESS_TASKS"),
    ("launch-sentencepiece-harness", ("launch", "llama2_7b", {**HARNESS_8B}), 2,
     r"TOKENIZER=\S+tokenizer\.model, a sentencepiece \.model: every harness job would refuse it.*set TOKENIZER to "
     r"the HF tokenizer"),
    ("launch-sentencepiece-tiny", ("launch", "tiny", {"HARNESS_TASKS": "tiny_mc", "SAVE": "{w}/save"}), 2,
     r"TOKENIZER=runs/demo/tok\.model, a sentencepiece \.model"),
    ("slurm-eval-harness-outside", ("slurm", "slurm/eval_harness.sh", ["--load", "{w}/save", "--tasks", "x"]), 2,
     r"not under Slurm \(SLURM_SUBMIT_DIR is not set\): submit it with `sbatch slurm/eval_harness\.sh"),
    ("slurm-train-outside", ("slurm", "slurm/train.sh", ["recipes/tiny.sh"]), 2,
     r"run this with sbatch \(SLURM_JOB_ID is not set\)"),
    # --- 4. the rule a request breaks; a flag given by the other command's name
    ("plan-sp-tp1", ("cli", [*PLAN, "--global-batch-size", "64", "--tp", "1", "--sequence-parallel"]), 2,
     r"--sequence-parallel needs tp > 1 .*drop it or raise --tp"),
    ("memory-sp-tp1",
     ("cli", ["memory", "--model", "tiny", "--tp", "1", "--pp", "1", "--dp", "1", "--micro-batch-size", "1",
              "--grad-accum-steps", "1", "--seq-length", "64", "--sequence-parallel"]), 2,
     r"--sequence-parallel needs tp > 1"),
    ("train-include-path", ("cli", ["train", "--model", "tiny", "--include-path", "{w}/tasks"]), 2,
     r"^threed train: error: unrecognized arguments: --include-path \S+; did you mean --harness-include-path\?"),
    ("eval-harness-harness-limit",
     ("cli", ["eval-harness", "--load", "{w}/save", "--tasks", "x", "--harness-limit", "5"]), 2,
     r"^threed eval-harness: error: unrecognized arguments: --harness-limit 5; did you mean --limit\?"),
    ("check-config-tasks", ("cli", [*CHECK, "--tasks", "a,b"]), 2, r"did you mean --harness-tasks\?"),
    ("train-typo", ("cli", ["train", "--model", "tiny", "--micro-batchsize", "2"]), 2,
     r"did you mean --micro-batch-size\?"),
    # --- 5. hand-edited data sidecars: the field by name and the fix
    ("sidecar-version-text", ("sidecar", "version_text"), 2,
     r"threed\.json: version is '2', not a whole number \(edited by hand, or damaged\); delete \S+ to train the "
     r"data unchecked, or re-run `threed preprocess`"),
    ("sidecar-bytes-missing", ("sidecar", "bytes_missing"), 2, r"bin\.bytes is missing .*re-run `threed preprocess`"),
    ("sidecar-version-newer", ("sidecar", "version_newer"), 2, r"is version 99, newer than this threed reads \(1\); "
     r"update threed, or delete"),
    ("sidecar-bytes-text", ("sidecar", "bytes_text"), 2, r"bin\.bytes is '123', not a whole number of bytes"),
    ("sidecar-version-missing", ("sidecar", "version_missing"), 2, r"version is missing"),
    ("sidecar-vocab-hash-number", ("sidecar", "vocab_hash_number"), 2, r"tokenizer\.vocab_sha256 is 12345, not text"),
]  # fmt: skip


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A folder the rows may name (SAVE, --load, the edited datasets) and must leave as it is."""
    from threed.data.sidecar import sidecar_path, sidecar_text

    w = tmp_path_factory.mktemp("sweep4")
    (w / "data").mkdir()
    for name, (field, value) in SIDECAR_EDITS.items():
        prefix = str(w / "data" / name)
        Path(prefix + ".bin").write_bytes(bytes(range(256)) * 4)
        Path(prefix + ".idx").write_bytes(b"MMIDIDX\x00\x00")  # not read: the sidecar's checks come first
        record = json.loads(sidecar_text(prefix + ".bin", {"name": "t", "vocab_size": 512, "vocab_sha256": "ab"}, {}))
        *path, key = field.split(".")
        where = record
        for part in path:
            where = where[part]
        if value is None:
            del where[key]
        else:
            where[key] = value
        Path(sidecar_path(prefix)).write_text(json.dumps(record))
    return w


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def run_row(w: Path, spec: tuple, capsys) -> tuple[int, str, str]:
    kind, *rest = spec
    sub = lambda a: a.replace("{w}", str(w))  # noqa: E731
    if kind == "m":
        module, args = rest
        p = subprocess.run([sys.executable, "-m", module, *map(sub, args)], env={**os.environ, **SRC_ENV},
                           cwd=w, capture_output=True, text=True, timeout=60)  # fmt: skip
        return p.returncode, p.stdout, p.stderr
    if kind == "launch":
        recipe, env = rest
        p = launch(recipe, {"SAVE": "", **{k: sub(v) for k, v in env.items()}})
        return p.returncode, p.stdout, p.stderr
    if kind == "slurm":
        script, args = rest
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "THREED_ROOT"}
        p = subprocess.run(["bash", str(REPO / script), *map(sub, args)], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
        return p.returncode, p.stdout, p.stderr
    from threed.cli.main import main

    argv = rest[0] if kind == "cli" else [*CHECK, "--paths", "--data-path", str(w / "data" / rest[0])]
    try:
        rc = main([sub(a) for a in argv])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("case,spec,status,message", ROWS, ids=[r[0] for r in ROWS])
def test_each_case_is_one_line_naming_the_fix(sandbox, case, spec, status, message, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    before = snapshot(sandbox)
    rc, out, err = run_row(sandbox, spec, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == status, (case, out, err)
    assert len(lines) == 1 and re.search(message, lines[0]), (case, err)
    assert "Traceback" not in out + err, (case, out, err)
    assert snapshot(sandbox) == before and not (sandbox / "save").exists(), case


def test_the_table_holds_each_case_and_a_variant():
    assert len(ROWS) >= 24 and len({r[0] for r in ROWS}) == len(ROWS)


def test_a_command_module_still_runs_under_python_m(tmp_path):
    """The refusal is for modules that run nothing: a command module (here the launcher's table) runs as before."""
    p = subprocess.run([sys.executable, "-m", "threed.cli.recipe"], env={**os.environ, **SRC_ENV}, cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0 and p.stdout.startswith("MODEL layout --model"), p.stderr


# ------------------------------------------------------------------------------- 3. summaries that add up at cp 2


def world_product(line: str) -> tuple[int, int]:
    """(the world a summary names, the product of the factors it gives for it)."""
    m = re.search(r"world (\d+) = ((?:[a-z]+ \d+ x )*[a-z]+ \d+)", line)
    assert m, line
    product = 1
    for factor in re.findall(r"\d+", m[2]):
        product *= int(factor)
    return int(m[1]), product


def test_check_config_names_cp_in_the_world(capsys):
    from threed.cli.main import main

    assert main(["check-config", "--world", "2", "--model", "tiny", "--cp", "2", "--seq-length", "64"]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert "world 2 = tp 1 x pp 1 x cp 2 x dp 1" in line and world_product(line) == (2, 2), line


def test_the_launchers_dry_run_at_cp_2_adds_up():
    out = launch("tiny", {"GPUS_PER_NODE": "4", "TP": "1", "PP": "1", "CP": "2", "TOKENIZER": ""})
    assert out.returncode == 0, out.stderr
    summary = next(line for line in out.stdout.splitlines() if line.startswith("threed check-config:"))
    assert "x cp 2 x dp 2" in summary and world_product(summary) == (4, 4), summary


def test_the_reports_summary_names_cp(tmp_path):
    """Variant: `threed report`'s summary of a cp 2 run (the run summary records cp; one written before: its config)."""
    from threed.metrics.report import load_run, summary_lines

    step = {"iteration": 1, "samples": 2, "tokens": 128, "lm loss": 5.0, "grad-norm": 0.5}
    step.update({"iteration-time": 0.1, "tokens-per-sec": 1280.0, "throughput": 0.01})
    config = {
        "model": {"name": "tiny"},
        "train": {"steps": 1, "seq_length": 64, "dtype": "fp32"},
        "parallel": {"cp": 2},
    }
    shape = {"tp": 1, "pp": 1, "dp": 1, "world_size": 2, "global_batch_size": 2, "micro_batch_size": 2}
    for name, summary in (("new", {**shape, "cp": 2}), ("old", shape)):  # the summary's cp; an older one's config
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text(json.dumps(step) + "\n")
        (run_dir / "run_config.json").write_text(json.dumps({"config": config, **summary, "grad_accum_steps": 1}))
        line = summary_lines(load_run(str(run_dir)))[1]
        assert "tp 1 x pp 1 x cp 2 x dp 1 = 2 rank(s)" in line, line
