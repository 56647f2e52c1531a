"""`--lm-head-chunks N` (threed.model.layers.chunked_token_losses) in one process at tp 1: the LM head and
cross-entropy made N chunks of tokens at a time give the whole-logits path's fp32 losses and gradients (the losses bit
for bit, the gradients within MAX_REL), for untied and tied heads, plain labels and packed SFT rows with their loss
mask; forward keeps no tensor the size of one chunk's logits; generation's `whole_sequences` gets the logits
themselves; the config refuses what it cannot do in one line; the memory model counts 1/N of the logits. At tp 2
(with and without sequence parallelism) and through DeepSpeed engines: tests/ranks/test_bytes.py; the CPU peak against
the memory model: tests/ranks/test_memory_head.py.

The model half runs in a child process (as tests/unit/test_packing.py): megatron's parallel state and DeepSpeed's
communication need torch.distributed (a world of one), which must not leak into the pytest process.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/unit/test_lm_head_chunks.py
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helpers import child_json, gradients_against, pipeline_module, tiny_batch
from threed.config import ConfigError, ParallelConfig, RunConfig, TrainConfig
from threed.convert.resolve import model_config
from threed.memory.model import Stage, logits_bytes, stage_activations

SEQ, MICRO, CHUNKS = 32, 2, 4
# The gradients' bound: per tensor, max |chunked - whole| over max |whole|. The weight's gradient of the head is a sum
# of CHUNKS partial matmuls instead of one, so it may differ in the last bits of fp32 (2^-23 = 1.2e-7 relative).
MAX_REL = 1e-6
CASES = [(name, packed) for name in ("tiny", "tiny-tied") for packed in (False, True)]


@pytest.fixture(scope="module")
def measured() -> dict:
    return child_json(Path(__file__).resolve(), timeout=600)


def config(name: str, chunks: int) -> RunConfig:
    return RunConfig(
        model=model_config(name),
        train=TrainConfig(dtype="fp32", seq_length=SEQ, micro_batch_size=MICRO, lm_head_chunks=chunks),
    )


def batch(packed: bool, seed: int = 0):
    return tiny_batch(MICRO, SEQ, packed, seed)


def loss_and_grads(name: str, chunks: int, packed: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    module = pipeline_module(config(name, chunks), 1)
    inputs, targets = batch(packed)
    loss = module.loss_fn(module(inputs), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def compare(name: str, packed: bool) -> dict:
    """The chunked run against the whole-logits run (`helpers.gradients_against`)."""
    whole_loss, whole = loss_and_grads(name, 1, packed)
    return gradients_against(*loss_and_grads(name, CHUNKS, packed), whole_loss, whole)


def largest_saved(chunks: int) -> int:
    """Elements of the largest tensor the loss's forward (head and cross-entropy) saves for backward, but the
    parameters and the hidden states it takes (views of them: the chunks' inputs), which exist anyway."""
    module = pipeline_module(config("tiny", chunks), 1)
    tokens, labels = batch(False)
    out = module(tokens)
    inputs = [out.hidden] if chunks > 1 else []  # unchunked, the head ran (and saved its input) in module(tokens)
    held = {t.untyped_storage().data_ptr() for t in [*inputs, *module.parameters()]}
    sizes = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in held:
            sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module.loss_fn(out, labels)
    return max(sizes)


def whole_sequences_logits() -> dict:
    """Generation and scoring (threed.generate.decode's `evaluation`) run the head for its logits: inside
    `whole_sequences` a chunked tied model's head returns them; outside it defers them again."""
    from threed.model.layers import DeferredLogits, whole_sequences  # megatron: heavy, the child process only

    torch.manual_seed(0)
    chunked = pipeline_module(config("tiny-tied", CHUNKS), 1)
    torch.manual_seed(0)
    whole = pipeline_module(config("tiny-tied", 1), 1)
    tokens, _ = batch(False)
    with torch.no_grad():
        with whole_sequences(chunked.forward_funcs):
            logits = chunked(tokens)
        return {
            "equal": isinstance(logits, torch.Tensor) and torch.equal(logits, whole(tokens)),
            "deferred_after": isinstance(chunked(tokens), DeferredLogits),
        }


def test_chunked_loss_and_gradients_equal_the_whole_logits(measured) -> None:
    for (name, packed), r in zip(CASES, measured["cases"]):
        what = f"{name} {'packed, masked' if packed else 'labels'}"
        print(f"{what}: loss {r['loss']:.6f}, max relative grad diff {r['max_rel']:.3g} in {r['differing']}")
        assert r["loss_equal"], f"{what}: a token's loss is the same arithmetic on the same logits row"
        assert r["max_rel"] <= MAX_REL, what
        assert r["all_nonzero"], what


def test_forward_keeps_no_logits(measured) -> None:
    """What the loss's forward saves for backward: the whole path the fp32 softmax [s, b, V] (and more), the chunked
    one nothing the size of one chunk's logits (only its inputs: views of the hidden states and the weight)."""
    v = model_config("tiny").padded_vocab_size(1)
    assert measured["largest_saved"]["1"] >= SEQ * MICRO * v
    assert measured["largest_saved"][str(CHUNKS)] < SEQ * MICRO * v // CHUNKS


def test_whole_sequences_get_the_logits(measured) -> None:
    assert measured["whole_sequences"] == {"equal": True, "deferred_after": True}


@pytest.mark.parametrize(
    "parallel, train, words",
    [
        (ParallelConfig(), dict(lm_head_chunks=0), ["--lm-head-chunks", ">= 1"]),
        (ParallelConfig(), dict(lm_head_chunks=3), ["--lm-head-chunks 3", "32 tokens", "divisor of 32"]),
        (ParallelConfig(cp=2), dict(lm_head_chunks=32), ["16 tokens", "over cp 2", "divisor of 16"]),
        (ParallelConfig(tp=2, sequence_parallel=True), dict(lm_head_chunks=32), ["16 tokens", "tp 2"]),
        (ParallelConfig(pp=2, pipeline_schedule="zb-h1"), dict(lm_head_chunks=2), ["zb-h1", "1f1b"]),
    ],
)
def test_config_refuses_in_one_line(parallel: ParallelConfig, train: dict, words: list[str]) -> None:
    cfg = dataclasses.replace(config("tiny", 1), parallel=parallel)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))
    with pytest.raises(ConfigError) as e:
        cfg.validate(8)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_config_takes_a_divisor() -> None:
    cfg = dataclasses.replace(config("tiny", 8), parallel=ParallelConfig(tp=2, cp=2, sequence_parallel=True))
    cfg.validate(4)  # 32 tokens / (cp 2 x tp 2) = 8 per rank's head: 8 chunks of one token


