"""Fixtures for the converter tests: tiny random HF Llamas saved locally in every source format the converter
reads, and helpers to read HF directories back.

    from convert_fixtures import save_hf, hf_tensors, GQA8
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from helpers import LLAMA31_SCALING, learnable_tokens, write_dataset

# GQA (16 query heads / 8 KV heads, 2 per group) so tp 1..8 all hold whole KV groups and tp=8 holds exactly
# one KV head per rank; vocab 200 needs padding at every tp (multiple 16*tp); Llama 3.1 rope scaling.
GQA8: dict[str, Any] = dict(
    vocab_size=200,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=96,
    rope_theta=500000.0,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_scaling=LLAMA31_SCALING,
)
# 8 query heads / 4 KV heads: at tp=4 each rank holds exactly one KV head and its two query heads.
GQA4: dict[str, Any] = dict(
    vocab_size=200,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=176,
    rope_theta=500000.0,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_scaling=LLAMA31_SCALING,
)
DIVISIBLE_BY = "16"  # --make-vocab-size-divisible-by for the tests: 200 -> 208 / 224 / 256 at tp 1 / 2 / 4


def hf_model(config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**config, tie_word_embeddings=tied)).to(dtype).eval()


def save_hf(
    out: Path,
    config: dict[str, Any] = GQA8,
    fmt: str = "safetensors",
    shard_kb: int = 0,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save a random HF Llama: fmt 'safetensors' (transformers' own writer; sharded with an index when
    shard_kb > 0) or 'bin' (old pytorch_model*.bin shards with pytorch_model.bin.index.json, written here
    because transformers 5 no longer writes them)."""
    model = hf_model(config, seed, dtype)
    if fmt == "safetensors":
        model.save_pretrained(out, max_shard_size=f"{shard_kb}KB" if shard_kb else "50GB")
        return out
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if not shard_kb:
        torch.save(sd, out / "pytorch_model.bin")
        return out
    names = sorted(sd)
    groups: list[list[str]] = [[]]
    for n in names:
        if groups[-1] and sum(sd[m].numel() * sd[m].element_size() for m in groups[-1]) > shard_kb * 1000:
            groups.append([])
        groups[-1].append(n)
    weight_map = {}
    for i, g in enumerate(groups):
        fname = f"pytorch_model-{i + 1:05d}-of-{len(groups):05d}.bin"
        torch.save({n: sd[n] for n in g}, out / fname)
        weight_map.update({n: fname for n in g})
    (out / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


def hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF directory (safetensors or bin), read eagerly: the reference for round trips."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    for f in sorted(path.glob("pytorch_model*.bin")):
        out.update(torch.load(f, weights_only=True))
    return out


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b), f"names differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (
            f"{k}: {a[k].dtype}{list(a[k].shape)} vs {b[k].dtype}{list(b[k].shape)}"
        )
        assert torch.equal(a[k], b[k]), f"{k} differs (max abs {(a[k].float() - b[k].float()).abs().max()})"


def write_tokens(prefix: Path, n: int, vocab: int, seed: int = 0) -> str:
    """A learnable token stream (next = 7*prev + 3 mod V, 10% noise) as a megatron `.bin/.idx` dataset."""
    return write_dataset(prefix, learnable_tokens(n, vocab, seed), vocab, seed=seed)


# Llama 3.2's layout at test size: the LM head tied to the embedding (transformers saves no lm_head.weight), GQA
# 4 query heads / 2 KV heads, 5 blocks (7 pipeline layers with files, 8 with the tied head: pp=3 is uneven), a
# vocab of 500 that --make-vocab-size-divisible-by 32 pads to 512 at tp 1 and 2.
TIED: dict[str, Any] = dict(
    vocab_size=500,
    hidden_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    rope_theta=500000.0,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_scaling=LLAMA31_SCALING,
    tie_word_embeddings=True,
)
TIED_DIVISIBLE_BY = "32"


def save_tied_hf(out: Path, config: dict[str, Any] = TIED, seed: int = 0, shard_kb: int = 0) -> Path:
    """Save a random tied HF Llama with transformers' own writer (one weight: no lm_head.weight in the files)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out, max_shard_size=f"{shard_kb}KB" if shard_kb else "50GB")
    return out
