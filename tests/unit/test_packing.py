"""Packed sequences in the model (issue 11, in one process): several documents in one row, per-token document ids
next to the hidden states, give each document exactly the logits it has alone — checked against transformers'
LlamaForCausalLM run on each document by itself (fp32, relative 1e-5), gradients equal those of the documents run
alone, and the single-tensor path is unchanged.

The model half runs in a child process: megatron's parallel state needs torch.distributed (a world of one), which
must not leak into the pytest process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import TESTS, pipeline_module
from threed.model.attention import block_causal_mask, cumulative_lengths, document_segments
from threed.model.rope import document_positions

ROWS = [[5, 17, 9, 1, 32], [64]]  # document lengths per packed row of 64 tokens; the second row is one document


def test_segments_positions_mask():
    doc_ids = torch.tensor([[7, 7, 3, 3, 3, 7], [0, 0, 0, 0, 0, 0]])
    seg = document_segments(doc_ids)
    assert seg.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]  # a repeated id later is a new document
    assert document_positions(seg).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    mask = block_causal_mask(seg)
    assert mask.shape == (2, 1, 6, 6)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert torch.equal(mask[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())
    cu, longest = cumulative_lengths(seg)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 6, 12] and longest == 6
    with pytest.raises(ValueError):
        document_segments(doc_ids.float())


@pytest.mark.parametrize("model", ["gqa31", "mha2"])
def test_packed_logits_match_hf_per_document(model):
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), model], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for doc_err in result["packed_vs_hf"]:
        assert doc_err <= 1e-5, result
    assert result["unpacked_vs_hf"] <= 1e-5, result
    assert result["one_document_packed_vs_unpacked"] <= 1e-5, result
    assert result["pipeline_forward_unchanged"] == 0.0, result
    assert result["packed_grads_vs_alone"] <= 1e-5, result


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _worker(name: str) -> dict:
    torch.set_num_threads(1)
    from helpers import hf_model, model_config
    from threed.config import ParallelConfig, RunConfig, TrainConfig
    from threed.convert.in_memory import load_hf_state
    from threed.parallel.distributed import init_distributed, init_megatron_parallel_state, shutdown_distributed

    seq = sum(ROWS[0])
    hf = hf_model(name)
    cfg_model = model_config(name)
    cfg = RunConfig(model=cfg_model, parallel=ParallelConfig(1, 1), train=TrainConfig(dtype="fp32", seq_length=seq))
    init_distributed()
    init_megatron_parallel_state(1, 1)
    try:
        module = pipeline_module(cfg, 1, initialize=False).eval()
        load_hf_state(module, cfg_model, hf.state_dict(), tp=1, tp_rank=0)
        embedding, *blocks, norm, head = module.forward_funcs
        vocab = cfg_model.vocab_size

        tokens = torch.randint(0, vocab, (len(ROWS), seq), generator=torch.Generator().manual_seed(1))
        doc_ids = torch.cat([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r))[None] for r in ROWS])

        def packed(tokens, doc_ids):
            x = (embedding(tokens), doc_ids.to(torch.int32))
            for block in blocks:
                x = block(x)
                assert x[1] is not None and x[1].dtype == torch.int32
            return head(norm(x[0]))[..., :vocab].transpose(0, 1)  # [b, s, v]

        def unpacked(tokens):
            h = embedding(tokens)
            for block in blocks:
                h = block(h)
            return head(norm(h))[..., :vocab].transpose(0, 1)

        with torch.no_grad():
            ours = packed(tokens, doc_ids)
            errors = []
            for row, lengths in enumerate(ROWS):
                start = 0
                for n in lengths:
                    ref = hf(tokens[row : row + 1, start : start + n]).logits[0]
                    errors.append(_rel(ours[row, start : start + n], ref))
                    start += n
            full = unpacked(tokens)
            unpacked_err = max(_rel(full[r], hf(tokens[r : r + 1]).logits[0]) for r in range(len(ROWS)))
            one_doc = _rel(ours[1], full[1])  # row 1 is a single document: packed path == plain causal path
            through_module = module(tokens)[..., :vocab].transpose(0, 1)
            module_diff = (through_module - full).abs().max().item()
        # Gradients: a summed next-token loss over the packed rows equals the sum of each document's loss run
        # alone through the plain path.
        labels = torch.randint(0, vocab, tokens.shape, generator=torch.Generator().manual_seed(2))
        params = [p for p in module.parameters() if p.requires_grad]

        def loss_sum(logits, labels):
            return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="sum")

        packed_grads = torch.autograd.grad(loss_sum(packed(tokens, doc_ids), labels), params)
        alone = 0
        for row, lengths in enumerate(ROWS):
            start = 0
            for n in lengths:
                alone = alone + loss_sum(
                    unpacked(tokens[row : row + 1, start : start + n]), labels[row : row + 1, start : start + n]
                )
                start += n
        alone_grads = torch.autograd.grad(alone, params)
        grad_err = max(_rel(a, b) for a, b in zip(packed_grads, alone_grads))
        return {
            "packed_vs_hf": errors,
            "unpacked_vs_hf": unpacked_err,
            "one_document_packed_vs_unpacked": one_doc,
            "pipeline_forward_unchanged": module_diff,
            "packed_grads_vs_alone": grad_err,
        }
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1])))
