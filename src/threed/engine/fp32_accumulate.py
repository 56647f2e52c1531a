"""The bf16 gradients added into BF16_Optimizer's fp32 accumulation buffer in one mixed-dtype add, with no fp32 copy.

Under bf16 with fp32 gradient accumulation and ZeRO-1 (threed.engine.ds_config), DeepSpeed 0.19.8 picks its
BF16_Optimizer (`DeepSpeedEngine._do_optimizer_sanity_check`: bf16 model, fp32 grad_accum_dtype, stage 1, no
offload). Its per-parameter gradient hook (`immediate_grad_update`) runs `_update_hp_grad`, which does
`hp_grad.add_(lp.grad.to(fp32).view(...))`: every micro-batch, an fp32 copy of every parameter's bf16 gradient is
written and read back before the add (4 B/param written, 4 read, one temporary as large as the largest parameter).
`hp_grad.add_(lp.grad)` promotes element by element inside the add: bf16 -> fp32 is exact, so the sums have the same
bits (tests/unit/test_loss_bytes.py at the tensor level, tests/ranks/test_bytes.py over a pipeline run with gas > 1).
On CUDA the add's kernel casts as it reads; on CPU torch makes the fp32 copy inside the add itself, so a CPU run saves
no memory, only the GPU does.

This is the one place threed changes a DeepSpeed method, and only where it can tell what it replaces: DeepSpeed's
`_update_hp_grad` must be the one read here (its source's digest), and torch's in-place add must promote bf16 into
fp32. Otherwise DeepSpeed's own method stays: the same bits, one temporary more. AutoEP's TP folding correction (not a
threed layout) and a parameter without a gradient go to DeepSpeed's method as well.
"""

from __future__ import annotations

import hashlib
import inspect
import textwrap
from typing import Any, Callable

import torch

# sha256 of DeepSpeed 0.19.8's `BF16_Optimizer._update_hp_grad` source (dedented), the method `_add_into_fp32` repeats
# without the cast.
DEEPSPEED_0_19_8 = "feea4e5c7758eff6baceb9c9bb794e2c1b25f7d23abdfbab63df88538ee477fa"


def install() -> bool:
    """Put `_add_into_fp32` in place of BF16_Optimizer's `_update_hp_grad` where that method and torch allow (see the
    module docstring); idempotent. True when installed."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer  # heavy: deepspeed, only where an engine is built

    current = BF16_Optimizer._update_hp_grad
    if current is _add_into_fp32:
        return True
    if not (_is_read_here(current) and _promotes_in_place()):
        return False
    _add_into_fp32.deepspeed = current  # type: ignore[attr-defined]
    BF16_Optimizer._update_hp_grad = _add_into_fp32
    return True


def _is_read_here(method: Callable[..., Any]) -> bool:
    try:
        source = inspect.getsource(method)
    except (OSError, TypeError):  # no source to compare (a frozen or compiled install)
        return False
    return hashlib.sha256(textwrap.dedent(source).encode()).hexdigest() == DEEPSPEED_0_19_8


def _promotes_in_place() -> bool:
    acc = torch.zeros(2)
    try:
        acc.add_(torch.tensor([1.0, -2.5], dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return acc.dtype == torch.float32 and acc.tolist() == [1.0, -2.5]


@torch.no_grad()
def _add_into_fp32(self, lp, group_idx, param_idx, clear_lp_grads):
    """DeepSpeed 0.19.8's `BF16_Optimizer._update_hp_grad`, the bf16 gradient added as it is."""
    if lp.grad is None or getattr(self, "autoep_folding_tp_group", None) is not None:
        return _add_into_fp32.deepspeed(self, lp, group_idx, param_idx, clear_lp_grads)  # type: ignore[attr-defined]
    hp_grad = self.fp32_groups_gradients[group_idx][param_idx]
    assert hp_grad is not None, f"no fp32 gradient buffer for lp param {id(lp)} [{group_idx}][{param_idx}]"
    hp_grad.data.add_(lp.grad.data.view(hp_grad.shape))  # fp32 += bf16, promoted inside the add
    lp._hp_grad = hp_grad
    self.fp32_groups_has_gradients[group_idx][param_idx] = True
    if clear_lp_grads:
        lp.grad.zero_()
