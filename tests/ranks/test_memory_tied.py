"""threed.memory for a tied model (Llama 3.2: the LM head's weight is the embedding's) against the tensors real
engines hold, and its parameter accounting at the real Llama 3.2 shapes.

A tied weight is one parameter of the model but two tensors at pp > 1: DeepSpeed's TiedLayerSpec puts a copy of
the embedding on the first and on the last stage, each with its own bf16 weight, fp32 gradient buffer, fp32 master
and AdamW state (ZeRO-1 partitions each over dp like any parameter); at pp = 1 one module serves both. One run of
4 CPU ranks per layout, each in a launch of its own (tests/ranks/memory_worker.py --model tiny-tied), builds tp x pp x
dp = 1x2x2, 1x1x4, 2x2x1.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from helpers import RANKS
from threed.convert.resolve import model_config
from threed.memory.model import estimate, stage_params, stages
from threed.model.spec import parameter_count

NPROC = 4
LAYOUTS = {"1x2x2": "1x2", "1x1x4": "1x1", "2x2x1": "2x2"}
SEQ = 32  # tests/ranks/memory_worker.py's STATIC


@pytest.fixture(scope="module")
def measured(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("memory_tied")
    # A request per layout: what one layout's engine leaves alive is not counted against the next one's
    # (memory_worker counts only the tensors made after its request started).
    for layout in LAYOUTS.values():
        rank_pool.run(
            NPROC,
            str(RANKS / "memory_worker.py"),
            ["--out", str(out), "--model", "tiny-tied", "--layouts", layout],
            timeout=900,
        )
    return {
        name: [json.loads(p.read_text()) for p in sorted(out.glob(f"static_{name}_rank*.json"))] for name in LAYOUTS
    }


@pytest.mark.slow  # a 4-rank launch (~40 s); the untied layouts' memory check (test_memory.py) stays in make test
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tied_static_bytes_match_engine_tensors(measured, layout: str) -> None:
    ranks = measured[layout]
    assert len(ranks) == NPROC
    for r in ranks:
        m, p = r["measured"], r["predicted"]
        assert r["model"] == "tiny-tied" and r["optimizer"] == "BF16_Optimizer"
        assert r["parts"] == r["predicted_parts"], "threed.memory must split stages as the engine does"
        everything = m["model_states"] + m.get("buffers", 0) + m["unaccounted"]
        print(
            f"tied {layout} rank {r['rank']} stage {r['stage']}: weights {m['weights']} B measured, "
            f"{p['weights']:.0f} predicted; model states {m['model_states']} / {p['model_states']:.0f}; all live "
            f"tensors {everything} / {p['static']:.0f}; largest unaccounted {m['largest_unaccounted'][:2]}"
        )
        # To the byte: an embedding copy (32768 of a stage's ~120k parameters) missing or counted twice shows.
        assert p["weights"] == m["weights"]
        assert p["grads"] == m["grads"]
        assert p["model_states"] == m["model_states"]
        assert abs(p["static"] - everything) <= 0.02 * everything


@pytest.mark.slow  # the same runs
def test_tied_copy_on_both_end_stages_of_the_measured_engines(measured) -> None:
    """What the engines held, read without the memory model: the last stage's parameters are its untied
    counterpart's (a copy of [V, h] in place of the LM head's [V, h]); at pp = 1 there is one [V, h] fewer."""
    tied, untied = model_config("tiny-tied"), model_config("tiny")
    v, h = tied.padded_vocab_size(1), tied.hidden_size
    for r in measured["1x2x2"] + measured["1x1x4"]:
        _, pp, dp = r["layout"]
        (st,) = [s for s in stages(untied, pp, 1, SEQ) if s.index == r["stage"]]
        expected = sum(stage_params(untied, 1, st)) - (v * h if pp == 1 else 0)
        # bf16; each of the two groups padded to a multiple of 2 x dp elements
        assert 0 <= r["measured"]["weights"] - 2 * expected < 2 * 2 * (2 * dp), (pp, r["stage"])


def test_tied_counts_once_in_the_model_twice_across_stages() -> None:
    tied, untied = model_config("tiny-tied"), model_config("tiny")
    assert tied == dataclasses.replace(untied, name="tiny-tied", tie_word_embeddings=True)
    for tp in (1, 2):
        v, h = tied.padded_vocab_size(tp), tied.hidden_size
        assert parameter_count(tied, tp) == parameter_count(untied, tp) - v * h
        for pp in (1, 2, 4):
            held = 0  # elements of the whole layout, each TP shard counted on its own rank
            for st in stages(tied, pp, tp, SEQ):
                matrices, norms = stage_params(tied, tp, st)
                held += matrices * tp + norms
            assert held == parameter_count(tied, tp) + (v * h if pp > 1 else 0), (tp, pp)
        # The last stage holds [V/tp, h] either way (a copy of the embedding, or the LM head): same bytes.
        for pp in (2, 4):
            assert [m.params for m in estimate(tied, tp, pp, 2, 2, 2, SEQ, False, device="cpu")] == [
                m.params for m in estimate(untied, tp, pp, 2, 2, 2, SEQ, False, device="cpu")
            ]
