"""Logits parity with transformers' LlamaForCausalLM at (tp, pp) in {(1,1), (2,1), (1,2), (2,2)}, fp32.

All four layouts (and two model configs: GQA + Llama 3.1 rope scaling, and Llama-2-style MHA) run in one
4-rank run; ranks not needed by a layout act as data-parallel replicas.
"""

from __future__ import annotations

import pytest
import torch

from helpers import RANKS, hf_model

LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
MODELS = ["gqa31", "mha2"]
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def parity_dir(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("parity")
    rank_pool.run(4, str(RANKS / "dist_worker.py"), ["parity", "--out", str(out)], timeout=900)
    return out


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_logits_match_hf(parity_dir, model, tp, pp):
    got = torch.load(parity_dir / f"{model}_tp{tp}_pp{pp}.pt")
    with torch.no_grad():
        ref = hf_model(model)(got["tokens"]).logits
    assert got["logits"].shape == ref.shape
    abs_diff = (got["logits"] - ref).abs().max().item()
    rel = abs_diff / ref.abs().max().item()
    print(f"{model} tp={tp} pp={pp}: max abs {abs_diff:.3e}, max rel {rel:.3e}")
    assert rel <= REL_TOL, f"{model} tp={tp} pp={pp}: relative logits difference {rel:.3e} > {REL_TOL}"
