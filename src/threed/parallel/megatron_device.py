"""megatron-core on the device policy's device: the one adaptation of its CUDA-only allocations.

megatron-core 0.16.1 allocates some communication buffers with `device=torch.cuda.current_device()`:
`tensor_parallel/mappings.py` (the sequence-parallel all-gather and reduce-scatter outputs), `tensor_parallel/layers.py`
(the backward's reduce-scatter buffer of a sequence-parallel linear) and `utils.py` (`GlobalMemoryBuffer`, the
all-gather buffer of the forward). On a CPU/gloo run that call raises, so those modules are given a `torch` whose
`cuda.current_device()` is the device `threed.parallel.distributed` chose; every other attribute is torch's own. On a
GPU that is the device megatron would have used, so a CPU run and a GPU run execute the same layers.

Selective recompute (`--recompute-granularity selective`) runs megatron's `tensor_parallel.checkpoint`, which saves
and restores the CUDA generator's state around the recompute (`random._get_cuda_rng_state` /
`_set_cuda_rng_state`); CPU torch has no CUDA generator and raises. Off CUDA there is no CUDA state to keep, so
those two become "nothing" / "nothing to restore"; the CPU generator and megatron's RNG tracker are still saved
and restored as megatron does. On a GPU both stay megatron's.
"""

from __future__ import annotations

from typing import Any

import torch


class _Cuda:
    """`torch.cuda` with `current_device()` answering the run's device."""

    def __init__(self, device: torch.device):
        self._device = device

    def current_device(self) -> Any:
        return torch.cuda.current_device() if self._device.type == "cuda" else self._device

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _Torch:
    """`torch` with the `cuda` above."""

    def __init__(self, device: torch.device):
        self.cuda = _Cuda(device)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def use_device(device: torch.device) -> None:
    """Point megatron-core's buffers at `device` (once per process, before a layer runs; idempotent)."""
    # megatron: heavy; imported where process groups are made anyway (threed.parallel.distributed.init_distributed)
    from megatron.core import utils
    from megatron.core.tensor_parallel import layers, mappings, random

    proxy = _Torch(device)
    for module in (mappings, layers, utils):
        module.torch = proxy  # type: ignore[attr-defined]
    if device.type != "cuda":
        random._get_cuda_rng_state = _no_cuda_rng_state  # type: ignore[attr-defined]
        random._set_cuda_rng_state = _keep_no_cuda_rng_state  # type: ignore[attr-defined]


def _no_cuda_rng_state(*_args: Any, **_kwargs: Any) -> None:
    """megatron's `_get_cuda_rng_state` off CUDA: there is no CUDA generator whose state a recompute must repeat."""
    return None


def _keep_no_cuda_rng_state(_state: Any, *_args: Any, **_kwargs: Any) -> None:
    """megatron's `_set_cuda_rng_state` off CUDA: what `_no_cuda_rng_state` saved (nothing) is restored."""
