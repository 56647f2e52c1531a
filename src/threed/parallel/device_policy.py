"""The switches that exist only on CUDA, decided in one place from the device type alone.

Pure (no torch): the memory model and the planner ask it too, and `threed check-config` answers in a fraction of a
second because nothing here imports torch. `threed.parallel.distributed` picks the device; this says what that
device turns on. On CPU every switch is off, so a CPU run is the GPU code path minus these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CudaOnly:
    """Switches that exist only on CUDA (`cuda_only` is the one function that decides them)."""

    fused_adamw: bool  # torch AdamW(fused=True): one kernel, no full-size foreach temporary
    fused_swiglu: bool  # megatron's bias_activation_fusion: fused SwiGLU kernel in the MLP
    pinned_batches: bool  # a step's micro-batches staged in page-locked host memory (threed.data.loader.on_device):
    # pinning exists only where a CUDA driver does, and only a copy to a device needs it
    pinned_saves: bool  # --async-save's host copy of a checkpoint in page-locked memory (threed.checkpoint.async_save):
    # a copy from the device at full bandwidth


def cuda_only(device) -> CudaOnly:
    """`device`: "cuda" / "cpu", or a torch.device (its type is read)."""
    on = getattr(device, "type", device) == "cuda"
    return CudaOnly(fused_adamw=on, fused_swiglu=on, pinned_batches=on, pinned_saves=on)
