"""`--torch-compile`: torch.compile of a stage's element-wise kernels (`rope-norm`) or of its whole blocks (`block`),
so that a block issues fewer, fused kernels (issue 35: the host issues ~2,100 launches per micro-batch on a GPU).

Off (`none`, the default) nothing here runs and torch's compiler is never imported: a CPU rank keeps megatron-core's
fusers plain and its start-up free of dynamo and inductor (threed.parallel.megatron_device). On, the compiler is
imported where the flag is applied (`refusal`, `compile_stage`), lazily, and the same code runs on CPU (inductor's
C++ kernels) and on CUDA (its triton kernels).

- `rope-norm`: every RMSNorm of the stage (each block's two, the final norm) is compiled as a module
  (`torch.nn.Module.compile`: its parameters stay the module's, its state dict unchanged), and so is the one function
  that rotates q and k by RoPE's angles. threed builds the angles (`threed.model.rope`); megatron-core's SelfAttention
  applies them with `rope_utils._apply_rotary_pos_emb_bshd` (cos, sin, rotate-half, multiply-add: five element-wise
  kernels, one fused), which is replaced in its module by its compiled self, process-wide (megatron calls it by its
  module-level name; a process runs one run, and the replacement is the same arithmetic).
- `block`: each LlamaBlock is compiled as a module. Dynamo traces megatron's TransformerLayer, our attention and our
  linears; where it cannot (a collective, a custom autograd function it cannot trace) it breaks the graph and runs
  that part eagerly, as before. Refused with ZB-H1 (`threed.config.check_torch_compile`).

Full and selective recompute run compiled modules inside their checkpoints: the recompute traces its own graph
(without grad, then with) and the gradients stay those of the eager path (tests/unit/test_torch_compile.py).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import typing
from typing import Iterable, Optional

import torch

from threed.config import ConfigError, TrainConfig
from threed.model.layers import LlamaBlock
from threed.model.wgrad import SplitColumnParallelLinear, SplitRowParallelLinear

MODES = typing.get_args(typing.get_type_hints(TrainConfig)["torch_compile"])  # the flag's choices, from its field


def refusal(mode: str, device_type: str) -> Optional[str]:
    """The one line refusing `--torch-compile mode` on this device type and torch, or None. What torch offers is asked
    (capabilities, not versions: docs/torch-versions.md); inductor's compiler toolchain is looked up as inductor does:
    `$CXX` or g++ for its C++ kernels on CPU, triton for its CUDA kernels."""
    if mode == "none":
        return None
    flag = f"--torch-compile {mode}"
    if not (callable(getattr(torch, "compile", None)) and callable(getattr(torch.nn.Module, "compile", None))):
        return f"{flag}: this torch ({torch.__version__}) has no torch.compile / Module.compile; drop {flag}"
    # torch._dynamo: the compiler itself (heavy, ~1.5 s); imported only with the flag on, where it will be used anyway
    from torch import _dynamo

    supported = getattr(_dynamo, "is_dynamo_supported", lambda: True)
    if not supported():
        return f"{flag}: torch {torch.__version__} cannot compile on this Python; drop {flag} or use a supported Python"
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return (
                f"{flag} on CUDA needs triton (inductor's GPU kernels); install it (pip install triton) or drop {flag}"
            )
        return None
    cxx = os.environ.get("CXX") or "g++"
    if shutil.which(cxx) is None:
        return (
            f"{flag} on {device_type} needs a C++ compiler for inductor's CPU kernels ({cxx} is not on PATH); install "
            f"g++ (or set CXX) or drop {flag}"
        )
    return None


def check(mode: str, device: torch.device) -> None:
    """`refusal` as a ConfigError (one line, before the layers are built)."""
    line = refusal(mode, device.type)
    if line:
        raise ConfigError(line)


def compile_stage(modules: Iterable[torch.nn.Module], mode: str) -> None:
    """Compile what `mode` says among a stage's layer modules (and their submodules), in place; `none` does
    nothing. A module is compiled at its first call, on the device it then runs on."""
    if mode not in MODES:
        raise ConfigError(f"--torch-compile must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "none":
        return
    wanted = LlamaBlock if mode == "block" else torch.nn.RMSNorm
    for module in {id(m): m for layer in modules for m in layer.modules()}.values():
        if isinstance(module, wanted):
            module.compile()
        if mode == "block" and isinstance(module, (SplitColumnParallelLinear, SplitRowParallelLinear)):
            # Dynamo cannot trace the linears' autograd function (its backward calls megatron's with a ctx dynamo
            # does not fake): each linear runs eagerly between the block's compiled graphs, its TP communication
            # and deferrable weight gradient as they are.
            module._forward_impl = torch.compiler.disable(module._forward_impl)
    if mode == "rope-norm":
        compile_rope()


def compile_rope() -> None:
    """megatron-core's RoPE rotation replaced, in its module, by its compiled self (idempotent)."""
    # megatron: heavy; the module that holds the function SelfAttention's `apply_rotary_pos_emb` calls
    from megatron.core.models.common.embeddings import rope_utils

    rotate = rope_utils._apply_rotary_pos_emb_bshd
    if not getattr(rotate, "threed_compiled", False):
        compiled = torch.compile(rotate)
        compiled.threed_compiled = True  # type: ignore[attr-defined]
        rope_utils._apply_rotary_pos_emb_bshd = compiled
