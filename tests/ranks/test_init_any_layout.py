"""`--init-from` a checkpoint written at another tp / pp (what `threed generate` and `threed eval-harness` load
too): each rank reads its shards' slices of the old files (threed.convert.into_stage). The reference is DeepSpeed's
own loader on the same weights resharded on disk by `threed reshard`: every rank's weights equal it bit for bit
after the load and after two training steps (so the optimizer's fp32 masters were refreshed from them too), and so
do the losses. Cases: tp1 pp1 -> tp2 pp2 in bf16 (vocabulary padding 208 -> 224 rows), tp4 pp1 -> tp1 pp2 dp2 in
fp32, and a tied head (Llama 3.2) tp1 pp1 -> tp2 pp2, whose last stage's copy of the embedding is read from
layer_00. The engine `threed generate` / `eval-harness` build holds the same weights and no optimizer state. One
4-rank run (layout_worker.py).

    .venv/bin/python -m pytest -q tests/ranks/test_init_any_layout.py
"""

from __future__ import annotations

import json

import pytest
import torch

from convert_fixtures import DIVISIBLE_BY, GQA4, TIED_DIVISIBLE_BY, save_hf, save_tied_hf
from helpers import RANKS
from threed.cli.main import main

WORLD = 4
CASES = [
    ("gqa", "bf16", (1, 1), (2, 2)),
    ("gqa", "fp32", (4, 1), (1, 2)),
    ("tied", "bf16", (1, 1), (2, 2)),
]


def convert(hf, out, tp: int, pp: int, divisible: str) -> str:
    argv = ["convert", "--hf", str(hf), "--tp", str(tp), "--pp", str(pp), "--out", str(out), "--quiet"]
    assert main(argv + ["--make-vocab-size-divisible-by", divisible]) == 0
    return str(out)


def reshard(ck: str, out, tp: int, pp: int) -> str:
    assert main(["reshard", "--ckpt", ck, "--tp", str(tp), "--pp", str(pp), "--out", str(out), "--quiet"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, rank_pool):
    root = tmp_path_factory.mktemp("any_layout")
    hf = {
        "gqa": (save_hf(root / "hf", GQA4), DIVISIBLE_BY),
        "tied": (save_tied_hf(root / "hf_tied"), TIED_DIVISIBLE_BY),
    }
    cases = []
    for kind, dtype, (tp0, pp0), (tp, pp) in CASES:
        name = f"{kind}_{dtype}_tp{tp0}pp{pp0}_to_tp{tp}pp{pp}"
        written = convert(hf[kind][0], root / f"{name}_written", tp0, pp0, hf[kind][1])
        native = reshard(written, root / f"{name}_native", tp, pp)
        cases.append({"name": name, "sliced": written, "native": native, "tp": tp, "pp": pp, "dtype": dtype})
    (root / "cases.json").write_text(json.dumps(cases))
    rank_pool.run(WORLD, str(RANKS / "layout_worker.py"), ["--out", str(root), "--cases", str(root / "cases.json")])
    return root, [c["name"] for c in cases]


def results(root, name: str, source: str) -> list[dict]:
    return [torch.load(root / f"{name}_{source}_rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_weights_and_training_equal_deepspeeds_load_of_the_resharded_copy(loaded, case):
    root, names = loaded
    sliced, native = results(root, names[case], "sliced"), results(root, names[case], "native")
    for rank, (a, b) in enumerate(zip(sliced, native)):
        assert "read slice by slice" in a["start"] and "slice" not in b["start"], (a["start"], b["start"])
        for when in ("loaded", "trained"):
            assert a[when].keys() == b[when].keys(), (rank, when)
            for key in a[when]:
                assert a[when][key].dtype == b[when][key].dtype, (rank, when, key)
                assert torch.equal(a[when][key], b[when][key]), f"rank {rank} {when} {key}"
        assert a["losses"] == b["losses"], rank
        # the steps moved the weights: the comparison after training is not the load's again
        assert any(not torch.equal(a["loaded"][k], a["trained"][k]) for k in a["loaded"]), rank


@pytest.mark.parametrize("case", range(len(CASES)))
def test_generate_and_harness_engines_hold_the_same_weights_and_no_optimizer_state(loaded, case):
    """`build_engine(train=False)`: the weights a training engine loads, without fp32 masters, gradients or Adam
    state (a training engine's BF16_Optimizer / ZeRO-1 holds them: 14 B/param more than bf16 weights)."""
    root, names = loaded
    trained, scoring = results(root, names[case], "sliced"), results(root, names[case], "inference")
    for rank, (a, b) in enumerate(zip(trained, scoring)):
        assert a["loaded"].keys() == b["loaded"].keys(), rank
        assert all(torch.equal(a["loaded"][k], b["loaded"][k]) for k in a["loaded"]), rank
        assert b["optimizer_fp32_tensors"] == 0, (rank, b["optimizer_fp32_tensors"])
