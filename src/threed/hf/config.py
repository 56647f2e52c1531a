"""HF Llama `config.json` <-> `ModelConfig`: the one place that knows HF's config keys (both the transformers<5
layout, `rope_theta` / `rope_scaling`, and the v5 one, `rope_parameters`), what `threed convert` reads and what
`threed export` writes.

    cfg = from_hf_config("Meta-Llama-3-8B")            # a directory, its config.json, or the parsed dict
    write_config(out_dir, cfg, torch.bfloat16, source_config)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

from threed.config import ConfigError, ModelConfig, RopeScaling

if TYPE_CHECKING:  # torch only names the dtype here: importing presets / this module stays torch-free
    import torch


def from_hf_config(src: Union[str, Path, dict[str, Any]], name: str = "hf") -> ModelConfig:
    """Build a ModelConfig from an HF Llama `config.json` (path, its directory, or the parsed dict).

    Handles both the transformers<5 layout (`rope_theta`, `rope_scaling`) and the v5 one (`rope_parameters`).
    """
    if not isinstance(src, dict):
        path = Path(src)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no HF config at {path}: pass a HF model directory that holds config.json")
        name = path.parent.name or name
        src = json.loads(path.read_text())
    hf = src
    if hf.get("model_type", "llama") != "llama":
        raise ConfigError(f"model_type {hf.get('model_type')!r} is not 'llama'; only Llama checkpoints convert")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ConfigError(f"{flag}=true is not a Llama 2/3 layout and is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (Llama uses silu)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "default":
        scaling = None
    else:
        raise ConfigError(f"rope type {rope_type!r} is not supported (only default and llama3)")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    if hf.get("head_dim") not in (None, hidden // heads):
        raise ConfigError(f"head_dim {hf['head_dim']} != hidden_size/num_attention_heads = {hidden // heads}")
    cfg = ModelConfig(
        name=name,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
        rope_scaling=scaling,
        # transformers' LlamaConfig default is False (Llama 2 / 3 / 3.1); Llama 3.2 1B / 3B say true.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    cfg.validate()
    return cfg


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` dict for a ModelConfig (what `threed export` writes)."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "initializer_range": cfg.init_std,
        "torch_dtype": "float32",
    }


# Keys of the source's config.json that describe tokens, not the weights' layout: carried over on export.
_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def write_config(out_dir: Path, cfg: ModelConfig, dtype: torch.dtype, source_config: Optional[dict] = None) -> None:
    """OUT/config.json for a ModelConfig whose weights are `dtype`; token ids come from the source's config."""
    hf = to_hf_config(cfg)
    hf.pop("torch_dtype", None)
    hf["dtype"] = str(dtype).replace("torch.", "")  # torch.bfloat16 -> "bfloat16", HF's name for it
    for key in _TOKEN_KEYS:
        if source_config and key in source_config:
            hf[key] = source_config[key]
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
