"""Pipeline micro-batches from megatron-core's datasets (`threed.data.datasets`), in Megatron's sample order.

Sample order (Megatron-LM's MegatronPretrainingSampler): global batch k is samples [k*GBS, (k+1)*GBS) of the
(blended) train dataset; data-parallel rank r takes the contiguous share [k*GBS + r*GBS/dp, k*GBS + (r+1)*GBS/dp),
in micro-batches of `micro`. The order depends only on the global batch, never on dp, so a run resumed at another
data-parallel size reads exactly the samples it would have read. Position = consumed samples, saved with every
checkpoint.

A micro-batch is what DeepSpeed's pipeline loads: `(tokens, (labels, loss_mask))` for training, with a third
target, the one-hot source dataset of each sample, for evaluation (per-dataset validation loss).

A step's micro-batches reach the device together (`on_device`): one pinned, non-blocking copy per kind of tensor, so
the host queues the step's kernels without waiting for a copy, and DeepSpeed's per-micro-batch `.to(device)` finds
a tensor already there (a no-op).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist


class SampleCounter:
    """Samples this rank has read (the tests count reads per pipeline stage)."""

    def __init__(self) -> None:
        self.samples = 0


def micro_batches(
    dataset,
    global_batch: int,
    micro: int,
    dp: int,
    dp_rank: int,
    start_sample: int,
    vocab_size: int,
    num_datasets: int = 0,
    counter: Optional[SampleCounter] = None,
) -> Iterator[tuple]:
    """Endless micro-batches for this data-parallel rank from `start_sample` (consumed samples) on.
    With `num_datasets` > 0 the targets carry each sample's one-hot source dataset (evaluation)."""
    share = global_batch // dp
    consumed = start_sample
    while True:
        first = consumed + dp_rank * share
        for m in range(share // micro):
            samples = [dataset[i] for i in range(first + m * micro, first + (m + 1) * micro)]
            if counter is not None:
                counter.samples += len(samples)
            yield collate(samples, vocab_size, num_datasets)
        consumed += global_batch


def collate(samples: Sequence[dict], vocab_size: int, num_datasets: int = 0) -> tuple:
    """Packed SFT samples carry per-position example ids: the inputs are then `(tokens, doc_ids)`, which the
    embedding stage passes on with the hidden states (`threed.model.layers`)."""
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    loss_mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).float()
    top = int(max(tokens.max(), labels.max()))
    if top >= vocab_size:  # the last guard behind check_data's (sampled, for big corpora) vocabulary check
        raise ValueError(
            f"a training sample holds token id {top} >= the model's vocab_size {vocab_size}: the data "
            f"was made with another tokenizer; re-run `threed preprocess` with the model's tokenizer"
        )
    inputs = tokens
    if "doc_ids" in samples[0]:
        inputs = (tokens, torch.stack([torch.as_tensor(s["doc_ids"]) for s in samples]).to(torch.int32))
    if not num_datasets:
        return inputs, (labels, loss_mask)
    ids = torch.tensor([int(s.get("dataset_id", 0)) for s in samples])
    return inputs, (labels, loss_mask, torch.nn.functional.one_hot(ids, num_datasets).float())


def token_weighted(step: list[tuple], dp_group=None, device: Optional[torch.device] = None) -> tuple[list[tuple], int]:
    """One step's micro-batches `(inputs, (labels, loss_mask))` -> `(inputs, (labels, weights))` where every loss
    token of the global batch weighs the same: weights = loss_mask x (gas x dp) / (loss tokens of the global batch,
    summed over `dp_group`). DeepSpeed then divides the summed micro-batch losses by gas and averages gradients over
    dp, so the step minimises sum(token loss x mask) / count over the whole global batch (Megatron-LM's
    --calculate-per-token-loss), and the loss it reports is that masked mean. Needed for SFT, where the response
    tokens per micro-batch vary a lot; a per-micro-batch mean would weigh a token of a short answer more.
    Called on the last pipeline stage only (it holds the loss); collective over `dp_group` when given. Returns the
    weighted micro-batches and the global batch's loss-token count."""
    count = torch.zeros(1, dtype=torch.float64, device=device)  # the group's backend decides where it lives
    for _, (_, mask) in step:
        count += mask.sum(dtype=torch.float64).to(count.device)
    dp = 1
    if dp_group is not None:
        dist.all_reduce(count, group=dp_group)
        dp = dist.get_world_size(dp_group)
    total = count.item()  # the step's start: the one read of the count
    scale = len(step) * dp / max(total, 1.0)
    return [(inputs, (labels, mask * scale)) for inputs, (labels, mask) in step], int(total)


def on_device(step: list[tuple], device: torch.device, pin: bool) -> list[tuple]:
    """One step's micro-batches, moved to `device` in one copy per tensor position: the micro-batches' tensors at
    each position of the `(inputs, targets)` structure are stacked into one host buffer (page-locked when `pin`:
    threed.parallel.device_policy's `pinned_batches`, CUDA only), copied with `non_blocking=True`, and each
    micro-batch gets its view of the copy. Values are unchanged (a stack and its slices), so losses are bit-identical
    to loading the micro-batches one by one. Pageable memory would make the copy wait for the host."""
    if not step:
        return step
    leaves = [_leaves(b) for b in step]
    moved = []
    for column in zip(*leaves):
        buffer = torch.empty((len(column), *column[0].shape), dtype=column[0].dtype, pin_memory=pin)
        torch.stack(column, out=buffer)
        moved.append(buffer.to(device, non_blocking=True))
    return [_rebuild(b, iter([m[i] for m in moved])) for i, b in enumerate(step)]


def _leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of a micro-batch's nested tuples, depth first."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    return [t for part in tree for t in _leaves(part)]


def _rebuild(tree: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """`tree`'s structure with its tensors replaced, in `_leaves`' order, by `tensors`."""
    if isinstance(tree, torch.Tensor):
        return next(tensors)
    return type(tree)(_rebuild(part, tensors) for part in tree)
