"""HF Llama <-> threed pipeline-layer state dicts: pure functions on dicts of tensors (no I/O, no process groups).

Our names are those of the PipelineModule's layers (see `threed.pipeline.pipeline_layers`):
  embedding:  word_embeddings.weight                   [padded_vocab, h]   vocab-parallel (rows)
  block i:    input_layernorm.weight                    [h]                 replicated
              self_attention.linear_qkv.weight          [(nh+2*nkv)*d, h]   grouped [q heads of group | k | v]
              self_attention.linear_proj.weight         [h, nh*d]           row-parallel (columns)
              pre_mlp_layernorm.weight                  [h]                 replicated
              mlp.linear_fc1.weight                     [2*f, h]            [gate shard ; up shard] per TP rank
              mlp.linear_fc2.weight                     [h, f]              row-parallel (columns)
  final_norm: norm.weight                               [h]                 replicated
  lm_head:    lm_head.weight                            [padded_vocab, h]   vocab-parallel (rows)

The grouped QKV layout makes a TP shard a plain row-chunk (each rank owns whole KV groups). gate/up is not a
row-chunk of [gate; up]: each rank holds [gate_r; up_r], because megatron's MLP chunks its fc1 output in two.
HF already uses rotate-half RoPE, so no q/k permutation is needed (Meta's raw weights would need one).
"""
from __future__ import annotations

from typing import Sequence

import torch

from threed.config import ModelConfig
from threed.model.sharding import SHARDING, ShardKind
from threed.pipeline import PipelineLayer

Tensor = torch.Tensor

# our name -> HF name templates, fused in this order. "{i}" is the block. How each is sharded: `SHARDING`.
HF_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "embedding": {"word_embeddings.weight": ("model.embed_tokens.weight",)},
    "block": {
        "input_layernorm.weight": ("model.layers.{i}.input_layernorm.weight",),
        "self_attention.linear_qkv.weight": ("model.layers.{i}.self_attn.q_proj.weight",
                                             "model.layers.{i}.self_attn.k_proj.weight",
                                             "model.layers.{i}.self_attn.v_proj.weight"),
        "self_attention.linear_proj.weight": ("model.layers.{i}.self_attn.o_proj.weight",),
        "pre_mlp_layernorm.weight": ("model.layers.{i}.post_attention_layernorm.weight",),
        "mlp.linear_fc1.weight": ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
        "mlp.linear_fc2.weight": ("model.layers.{i}.mlp.down_proj.weight",),
    },
    "final_norm": {"norm.weight": ("model.norm.weight",)},
    "lm_head": {"lm_head.weight": ("lm_head.weight",)},
}
# our name -> (shard kind, HF name templates)
TEMPLATES: dict[str, dict[str, tuple[ShardKind, tuple[str, ...]]]] = {
    kind: {ours: (SHARDING[kind][ours], hf) for ours, hf in names.items()} for kind, names in HF_NAMES.items()
}


def hf_names(layer: PipelineLayer) -> dict[str, tuple[str, ...]]:
    """our name -> the HF names it is made of, for one pipeline layer."""
    return {ours: tuple(t.format(i=layer.block) for t in hf) for ours, (_, hf) in TEMPLATES[layer.kind].items()}


def hf_shapes(cfg: ModelConfig, layer: PipelineLayer) -> dict[str, tuple[int, ...]]:
    """Expected HF tensor shapes for one pipeline layer (to check a source before converting it)."""
    h, f, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    by_suffix = {
        "embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h), "norm.weight": (h,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "q_proj.weight": (cfg.num_heads * d, h), "k_proj.weight": (cfg.num_kv_heads * d, h),
        "v_proj.weight": (cfg.num_kv_heads * d, h), "o_proj.weight": (h, cfg.num_heads * d),
        "gate_proj.weight": (f, h), "up_proj.weight": (f, h), "down_proj.weight": (h, f),
    }
    out = {}
    for names in hf_names(layer).values():
        for name in names:
            suffix = ".".join(name.split(".")[-2:])
            out[name] = by_suffix[suffix]
    return out


