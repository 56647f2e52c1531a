"""RoPE frequencies, computed by us (megatron's RotaryEmbedding moves its buffer to CUDA, and has no Llama 3.1
scaling in the form HF uses). Layout: megatron-core's rotate-half `[s, 1, 1, head_dim]` angles, which equals
HF's `rotate_half` convention, so HF weights need no permutation."""

from __future__ import annotations

import math
from typing import Optional

import torch

from threed.config import ModelConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: Optional[RopeScaling]) -> torch.Tensor:
    """fp32 inverse frequencies, identical to transformers' default and `llama3` rope initialisers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    old_ctx = scaling.original_max_position_embeddings
    low_freq_wavelen = old_ctx / scaling.low_freq_factor
    high_freq_wavelen = old_ctx / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryAngles:
    """Caches `[s, 1, 1, head_dim]` fp32 angles per (length, device). A plain object, not a module: module
    buffers would be cast to bf16 by DeepSpeed and saved into checkpoints; neither is wanted."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.key = (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)  # what the angles depend on (hashable)
        self._cache: dict[tuple[int, str], torch.Tensor] = {}

    def __call__(self, seq_len: int, device: torch.device) -> torch.Tensor:
        key = (seq_len, str(device))
        if key not in self._cache:
            positions = torch.arange(seq_len, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout
            self._cache[key] = emb[:, None, None, :].to(device)
        return self._cache[key]

    def at_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Angles for explicit per-token positions `[b, s]` (packed sequences: positions restart at each
        document) -> `[s, b, 1, head_dim]`, which megatron's rotate-half RoPE broadcasts over heads."""
        inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.transpose(0, 1).to(torch.float32)[..., None] * inv_freq  # [s, b, d/2]
        return torch.cat((freqs, freqs), dim=-1)[:, :, None, :]


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """Position of each token inside its document, `[b, s]` int64, from contiguous segment ids `[b, s]`
    (`threed.model.attention.document_segments`): 0 at each document's first token. With block-diagonal
    attention RoPE's offsets cancel in exact arithmetic (it is relative), so restarting is about numerics: the same
    angles, hence the same rounding, as the document alone (what HF computes), however far into the row it sits."""
    b, s = segments.shape
    index = torch.arange(s, device=segments.device).expand(b, s)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first
