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
from threed.model.spec import (
    LayerKind,
    Param,
    PipelineLayer,
    full_shape,
    layer_parameters,
    shard_shape,
    split_axis,
    tp_segments,
)

# Rows drawn per task: large enough that the pool's overhead is small, small enough to balance the threads.
_ROWS_PER_TASK = 64


def _seed(seed: int, layer_index: int, name: str, index: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{layer_index}/{name}/{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def draw_rows(
    seed: int,
    layer_index: int,
    name: str,
    indices: Sequence[int],
    length: int,
    std: float,
    threads: Optional[int] = None,
) -> torch.Tensor:
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


def _std(model: ModelConfig, p: Param) -> float:
    if p.init == "scaled":  # the output projections: Megatron-LM's scaled init
        return model.init_std / math.sqrt(2.0 * model.num_layers)
    return model.init_std


def shard_of(model: ModelConfig, layer_index: int, p: Param, tp: int, tp_rank: int, seed: int) -> torch.Tensor:
    """This TP rank's shard of the unsharded parameter `p` of pipeline layer `layer_index`: the rows (columns for
    a row-parallel weight) that `spec.tp_segments` gives the rank, each from its own generator."""
    shape = shard_shape(model, p, tp)
    if p.init == "ones":
        return torch.ones(*shape)
    std = _std(model, p)
    axis = split_axis(p.split)
    full = full_shape(model, p, tp)
    segments = tp_segments(p.split, full[axis], tp, tp_rank)
    other = full[1 - axis]  # the length of each drawn row: the axis TP does not split
    if p.split == "gate_up":
        # [gate; up]: each half keyed on its own (name:gate / name:up, index within the half).
        half = full[0] // 2
        gate, up = segments
        return torch.cat(
            [
                draw_rows(seed, layer_index, p.name + ":gate", range(gate.start, gate.start + gate.length), other, std),
                draw_rows(
                    seed, layer_index, p.name + ":up", range(up.start - half, up.start - half + up.length), other, std
                ),
            ]
        )
    (seg,) = segments
    out = torch.zeros(seg.length, other)
    real = [i for i in range(seg.start, seg.start + seg.length) if p.split != "vocab" or i < model.vocab_size]
    if real:  # vocabulary padding rows stay zero (the LM head masks them)
        out[: len(real)] = draw_rows(seed, layer_index, p.name, real, other, std)
    return out.t() if axis == 1 else out  # row-parallel: keyed by column, drawn as rows


@torch.no_grad()
def init_layer_(
    module: torch.nn.Module,
    layer_kind: LayerKind,
    layer_index: int,
    model: ModelConfig,
    tp: int,
    tp_rank: int,
    seed: int,
) -> None:
    """Fill every parameter of one pipeline layer's module (on any device) with its layout-independent init."""
    table = {p.name: p for p in layer_parameters(layer_kind)}
    params = dict(module.named_parameters())
    unknown = set(params) - set(table)
    if unknown:
        raise RuntimeError(
            f"no initialisation rule for {sorted(unknown)} in a {layer_kind} layer; add it to "
            f"threed.model.spec.PARAMETERS"
        )
    for name, param in params.items():
        value = shard_of(model, layer_index, table[name], tp, tp_rank, seed)
        if tuple(value.shape) != tuple(param.shape):
            raise RuntimeError(
                f"{layer_kind} layer {layer_index}: {name} is {list(param.shape)} in the module, "
                f"{list(value.shape)} in threed.model.spec"
            )
        param.copy_(value)


def init_pipeline_layers_(
    layers: Iterable[tuple[PipelineLayer, torch.nn.Module]], model: ModelConfig, tp: int, tp_rank: int, seed: int
) -> None:
    """Each (spec layer, its module): a tied weight is drawn from its owner layer's seeds on every stage that holds
    a copy, so the copies start bit-identical without a broadcast."""
    for layer, module in layers:
        init_layer_(module, layer.kind, layer.index, model, tp, tp_rank, seed)
