"""Throughput accounting: tokens/s, model TFLOPs per device, MFU. Why both attention conventions: published MFU
figures differ in how they count causal attention (torchtitan the full square, Megatron-LM since mid-2025 its
half; `threed.model.spec`'s docstring), so a figure is only comparable beside the one of the same convention."""

from __future__ import annotations

import os
from typing import Optional

from threed.config import ModelConfig
from threed.model.spec import Attention, training_flops_per_token

# Dense bf16 peak TFLOPs per device (no sparsity), by substring of torch.cuda.get_device_name().
_PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def flops_per_token(model: ModelConfig, seq_length: int, tp: int = 1, attention: Attention = "full") -> float:
    """Training FLOPs per token (forward + backward, no recompute): `threed.model.spec.training_flops_per_token`
    (matmuls incl. the LM head over the vocabulary padded for `tp`, attention scores over the full square, or with
    attention="causal" over its half)."""
    return training_flops_per_token(model, seq_length, tp, attention)


def peak_tflops_per_device() -> Optional[float]:
    """THREED_PEAK_TFLOPS overrides; otherwise known GPUs; None on CPU (MFU is then not reported)."""
    if os.environ.get("THREED_PEAK_TFLOPS"):
        return float(os.environ["THREED_PEAK_TFLOPS"])
    import torch  # here, so that `threed report` (which reads only files) never imports torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, peak in _PEAK_BF16_TFLOPS.items():
            if key in name:
                return peak
    return None


def throughput(
    model: ModelConfig, seq_length: int, global_batch: int, step_seconds: float, world_size: int
) -> dict[str, Optional[float]]:
    """tokens/s, TFLOP/s per device and MFU, both over the full attention square and (`_causal`) over its half."""
    tokens_per_s = global_batch * seq_length / step_seconds
    tflops = flops_per_token(model, seq_length) * tokens_per_s / world_size / 1e12
    causal = flops_per_token(model, seq_length, attention="causal") * tokens_per_s / world_size / 1e12
    peak = peak_tflops_per_device()
    return {
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": tflops,
        "tflops_per_device_causal": causal,
        "mfu": tflops / peak if peak else None,
        "mfu_causal": causal / peak if peak else None,
    }
