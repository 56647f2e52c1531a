"""Random initialisation that depends only on the seed and the tensor, never on the layout.

Every weight is defined row by row (or column by column) of its *unsharded* tensor: index `i` along the tensor's
key axis is drawn from its own generator, seeded from (seed, pipeline layer index, parameter name, i). A TP rank
then draws only the indices of its own shard, so

- the weights are identical at any tp and pp (the export of a random init is the same HF model at every layout),
- no two blocks are equal (the layer index is in every seed; before this, every pipeline stage re-seeded the
  same global generator and built its blocks as copies of the first stage's),
- a rank never materialises a full (unsharded) master weight: megatron's `use_cpu_initialization` draws the whole
  [2f, h] fc1 on every TP rank and keeps 1/tp of it (~20 GB of host memory and minutes per rank at 405B),
- the rows are independent, so a thread pool draws them in parallel (torch ops release the GIL).

The key axis is the one TP splits: rows for column-parallel and vocab-parallel weights, columns for row-parallel
ones. Distributions follow Megatron-LM: N(0, init_std) for the embedding, QKV, fc1 and the LM head; N(0,
init_std / sqrt(2 * num_layers)) for the two output projections (linear_proj, linear_fc2); norms are ones;
vocabulary padding rows are zero (the LM head masks them).
"""
from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional, Sequence

import torch

from threed.config import ModelConfig
from threed.model.sharding import SHARDING, ShardKind

# Rows drawn per task: large enough that the pool's overhead is small, small enough to balance the threads.
_ROWS_PER_TASK = 64


def _seed(seed: int, layer_index: int, name: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{layer_index}/{name}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def draw_rows(seed: int, layer_index: int, name: str, indices: Sequence[int], length: int, std: float,
              threads: Optional[int] = None) -> torch.Tensor:
    """`[len(indices), length]` fp32: row k is N(0, std) from the generator of key index `indices[k]`."""
    out = torch.empty(len(indices), length, dtype=torch.float32)

    def fill(start: int) -> None:
        gen = torch.Generator()
        for k in range(start, min(start + _ROWS_PER_TASK, len(indices))):
            gen.manual_seed(_seed(seed, layer_index, name, indices[k]))
            out[k].normal_(0.0, std, generator=gen)

    starts = range(0, len(indices), _ROWS_PER_TASK)
    workers = threads or int(os.environ.get("THREED_INIT_THREADS", "0")) or (os.cpu_count() or 1)
    if workers <= 1 or len(starts) <= 1:
        for s in starts:
            fill(s)
    else:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(fill, starts))
    return out


def _std(model: ModelConfig, name: str) -> float:
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return model.init_std / math.sqrt(2.0 * model.num_layers)
    return model.init_std


def shard_of(model: ModelConfig, layer_index: int, name: str, kind: ShardKind, shape: Sequence[int], tp: int,
             tp_rank: int, seed: int) -> torch.Tensor:
    """This TP rank's shard (shape `shape`) of the unsharded tensor `name` of pipeline layer `layer_index`."""
    std = _std(model, name)
    if kind == "replicated":
        return torch.ones(*shape)
    rows, cols = shape
    if kind == "vocab":
        first = tp_rank * rows
        real = [i for i in range(first, first + rows) if i < model.vocab_size]
        out = torch.zeros(rows, cols)
        if real:
            out[:len(real)] = draw_rows(seed, layer_index, name, real, cols, std)
        return out
    if kind in ("column", "qkv"):
        # qkv: megatron's grouped layout [q heads of group | k | v] makes each TP shard a contiguous row range.
        return draw_rows(seed, layer_index, name, range(tp_rank * rows, (tp_rank + 1) * rows), cols, std)
    if kind == "gate_up":
        # Each rank holds [gate_r; up_r]: its slice of the gate rows, then its slice of the up rows.
        half = rows // 2
        own = range(tp_rank * half, (tp_rank + 1) * half)
        return torch.cat([draw_rows(seed, layer_index, name + ":gate", own, cols, std),
                          draw_rows(seed, layer_index, name + ":up", own, cols, std)])
    if kind == "row":
        # Keyed by column (the split axis): draw this rank's columns as rows, then transpose.
        return draw_rows(seed, layer_index, name, range(tp_rank * cols, (tp_rank + 1) * cols), rows, std).t()
    raise ValueError(f"unknown shard kind {kind!r}")


@torch.no_grad()
def init_layer_(module: torch.nn.Module, layer_kind: str, layer_index: int, model: ModelConfig, tp: int,
                tp_rank: int, seed: int) -> None:
    """Fill every parameter of one pipeline layer's module (on any device) with its layout-independent init."""
    kinds = SHARDING[layer_kind]
    params = dict(module.named_parameters())
    unknown = set(params) - set(kinds)
    if unknown:
        raise RuntimeError(f"no initialisation rule for {sorted(unknown)} in a {layer_kind} layer; add it to "
                           f"threed.model.sharding.SHARDING")
    for name, param in params.items():
        value = shard_of(model, layer_index, name, kinds[name], tuple(param.shape), tp, tp_rank, seed)
        param.copy_(value)


def init_pipeline_layers_(layers: Iterable[tuple[int, torch.nn.Module]], kinds: dict[int, str],
                          model: ModelConfig, tp: int, tp_rank: int, seed: int) -> None:
    for index, module in layers:
        init_layer_(module, kinds[index], index, model, tp, tp_rank, seed)
