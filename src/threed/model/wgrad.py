"""The weight-gradient split for zero-bubble schedules (`--pipeline-schedule zb-h1`, threed.parallel.schedule):
megatron-core's Column/RowParallelLinear with a backward that, while `DEFERRED.deferring()` is on, computes only the
input gradient and queues the weight gradient for the schedule's W pass.

The forward is megatron's function, and so is the backward outside a W-split schedule (1F1B, evaluation, anything
else). While deferring, the backward is megatron's input-gradient half, with the same tensor-parallel
communication (the all-reduce of the input gradient, or the sequence-parallel reduce-scatter), and the weight
gradient is queued with what it needs: the saved input and the output gradient.

The W pass recomputes nothing: it multiplies the kept output gradient by the kept input (under sequence parallelism
both are kept as this rank's sequence part, 1/tp of the bytes, and all-gathered again over TP: megatron's backward
re-gathers the input the same way) and hands the result to autograd on the weight itself, so it lands exactly where
the fused backward would put it, through the parameter's AccumulateGrad: DeepSpeed's BF16_Optimizer hooks (fp32
accumulation) and ZeRO's see it as usual. One `torch.autograd.backward` call per W pass (the micro-batch's linears
together), each weight gradient computed inside it just before its AccumulateGrad (`_WeightGradient`), so only one
is alive at a time, as with one call per linear.

    python -m pytest tests/ranks/test_pipeline_schedule.py
"""

from __future__ import annotations

import functools
from collections import deque
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication
from megatron.core.utils import get_tensor_model_parallel_group_if_none, prepare_input_tensors_for_wgrad_compute


# One deferred weight gradient: the weight, and what computes its gradient (no graph, as inside a backward).
Deferred = tuple[torch.Tensor, Callable[[], torch.Tensor]]


class _WeightGradient(torch.autograd.Function):
    """A handle on one deferred weight gradient: its backward computes the gradient, which autograd's engine passes
    to the weight's AccumulateGrad. AccumulateGrad nodes run first among ready nodes, so each gradient reaches its
    parameter (and DeepSpeed's hooks free the bf16 copy) before the next handle computes its own."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.compute = compute
        return weight.new_empty(0)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):  # type: ignore[override]
        compute, ctx.compute = ctx.compute, None  # the kept input and output gradient go with it
        return compute(), None


class DeferredWeightGrads:
    """The queue of deferred weight gradients: one group per backward (micro-batch), run first in, first out.
    One per process (like megatron's parallel_state): the linears deep inside a block cannot be handed it."""

    def __init__(self) -> None:
        self._active = False
        self._current: list[Deferred] = []
        self._groups: deque[list[Deferred]] = deque()

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """While on, split-backward linears queue their weight gradients; on exit they form one group."""
        assert not self._active, "nested deferral"
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self._groups.append(self._current)
            self._current = []

    @property
    def active(self) -> bool:
        return self._active

    def put(self, item: Deferred) -> None:
        self._current.append(item)

    def pending(self) -> int:
        return len(self._groups)

    def run_oldest(self) -> None:
        """The W pass: the oldest backward's weight gradients, in the order its backward met the linears, in one
        autograd call (one start of autograd's engine per micro-batch, not one per linear). The handles are made
        newest first: the engine runs the highest sequence number first, so the first handle made runs last."""
        group = self._groups.popleft()
        if not group:
            return
        handles = [_WeightGradient.apply(weight, compute) for weight, compute in reversed(group)]
        torch.autograd.backward(tensors=handles, grad_tensors=[torch.empty_like(h) for h in handles])

    def clear(self) -> None:
        self._groups.clear()
        self._current = []


DEFERRED = DeferredWeightGrads()


def _gather_sequence(part: torch.Tensor, tp_group) -> torch.Tensor:
    """The TP group's sequence parts, concatenated along the first (sequence) dimension in group-rank order: what
    megatron's sequence-parallel all-gather makes."""
    full = torch.empty((part.shape[0] * tp_group.size(), *part.shape[1:]), dtype=part.dtype, device=part.device)
    torch.distributed.all_gather_into_tensor(full, part.contiguous(), group=tp_group)
    return full


def _weight_grad(
    input_: torch.Tensor,
    grad_output: torch.Tensor,
    input_part: bool,
    grad_output_part: bool,
    tp_group,
) -> torch.Tensor:
    # What megatron's backward does for the weight (gradient_accumulation_fusion is off in threed: no main_grad),
    # without recording a graph, as inside a backward.
    with torch.no_grad():
        if input_part:
            input_ = _gather_sequence(input_, tp_group)
        if grad_output_part:
            grad_output = _gather_sequence(grad_output, tp_group)
        grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, input_)
        return grad_output.t().matmul(total_input)


