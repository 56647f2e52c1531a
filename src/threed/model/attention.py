"""Causal self-attention core with torch SDPA, plugged into megatron-core's SelfAttention through the layer spec.

Replaces megatron's DotProductAttention, which allocates its score buffer on CUDA and forks the CUDA RNG tracker.
SDPA picks flash / memory-efficient kernels on GPU and a fused CPU kernel here: one code path.

Packed sequences (several documents in one row): the block passes per-token segment ids `[b, s]` (integers,
`document_segments`) as megatron's `attention_mask`, and attention becomes block-diagonal causal: no token attends
outside its document. On CUDA in half precision that runs through `torch.nn.attention.varlen.varlen_attn` (flash,
cumulative lengths, no s x s mask); elsewhere SDPA with a boolean `[b, 1, s, s]` mask (exact; on CPU ~3x the cost
of `is_causal`, see the stack notes). Which varlen_attn keywords a torch release has is asked of the function itself
(`takes_keyword`): docs/torch-versions.md.

Context parallelism (`--context-parallel-size` > 1): each rank holds 2 of each row's 2·cp chunks of queries, keys and
values, and the attention is `threed.model.context.context_parallel_attention` (K/V all-gathered over the CP group
megatron's SelfAttention hands over in its `pg_collection`, the causal mask built from global positions, so aligned
bottom-right; packed rows pass the full row's segment ids).

Generation (`threed generate`, `threed.generate.decode`) passes a boolean `[b, 1, sq, sk]` mask instead: which keys
each query of a left-padded batch may see, with a KV cache `sq` < `sk` (the query is the last tokens). SDPA's
`is_causal=True` aligns its triangle top-left, wrong for such a query, so decode never relies on it; a query shorter
than its keys without a mask gets the bottom-right triangle (`causal_lower_right`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from threed.model.context import context_parallel_attention


class SDPACoreAttention(torch.nn.Module):
    def __init__(
        self,
        config: Any,
        layer_number: int,
        softmax_scale: Optional[float] = None,
        pg_collection: Any = None,
        **_: Any,
    ):
        super().__init__()
        self.softmax_scale = softmax_scale  # None: 1/sqrt(head_dim), as in Llama
        self.layer_number = layer_number
        # megatron-core's SelfAttention passes its process groups; its CP group is the one this layer's queries,
        # keys and values are split over (None: the whole row is here).
        cp_group = getattr(pg_collection, "cp", None)
        self.cp_group = cp_group if cp_group is not None and cp_group.size() > 1 else None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        **_: Any,
    ) -> torch.Tensor:
        """query `[s, b, heads, d]`, key/value `[s, b, kv_heads, d]` (this TP rank's heads) -> `[s, b, heads*d]`.

        `attention_mask` None: every sequence is a full causal window. Otherwise it holds integer segment ids
        `[b, s]` (packed documents) and attention is block-diagonal causal.
        """
        s, b, heads, d = query.shape
        if self.cp_group is not None:
            return context_parallel_attention(
                query, key, value, self.cp_group, segments=attention_mask, scale=self.softmax_scale
            )
        if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.dim() == 4:
            return self._masked(query, key, value, attention_mask)  # generation: an explicit [b, 1, sq, sk] mask
        if attention_mask is not None:
            return self._packed(query, key, value, attention_mask)
        if key.shape[0] != s:  # a query shorter than its keys (a KV cache): the triangle aligns bottom-right
            # torch.nn.attention.bias: heavy, it imports torch's compiler (dynamo, ~1 s) as it loads; only decoding
            # with a KV cache and no mask comes here, so a training rank does not pay for it
            from torch.nn.attention.bias import causal_lower_right

            return self._masked(query, key, value, causal_lower_right(s, key.shape[0]))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != heads
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    def _masked(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask) -> torch.Tensor:
        """SDPA with an explicit mask (boolean `[b, 1, sq, sk]`, True where a query may see a key, or torch's
        `causal_lower_right` bias); query `[sq, b, heads, d]`, key/value `[sk, b, kv_heads, d]`."""
        s, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        if k.shape[1] != heads and not isinstance(mask, torch.Tensor):
            # torch's bias object takes no enable_gqa: each key/value head serves heads / kv_heads query heads
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        gqa = {"enable_gqa": True} if k.shape[1] != heads else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.softmax_scale, **gqa)
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: torch.Tensor
    ) -> torch.Tensor:
        if segments.is_floating_point() or segments.dtype == torch.bool or segments.dim() != 2:
            raise ValueError(
                "SDPACoreAttention takes integer segment ids [b, s] as its mask, got "
                f"{segments.dtype} {tuple(segments.shape)}"
            )
        s, b, heads, d = query.shape
        if _varlen_usable(query):
            return self._varlen(query, key, value, segments)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask = reuse_per_tensor(segments, "mask", block_causal_mask)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self.softmax_scale, enable_gqa=k.shape[1] != heads
        )
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    def _varlen(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: torch.Tensor
    ) -> torch.Tensor:
        varlen_attn = varlen_kernel()
        assert varlen_attn is not None, "only called where _varlen_usable"
        s, b, heads, d = query.shape
        # [s, b, h, d] -> [b*s, h, d]: each row's documents become sequences of one flat batch.
        q, k, v = (t.transpose(0, 1).reshape(b * s, t.shape[2], d) for t in (query, key, value))
        cu, max_len = reuse_per_tensor(segments, "varlen", cumulative_lengths)  # one host sync per micro-batch
        gqa: dict[str, bool] = {}
        if k.shape[1] != heads and takes_keyword(varlen_attn, "enable_gqa"):
            gqa = {"enable_gqa": True}
        elif k.shape[1] != heads:
            # torch 2.11's varlen_attn has no enable_gqa (a TypeError on every packed bf16 forward): each key/value head
            # serves heads / kv_heads consecutive query heads, as SDPA's enable_gqa does, so the kernel gets them
            # repeated. Same numbers; the copies cost (heads / kv_heads - 1) x the K/V bytes of the layer.
            k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
        out = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=self.softmax_scale, window_size=(-1, 0), **gqa)
        return out.reshape(b, s, heads * d).transpose(0, 1).contiguous()


# What is derived from a micro-batch's document ids (segments, RoPE angles: threed.model.layers) and from its
# segments (mask, varlen lengths: here) is kept while the same tensor object comes back: the next block of the
# stage, or activation checkpointing's recompute, gets the very object the previous block passed on. One entry per
# kind; it holds the tensor, so an identity match cannot be a recycled object.
_PER_TENSOR: dict = {}


def reuse_per_tensor(key: torch.Tensor, kind, build):
    """`build(key)`, or its value from the last call with this `kind` when `key` is the same tensor object."""
    hit = _PER_TENSOR.get(kind)
    if hit is not None and hit[0] is key:
        return hit[1]
    value = build(key)
    _PER_TENSOR[kind] = (key, value)
    return value


def _varlen_usable(query: torch.Tensor) -> bool:
    """Whether this query takes `varlen_attn`: CUDA, half precision, and a torch that has the kernel
    (`varlen_kernel`). Where any is missing the SDPA mask path runs, which is exact too, only slower."""
    return query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and varlen_kernel() is not None


def varlen_kernel() -> Optional[Callable]:
    """torch's `varlen_attn` where this torch has one that says causal as `window_size=(-1, 0)` (2.11 does; older
    releases had `is_causal` instead, or no varlen module), else None. Capabilities, not versions."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # CUDA-only kernel module (flash only)
    except ImportError:
        return None
    return varlen_attn if takes_keyword(varlen_attn, "window_size") else None


