"""Model presets with the published Llama hyperparameters, and HF `config.json` <-> `ModelConfig`.

Sources: the `config.json` of each meta-llama/* checkpoint on the HF hub (Llama 2: 7b/13b/70b-hf; Llama 3 / 3.1).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

from threed.config import ConfigError, ModelConfig, RopeScaling

_LLAMA31_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192)


def _llama2(name: str, hidden: int, layers: int, heads: int, kv: int, ffn: int) -> ModelConfig:
    return ModelConfig(name=name, vocab_size=32000, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv, ffn_hidden_size=ffn, max_position_embeddings=4096, rope_theta=10000.0,
                       rms_norm_eps=1e-5)


def _llama3(name: str, hidden: int, layers: int, heads: int, ffn: int, v31: bool) -> ModelConfig:
    return ModelConfig(name=name, vocab_size=128256, hidden_size=hidden, num_layers=layers, num_heads=heads,
                       num_kv_heads=8, ffn_hidden_size=ffn, max_position_embeddings=131072 if v31 else 8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, rope_scaling=_LLAMA31_SCALING if v31 else None)


PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": _llama2("llama2-7b", 4096, 32, 32, 32, 11008),
    "llama2-13b": _llama2("llama2-13b", 5120, 40, 40, 40, 13824),
    "llama2-70b": _llama2("llama2-70b", 8192, 80, 64, 8, 28672),
    "llama3-8b": _llama3("llama3-8b", 4096, 32, 32, 14336, v31=False),
    "llama3-70b": _llama3("llama3-70b", 8192, 80, 64, 28672, v31=False),
    "llama3.1-8b": _llama3("llama3.1-8b", 4096, 32, 32, 14336, v31=True),
    "llama3.1-70b": _llama3("llama3.1-70b", 8192, 80, 64, 28672, v31=True),
    "llama3.1-405b": _llama3("llama3.1-405b", 16384, 126, 128, 53248, v31=True),
    # Tiny CPU models. `tiny` fits tp<=2 (GQA 4/2); `tiny-tp8` has 8 heads and 8 KV heads so tp=8 holds one
    # KV head per rank (the 70B slurm layout scaled down in width). Vocab sized for the demo tokenizer.
    "tiny": ModelConfig(name="tiny", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                        ffn_hidden_size=176, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                        make_vocab_size_divisible_by=32),
    "tiny-tp8": ModelConfig(name="tiny-tp8", vocab_size=512, hidden_size=128, num_layers=8, num_heads=8,
                            num_kv_heads=8, ffn_hidden_size=352, max_position_embeddings=256, rope_theta=10000.0,
                            rms_norm_eps=1e-5, make_vocab_size_divisible_by=32),
}


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
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if hf.get(flag):
            raise ConfigError(f"{flag}=true is not a Llama 2/3 layout and is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf['hidden_act']!r} is not supported (Llama uses silu)")
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "llama3":
        scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif rope_type == "default":
        scaling = None
    else:
        raise ConfigError(f"rope type {rope_type!r} is not supported (only default and llama3)")
    heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    if hf.get("head_dim") not in (None, hidden // heads):
        raise ConfigError(f"head_dim {hf['head_dim']} != hidden_size/num_attention_heads = {hidden // heads}")
    cfg = ModelConfig(
        name=name, vocab_size=int(hf["vocab_size"]), hidden_size=hidden, num_layers=int(hf["num_hidden_layers"]),
        num_heads=heads, num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf["intermediate_size"]),
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)), rope_theta=theta,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)), rope_scaling=scaling,
    )
    cfg.validate()
    return cfg


def to_hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The HF `config.json` dict for a ModelConfig (what `threed export` writes)."""
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope.update(rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings)
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_hidden_size,
        "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "initializer_range": cfg.init_std, "torch_dtype": "float32",
    }


def get_model_config(name_or_path: str) -> ModelConfig:
    """A preset name; a converted or trained checkpoint directory (its recorded model, vocab padding included);
    or a path to an HF config.json / model directory."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if (Path(name_or_path) / "threed_run.json").is_file():
        from threed.checkpoint.format import read_model_config

        recorded = read_model_config(name_or_path)
        if recorded is not None:
            return recorded
    if Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise ConfigError(
        f"unknown model {name_or_path!r}: use one of {', '.join(PRESETS)}, a checkpoint directory or a path "
        f"to an HF config.json"
    )
