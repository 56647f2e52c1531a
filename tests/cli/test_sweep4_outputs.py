"""Issue 39's generate / eval-harness cases, one row each, plus a variant of each the issue does not list: outputs
checked before the work (read-only, a directory, a missing folder, the default CKPT/harness/ of a read-only
checkpoint), a late write failure that keeps what was computed, a --tokenizer that is not the checkpoint's, values
that cannot work (--num-fewshot -1, --limit inf / nan / 0), a prompts file that is not UTF-8, a sentencepiece
tokenizer with --harness-interval during training, a prompt longer than the context, a broken task YAML or a
missing `include:`, a missing local data file. Every row: exit status 2, exactly one line on stderr naming the
problem and the fix, no traceback, nothing changed on disk, and no process group (refused before any engine).

    .venv/bin/python -m pytest -q tests/cli/test_sweep4_outputs.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from convert_fixtures import GQA4
from harness_fixtures import MC_YAML, OFFLINE_ENV, model_dir, write_tasks
from test_bad_inputs import snapshot
from threed.cli.main import main

CONFIG = dict(GQA4, vocab_size=320)  # room for the 300-piece test tokenizer; context 128


@pytest.fixture(scope="module")
def world(tmp_path_factory, tok_dirs):
    """A converted checkpoint carrying its HF source's tokenizer (hf/), the local tasks, broken task folders, and
    the files the rows give: prompts that are not UTF-8, one too long, a sentencepiece-named tokenizer."""
    root = tmp_path_factory.mktemp("sweep4")
    hf = model_dir(root / "hf", CONFIG, tok_dirs["plain"])
    assert main(["convert", "--hf", str(hf), "--tp", "1", "--pp", "1", "--out", str(root / "ck"), "--quiet"]) == 0
    write_tasks(root / "tasks")
    (root / "broken").mkdir()
    (root / "broken" / "broken_task.yaml").write_text("task: broken_task\ndataset_path: [json\n")
    (root / "broken" / "stem_only.yaml").write_text("task: [stem_only\n")
    (root / "noinclude").mkdir()
    (root / "noinclude" / "inc_task.yaml").write_text("include: _base.yaml\ntask: inc_task\n")
    (root / "nodata").mkdir()
    (root / "nodata" / "tiny_mc.yaml").write_text(MC_YAML.format(data=root / "nodata" / "gone.jsonl"))
    (root / "nodata" / "split_mc.yaml").write_text(
        MC_YAML.replace("tiny_mc", "split_mc").format(data=root / "nodata" / "gone_too.jsonl")
    )
    (root / "latin1.jsonl").write_bytes('{"prompt": "café"}\n'.encode("latin-1"))
    (root / "utf16.jsonl").write_bytes('{"prompt": "x"}\n'.encode("utf-16"))
    (root / "long.jsonl").write_text(json.dumps({"prompt": "hello world " * 200}) + "\n")
    (root / "long2.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "a b " * 300}) + "\n")
    (root / "file").write_text("a file where a folder is expected\n")
    (root / "outdir").mkdir()
    (root / "sp.model").write_bytes(b"a sentencepiece model, by its name")
    return root


@pytest.fixture
def offline(world, monkeypatch):
    for k, v in {**OFFLINE_ENV, "HF_DATASETS_CACHE": str(world / "datasets_cache"), "RANK": "0"}.items():
        monkeypatch.setenv(k, v)


def read_only(monkeypatch, *folders: Path) -> None:
    """The folders as a read-only mount shows them (the tests run as root, whom a chmod does not stop)."""
    real = os.access
    names = {str(f) for f in folders}
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if str(p) in names else real(p, mode, **kw))


GEN = ["generate", "--load", "{w}/ck", "--max-new-tokens", "4"]
HAR = ["eval-harness", "--load", "{w}/ck", "--include-path", "{w}/tasks", "--tasks", "tiny_mc"]
TRAIN = ["check-config", "--model", "tiny", "--data-path", "{w}/no-data", "--world", "1", "--paths"]
SAMPLES = ["--generate-interval", "5", "--generate-prompts"]

# (id, argv, the folders shown read-only, a regex the one line matches). "variant" ids: not listed in the issue.
ROWS = [
    # 1. every output checked before the work
    ("gen-output-read-only", GEN + ["--prompt", "x", "--output", "{w}/outdir/o.jsonl"], ["outdir"], r"not writable"),
    ("variant-harness-output-read-only", HAR + ["--output", "{w}/outdir/s.json"], ["outdir"], r"outdir is not writ"),
    ("gen-output-is-directory", GEN + ["--prompt", "x", "--output", "{w}/outdir"], [], r"is a directory; give a file"),
    ("variant-harness-output-is-directory", HAR + ["--output", "{w}/outdir"], [], r"is a directory; give a file"),
    ("gen-output-no-parent", GEN + ["--prompt", "x", "--output", "{w}/no/o.jsonl"], [], r"does not exist; create it"),
    ("variant-harness-output-no-parent", HAR + ["--output", "{w}/no/s.json"], [], r"does not exist; create it"),
    ("harness-default-output-read-only-ckpt", HAR, ["ck"], r"default place .*not writable.* with --output FILE.json"),
    ("variant-gen-output-under-a-file", GEN + ["--prompt", "x", "--output", "{w}/file/o.jsonl"], [], r"is a file, not"),
    # 2. identities: a tokenizer that is not the checkpoint's
    ("gen-other-tokenizer", GEN + ["--prompt", "x", "--tokenizer", "{tok}"], [], r"not the tokenizer .*--allow-other"),
    ("variant-harness-other-tokenizer", HAR + ["--tokenizer", "{tok}"], [], r"not the tokenizer .*--allow-other-tok"),
    # 3. values that cannot work
    ("harness-num-fewshot-negative", HAR + ["--num-fewshot", "-1"], [], r"--num-fewshot -1: .*give 0 or more"),
    ("harness-limit-inf", HAR + ["--limit", "inf"], [], r"--limit inf cannot be scored; give a whole number"),
    ("variant-harness-limit-nan", HAR + ["--limit", "nan"], [], r"--limit nan cannot be scored; .*fraction"),
    ("variant-harness-limit-zero", HAR + ["--limit", "0"], [], r"--limit 0 cannot be scored"),
    ("variant-harness-limit-negative", HAR + ["--limit", "-3"], [], r"--limit -3 cannot be scored"),
    ("variant-harness-limit-2.5", HAR + ["--limit", "2.5"], [], r"--limit 2.5 cannot be scored"),
    ("gen-prompts-not-utf8", GEN + ["--prompts", "{w}/latin1.jsonl"], [], r"latin1.jsonl:1: not UTF-8 .*iconv"),
    (
        "variant-gen-prompts-utf16",
        GEN + ["--prompts", "{w}/utf16.jsonl"],
        [],
        r"utf16.jsonl:1: not UTF-8 .*0xff.*iconv -f utf-16",
    ),
    ("train-prompts-not-utf8", TRAIN + ["--tokenizer", "{w}/ck/hf"] + SAMPLES + ["{w}/latin1.jsonl"], [], r"not UTF"),
    (
        "train-sentencepiece-with-harness",
        TRAIN + ["--tokenizer", "{w}/sp.model", "--harness-interval", "5", "--harness-tasks", "tiny_mc"],
        [],
        r"--harness-interval needs an HF tokenizer.*sp.model is a sentencepiece .*threed export",
    ),
    (
        "variant-train-sentencepiece-with-harness-and-generate",
        TRAIN
        + ["--tokenizer", "{w}/sp.model", "--harness-interval", "5", "--harness-tasks", "tiny_mc"]
        + SAMPLES
        + ["{w}/long2.jsonl"],
        [],
        r"--harness-interval needs an HF tokenizer",
    ),  # fmt: skip
    ("gen-prompt-past-context", GEN + ["--prompts", "{w}/long.jsonl"], [], r"no new token fits; shorten the prompt"),
    ("variant-gen-second-prompt-past", GEN + ["--prompts", "{w}/long2.jsonl"], [], r"prompt 2 has \d+ tokens, .*short"),
    (
        "harness-broken-task-yaml",
        HAR[:4] + ["{w}/broken", "--tasks", "broken_task"],
        [],
        r"task 'broken_task' is in .*broken_task.yaml, which does not load: lm-eval cannot read it",
    ),
    (
        "variant-harness-broken-yaml-by-file-name",
        HAR[:4] + ["{w}/broken", "--tasks", "stem_only"],
        [],
        r"stem_only.yaml, which does not load",
    ),
    (
        "harness-include-missing",
        HAR[:4] + ["{w}/noinclude", "--tasks", "inc_task"],
        [],
        r"inc_task.yaml, which does not load: its include: .*_base.yaml does not exist",
    ),
    (
        "harness-data-file-missing",
        HAR[:4] + ["{w}/nodata", "--tasks", "tiny_mc"],
        [],
        r"its data file .*gone.jsonl \(dataset_kwargs.data_files in .*tiny_mc.yaml\) does not exist; fix the path",
    ),
    (
        "variant-harness-second-task-data-missing",
        HAR[:4] + ["{w}/nodata", "--tasks", "split_mc"],
        [],
        r"task 'split_mc': its data file .*gone_too.jsonl",
    ),
]


@pytest.mark.parametrize("case,argv,ro,line", ROWS, ids=[r[0] for r in ROWS])
def test_refused_in_one_line_before_the_work(world, tok_dirs, offline, monkeypatch, capsys, case, argv, ro, line):
    read_only(monkeypatch, *(world / f for f in ro))
    before = snapshot(world)
    argv = [a.replace("{w}", str(world)).replace("{tok}", tok_dirs["llama3"]) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse: would be a usage dump, not one line
        rc = e.code
    out = capsys.readouterr()
    err = [x for x in out.err.splitlines() if x.strip()]
    assert rc == 2, f"{case}: exit {rc}\n{out.out[-2000:]}{out.err[-2000:]}"
    assert "Traceback" not in out.out + out.err, out.err[-3000:]
    assert len(err) == 1, f"{case}: {err}"
    assert re.search(line, err[0]), f"{case}: {err[0]!r} does not match {line!r}"
    assert snapshot(world) == before, f"{case}: the files changed"
    assert not torch.distributed.is_initialized()


def test_the_checkpoints_own_tokenizer_and_an_intended_other_pass(world, tok_dirs):
    """The refusal's counterpart: the recorded tokenizer at another path (the same pieces: compared, equal) passes,
    and so does another one with the flag."""
    from threed.generate.prompts import check_tokenizer, pinned_checkpoint

    model = pinned_checkpoint(str(world / "ck"), None, None)[0]
    check_tokenizer(str(world / "ck"), tok_dirs["plain"], model, allow=False)
    check_tokenizer(str(world / "ck"), tok_dirs["llama3"], model, allow=True)


def test_a_late_write_failure_keeps_the_results(world, tmp_path, monkeypatch):
    """The output's folder turned unwritable while the work ran: the text goes to the temporary directory, then
    (that failing too) the working directory, and the one line names where; nothing half written is left."""
    import threed.generate.prompts as prompts

    real = prompts.write_atomic
    target = tmp_path / "gone" / "out.jsonl"
    (tmp_path / "gone").mkdir()

    def failing(path, data):
        if Path(path).parent == target.parent:
            raise PermissionError(13, "Permission denied")
        real(path, data)

    monkeypatch.setattr(prompts, "write_atomic", failing)
    monkeypatch.setattr(prompts.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    problem = prompts.keep_output(str(target), "line\n", "continuations")
    kept = Path(re.search(r"kept in (\S+):", problem).group(1))
    assert kept.parent == tmp_path / "tmp" and kept.read_text() == "line\n", problem
    assert "could not write" in problem and "Permission denied" in problem
    assert list((tmp_path / "gone").iterdir()) == []

    # variant: the temporary directory is not writable either (a file stands where it should be): the working one
    monkeypatch.setattr(prompts.tempfile, "gettempdir", lambda: str(world / "file"))
    monkeypatch.chdir(tmp_path)
    problem = prompts.keep_output(str(target), "line\n", "scores")
    kept = Path(re.search(r"kept in (\S+):", problem).group(1))
    assert kept.parent == tmp_path and kept.read_text() == "line\n", problem


def test_harness_results_name_the_tag_pinned_at_the_start(world):
    """`latest` moving while scoring (a run still saving) changes neither the tag loaded nor the results' name."""
    from threed.checkpoint.format import step_of
    from threed.generate.prompts import pinned_checkpoint
    from threed.harness.run import HarnessRequest, scored  # lm-eval: the eval extra, in the dev environment
    from threed.harness.tasks import default_output

    model, tp, pp, tag = pinned_checkpoint(str(world / "ck"), None, None)
    request = HarnessRequest(load=str(world / "ck"), model=model, tp=tp, pp=pp, tasks=["t"], tokenizer="t", tag=tag)
    latest = world / "ck" / "latest"
    saved = latest.read_text()
    try:
        latest.write_text("global_step999")  # a newer save, as a training run writes it
        assert scored(request) == {"checkpoint": str((world / "ck").resolve()), "tag": tag, "step": step_of(tag)}
        assert default_output(request.load, request.tag).name.startswith(f"{tag}_")
    finally:
        latest.write_text(saved)
