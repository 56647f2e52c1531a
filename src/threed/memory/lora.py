"""What LoRA (`--lora-rank`, threed.model.lora) changes in the memory model and the step-time model: the adapters'
elements per TP rank and what their forward keeps for backward. Pure (no torch): `threed check-config`, `threed
memory` and `threed plan` count LoRA without the heavy libraries.

An adapter's shapes come from the base weight it sits on, read off the HF table (`threed.hf.names.hf_shapes`: the
q_proj ... down_proj tensors of a block), as threed.convert.lora reads them to cut PEFT tensors into TP shards:
rank r on a base of [out, in] is A [r, in] + B [out, r]. Every adapter element lives on one TP rank (Megatron-Bridge's
layout: column bases shard A's rank and B's rows, row bases A's columns and B's rows), so a rank holds 1/tp of them;
tests/unit/test_memory_lora.py checks both against `threed.convert.lora.target_slices`, rank by rank.

What a block keeps for backward under LoRA (`activation_bytes_per_token`), against a full fine-tune:
  the frozen base linears (megatron's `linear_with_frozen_weight`) keep no input, but each adapter keeps the same
  one (A's input: the norm's output, the attention's output, the SwiGLU product), so with every target chosen the
  block's terms stay as they are (fewer targets keep less: the estimate is then an upper bound);
  plus per target B's input [r] (bf16), and under sequence parallelism A's input on a column-parallel base (q k v,
  gate up): the whole sequence [s, b, h] gathered (megatron's frozen linear gathers its own and keeps nothing).
`--lora-dropout` > 0 keeps a dropped copy of the input per target: not modelled (the estimate is for dropout 0).
"""

from __future__ import annotations

from typing import Optional

from threed.config import LORA_COLUMN_TARGETS, LoraConfig, ModelConfig

# Each chosen target's base weight [out, in] (HF's `<target>_proj`), read off the HF table.
from threed.hf.names import lora_block_elements, lora_target_shapes as target_shapes

BF16 = 2


def active(lora: Optional[LoraConfig]) -> bool:
    """LoRA is on (a rank > 0); None or rank 0: a full fine-tune."""
    return lora is not None and lora.lora_rank > 0


def block_elements(model: ModelConfig, lora: Optional[LoraConfig], tp: int = 1) -> int:
    """Adapter elements of one block on one TP rank (0 without LoRA): r (out + in) per target, / tp."""
    if not active(lora):
        return 0
    assert lora is not None
    return lora_block_elements(model, lora, tp)


def largest_adapter(model: ModelConfig, lora: LoraConfig, tp: int) -> int:
    """Elements of the largest adapter tensor on one TP rank: its bf16 .grad is the one-parameter transient the
    activation peak adds (the frozen base makes none)."""
    return max(lora.lora_rank * max(rows, cols) for rows, cols in target_shapes(model, lora).values()) // tp


def index_bytes(model: ModelConfig, lora: Optional[LoraConfig], tp: int) -> int:
    """One block's int64 index buffers on one TP rank (`threed.model.lora.LoraAdapter.destination`): where each
    output row of a column-parallel base's adapters goes in the fused output (q k v, gate up rows / tp)."""
    if not active(lora):
        return 0
    assert lora is not None
    shapes = target_shapes(model, lora)
    return 8 * sum(shapes[t][0] for t in lora.lora_targets if t in LORA_COLUMN_TARGETS) // tp


def activation_bytes_per_token(model: ModelConfig, lora: Optional[LoraConfig], tp: int, sp: bool) -> int:
    """What one block's adapters keep per token beyond a full fine-tune's block (the module docstring): each
    target's B input [r], and under sequence parallelism the gathered [s, b, h] input of each column-parallel base
    that carries an adapter (linear_qkv, linear_fc1)."""
    if not active(lora):
        return 0
    assert lora is not None
    kept = BF16 * lora.lora_rank * len(lora.lora_targets)
    if sp:
        column = {("qkv" if t in ("q", "k", "v") else "fc1") for t in lora.lora_targets if t in LORA_COLUMN_TARGETS}
        kept += BF16 * model.hidden_size * len(column)
    return kept


def collectives_per_block(lora: Optional[LoraConfig], sp: bool) -> tuple[float, float]:
    """(forward, backward) TP collectives of [s, b, h] a block's adapters add, in all-reduces (an all-gather or a
    reduce-scatter is half of one), as threed.model.lora runs them; the [s, b, r] ones are left out.
      column-parallel base with adapters (linear_qkv, linear_fc1): the adapters' input gradient, partial per rank,
          all-reduced in backward; under SP the input all-gathered in forward and its gradient reduce-scattered
      each row-parallel target (o, down): its output all-gathered over TP in forward; under SP cut to this rank's
          sequence part, whose backward all-gathers again"""
    if not active(lora):
        return 0.0, 0.0
    assert lora is not None
    column = len({("qkv" if t in ("q", "k", "v") else "fc1") for t in lora.lora_targets if t in LORA_COLUMN_TARGETS})
    row = sum(t not in LORA_COLUMN_TARGETS for t in lora.lora_targets)
    if sp:
        return column / 2 + row / 2, column / 2 + row / 2
    return row / 2, float(column)
