"""What a micro-batch holds between its input-gradient pass B and its weight-gradient pass W under
`--pipeline-schedule zb-h1` (`threed.parallel.schedule`), for the memory model.

Megatron's deferred weight gradient (`grad_output_buffer`) keeps, per Column/RowParallelLinear and micro-batch, the
linear's saved input and its output gradient until W computes `grad_output^T @ input`; everything else of the
micro-batch is freed by B. Per TP rank and token, in the activation dtype:

    column-parallel (qkv, fc1, LM head)   input h (h / tp under sequence parallelism: megatron saves its own
                                          sequence part and all-gathers it again at W), output its rows / tp
    row-parallel (o, fc2)                 input its columns / tp, output h (h / tp under sequence parallelism:
                                          the output gradient is the all-gather of the ranks' sequence parts;
                                          threed.model.wgrad keeps its own part and gathers it again at W)

The widths are the weights' own shapes per TP rank (`threed.model.spec.shard_shape`: [output, input]), so a
linear added to the table is counted here without an edit. The LM head of a tied model runs the embedding's
weight through the same linear: its row of the table has the same shape. A recomputed block's W holds the same,
recomputed, tensors, so this does not depend on the recompute flags.
"""

from __future__ import annotations

from functools import cache
from typing import Iterable

from threed.config import ModelConfig
from threed.model.spec import LayerKind, Param, layer_parameters, shard_shape, split_axis

BF16 = 2


def deferred_bytes_per_token(model: ModelConfig, tp: int, kind: LayerKind, sequence_parallel: bool = False) -> int:
    """Bytes one layer of `kind` keeps per token of the sequence for its deferred weight gradients (0: none)."""
    return _deferred_bytes(model, tp, layer_parameters(kind), sequence_parallel and tp > 1)


@cache  # pure; a planner's search asks it for every layer of every layout it weighs (keyed by the table's rows)
def _deferred_bytes(model: ModelConfig, tp: int, params: tuple[Param, ...], sp: bool) -> int:
    total = 0
    for p in params:
        if not p.megatron_linear:
            continue
        out_width, in_width = shard_shape(model, p, tp)
        # Under SP a column-parallel linear (rows split) keeps its input as the rank's sequence part, a row-parallel
        # one its output gradient.
        if sp and split_axis(p.split) == 0:
            in_width //= tp
        elif sp:
            out_width //= tp
        total += BF16 * (in_width + out_width)
    return total


def awaiting_w_bytes(model: ModelConfig, tp: int, kinds: Iterable[LayerKind], sequence_parallel: bool = False) -> int:
    """Bytes per token one micro-batch awaiting W holds on a stage of these layers (`threed.memory.model.stage_kinds`:
    one entry per layer, a block once per block)."""
    return sum(deferred_bytes_per_token(model, tp, kind, sequence_parallel) for kind in kinds)