def _backward(ctx, grad_output: torch.Tensor, keep_sequence_part: bool):
    base = LinearWithGradAccumulationAndAsyncCommunication.backward
    if not DEFERRED.active or ctx.grad_output_buffer is not None or ctx.gradient_accumulation_fusion:
        return base(ctx, grad_output)
    input_, weight = ctx.saved_tensors
    # megatron's backward without its weight-gradient half. (Its own deferral, `grad_output_buffer`, only skips
    # the weight gradient under gradient_accumulation_fusion: the apex main_grad kernel, CUDA only, which threed
    # does not use; without it megatron computes the weight gradient anyway.)
    grad_input = grad_output.matmul(weight)
    grad_bias = grad_output.sum(dim=tuple(range(grad_output.dim() - 1))) if ctx.use_bias else None
    if ctx.sequence_parallel:
        # The input was all-gathered over TP in forward: its gradient is reduce-scattered back (megatron's).
        shape = (grad_input.shape[0] // ctx.tp_group.size(), *grad_input.shape[1:])
        grad_input_part = torch.empty(shape, dtype=grad_input.dtype, device=grad_input.device)
        torch.distributed.reduce_scatter_tensor(grad_input_part, grad_input.contiguous(), group=ctx.tp_group)
        grad_input = grad_input_part
    elif ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
    kept = grad_output
    if keep_sequence_part:
        # A row-parallel linear under sequence parallelism: its output gradient is the all-gather of the TP ranks'
        # sequence parts (the reduce-scatter's backward), so every rank holds the same [s, b, h]. W keeps only
        # this rank's part (its own bits: the gather concatenates the parts unchanged) and gathers again, as the
        # column-parallel linears do with their input: 1/tp of the bytes while it waits.
        rank = torch.distributed.get_rank(ctx.tp_group)
        kept = grad_output.chunk(ctx.tp_group.size(), dim=0)[rank].clone()
    compute = functools.partial(_weight_grad, input_, kept, ctx.sequence_parallel, keep_sequence_part, ctx.tp_group)
    DEFERRED.put((weight, compute))
    return grad_input, None, grad_bias, None, None, None, None, None, None


class SplitBackwardLinear(LinearWithGradAccumulationAndAsyncCommunication):
    """megatron's linear function (its forward, and its backward unless deferring); while DEFERRED is on, the
    backward returns the input gradient only and queues the weight gradient."""

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return _backward(ctx, grad_output, keep_sequence_part=False)


class SplitBackwardSequenceParallelRow(LinearWithGradAccumulationAndAsyncCommunication):
    """The same, for a row-parallel linear under sequence parallelism (its W keeps a sequence part)."""

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        return _backward(ctx, grad_output, keep_sequence_part=True)


def _split_forward(
    function,
    input,
    weight,
    bias,
    gradient_accumulation_fusion,
    allreduce_dgrad,
    sequence_parallel,
    grad_output_buffer=None,
    wgrad_deferral_limit=0,
    tp_group=None,
    **_ignored,
):
    """megatron's `linear_with_grad_accumulation_and_async_allreduce`, applying `function`."""
    return function.apply(
        input,
        weight,
        bias,
        gradient_accumulation_fusion,
        allreduce_dgrad,
        sequence_parallel,
        grad_output_buffer,
        wgrad_deferral_limit,
        get_tensor_model_parallel_group_if_none(tp_group),
    )


class _SplitBackward:
    """Mixin over megatron's linear: its `_forward_impl` chooses between a frozen and a trainable linear function;
    the trainable one becomes ours (same forward, same arguments)."""

    def _forward_impl(self, input, weight, *args, **kwargs):
        if not weight.requires_grad or args:
            return super()._forward_impl(input, weight, *args, **kwargs)  # type: ignore[misc]
        row_sp = isinstance(self, RowParallelLinear) and self.sequence_parallel  # type: ignore[attr-defined]
        return _split_forward(
            SplitBackwardSequenceParallelRow if row_sp else SplitBackwardLinear, input, weight, **kwargs
        )


class SplitColumnParallelLinear(_SplitBackward, ColumnParallelLinear):
    """megatron's ColumnParallelLinear (qkv, gate+up, LM head) with the deferrable weight gradient."""


class SplitRowParallelLinear(_SplitBackward, RowParallelLinear):
    """megatron's RowParallelLinear (attention output, down) with the deferrable weight gradient."""
