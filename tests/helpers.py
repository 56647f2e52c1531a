"""Shared test helpers: tiny random HF Llamas built locally, synthetic token files, rank launching."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from threed.config import ModelConfig
from threed.hf.config import from_hf_config

TESTS = Path(__file__).resolve().parent
LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> LlamaConfig kwargs. Vocab 200 with padding multiple 16 pads to 208/224/256 at tp 1/2/4: padding is real.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA (4 query heads / 2 KV heads) with Llama 3.1 rope scaling, short original context so scaling matters.
    "gqa31": dict(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
        rope_theta=500000.0,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_scaling=LLAMA31_SCALING,
    ),
    # Llama-2-like multi-head attention, default RoPE.
    "mha2": dict(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=160,
        rope_theta=10000.0,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    ),
}


def hf_model(name: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**HF_CONFIGS[name], tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def model_config(name: str) -> ModelConfig:
    hf = hf_model(name).config.to_dict()
    return dataclasses.replace(from_hf_config(hf, name=name), make_vocab_size_divisible_by=16)


def write_dataset(
    prefix: Path | str, tokens: np.ndarray, vocab_size: int, doc_len: tuple[int, int] = (40, 400), seed: int = 0
) -> str:
    """Cut a token stream into documents of random length and write them as a megatron-core `.bin/.idx` pair with
    megatron's own IndexedDatasetBuilder (the format Megatron-LM's preprocess_data.py writes). Returns the prefix."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    rng = np.random.default_rng(seed)
    start = 0
    while start < len(tokens):
        n = int(rng.integers(*doc_len))
        builder.add_item(torch.from_numpy(np.asarray(tokens[start : start + n], dtype=np.int64)))
        builder.end_document()
        start += n
    builder.finalize(prefix + ".idx")
    return prefix


def gpt_dataset(cfg, global_batch: int):
    """The train dataset `threed train` builds for `cfg` (a RunConfig), built here in one process: the reference
    side of data-order tests."""
    from threed.data.datasets import build_datasets
    from threed.data.splits import read_data_flags

    return build_datasets(cfg, read_data_flags(cfg), global_batch, builds_here=True)


def learnable_tokens(n: int, alphabet: int = 16, seed: int = 0) -> np.ndarray:
    """A noisy bigram pattern over a few token ids (next = 7*prev + 3 mod alphabet, 10% random): loss falls fast."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int64)
    out[0] = 1
    for i in range(1, n):
        out[i] = rng.integers(alphabet) if rng.random() < 0.1 else (out[i - 1] * 7 + 3) % alphabet
    return out


def sft_examples(n: int, vocab_size: int, length: tuple[int, int] = (6, 40), seed: int = 0) -> list[tuple]:
    """`n` synthetic chat examples (tokens, mask): a random prompt (mask 0) then a response (mask 1) that follows a
    learnable bigram pattern, as `threed preprocess --sft` would store them."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        total = int(rng.integers(*length))
        prompt = int(rng.integers(1, total - 1))
        tokens = rng.integers(0, vocab_size, total)
        for i in range(prompt, total):
            tokens[i] = (tokens[i - 1] * 7 + 3) % min(vocab_size, 16) if rng.random() > 0.1 else rng.integers(16)
        out.append((tokens.astype(np.int64), np.r_[np.zeros(prompt), np.ones(total - prompt)].astype(np.uint8)))
    return out


def write_sft_dataset(base: Path | str, examples: list[tuple], vocab_size: int) -> str:
    """BASE_text_document + BASE_mask_document (one example per document, the mask as uint8), the pair `threed
    preprocess --sft` writes, through megatron's IndexedDatasetBuilder. Returns the text prefix."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    base = str(base)
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    text = IndexedDatasetBuilder(base + "_text_document.bin", dtype=DType.optimal_dtype(vocab_size))
    mask = IndexedDatasetBuilder(base + "_mask_document.bin", dtype=np.uint8)
    for tokens, m in examples:
        text.add_item(torch.from_numpy(np.asarray(tokens, dtype=np.int64)))
        mask.add_item(torch.from_numpy(np.asarray(m, dtype=np.uint8)))
        text.end_document()
        mask.end_document()
    text.finalize(base + "_text_document.idx")
    mask.finalize(base + "_mask_document.idx")
    return base + "_text_document"


def plain_adamw(model, train) -> tuple:
    """The single-process reference's optimizer: torch AdamW (no decay on 1-D weights, as Megatron) and threed's
    warmup + cosine multiplier, for a TrainConfig `train`."""
    from threed.config import RunConfig
    from threed.train.engine import lr_lambda

    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=train.adam_eps,
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(RunConfig(model=None, train=train)))


def plain_step(model, opt, sched, loss, grad_clip: float) -> float:
    """backward, clip, step: one reference step; returns the gradient norm before clipping."""
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item()
    opt.step()
    sched.step()
    return norm
