"""How each parameter of a pipeline layer is split over tensor-parallel ranks (our names, see
`threed.pipeline.pipeline_layers`). The converters (`threed.convert.mapping`) and the random init
(`threed.model.init`) both read this one table.

  vocab       rows, vocabulary padded to a multiple of make_vocab_size_divisible_by x tp (padding rows at the end)
  column      rows (ColumnParallelLinear)
  qkv         rows of megatron's grouped [q heads of group | k | v] layout: each rank owns whole KV groups
  gate_up     [gate_r; up_r] per rank: megatron's MLP chunks its fc1 output in two
  row         columns (RowParallelLinear)
  replicated  the same on every rank (norms)
"""
from __future__ import annotations

from typing import Literal

ShardKind = Literal["vocab", "column", "row", "replicated", "qkv", "gate_up"]

SHARDING: dict[str, dict[str, ShardKind]] = {
    "embedding": {"word_embeddings.weight": "vocab"},
    "block": {
        "input_layernorm.weight": "replicated",
        "self_attention.linear_qkv.weight": "qkv",
        "self_attention.linear_proj.weight": "row",
        "pre_mlp_layernorm.weight": "replicated",
        "mlp.linear_fc1.weight": "gate_up",
        "mlp.linear_fc2.weight": "row",
    },
    "final_norm": {"norm.weight": "replicated"},
    "lm_head": {"lm_head.weight": "vocab"},
}
