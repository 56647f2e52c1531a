"""--generate-interval / --harness-interval under --sequence-parallel and --context-parallel-size 2 (tp2 cp2 sp, fp32):
generation and scoring run whole sequences for their duration (`threed.generate.decode.evaluation`, the switch
`threed.model.layers.whole_sequences`), the CP ranks as extra replicas. Against the same weights at tp2 without
either split (the run's checkpoint, dp2): the greedy tokens are equal and every harness request's log-probability is
within 1e-5 (is greedy equal); the losses are bit-identical to the same run without the intervals; every module's
split attributes are the same after each evaluation as before; and the same scoring with the switch left off (or
half of it) raises or gives other numbers, so these checks can fail. One 4-rank run (samples_split_worker.py),
offline, local tasks; the switch itself without ranks: tests/unit/test_whole_sequences.py.

    .venv/bin/python -m pytest -q tests/ranks/test_samples_split.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from convert_fixtures import GQA4
from harness_fixtures import OFFLINE_ENV, write_tasks
from helpers import RANKS, write_dataset

STEPS = 2
LOGPROB_TOL = 1e-5
# Three trainings' worth in a 4-rank run on 2 busy cores: `make test-slow`, like test_samples.py.
pytestmark = pytest.mark.slow
MODEL = dict(
    name="samples",
    vocab_size=320,
    hidden_size=GQA4["hidden_size"],
    num_layers=2,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden_size=GQA4["intermediate_size"],
    max_position_embeddings=128,
)  # fmt: skip (test_samples.py's)


@pytest.fixture(scope="module")
def split(tmp_path_factory, rank_pool, tok_dirs):
    root = tmp_path_factory.mktemp("samples_split")
    data = write_dataset(root / "data" / "tokens", np.random.default_rng(0).integers(0, 300, 20_000), 320)
    prompts = ["hello world", "the river runs under the old stone", "north"]  # 3 over 2 replicas: uneven shares
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    spec = {
        "model": MODEL,
        "data": data,
        "tokenizer": tok_dirs["plain"],
        "prompts": str(root / "prompts.jsonl"),
        "include_path": str(write_tasks(root / "tasks")),
    }
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**OFFLINE_ENV, "HF_DATASETS_CACHE": str(root / "datasets_cache")}
    rank_pool.run(4, str(RANKS / "samples_split_worker.py"), ["--out", str(root), "--spec", str(root / "spec.json")],
                  env=env, timeout=900)  # fmt: skip
    return json.loads((root / "split.json").read_text())


def at_last_step(records: list[dict]) -> list[dict]:
    return [r for r in records if r["step"] == STEPS]


def test_generations_equal_the_same_weights_without_either_split(split):
    generated = split["generated"]
    assert [g["step"] for g in generated] == [1, 2]
    for g in generated:  # every prompt once, in order: the CP ranks split the prompts, none run twice or skipped
        assert g["indices"] == list(range(len(g["prompts"]))) == [0, 1, 2]
        assert all(1 <= len(t) <= g["max_new"] for t in g["tokens"])
    (last,) = at_last_step(generated)
    assert last["tokens"] == split["generated_ref"][0]
    assert split["reference"] == {"replicas": 2, "split_on": 0, "cp_groups": 0}  # tp2 dp2, built without either


def test_harness_log_likelihoods_equal_the_same_weights_without_either_split(split):
    scored = at_last_step(split["scored"])
    assert len(scored) == len(split["scored_ref"]) >= 2  # the multiple-choice requests, the rolling windows
    assert len({len(r) for s in scored for r in s["rows"]}) > 1  # batches of rows of different lengths (padding)
    for s, ref in zip(scored, split["scored_ref"]):
        assert len(s["answers"]) == len(s["rows"]) == len(ref)
        for (logprob, greedy), (ref_logprob, ref_greedy) in zip(s["answers"], ref):
            assert abs(logprob - ref_logprob) <= LOGPROB_TOL * max(1.0, abs(ref_logprob))
            assert greedy == ref_greedy
    assert [s["step"] for s in split["scored"]].count(1) >= 2  # scored after step 1 too, mid-run


def test_losses_are_bit_identical_with_and_without(split):
    losses = split["losses"]
    assert len(losses["with"]) == STEPS
    assert losses["with"] == losses["without"]  # evaluation after step 1 disturbed neither data, RNG nor modules
    with_them, without = split["draws"]
    assert with_them == without


def test_every_split_attribute_is_back_after_each_evaluation(split):
    flags = split["flags"]
    assert [f["step"] for f in flags] == [1, 2]
    for f in flags:
        assert f["same"] and f["training"]
        assert f["split_on"] > 0 and f["cp_groups"] > 0  # the training engine does split: the check is not empty
    assert flags[-1]["same_after_controls"]


def test_without_the_switch_scoring_raises_or_differs(split):
    """Each half of the switch is needed: with sequence parallelism left on, 9 positions cannot be cut over tp 2
    (megatron's reduce-scatter asserts), nor can a decode step's one token; with context parallelism left on, the
    8 positions are taken for 2 of 4 chunks of a 16-long row and attend to the other CP rank's keys: other numbers."""
    c = split["controls"]
    assert c["none_odd"].startswith("raised ")
    assert c["context_off_odd"].startswith("raised ")
    assert isinstance(c["switched_odd"], list) and isinstance(c["switched_even"], list)
    wrong = c["sequence_off_even"]
    assert isinstance(wrong, list), wrong
    assert max(abs(a - b) for a, b in zip(wrong, c["switched_even"])) > 1e-3
