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

megatron-core decorates its fusable element-wise kernels (SwiGLU, GeLU, bias-dropout-add, ...) with
`megatron.core.jit.jit_fuser`, which is `torch.compile`: decorating imports torch's compiler stack (dynamo,
inductor, sympy's users: ~1.6 s of a rank's start on CPU) whether or not a fused kernel ever runs. On a CPU run none
does (`threed.parallel.distributed.cuda_only`: every fusion is a CUDA switch), so when the device policy says CPU,
`skip_fuser_compile` has megatron switch its fuser off (its own `disable_jit_fuser`, the plain function) as its jit
module is first imported: the same eager code runs, and the compiler is never imported. On CUDA the decorators stay
`torch.compile`, as megatron has them.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

import torch

JIT_MODULE = "megatron.core.jit"  # where megatron-core keeps `jit_fuser` and `disable_jit_fuser`


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


def skip_fuser_compile(device_type: str) -> None:
    """Off CUDA, megatron-core's `jit_fuser` becomes the plain function before any module decorates with it (see the
    module docstring). Must run before megatron-core is first imported (`threed.parallel.distributed` calls it as it
    is imported, with the device policy's `device_type`); later, or on CUDA, it changes nothing. A megatron-core
    without `disable_jit_fuser` keeps its decorators (what it offers is asked, not its version)."""
    if device_type == "cuda" or JIT_MODULE in sys.modules:
        return
    if not any(isinstance(finder, _FuserOffFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _FuserOffFinder())


class _FuserOffFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` where the ordinary path finder does, with a loader that switches its fuser off."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _FuserOffLoader(spec.loader)
        return spec


class _FuserOffLoader(importlib.abc.Loader):
    """megatron's own loader of `megatron.core.jit`, then its `disable_jit_fuser()`: the modules that import
    `jit_fuser` from it afterwards (all of them: it is imported by the first) decorate with the plain function."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        disable = getattr(module, "disable_jit_fuser", None)
        if callable(disable):
            disable()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)  # get_source and the rest, for tracebacks
