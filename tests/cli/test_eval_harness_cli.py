"""`threed eval-harness` end to end on a converted checkpoint (one rank, the tokenizer the checkpoint carried from
its HF source, local tasks, offline): lm-eval's results dict written as JSON with the scores of lm-eval's own HF
backend on the model exported back to HF; and its refusals, each one line before any engine is built.

    .venv/bin/python -m pytest -q tests/cli/test_eval_harness_cli.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from convert_fixtures import GQA4
from harness_fixtures import OFFLINE_ENV, TASKS, model_dir, write_tasks
from helpers import SRC_ENV, own_world_env
from threed.cli.main import main

CONFIG = dict(GQA4, vocab_size=320)
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory, tok_dirs):
    """A model directory with its tokenizer converted at tp1 pp1 and exported back, the local tasks, and a task
    whose data is a hub dataset this machine does not have."""
    root = tmp_path_factory.mktemp("harness_cli")
    hf = model_dir(root / "hf", CONFIG, tok_dirs["plain"])
    assert main(["convert", "--hf", str(hf), "--tp", "1", "--pp", "1", "--out", str(root / "ck"), "--quiet"]) == 0
    assert main(["export", "--ckpt", str(root / "ck"), "--out", str(root / "exported"), "--quiet"]) == 0
    write_tasks(root / "tasks")
    (root / "hub_tasks").mkdir()
    (root / "hub_tasks" / "not_here.yaml").write_text(
        "task: not_here\ndataset_path: threed-tests/no-such-dataset\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{q}}"\ndoc_to_choice: "{{c}}"\ndoc_to_target: 0\n'
    )
    (root / "sp.model").write_bytes(b"not really")
    return root


def env(root) -> dict[str, str]:
    return {**own_world_env(), **SRC_ENV, **OFFLINE_ENV, "HF_DATASETS_CACHE": str(root / "datasets_cache")}


def hf_scores(world) -> dict:
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    from threed.harness.tasks import task_manager

    lm = HFLM(pretrained=str(world / "exported"), dtype="float32", batch_size=8, device="cpu")
    manager = task_manager(TASKS, str(world / "tasks"))
    return evaluator.simple_evaluate(model=lm, tasks=list(TASKS), task_manager=manager, bootstrap_iters=0)["results"]


def test_eval_harness_writes_lm_eval_results_equal_to_hf(world, monkeypatch):
    out = world / "scores.json"
    cmd = [sys.executable, "-m", "threed.cli", "eval-harness", "--load", str(world / "ck"), "--tasks", ",".join(TASKS)]
    cmd += ["--include-path", str(world / "tasks"), "--output", str(out)]
    proc = subprocess.run(cmd, env=env(world), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"threed eval-harness: tiny_mc acc \d\.\d{4}", proc.stdout), proc.stdout[-2000:]
    results = json.loads(out.read_text())
    for k, v in env(world).items():
        monkeypatch.setenv(k, v)
    reference = hf_scores(world)
    for task in TASKS:
        for key, value in reference[task].items():
            if isinstance(value, float):
                got = results["results"][task][key]
                assert abs(got - value) <= REL_TOL * max(abs(value), 1.0), (task, key, got, value)
    assert results["configs"]["tiny_mc"]["output_type"] == "multiple_choice"  # lm-eval's whole results dict


REFUSALS = [
    (["--tasks", "tiny_mc,no_such_task"], r"unknown task 'no_such_task': not an lm-eval task or under --include-path"),
    (["--tasks", ","], r"--tasks names no task"),
    (
        ["--tasks", "not_here", "--include-path", "{root}/hub_tasks"],
        r"could not be loaded and this machine is "
        r"offline .*on a machine with network access run",
    ),  # fmt: skip
    (["--tasks", "tiny_mc", "--load", "{root}/nothing"], r"--load .*nothing: no such directory"),
    (["--tasks", "tiny_mc", "--tokenizer", "{root}/sp.model"], r"lm-eval needs an HF tokenizer .*threed export"),
    (["--tasks", "tiny_mc", "--include-path", "{root}/nothing"], r"--include-path .*nothing: no such directory"),
]


@pytest.mark.parametrize("flags,line", REFUSALS)
def test_bad_input_is_one_line_before_any_engine(world, capsys, monkeypatch, flags, line):
    for k, v in env(world).items():
        monkeypatch.setenv(k, v)
    flags = [f.format(root=world) for f in flags]
    argv = ["eval-harness", "--load", str(world / "ck"), "--include-path", str(world / "tasks")]
    if "--load" in flags:
        argv = [argv[0], *argv[3:]]
    if "--include-path" in flags:
        argv = argv[:-2]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("threed eval-harness: "), err
    assert re.search(line, err[0]), err[0]
    assert not torch.distributed.is_initialized()  # refused before any process group or engine


@pytest.mark.slow  # lm-eval's whole stock index (~18 s, ~40 s on 2 loaded cores) and a read of its task files
def test_a_name_of_the_stock_index_is_never_refused_before_it():
    """The refusal before the stock index (`unmentioned`: no stock file holds the name as text) refuses only what the
    index does not know: every group, tag and Python task lm-eval indexes, and 300 of its YAML tasks (a seeded
    sample: the read is per name), is found written in some file of its tasks folder."""
    import random

    from lm_eval.tasks import TaskManager

    from threed.harness.tasks import quiet_lm_eval, stock_task_dir, unmentioned

    with quiet_lm_eval():
        index = TaskManager().task_index
    tasks = sorted(n for n, e in index.items() if e.kind.name == "TASK")
    names = sorted(n for n, e in index.items() if e.kind.name != "TASK") + random.Random(0).sample(tasks, 300)
    assert len(names) > 1000, len(names)
    assert unmentioned(names, stock_task_dir()) == []
    assert unmentioned(["hellaswag", "no_such_task_x"], stock_task_dir()) == ["no_such_task_x"]


def test_lm_eval_missing_names_the_extra(world, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # what an install without the extra has: ImportError
    assert main(["eval-harness", "--load", str(world / "ck"), "--tasks", "tiny_mc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["threed eval-harness: error: lm-eval is not installed: pip install 'threed[eval]' (the eval extra)"]


def test_results_go_beside_the_checkpoint_by_default(world):
    from threed.harness.run import default_output  # lm-eval: only this test of the file's light ones needs it

    out = default_output(str(world / "ck"))
    tag = (world / "ck" / "latest").read_text().strip()
    assert out.parent == world / "ck" / "harness" and re.fullmatch(rf"{tag}_\d{{8}}-\d{{6}}\.json", out.name)
