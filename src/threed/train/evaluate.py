"""Validation loss through DeepSpeed's pipeline `eval_batch`, reduced exactly.

Each evaluation runs `eval_iters` global batches of the valid split with the training micro-batch shape (another
shape would need DeepSpeed's reset_activation_shape, #3045). Evaluation k reads valid samples
[k * eval_iters * GBS, (k+1) * eval_iters * GBS), in the training sampler's order, so the result does not depend on
the layout. The loss is the token-weighted mean: the last stage's loss_fn returns (sum of token losses, token
count) and the same per source dataset, summed over micro-batches and data-parallel ranks — not DeepSpeed's mean
of micro-batch means.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from threed.data.loader import SampleCounter, micro_batches, on_device
from threed.model.context import share_batches
from threed.parallel.device_policy import cuda_only


@dataclass
class EvalResult:
    loss: float
    tokens: int
    per_dataset: dict[str, float] = field(default_factory=dict)  # source prefix -> loss (only for a blend)

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


def evaluate(
    engine,
    valid_dataset,
    dataset_names: tuple[str, ...],
    eval_index: int,
    eval_iters: int,
    micro: int,
    gas: int,
    vocab_size: int,
    device: torch.device,
    counter: Optional[SampleCounter] = None,
) -> EvalResult:
    """Every rank calls this (DeepSpeed's eval_batch is collective). Returns the same result on every rank. Under
    context parallelism DeepSpeed's data axis holds dp x cp ranks: the rows are dealt over dp (megatron's
    data-parallel group without CP), and the CP ranks of a data-parallel rank each take their share of them."""
    n = max(1, len(dataset_names))
    batches = None
    if engine.is_first_stage() or engine.is_last_stage():
        batches = valid_batches(valid_dataset, eval_index * eval_iters, micro, gas, vocab_size, n, counter)
    totals = torch.zeros(2 + 2 * n, dtype=torch.float64, device=device)
    pin = cuda_only(device).pinned_batches
    for _ in range(eval_iters):
        # DeepSpeed 0.19's eval_batch adds each micro-batch loss into `total_loss`, which only train_batch resets:
        # after a training step it still holds that step's scalar, and our loss vector cannot be added to it.
        engine.total_loss = None
        # The batch's micro-batches reach the device together, as a training step's do (threed.train.loop).
        staged = None if batches is None else iter(on_device([next(batches) for _ in range(gas)], device, pin))
        outputs = engine.eval_batch(
            staged, compute_loss=True, reduce_output=None, bcast_loss=False, num_micro_batches=gas
        )
        if engine.is_last_stage():
            totals += torch.stack([o.detach().to(device, torch.float64) for o in outputs]).sum(dim=0)
    engine.total_loss = None
    # Every TP rank of the last stage holds the same sums: count them once per data-parallel replica and CP rank
    # (each CP rank's sums are over its own share of the rows' tokens).
    if not (engine.is_last_stage() and engine.grid.get_slice_parallel_rank() == 0):
        totals.zero_()
    # float64 so that a token count stays exact and the sum of losses loses nothing in the reduction.
    dist.all_reduce(totals)
    loss_sum, count = totals[0].item(), totals[1].item()
    per_dataset = {}
    if len(dataset_names) > 1:
        sums, counts = totals[2 : 2 + n].tolist(), totals[2 + n :].tolist()
        per_dataset = {name: s / c for name, s, c in zip(dataset_names, sums, counts) if c > 0}
    return EvalResult(loss=loss_sum / max(count, 1.0), tokens=int(count), per_dataset=per_dataset)


def valid_batches(valid_dataset, first_batch: int, micro: int, gas: int, vocab_size: int, n: int, counter):
    """This rank's micro-batches of valid global batches from `first_batch` on, in the training sampler's order:
    dealt over dp (megatron's data-parallel group without CP), then each CP rank's share of them."""
    from megatron.core import parallel_state as ps  # megatron: heavy, as wherever an engine exists

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    global_batch = micro * gas * dp
    rows = micro_batches(
        valid_dataset,
        global_batch,
        micro,
        dp,
        dp_rank,
        first_batch * global_batch,
        vocab_size,
        num_datasets=n,
        counter=counter,
    )
    return share_batches(rows, cp, cp_rank)
