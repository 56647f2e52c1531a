"""`threed eval-harness`'s model (`ThreedLM`) against lm-eval's own HF backend on the same tiny random Llama (fp32),
fully offline, on a local multiple-choice task (30 documents, some choices the model's greedy token) and a
rolling-loglikelihood task (20 documents, some past the 128-token context): every request's (log-probability,
is-greedy) within 1e-5 of HF's, and the same at tp1 pp1 (dp4), tp2 pp2 and tp1 pp2 (dp2); and a generate_until task
(through `threed generate`'s loop) giving HF's texts. One 4-rank launch
(harness_worker.py).

    .venv/bin/python -m pytest -q tests/ranks/test_harness.py
"""

from __future__ import annotations

import json
import os

import pytest

from convert_fixtures import GQA4
from harness_fixtures import GEN_TASK, OFFLINE_ENV, TASKS, add_greedy_choices, model_dir, request_results, write_tasks
from helpers import RANKS
from threed.parallel.launch import run_ranks

CONFIG = dict(GQA4, vocab_size=320)  # room for the 300-piece test tokenizer
REL_TOL = 1e-5
LAYOUTS = ["tp1_pp1", "tp2_pp2", "tp1_pp2"]


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """lm-eval's datasets offline, cached in a folder of this module's (restored after)."""
    env = {**OFFLINE_ENV, "HF_DATASETS_CACHE": str(tmp_path_factory.mktemp("datasets_cache"))}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def hf_reference(model_path, include_path) -> dict:
    """lm-eval's own HF backend (HFLM) on the model directory, every request logged."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    from threed.harness.tasks import task_manager

    lm = HFLM(pretrained=str(model_path), dtype="float32", batch_size=8, device="cpu")
    return evaluator.simple_evaluate(
        model=lm, tasks=[*TASKS, GEN_TASK], log_samples=True,
        task_manager=task_manager([*TASKS, GEN_TASK], str(include_path)),
        bootstrap_iters=0,
    )  # fmt: skip


@pytest.fixture(scope="module")
def harness(tmp_path_factory, tok_dirs, offline):
    root = tmp_path_factory.mktemp("harness")
    path = model_dir(root / "hf", CONFIG, tok_dirs["plain"])
    include = write_tasks(root / "tasks")
    add_greedy_choices(include, path)
    reference = hf_reference(path, include)
    spec = {"config": CONFIG, "model_dir": str(path), "include_path": str(include)}
    (root / "spec.json").write_text(json.dumps(spec))
    run_ranks(4, str(RANKS / "harness_worker.py"), ["--out", str(root), "--spec", str(root / "spec.json")],
              env=offline, timeout=900)  # fmt: skip
    return json.loads((root / "harness.json").read_text()), request_results(reference), reference["results"]


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(b), 1.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multiple_choice_requests_equal_lm_eval_hf(harness, layout):
    ours, theirs, _ = harness
    got, ref = ours[layout]["requests"]["tiny_mc"], theirs["tiny_mc"]
    assert len(got) == len(ref) == 30
    pairs = [(g[0], r[0]) for doc_g, doc_r in zip(got, ref) for g, r in zip(doc_g, doc_r)]
    assert len(pairs) == 120
    worst = max(abs(g[0] - r[0]) / max(abs(r[0]), 1.0) for g, r in pairs)
    print(f"{layout}: tiny_mc worst relative log-prob difference {worst:.2e}")
    assert all(close(g[0], r[0]) for g, r in pairs)
    assert [g[1] for g, _ in pairs] == [r[1] for _, r in pairs]  # is greedy, request by request
    assert sum(r[1] for _, r in pairs) >= 3  # True is compared too, not only False


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rolling_loglikelihood_equals_lm_eval_hf(harness, layout):
    ours, theirs, _ = harness
    got, ref = ours[layout]["requests"]["tiny_ppl"], theirs["tiny_ppl"]
    assert len(got) == len(ref) == 20
    pairs = [(g[0][0], r[0][0]) for g, r in zip(got, ref)]  # resps: [[log-prob]] per document
    assert all(close(g, r) for g, r in pairs), pairs[:5]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generate_until_equals_lm_eval_hf(harness, layout):
    ours, theirs, _ = harness
    got, ref = ours[layout]["requests"][GEN_TASK], theirs[GEN_TASK]
    assert len(got) == len(ref) == 12
    assert got == ref  # the texts, cut at the first stop string
    assert sum(len(r[0]) > 0 for r in ref) >= 6  # most generated something before a stop string


def test_scores_equal_lm_eval_hf_at_every_layout(harness):
    ours, _, scores = harness
    for layout in LAYOUTS:
        for task in [*TASKS, GEN_TASK]:
            for key, value in scores[task].items():
                if isinstance(value, float):
                    assert close(ours[layout]["results"][task][key], value), (layout, task, key)
