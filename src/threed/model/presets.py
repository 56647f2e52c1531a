"""Model presets with the published Llama hyperparameters (HF `config.json` <-> `ModelConfig` is threed.hf.config).

Sources: the `config.json` of each meta-llama/* checkpoint on the HF hub (Llama 2: 7b/13b/70b-hf; Llama 3 / 3.1 /
3.2 / 3.3).
"""

from __future__ import annotations

from threed.config import ModelConfig, RopeScaling

_LLAMA31_SCALING = RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama2(name: str, hidden: int, layers: int, heads: int, kv: int, ffn: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=32000,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_hidden_size=ffn,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    )


# Llama 3.2 1B / 3B: the 3.1 scaling with factor 32, and the LM head tied to the embedding.
_LLAMA32_SCALING = RopeScaling(
    factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def _llama3(name: str, hidden: int, layers: int, heads: int, ffn: int, v31: bool) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=128256,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        ffn_hidden_size=ffn,
        max_position_embeddings=131072 if v31 else 8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling=_LLAMA31_SCALING if v31 else None,
    )


def _llama32(name: str, hidden: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=128256,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        ffn_hidden_size=8192,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling=_LLAMA32_SCALING,
        tie_word_embeddings=True,
    )


PRESETS: dict[str, ModelConfig] = {
    "llama2-7b": _llama2("llama2-7b", 4096, 32, 32, 32, 11008),
    "llama2-13b": _llama2("llama2-13b", 5120, 40, 40, 40, 13824),
    "llama2-70b": _llama2("llama2-70b", 8192, 80, 64, 8, 28672),
    "llama3-8b": _llama3("llama3-8b", 4096, 32, 32, 14336, v31=False),
    "llama3-70b": _llama3("llama3-70b", 8192, 80, 64, 28672, v31=False),
    "llama3.1-8b": _llama3("llama3.1-8b", 4096, 32, 32, 14336, v31=True),
    "llama3.1-70b": _llama3("llama3.1-70b", 8192, 80, 64, 28672, v31=True),
    "llama3.1-405b": _llama3("llama3.1-405b", 16384, 126, 128, 53248, v31=True),
    "llama3.2-1b": _llama32("llama3.2-1b", 2048, 16, 32),  # head_dim 64
    "llama3.2-3b": _llama32("llama3.2-3b", 3072, 28, 24),  # head_dim 128
    "llama3.3-70b": _llama3("llama3.3-70b", 8192, 80, 64, 28672, v31=True),  # the Llama 3.1 70B architecture
    # Tiny CPU models. `tiny` fits tp<=2 (GQA 4/2); `tiny-tp8` has 8 heads and 8 KV heads so tp=8 holds one
    # KV head per rank (the 70B slurm layout scaled down in width). Vocab sized for the demo tokenizer.
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=176,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        make_vocab_size_divisible_by=32,
    ),
    # `tiny` with the LM head tied to the embedding (the Llama 3.2 layout).
    "tiny-tied": ModelConfig(
        name="tiny-tied",
        vocab_size=512,
        hidden_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=176,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        make_vocab_size_divisible_by=32,
        tie_word_embeddings=True,
    ),
    "tiny-tp8": ModelConfig(
        name="tiny-tp8",
        vocab_size=512,
        hidden_size=128,
        num_layers=8,
        num_heads=8,
        num_kv_heads=8,
        ffn_hidden_size=352,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        make_vocab_size_divisible_by=32,
    ),
}
