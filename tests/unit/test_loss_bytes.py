"""Fewer bytes per micro-batch, checked at the tensor level in one process (a gloo world of one, megatron-core at
tp 1): the loss on bf16 logits through megatron-core's fused cross-entropy (threed.model.layers.token_losses) and the
fp32 gradient accumulation in one mixed-dtype add (threed.engine.fp32_accumulate). The pipeline runs with TP, CP,
packed rows and gas > 1 are in tests/ranks (test_bytes.py, test_training.py, test_context_parallel.py,
test_sft_train.py).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/unit/test_loss_bytes.py
"""

from __future__ import annotations

import threed.parallel.distributed  # noqa: F401  (first, as every entry point: the device policy, then megatron)
import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.fusions import fused_cross_entropy
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from threed.engine import fp32_accumulate
from threed.model.layers import token_losses
from threed.parallel.distributed import init_megatron_parallel_state

SEQ, MICRO, VOCAB = 24, 3, 1000


@pytest.fixture
def tp1(own_process_group, monkeypatch):
    """A world of one with megatron-core's groups at tp 1; the fused cross-entropy's steps as a CPU rank runs them
    (plain functions: tests/unit/test_megatron_device.py checks a CPU rank never compiles them; a module imported
    before the device policy in this pytest process may have decorated them with torch.compile)."""
    for name in ("calculate_logits_max", "calculate_predicted_logits", "calculate_cross_entropy_loss"):
        fn = getattr(fused_cross_entropy, name)
        monkeypatch.setattr(fused_cross_entropy, name, getattr(fn, "__wrapped__", fn))
    fn = fused_cross_entropy.calculate_gradients
    monkeypatch.setattr(fused_cross_entropy, "calculate_gradients", getattr(fn, "__wrapped__", fn))
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    init_megatron_parallel_state(1, 1)
    yield
    parallel_state.destroy_model_parallel()


def logits_and_labels(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 logits [s, b, V] at a trained model's spread (std 3), the same values in `dtype`, labels [b, s]."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(SEQ, MICRO, VOCAB, generator=gen) * 3
    labels = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
    return logits, logits.to(dtype), labels


def loss_and_grad(fn, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor):
    """Per-token losses [b, s] and the logits' gradient of sum(loss x weight) (weights: a masked, weighted loss)."""
    x = logits.detach().clone().requires_grad_(True)
    losses = fn(x, labels)
    (losses * weights).sum().backward()
    return losses.detach(), x.grad


def unfused(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss before this change: logits cast to fp32, then megatron's unfused vocab-parallel cross-entropy."""
    return vocab_parallel_cross_entropy(logits.float(), labels.transpose(0, 1).contiguous()).transpose(0, 1)


def token_weights(seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(MICRO, SEQ, generator=gen) * (torch.rand(MICRO, SEQ, generator=gen) > 0.3)


def test_bf16_logits_give_the_unfused_losses_and_gradient_bit_for_bit(tp1, monkeypatch):
    calls = []
    fused = fused_cross_entropy.fused_vocab_parallel_cross_entropy
    monkeypatch.setattr(
        "threed.model.layers.fused_vocab_parallel_cross_entropy", lambda *a: (calls.append(1), fused(*a))[1]
    )
    _, bf16, labels = logits_and_labels(torch.bfloat16)
    w = token_weights()
    loss, grad = loss_and_grad(token_losses, bf16, labels, w)
    want_loss, want_grad = loss_and_grad(unfused, bf16, labels, w)
    assert calls == [1], "bf16 logits take megatron's fused cross-entropy"
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert torch.equal(loss, want_loss)
    assert torch.equal(grad, want_grad)


def test_fp32_logits_keep_the_unfused_path_and_an_fp32_gradient(tp1):
    logits, _, labels = logits_and_labels(torch.float32)
    w = token_weights()
    loss, grad = loss_and_grad(token_losses, logits, labels, w)
    want_loss, want_grad = loss_and_grad(unfused, logits, labels, w)
    assert torch.equal(loss, want_loss) and torch.equal(grad, want_grad)
    assert grad.dtype == torch.float32
    # The fused backward would have rounded the gradient to bf16: this one is not.
    assert not torch.equal(grad, grad.bfloat16().float())


def test_bf16_loss_and_gradient_against_the_fp32_reference(tp1):
    """What bf16 logits cost against fp32 logits of the same values. Rounding the logits to bf16 (8 significant bits:
    a relative 2^-8 at most) moves log-sum-exp and the target logit by at most 2^-8 max|x| each, so a token's loss by
    2^-7 max|x|, and the softmax p by p 2^-7 max|x| (first order); the gradient p - onehot is then rounded to bf16, a
    relative 2^-8. Measured here (std-3 logits, max|x| 13.3, V 1000): loss 0.018 at most (0.2% of it), gradient
    5.9e-3 at most (of 0.95), 3.7% at most relative where |g| > 1e-3, and 0.92 of the bound below at its tightest (a
    target's -1 entry, where the final rounding is the whole error)."""
    logits, bf16, labels = logits_and_labels(torch.bfloat16, seed=2)
    w = token_weights(seed=3)
    loss, grad = loss_and_grad(token_losses, bf16, labels, w)
    ref_loss, ref_grad = loss_and_grad(unfused, logits, labels, w)
    top = logits.abs().max().item()
    loss_err = (loss - ref_loss).abs().max().item()
    grad_err = (grad.float() - ref_grad).abs()
    p = torch.softmax(logits, dim=-1) * w.transpose(0, 1).unsqueeze(-1)  # the gradient's scale per element
    bound = 1.05 * (2**-8 * ref_grad.abs() + 2**-7 * top * p) + 1e-30  # 5%: the first order's remainder
    tightest = (grad_err / bound).max().item()
    print(f"bf16 vs fp32: max |loss diff| {loss_err:.3g} (max|x| {top:.3g}), grad diff / bound at most {tightest:.3g}")
    assert 0 < loss_err <= 2**-7 * top
    assert (grad_err <= bound).all()


def test_mixed_dtype_add_gives_the_bits_of_cast_then_add():
    """fp32 += bf16 (one add, promoted element by element) against fp32 += bf16.to(fp32), over many accumulations of
    gradients of mixed magnitude: the same bits every time."""
    gen = torch.Generator().manual_seed(0)
    acc_one, acc_two = torch.zeros(4096), torch.zeros(4096)
    for k in range(16):
        grad = (torch.randn(4096, generator=gen) * 10.0 ** (k % 5 - 2)).bfloat16()
        acc_one.add_(grad)
        acc_two.add_(grad.to(torch.float32))
        assert torch.equal(acc_one, acc_two)
    assert acc_one.dtype == torch.float32


def test_fp32_accumulation_is_installed_only_over_the_method_it_read(monkeypatch):
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    original = BF16_Optimizer._update_hp_grad
    monkeypatch.setattr(BF16_Optimizer, "_update_hp_grad", getattr(original, "deepspeed", original))
    assert fp32_accumulate.install()
    assert BF16_Optimizer._update_hp_grad is fp32_accumulate._add_into_fp32
    assert fp32_accumulate.install(), "idempotent"

    def changed(self, lp, group_idx, param_idx, clear_lp_grads):  # another DeepSpeed's method: left alone
        return None

    monkeypatch.setattr(BF16_Optimizer, "_update_hp_grad", changed)
    assert not fp32_accumulate.install()
    assert BF16_Optimizer._update_hp_grad is changed