def test_memory_model_counts_one_nth_of_the_logits() -> None:
    """The last stage's logits terms from the model's spec: kept for backward, the fp32 softmax (4 B x V/tp per token);
    in the loss's backward, the bf16 logits gradient (2 B). Chunked: nothing kept, one chunk's softmax and gradient at
    a time: 6 B x V/tp x tokens / N, and beside them the sum of the chunks' bf16 gradients of the head's weight
    [V/tp, h]. Everything else of the stage unchanged, so the peak falls by the difference."""
    model = dataclasses.replace(model_config("tiny"), vocab_size=32000)  # a head large enough to set the peak
    tp, micro, seq, n = 2, 2, 256, 8
    v, tokens = model.padded_vocab_size(tp) // tp, micro * seq
    assert logits_bytes(v, tokens) == (4 * v * tokens, 2 * v * tokens)
    assert logits_bytes(v, tokens, n) == (0, 6 * v * tokens // n)
    stage = Stage(index=0, blocks=model.num_layers, first=True, last=True)
    peak = {c: stage_activations(model, tp, 1, stage, micro, 1, seq, False, head_chunks=c) for c in (1, n)}
    assert peak[1] - peak[n] == 6 * v * tokens - 6 * v * tokens // n - 2 * v * model.hidden_size


def _worker() -> dict:
    torch.set_num_threads(1)
    from threed.parallel.distributed import init_distributed, init_megatron_parallel_state, shutdown_distributed

    init_distributed()
    init_megatron_parallel_state(1, 1)
    try:
        return {
            "cases": [compare(name, packed) for name, packed in CASES],
            "largest_saved": {str(c): largest_saved(c) for c in (1, CHUNKS)},
            "whole_sequences": whole_sequences_logits(),
        }
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    print(json.dumps(_worker()))
