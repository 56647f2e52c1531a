"""`threed generate` against HF's `generate` on the same tiny random Llama (fp32): greedy tokens equal HF's token
for token on prompts of different lengths in one batch, at tp1 pp1 (dp4), tp2 pp2 and tp1 pp2 (dp2), with and
without the KV cache; every compared step's top-1 / top-2 margin exceeds MARGIN_TOL on both sides, so a near-tie
cannot pass by luck; seeded sampling gives the same tokens at every layout and cache mode; a stop id ends its row.
One 4-rank run (generate_worker.py).

    .venv/bin/python -m pytest -q tests/ranks/test_generate.py
"""

from __future__ import annotations

import json

import pytest
import torch

from convert_fixtures import GQA4, hf_model
from helpers import RANKS

SEED = 0
LENGTHS = (5, 11, 3, 8, 1)  # prompt lengths in one batch (left-padded to 11)
MAX_NEW = 8
# The smallest gap between the best and the second-best logit of a compared step: ~100x the fp32 logit differences
# between the engine and HF here (~1e-7 absolute; test_parity.py), so a flip would need a real difference.
MARGIN_TOL = 1e-5
LAYOUTS = ["tp1_pp1", "tp2_pp2", "tp1_pp2"]


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, GQA4["vocab_size"], (n,), generator=gen).tolist() for n in LENGTHS]


def hf_greedy(model, batch: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """HF's greedy continuation of a left-padded batch, and each step's top-1 / top-2 logit margin."""
    longest = max(map(len, batch))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in batch])
    out = model.generate(
        ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        pad_token_id=0,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    top2 = torch.stack(out.scores, dim=1).topk(2, dim=-1).values  # [b, steps, 2]
    return out.sequences[:, longest:].tolist(), (top2[..., 0] - top2[..., 1]).tolist()


@pytest.fixture(scope="module")
def generated(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("generate")
    batch = prompts()
    with torch.no_grad():
        hf_tokens, hf_margins = hf_greedy(hf_model(GQA4, seed=SEED), batch)
        tied_tokens, tied_margins = hf_greedy(hf_model(GQA4, seed=SEED, tied=True), batch)
    stop = [hf_tokens[0][2], hf_tokens[3][5]]  # row 0 ends at its 3rd new token, row 3 at its 6th (or sooner)
    spec = {"config": GQA4, "seed": SEED, "prompts": batch, "max_new": MAX_NEW, "stop": stop}
    (out / "spec.json").write_text(json.dumps(spec))
    rank_pool.run(
        4, str(RANKS / "generate_worker.py"), ["--out", str(out), "--spec", str(out / "spec.json")], timeout=900
    )
    results = json.loads((out / "generated.json").read_text())
    return results, hf_tokens, hf_margins, stop, (tied_tokens, tied_margins)


@pytest.mark.parametrize("cache", ["cache", "nocache"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_equals_hf_generate(generated, layout, cache):
    results, hf_tokens, hf_margins, _, _ = generated
    rows = results[f"{layout}_greedy_{cache}"]
    assert [r["tokens"] for r in rows] == hf_tokens
    ours = [m for r in rows for m in r["margins"]]
    assert len(ours) == len(LENGTHS) * MAX_NEW  # every step of every row was compared
    theirs = [m for row in hf_margins for m in row]
    print(f"{layout} {cache}: smallest margin ours {min(ours):.2e}, HF {min(theirs):.2e}")
    assert min(ours) > MARGIN_TOL and min(theirs) > MARGIN_TOL
    # Our margins are HF's (the same logits), not only above the tolerance.
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < MARGIN_TOL


def test_seeded_sampling_is_the_same_at_every_layout(generated):
    results, hf_tokens, _, _, _ = generated
    runs = {k: [r["tokens"] for r in v] for k, v in results.items() if "_sample_" in k}
    assert len(runs) == 2 * len(LAYOUTS)
    first = next(iter(runs.values()))
    for name, tokens in runs.items():
        assert tokens == first, name
    assert first != hf_tokens  # it samples: not the greedy continuation
    assert all(len(t) == MAX_NEW for t in first)


def test_stop_ids_end_their_rows(generated):
    results, hf_tokens, _, stop, _ = generated
    for got, full in zip((r["tokens"] for r in results["tp2_pp2_stop"]), hf_tokens):
        ends = [i for i, t in enumerate(full) if t in stop]
        assert got == (full[: ends[0] + 1] if ends else full)
    assert len(results["tp2_pp2_stop"][0]["tokens"]) <= 3


def test_tied_model_greedy_equals_hf_generate(generated):
    """Llama 3.2's layout: the head runs with the last stage's copy of the embedding (tp2 pp2)."""
    results, untied, _, _, (hf_tokens, hf_margins) = generated
    rows = results["tied_tp2_pp2_greedy_cache"]
    assert [r["tokens"] for r in rows] == hf_tokens != untied
    ours = [m for r in rows for m in r["margins"]]
    theirs = [m for row in hf_margins for m in row]
    assert len(ours) == len(theirs) == len(LENGTHS) * MAX_NEW
    assert min(ours) > MARGIN_TOL and min(theirs) > MARGIN_TOL