@functools.lru_cache(maxsize=None)
def takes_keyword(fn: Callable, name: str) -> bool:
    """Whether `fn` accepts the keyword argument `name` (or any keyword): how a call guards an argument that only
    some torch releases have. Cached per function object, so a replaced function is asked again."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: the path that needs no such keyword is the safe one
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def document_segments(doc_ids: torch.Tensor) -> torch.Tensor:
    """Per-token document ids `[b, s]` -> segment ids `[b, s]` int64 counting contiguous runs in each row (0, 0, 1,
    1, 1, 2, ...). A document is a maximal run of equal ids, so ids may repeat elsewhere in the row (e.g. padding)
    without joining their runs."""
    if doc_ids.is_floating_point() or doc_ids.dim() != 2:
        raise ValueError(f"document ids must be integers [b, s], got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    change = torch.zeros_like(doc_ids, dtype=torch.int64)
    change[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]).to(torch.int64)
    return change.cumsum(dim=1)


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask `[b, 1, s, s]`, True where query i may attend to key j: same segment and j <= i."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return ((segments[:, :, None] == segments[:, None, :]) & causal)[:, None]


def cumulative_lengths(segments: torch.Tensor) -> tuple[torch.Tensor, int]:
    """int32 cumulative document lengths over the flattened `[b*s]` tokens (each row starts a document), and the
    longest document: the `cu_seq` / `max` arguments of varlen attention. One host sync for the maximum."""
    b, s = segments.shape
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    begin = starts.reshape(-1).nonzero().squeeze(1)
    cu = torch.cat([begin, begin.new_tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max().item())
