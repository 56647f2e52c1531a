"""Generations and lm-eval harness scores during training (--generate-interval / --harness-interval, through the
training engine itself): logged to metrics.jsonl and TensorBoard at the right steps, by the writer rank (rank 1 at
tp1 pp2, while lm-eval hands its results to rank 0), and the training losses are bit-identical to the same run
without them; at --vpp 2 (interleaved chunks, the decode loop over them) the same, and the generations and scores
those of --vpp 1 (tokens identical, scores within 1e-5, losses within 1e-6). One 2-rank run (samples_worker.py),
offline, local tasks.

    .venv/bin/python -m pytest -q tests/ranks/test_samples.py
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from convert_fixtures import GQA4
from harness_fixtures import OFFLINE_ENV, write_tasks
from helpers import RANKS, write_dataset

STEPS, INTERVAL = 4, 2
# Four trainings in a 2-rank run (minutes on 2 busy cores): `make test-slow`; the refusals are in tests/unit.
pytestmark = pytest.mark.slow
MODEL = dict(
    name="samples", vocab_size=320, hidden_size=GQA4["hidden_size"], num_layers=4, num_heads=8, num_kv_heads=4,
    ffn_hidden_size=GQA4["intermediate_size"], max_position_embeddings=128,
)  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, rank_pool, tok_dirs):
    root = tmp_path_factory.mktemp("samples")
    data = write_dataset(root / "data" / "tokens", np.random.default_rng(0).integers(0, 300, 20_000), 320)
    (root / "prompts.jsonl").write_text('{"prompt": "hello world"}\n{"prompt": "the river"}\n')
    spec = {
        "model": MODEL,
        "data": data,
        "tokenizer": tok_dirs["plain"],
        "prompts": str(root / "prompts.jsonl"),
        "include_path": str(write_tasks(root / "tasks")),
    }
    (root / "spec.json").write_text(json.dumps(spec))
    env = {**OFFLINE_ENV, "HF_DATASETS_CACHE": str(root / "datasets_cache")}
    proc = rank_pool.run(2, str(RANKS / "samples_worker.py"), ["--out", str(root), "--spec", str(root / "spec.json")],
                         env=env, timeout=900)  # fmt: skip
    return root, proc.stdout


def test_losses_are_bit_identical_with_and_without(run):
    root, _ = run
    losses = json.loads((root / "losses.json").read_text())
    assert len(losses["with"]) == STEPS
    assert losses["with"] == losses["without"]  # exact: no RNG draw, data read or pipeline buffer disturbed
    with_them, without = losses["draws"]
    assert with_them == without  # the generators are where the run left them, though lm-eval reseeded them


def test_scores_and_generations_in_metrics_jsonl_at_the_interval(run):
    root, stdout = run
    records = [json.loads(line) for line in (root / "with" / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if "harness/tiny_mc/acc" in r]
    assert [r["iteration"] for r in scored] == [2, 4]
    assert all(0.0 <= r["harness/tiny_mc/acc"] <= 1.0 and r["harness/tiny_ppl/word_perplexity"] > 1 for r in scored)
    generated = [r for r in records if "generate/0" in r]
    assert [r["iteration"] for r in generated] == [2, 4]
    assert all(isinstance(r["generate/1"], str) and r["generate tokens/s"] > 0 for r in generated)
    assert "harness at step 2 | harness/tiny_mc/acc" in stdout
    assert "generation at step 4 | 'hello world' -> " in stdout
    without = (root / "without" / "metrics.jsonl").read_text()
    assert "harness/" not in without and "generate/" not in without


def test_scores_in_tensorboard(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, _ = run
    acc = EventAccumulator(str(root / "with" / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("harness/tiny_mc/acc")] == [2, 4]
    assert [e.step for e in acc.Scalars("harness/tiny_ppl/bits_per_byte")] == [2, 4]
    assert "generate/0/text_summary" in acc.Tags()["tensors"]  # the generations, as text


def records(root, name: str) -> dict[int, dict]:
    """metrics.jsonl of run `name`: iteration -> its generations and harness scores (merged)."""
    out: dict[int, dict] = {}
    for r in map(json.loads, (root / name / "metrics.jsonl").read_text().splitlines()):
        picked = {k: v for k, v in r.items() if k.startswith(("generate/", "harness/"))}
        if picked:
            out.setdefault(r["iteration"], {}).update(picked)
    return out


def test_at_vpp2_the_same_generations_scores_and_losses_as_vpp1(run):
    """--vpp 2 (two chunks per rank, the decode loop rank 0 chunk 0 -> rank 1 chunk 0 -> rank 0 chunk 1 -> rank 1
    chunk 1): losses bit-identical with and without the samples, within 1e-6 of vpp 1's; the greedy generations
    token for token vpp 1's, the harness scores within 1e-5."""
    root, stdout = run
    losses = json.loads((root / "losses.json").read_text())
    assert losses["with_vpp2"] == losses["without_vpp2"] and len(losses["with_vpp2"]) == STEPS
    assert losses["draws_vpp2"][0] == losses["draws_vpp2"][1]
    assert losses["with_vpp2"] == pytest.approx(losses["with"], rel=1e-6)
    one, inter = records(root, "with"), records(root, "with_vpp2")
    assert sorted(inter) == [2, 4] and sorted(inter[2]) == sorted(one[2])
    for step, values in one.items():
        for key, want in values.items():
            if key.startswith("generate/"):
                assert inter[step][key] == want, (step, key)
            else:
                assert inter[step][key] == pytest.approx(want, rel=1e-5, abs=1e-5), (step, key)
    assert "harness/" not in (root / "without_vpp2" / "metrics.jsonl").read_text()