# ---------------------------------------------------------------- fusing (HF tensors <-> one unsharded tensor)

def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    groups, d = cfg.num_kv_heads, cfg.head_dim
    q_per_group = cfg.num_heads // groups
    h = q.shape[-1]
    fused = torch.cat([q.reshape(groups, q_per_group * d, h), k.reshape(groups, d, h), v.reshape(groups, d, h)],
                      dim=1)
    return fused.reshape(-1, h)


def split_qkv(fused: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    groups, d = cfg.num_kv_heads, cfg.head_dim
    q_per_group = cfg.num_heads // groups
    h = fused.shape[-1]
    q, k, v = fused.reshape(groups, (q_per_group + 2) * d, h).split([q_per_group * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


# ------------------------------------------------------------------------ TP sharding (one tensor <-> TP shards)

def shard(t: Tensor, kind: ShardKind, tp: int, padded_vocab: int = 0) -> list[Tensor]:
    """Split one unsharded tensor (HF-shaped vocab, i.e. unpadded) into `tp` contiguous shards."""
    if kind == "replicated":
        return [t for _ in range(tp)]
    if kind == "vocab":
        if padded_vocab > t.shape[0]:
            # Padding rows are zero; the LM head masks their logits, so the value never matters.
            t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
        return [c.contiguous() for c in t.chunk(tp, dim=0)]
    if kind in ("column", "qkv"):
        return [c.contiguous() for c in t.chunk(tp, dim=0)]
    if kind == "row":
        return [c.contiguous() for c in t.chunk(tp, dim=1)]
    if kind == "gate_up":
        gate, up = t.chunk(2, dim=0)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]
    raise ValueError(f"unknown shard kind {kind!r}")


def unshard(shards: Sequence[Tensor], kind: ShardKind, vocab_size: int = 0) -> Tensor:
    """Inverse of `shard`: TP shards -> one tensor (vocab padding rows dropped)."""
    if kind == "replicated":
        return shards[0]
    if kind == "vocab":
        return torch.cat(list(shards), dim=0)[:vocab_size]
    if kind in ("column", "qkv"):
        return torch.cat(list(shards), dim=0)
    if kind == "row":
        return torch.cat(list(shards), dim=1)
    if kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])])
    raise ValueError(f"unknown shard kind {kind!r}")


# ------------------------------------------------------------------- one pipeline layer, HF dict <-> TP shards

def layer_from_hf(cfg: ModelConfig, layer: PipelineLayer, hf: dict[str, Tensor], tp: int) -> list[dict[str, Tensor]]:
    """HF tensors of one pipeline layer -> that layer's state dict on each of `tp` ranks."""
    padded = cfg.padded_vocab_size(tp)
    per_rank: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    for ours, (kind, _) in TEMPLATES[layer.kind].items():
        parts = [hf[n] for n in hf_names(layer)[ours]]
        if kind == "qkv":
            full = fuse_qkv(*parts, cfg)
        elif kind == "gate_up":
            full = torch.cat(parts, dim=0)
        else:
            (full,) = parts
        for rank, piece in enumerate(shard(full, kind, tp, padded)):
            per_rank[rank][ours] = piece
    return per_rank


def layer_to_hf(cfg: ModelConfig, layer: PipelineLayer, shards: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One pipeline layer's state dicts from every TP rank -> its HF tensors."""
    out: dict[str, Tensor] = {}
    for ours, (kind, _) in TEMPLATES[layer.kind].items():
        missing = [r for r, s in enumerate(shards) if ours not in s]
        if missing:
            raise KeyError(f"layer {layer.index} ({layer.kind}): {ours} missing on TP ranks {missing}")
        full = unshard([s[ours] for s in shards], kind, cfg.vocab_size)
        names = hf_names(layer)[ours]
        if kind == "qkv":
            parts: tuple[Tensor, ...] = split_qkv(full, cfg)
        elif kind == "gate_up":
            parts = tuple(full.chunk(2, dim=0))
        else:
            parts = (full,)
        out.update({n: p.contiguous() for n, p in zip(names, parts)})
    return out


