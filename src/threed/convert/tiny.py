"""A small random HF Llama saved locally (the demo's and the tests' starting point; nothing is downloaded).

threed make-tiny-hf --out runs/demo/hf-init --like tiny [--vocab-size 512] [--tokenizer runs/demo/tok.model]
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Optional

import torch

from threed.config import ModelConfig
from threed.convert.io_utils import ConvertError, atomic_output_dir, parse_dtype
from threed.hf.config import to_hf_config
from threed.hf.write import write_sentencepiece_tokenizer
from threed.model.spec import parameter_count
from threed.model.presets import PRESETS


def hf_config_kwargs(cfg: ModelConfig) -> dict[str, Any]:
    """LlamaConfig kwargs for a ModelConfig (through to_hf_config, the mapping export uses)."""
    hf = to_hf_config(cfg)
    for key in ("architectures", "model_type", "torch_dtype"):
        hf.pop(key, None)
    return hf


def make_tiny_hf(
    out: str | os.PathLike,
    like: str = "tiny",
    vocab_size: Optional[int] = None,
    seed: int = 0,
    dtype: str = "fp32",
    tokenizer: Optional[str] = None,
    max_shard_size: str = "50GB",
    force: bool = False,
) -> Path:
    """Save a random `transformers.LlamaForCausalLM` with the shape of preset `like` to `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers: heavy, only to build the model

    if like not in PRESETS:
        raise ConvertError(f"unknown preset {like!r}: use one of {', '.join(PRESETS)}")
    cfg = PRESETS[like]
    if parameter_count(cfg) > 50_000_000:
        raise ConvertError(f"{like} has {parameter_count(cfg) / 1e9:.1f}B parameters; make-tiny-hf is for small models")
    if vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**hf_config_kwargs(cfg)))
    torch_dtype = parse_dtype(dtype)
    if torch_dtype is not None:
        model = model.to(torch_dtype)
    with atomic_output_dir(out, force) as tmp:
        model.save_pretrained(tmp, max_shard_size=max_shard_size)
        if tokenizer:
            write_sentencepiece_tokenizer(Path(tokenizer), tmp)
    return Path(out)
