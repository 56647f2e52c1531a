"""`threed eval-harness`'s model (`ThreedLM`) against lm-eval's own HF backend on the same tiny random Llama (fp32),
fully offline, on a local multiple-choice task (30 documents, some choices the model's greedy token) and a
rolling-loglikelihood task (20 documents, some past the 128-token context): every request's (log-probability,
is-greedy) within 1e-5 of HF's, and the same at tp1 pp1 (dp4), tp2 pp2 and tp1 pp2 (dp2); and a generate_until task
(through `threed generate`'s loop) giving HF's texts. The same request parity through `threed eval-harness`'s rank
code for a tied model (Llama 3.2's layout, converted, scored at tp2 pp2) and a checkpoint trained a few steps with
packed SFT (scored at tp2 pp2), each against HF on its HF directory (the source; `threed export`'s output). One
4-rank run (harness_worker.py).

    .venv/bin/python -m pytest -q tests/ranks/test_harness.py
"""

from __future__ import annotations

import json
import os

import pytest

import shutil
from pathlib import Path

from convert_fixtures import GQA4, TIED, TIED_DIVISIBLE_BY, save_tied_hf
from harness_fixtures import GEN_TASK, OFFLINE_ENV, TASKS, add_greedy_choices, model_dir, request_results, write_tasks
from helpers import RANKS, sft_examples, write_sft_dataset
from threed.cli.main import main

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


def hf_reference(model_path, include_path, tasks=(*TASKS, GEN_TASK)) -> dict:
    """lm-eval's own HF backend (HFLM) on the model directory, every request logged."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM

    from threed.harness.tasks import task_manager

    lm = HFLM(pretrained=str(model_path), dtype="float32", batch_size=8, device="cpu")
    return evaluator.simple_evaluate(
        model=lm, tasks=list(tasks), log_samples=True, task_manager=task_manager(list(tasks), str(include_path)),
        bootstrap_iters=0,
    )  # fmt: skip


def tied_checkpoint(root: Path, tokenizer_dir: str) -> tuple[Path, Path]:
    """A random tied HF Llama (no lm_head.weight in its files) with the test tokenizer, and its `threed convert`
    checkpoint at tp2 pp2 (the tied weight on both stages)."""
    hf = save_tied_hf(root / "tied_hf", dict(TIED))
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, hf / f.name)
    ckpt = root / "tied_ckpt"
    argv = ["convert", "--hf", str(hf), "--tp", "2", "--pp", "2", "--out", str(ckpt), "--quiet"]
    assert main([*argv, "--make-vocab-size-divisible-by", TIED_DIVISIBLE_BY]) == 0
    return hf, ckpt


def exported(ckpt: Path, out: Path, tokenizer_dir: str) -> Path:
    """`threed export` of the SFT-trained checkpoint: the HF directory lm-eval's HF backend scores."""
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out), "--tokenizer", tokenizer_dir, "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def harness(tmp_path_factory, rank_pool, tok_dirs, offline):
    root = tmp_path_factory.mktemp("harness")
    path = model_dir(root / "hf", CONFIG, tok_dirs["plain"])
    include = write_tasks(root / "tasks")
    add_greedy_choices(include, path)
    reference = hf_reference(path, include)
    tied_hf, tied_ckpt = tied_checkpoint(root, tok_dirs["plain"])
    sft_data = write_sft_dataset(root / "chat", sft_examples(200, CONFIG["vocab_size"]), CONFIG["vocab_size"])
    spec = {
        "config": CONFIG, "model_dir": str(path), "include_path": str(include), "tied_ckpt": str(tied_ckpt),
        "sft_data": sft_data, "sft_ckpt": str(root / "sft_ckpt"),
    }  # fmt: skip
    (root / "spec.json").write_text(json.dumps(spec))
    rank_pool.run(4, str(RANKS / "harness_worker.py"), ["--out", str(root), "--spec", str(root / "spec.json")],
                  env=offline, timeout=900)  # fmt: skip
    sft_hf = exported(root / "sft_ckpt", root / "sft_hf", tok_dirs["plain"])
    checkpoints = {
        name: (json.loads((root / f"{name}_harness.json").read_text()), hf_reference(hf, include, TASKS))
        for name, hf in (("tied", tied_hf), ("sft", sft_hf))
    }
    ours = json.loads((root / "harness.json").read_text())
    return ours, request_results(reference), reference["results"], checkpoints, root


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(b), 1.0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_multiple_choice_requests_equal_lm_eval_hf(harness, layout):
    ours, theirs, _, _, _ = harness
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
    ours, theirs, _, _, _ = harness
    got, ref = ours[layout]["requests"]["tiny_ppl"], theirs["tiny_ppl"]
    assert len(got) == len(ref) == 20
    pairs = [(g[0][0], r[0][0]) for g, r in zip(got, ref)]  # resps: [[log-prob]] per document
    assert all(close(g, r) for g, r in pairs), pairs[:5]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generate_until_equals_lm_eval_hf(harness, layout):
    ours, theirs, _, _, _ = harness
    got, ref = ours[layout]["requests"][GEN_TASK], theirs[GEN_TASK]
    assert len(got) == len(ref) == 12
    assert got == ref  # the texts, cut at the first stop string
    assert sum(len(r[0]) > 0 for r in ref) >= 6  # most generated something before a stop string


def test_scores_equal_lm_eval_hf_at_every_layout(harness):
    ours, _, scores, _, _ = harness
    for layout in LAYOUTS:
        for task in [*TASKS, GEN_TASK]:
            for key, value in scores[task].items():
                if isinstance(value, float):
                    assert close(ours[layout]["results"][task][key], value), (layout, task, key)


@pytest.mark.parametrize("name", ["tied", "sft"])
def test_checkpoint_requests_equal_lm_eval_hf_on_its_export(harness, name):
    """`threed eval-harness` on a tied checkpoint and on a packed-SFT-trained one: every request as HF scores it."""
    ours, theirs = (request_results(r) for r in harness[3][name])
    got, ref = ours["tiny_mc"], theirs["tiny_mc"]
    assert len(got) == len(ref) == 30
    pairs = [(g[0], r[0]) for doc_g, doc_r in zip(got, ref) for g, r in zip(doc_g, doc_r)]  # [(log-prob, greedy)]
    worst = max(abs(g[0] - r[0]) / max(abs(r[0]), 1.0) for g, r in pairs)
    print(f"{name}: tiny_mc worst relative log-prob difference {worst:.2e}")
    assert len(pairs) == 120 and all(close(g[0], r[0]) for g, r in pairs)
    assert [g[1] for g, _ in pairs] == [r[1] for _, r in pairs]
    rolling = [(g[0][0], r[0][0]) for g, r in zip(ours["tiny_ppl"], theirs["tiny_ppl"])]
    assert len(rolling) == 20 and all(close(g, r) for g, r in rolling), rolling[:5]
    for task in TASKS:
        for key, value in harness[3][name][1]["results"][task].items():
            if isinstance(value, float):
                assert close(harness[3][name][0]["results"][task][key], value), (name, task, key)


def test_sft_checkpoint_is_the_trained_one(harness):
    """What the SFT side scored is the packed run's checkpoint after its 3 steps."""
    ckpt = harness[4] / "sft_ckpt"
    assert (ckpt / "latest").read_text().strip() == "global_step3"
    assert json.loads((ckpt / "threed_run.json").read_text())["data"]["pack"] is True
