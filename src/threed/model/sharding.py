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

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from threed.config import ModelConfig

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


def parameter_shapes(cfg: "ModelConfig", kind: str, tp: int = 1) -> dict[str, tuple[int, ...]]:
    """Shapes of a pipeline layer's parameters (our names) on one of `tp` ranks; tp=1: the full tensors, the
    vocabulary padded for tp 1. What the random init draws and what a converted checkpoint holds."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    v = cfg.padded_vocab_size(tp)
    full = {
        "word_embeddings.weight": (v, h), "lm_head.weight": (v, h), "norm.weight": (h,),
        "input_layernorm.weight": (h,), "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": ((cfg.num_heads + 2 * cfg.num_kv_heads) * d, h),
        "self_attention.linear_proj.weight": (h, cfg.num_heads * d),
        "mlp.linear_fc1.weight": (2 * f, h), "mlp.linear_fc2.weight": (h, f),
    }
    out = {}
    for name, how in SHARDING[kind].items():
        rows, *rest = full[name]
        if how == "replicated":
            out[name] = full[name]
        elif how == "row":
            out[name] = (rows, rest[0] // tp)
        else:  # vocab, column, qkv, gate_up: split by rows
            out[name] = (rows // tp, *rest)
    return out
