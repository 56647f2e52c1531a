"""HF Llama <-> threed pipeline-layer state dicts: pure functions on dicts of tensors (no I/O, no process groups).

What each of our parameters is (shape, TP split) is `threed.model.spec.PARAMETERS`; which HF tensors make it is
`threed.hf.names`. This module only moves bytes between the two:
  fuse / split   HF q, k, v <-> megatron's grouped [q heads of group | k | v] (each TP rank owns whole KV groups,
                 so a TP shard is a plain row range); gate, up <-> [gate; up]
  shard/unshard  one unsharded tensor <-> its TP shards, the slices of `threed.model.spec.tp_segments`
"""

from __future__ import annotations

from typing import Sequence

import torch

from threed.config import ModelConfig
from threed.hf.names import hf_names
from threed.model.spec import PipelineLayer, Split, layer_parameters, split_axis, tp_segments

Tensor = torch.Tensor


# ---------------------------------------------------------------- fusing (HF tensors <-> one unsharded tensor)


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    groups, d = cfg.num_kv_heads, cfg.head_dim
    q_per_group = cfg.num_heads // groups
    h = q.shape[-1]
    fused = torch.cat([q.reshape(groups, q_per_group * d, h), k.reshape(groups, d, h), v.reshape(groups, d, h)], dim=1)
    return fused.reshape(-1, h)


def split_qkv(fused: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    groups, d = cfg.num_kv_heads, cfg.head_dim
    q_per_group = cfg.num_heads // groups
    h = fused.shape[-1]
    q, k, v = fused.reshape(groups, (q_per_group + 2) * d, h).split([q_per_group * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


# ------------------------------------------------------------------------ TP sharding (one tensor <-> TP shards)


def shard(t: Tensor, kind: Split, tp: int, padded_vocab: int = 0) -> list[Tensor]:
    """Split one unsharded tensor (HF-shaped vocab, i.e. unpadded) into `tp` shards (`spec.tp_segments`)."""
    if kind == "replicated":
        return [t for _ in range(tp)]
    if kind == "vocab" and padded_vocab > t.shape[0]:
        # Padding rows are zero; the LM head masks their logits, so the value never matters.
        t = torch.cat([t, t.new_zeros(padded_vocab - t.shape[0], *t.shape[1:])])
    axis = split_axis(kind)
    out = []
    for rank in range(tp):
        segs = tp_segments(kind, t.shape[axis], tp, rank)
        out.append(torch.cat([t.narrow(axis, s.start, s.length) for s in segs], dim=axis).contiguous())
    return out


def unshard(shards: Sequence[Tensor], kind: Split, vocab_size: int = 0) -> Tensor:
    """Inverse of `shard`: TP shards -> one tensor (vocab padding rows dropped)."""
    if kind == "replicated":
        return shards[0]
    axis = split_axis(kind)
    tp = len(shards)
    n = shards[0].shape[axis] * tp
    full = shards[0].new_empty(*[n if i == axis else d for i, d in enumerate(shards[0].shape)])
    for rank, piece in enumerate(shards):
        for s in tp_segments(kind, n, tp, rank):
            full.narrow(axis, s.start, s.length).copy_(piece.narrow(axis, s.local, s.length))
    return full[:vocab_size] if kind == "vocab" else full


# ------------------------------------------------------------------- one pipeline layer, HF dict <-> TP shards


def layer_from_hf(cfg: ModelConfig, layer: PipelineLayer, hf: dict[str, Tensor], tp: int) -> list[dict[str, Tensor]]:
    """HF tensors of one pipeline layer -> that layer's state dict on each of `tp` ranks."""
    padded = cfg.padded_vocab_size(tp)
    per_rank: list[dict[str, Tensor]] = [{} for _ in range(tp)]
    names = hf_names(layer)
    for p in layer_parameters(layer.kind):
        ours, kind = p.name, p.split
        parts = [hf[n] for n in names[ours]]
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
    names_of = hf_names(layer)
    for p in layer_parameters(layer.kind):
        ours, kind = p.name, p.split
        missing = [r for r, s in enumerate(shards) if ours not in s]
        if missing:
            raise KeyError(f"layer {layer.index} ({layer.kind}): {ours} missing on TP ranks {missing}")
        full = unshard([s[ours] for s in shards], kind, cfg.vocab_size)
        names = names_of[ours]
        if kind == "qkv":
            parts: tuple[Tensor, ...] = split_qkv(full, cfg)
        elif kind == "gate_up":
            parts = tuple(full.chunk(2, dim=0))
        else:
            parts = (full,)
        out.update({n: t.contiguous() for n, t in zip(names, parts)})
    return out
