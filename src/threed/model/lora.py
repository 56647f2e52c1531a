"""LoRA adapters on megatron-core's tensor-parallel linears: the base weight frozen, `y = W x + alpha/r * B A x`.

One `LoraAdapter` per base linear holds the adapters of every target on it: q, k and v on the fused `linear_qkv`,
gate and up on the fused `linear_fc1`, each its own A and B (canonical: what an HF PEFT file holds, so an adapter
comes in and goes out exactly; threed.convert.lora says which rows of each are this TP rank's and where the fused
output puts them). It runs as a forward hook of the base linear, adding its output to the base's.

TP layout: Megatron-Bridge's `ParallelLinearAdapter` (its peft utils; NeMo's is the same), so no adapter weight is
replicated over TP and the gradient norm counts each element once (every adapter tensor is tagged
`tensor_model_parallel`):
  column-parallel base (q k v gate up; output rows sharded): A [r/tp, in] (its linear_in: a ColumnParallelLinear
      with gather_output=True: the rank dimension is gathered), B [out/tp, r] (its linear_out: ColumnParallelLinear,
      gather_output=False), the output staying this rank's rows as the base's does;
  row-parallel base (o down; input columns sharded): A [r, in/tp] (linear_in: a RowParallelLinear, its output
      all-reduced), B [out/tp, r] (linear_out: ColumnParallelLinear with gather_output=True: the whole output).
Sequence parallelism, as Bridge does it: a column-parallel base's input [s/tp, b, h] is all-gathered along the
sequence before A (reduce-scattered in backward); a row-parallel base's adapter output is cut to this rank's
sequence part after B (all-gathered in backward), matching the base's reduce-scattered output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from threed.model.spec import LORA_ADAPTER, is_adapter_key
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)


@dataclass(frozen=True)
class TargetShape:
    """One target's adapter on this TP rank: A and B shard shapes, and (column-parallel bases) where B's output rows
    go in the base's output rows: (B row, length, base output row) runs."""

    a_shape: tuple[int, int]
    b_shape: tuple[int, int]
    placement: tuple[tuple[int, int, int], ...] = ()


class LoraAdapter(torch.nn.Module):
    """The adapters of one base linear. `row_parallel`: the base is a RowParallelLinear (input sharded over TP);
    `out_features`: the base's output features on this rank. Sequence parallelism is the base's own flag, read at
    each call (generation switches it off for whole sequences: threed.model.layers.whole_sequences)."""

    def __init__(
        self,
        targets: dict[str, TargetShape],
        row_parallel: bool,
        out_features: int,
        scale: float,
        dropout: float,
    ):
        super().__init__()
        self.row_parallel, self.scale = row_parallel, scale
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.A = torch.nn.ParameterDict()
        self.B = torch.nn.ParameterDict()
        for name, shape in targets.items():
            self.A[name] = torch.nn.Parameter(torch.zeros(shape.a_shape))
            self.B[name] = torch.nn.Parameter(torch.zeros(shape.b_shape))
            # A: rank rows (column base) or input columns (row base) over TP; B: output rows. Every element on one
            # TP rank only: DeepSpeed's gradient norm sums them over the TP group.
            set_tensor_model_parallel_attributes(self.A[name], True, 1 if row_parallel else 0, 1)
            set_tensor_model_parallel_attributes(self.B[name], True, 0, 1)
        self.out_features = out_features
        index = [dst + i for shape in targets.values() for _, length, dst in shape.placement for i in range(length)]
        # Column bases: base output row of each adapter output row (the targets' B rows concatenated in order).
        self.register_buffer("destination", torch.tensor(index, dtype=torch.long), persistent=False)
        self._register_load_state_dict_pre_hook(self._keep_if_absent)

    def _keep_if_absent(self, state_dict: dict, prefix: str, *_args) -> None:
        """A base checkpoint's layer files hold no adapters: loading one (strictly, as DeepSpeed and
        threed.convert.into_stage do) leaves the adapters as they are; the base's own keys stay checked."""
        for name, p in self.named_parameters():
            state_dict.setdefault(prefix + name, p.detach())

    def hook(self, module: torch.nn.Module, args: tuple, output: tuple) -> tuple:
        """The base linear's forward hook: its (output, bias) with the adapters' output added."""
        out, bias = output
        return out + self.delta(args[0], bool(module.sequence_parallel)), bias

    def _input(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        if self.dropout is not None:
            x = self.dropout(x)  # PEFT draws one mask per target module
        if self.row_parallel:
            return x
        # Column base: the whole input on every rank; its gradient, partial per rank, summed over TP (under SP:
        # reduce-scattered back to this rank's sequence part).
        if sequence_parallel:
            return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
        return copy_to_tensor_model_parallel_region(x)

    def delta(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        if self.row_parallel:
            return self._row_delta(x, sequence_parallel)
        shared = self._input(x, sequence_parallel) if self.dropout is None else None
        parts = []
        for name in self.A:
            xin = shared if shared is not None else self._input(x, sequence_parallel)
            h = gather_from_tensor_model_parallel_region(F.linear(xin, self.A[name]))  # [.., r]: A's rank rows
            h = copy_to_tensor_model_parallel_region(h)  # its gradient, partial per rank (B's rows), summed
            parts.append(F.linear(h, self.B[name]))
        rows = torch.cat(parts, dim=-1) * self.scale
        out = rows.new_zeros(*rows.shape[:-1], self.out_features)
        return out.index_copy(-1, self.destination, rows)

    def _row_delta(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        out: Optional[torch.Tensor] = None
        for name in self.A:
            h = reduce_from_tensor_model_parallel_region(
                F.linear(self._input(x, False), self.A[name])
            )  # sum over inputs
            h = copy_to_tensor_model_parallel_region(h)
            y = gather_from_tensor_model_parallel_region(F.linear(h, self.B[name])) * self.scale
            if sequence_parallel:
                y = scatter_to_sequence_parallel_region(y)  # the base's output is this rank's sequence part
            out = y if out is None else out + y
        assert out is not None
        return out


def attach(linear: torch.nn.Module, adapter: LoraAdapter) -> None:
    """Put `adapter` on the base `linear` (a submodule, so its parameters are saved with the layer)."""
    linear.add_module(LORA_ADAPTER, adapter)
    linear.register_forward_hook(adapter.hook)


def freeze_base(module: torch.nn.Module) -> int:
    """requires_grad False on every parameter but the adapters': no gradient, and DeepSpeed's optimizer (handed
    only trainable parameters, threed.engine.optimizer) holds no master weight or Adam state for them. Returns the
    adapters' element count."""
    trainable = 0
    for name, p in module.named_parameters():
        p.requires_grad_(is_adapter_key(name))
        trainable += p.numel() if p.requires_grad else 0
    return trainable


def input_requires_grad(_module: torch.nn.Module, _args: tuple, output):
    """The embedding's forward hook under LoRA: its output (hidden states, or (hidden, doc_ids)) requires grad. With
    the embedding frozen it would not, and DeepSpeed's reentrant activation checkpoint of the first stage's blocks
    (torch.utils.checkpoint's reentrant variant) then runs their backward for nobody: no adapter there would get a
    gradient (Megatron-Bridge's peft/recompute.py makes the same input require grad)."""
    hidden = output[0] if isinstance(output, tuple) else output
    if not hidden.requires_grad:
        hidden.requires_grad_(True)
    return output
