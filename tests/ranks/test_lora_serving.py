"""`threed generate --lora` against HF + PEFT's `generate` (fp32, greedy): base + adapter on the engine, never merged
on disk, give PEFT's tokens, from an HF PEFT folder with --load BASE and from a threed LoRA run's checkpoint, at its
own layout (tp2 pp1 dp2: DeepSpeed's load of the layer files, adapters included) and at others (each rank reads its
slices of the base and cuts its shards of the adapters). One 4-rank run per test (lora_serve_worker.py); the
fixtures are tests/lora_fixtures.py's.

    .venv/bin/python -m pytest -q tests/ranks/test_lora_serving.py
"""

from __future__ import annotations

import json
import os

import pytest

from harness_fixtures import OFFLINE_ENV, TASKS, request_results, write_tasks
from helpers import RANKS
from lora_fixtures import greedy_rows, make_served, peft_model
from test_harness import close, offline  # noqa: F401 (a fixture: lm-eval's datasets offline, in a cache of its own)

PROMPTS = ["hello world", "the quick brown fox jumps over", "a"]
MAX_NEW = 6


@pytest.fixture(scope="module")
def served(tmp_path_factory, tok_dirs):
    root = make_served(tmp_path_factory.mktemp("lora_serve"), tok_dirs["plain"])
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS))
    return root


@pytest.fixture(scope="module")
def reference(served) -> list[list[int]]:
    """HF + PEFT's greedy continuation of each prompt alone, stopping at the tokenizer's EOS (included)."""
    from transformers import AutoTokenizer

    return greedy_rows(peft_model(), AutoTokenizer.from_pretrained(str(served / "hf")), PROMPTS, MAX_NEW)


def served_tokens(served, rank_pool, cases: dict[str, list[str]]) -> dict[str, list[list[int]]]:
    """Each case's `threed generate` arguments (plus the prompts and --output) run on 4 ranks: its rows' tokens."""
    common = ["--prompts", str(served / "prompts.jsonl"), "--max-new-tokens", str(MAX_NEW), "--greedy"]
    full = {name: [*argv, *common, "--output", str(served / f"{name}.jsonl")] for name, argv in cases.items()}
    (served / "cases.json").write_text(json.dumps(full))
    argv = ["serve", "--out", str(served), "--cases", str(served / "cases.json")]
    rank_pool.run(4, str(RANKS / "lora_serve_worker.py"), argv)
    rows = {name: [json.loads(line) for line in (served / f"{name}.jsonl").read_text().splitlines()] for name in cases}
    assert all([r["prompt"] for r in got] == PROMPTS for got in rows.values())
    return {name: [r["tokens"] for r in got] for name, got in rows.items()}


def test_generate_lora_equals_hf_peft(served, reference, rank_pool):
    """A PEFT folder on the base at tp2 pp2 (the base sliced from its tp2 pp1 files), and the LoRA checkpoint alone at
    its own layout, whole and adapter-only."""
    got = served_tokens(
        served,
        rank_pool,
        {
            "peft_tp2_pp2": ["--load", str(served / "base"), "--lora", str(served / "peft"), "--tp", "2", "--pp", "2"],
            "lora_tp2_pp1": ["--lora", str(served / "lora")],
            "adapter_only_tp2_pp1": ["--lora", str(served / "only")],  # the base read from the one it names
        },
    )
    assert reference != [[]] * len(PROMPTS) and any(len(r) > 1 for r in reference)
    for name, tokens in got.items():
        assert tokens == reference, name


@pytest.mark.slow  # another 4-rank run (~20 s)
def test_generate_lora_equals_hf_peft_at_other_layouts(served, reference, rank_pool):
    base = ["--load", str(served / "base")]
    got = served_tokens(
        served,
        rank_pool,
        {
            "lora_tp2_pp2": ["--lora", str(served / "lora"), "--tp", "2", "--pp", "2"],
            "lora_base_tp1_pp2": [*base, "--lora", str(served / "lora"), "--tp", "1", "--pp", "2"],
            "peft_tp1_pp1": [*base, "--lora", str(served / "peft"), "--tp", "1", "--pp", "1"],
        },
    )
    for name, tokens in got.items():
        assert tokens == reference, name


@pytest.mark.slow  # a 4-rank lm-eval run and lm-eval's HF backend (~40 s)
@pytest.mark.usefixtures("offline")
def test_eval_harness_lora_equals_lm_eval_hf_peft(served, rank_pool):
    """`threed eval-harness --load BASE --lora PEFT_DIR --tp 2 --pp 2`: every multiple-choice and rolling request's
    log-probability as lm-eval's HF backend scores the base with the PEFT adapter merged in by PEFT."""
    from lm_eval import evaluator
    from lm_eval.models.huggingface import HFLM
    from transformers import AutoTokenizer

    from threed.harness.tasks import task_manager

    include, out = write_tasks(served / "tasks"), served / "harness.json"
    argv = ["--load", str(served / "base"), "--lora", str(served / "peft"), "--tasks", ",".join(TASKS)]
    argv += ["--include-path", str(include), "--log-samples", "--output", str(out), "--tp", "2", "--pp", "2"]
    (served / "harness_cases.json").write_text(json.dumps({"peft_tp2_pp2": [*argv, "--batch-size", "5"]}))
    cases = ["harness", "--out", str(served), "--cases", str(served / "harness_cases.json")]
    env = {k: os.environ[k] for k in (*OFFLINE_ENV, "HF_DATASETS_CACHE")}  # the `offline` fixture's
    rank_pool.run(4, str(RANKS / "lora_serve_worker.py"), cases, env=env, timeout=900)
    # PEFT's own merge of the adapter into the base (HFLM's `peft=` gave other log-probs than PEFT itself here)
    merged = peft_model().merge_and_unload()
    tok = AutoTokenizer.from_pretrained(str(served / "hf"))
    lm = HFLM(pretrained=merged, tokenizer=tok, batch_size=8, device="cpu")
    theirs = evaluator.simple_evaluate(
        model=lm, tasks=list(TASKS), log_samples=True, task_manager=task_manager(list(TASKS), str(include)),
        bootstrap_iters=0,
    )  # fmt: skip
    ours = json.loads(out.read_text())
    assert ours["threed"]["lora"] == str((served / "peft").resolve())
    got, ref = request_results(ours), request_results(theirs)
    pairs = [(g[0], r[0]) for doc_g, doc_r in zip(got["tiny_mc"], ref["tiny_mc"]) for g, r in zip(doc_g, doc_r)]
    assert len(pairs) == 120 and all(close(g[0], r[0]) for g, r in pairs), pairs[:5]  # (log-prob, is greedy)
    rolling = [(g[0][0], r[0][0]) for g, r in zip(got["tiny_ppl"], ref["tiny_ppl"])]
    assert len(rolling) == 20 and all(close(g, r) for g, r in rolling), rolling[:5]
