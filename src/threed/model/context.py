"""Context parallelism (CP): the sequence of every row split over a CP group, with Llama 3's all-gather-K/V attention.
Wired in by threed.model.attention (the attention), threed.model.layers (RoPE, the loss's token count),
threed.parallel.distributed / pipeline (the groups) and threed.train (each CP rank's share of the rows:
`share_batches`).

The layout. Each row is cut into 2·cp equal chunks and CP rank i holds chunks i and 2·cp-1-i ("zigzag"). Under a
causal mask chunk j costs j+1 chunk-pairs of work, so every rank does (i+1) + (2·cp-i) = 2·cp+1: balanced. Tokens,
labels, loss masks, RoPE positions and segment ids are all cut with the same index (`split`); what depends on the
whole row is computed on the whole row first: labels are shifted, positions restart per document and segment ids
count documents before the split (`local_inputs_and_labels`, `rope_positions`).

The attention. Each rank all-gathers K and V over the CP group (small under GQA: kv_heads/heads of Q's size), then
each of its two query chunks attends to the key prefix it may see, [0, end of the chunk), under a mask built from
global positions (causal, aligned bottom-right by construction: the query chunk is the prefix's tail) and document
ids (packed rows). The backward of the all-gather is a reduce-scatter (sum) of dK and dV: every rank's queries
read every rank's keys. One collective each way per layer, both on the fast path of every backend (nccl and gloo:
`dist.all_gather_single` and `dist.reduce_scatter_single` both run on gloo in torch 2.13; `_GatherRow`).

Kernels. Exact boolean-mask SDPA everywhere (CPU, fp32/fp64 on CUDA); its mask is chunk x prefix, never s x s. On
CUDA in half precision: flash varlen with offsets (`varlen_offsets`): each query chunk is cut at document edges
into pieces, each piece a varlen sequence whose keys run from its document's start to the piece's end. A row
without documents is one document, so plain causal takes the same kernel: its GQA is explicit, while SDPA's
`causal_lower_right` dispatch calls the flash and efficient kernels without `enable_gqa` (torch 2.13's bias.py)
and knows no documents. Pieces have fewer queries than keys, so the kernel must align its causal mask
bottom-right: `check_bottom_right` runs it once per device and dtype on one query over two keys and refuses a
kernel that aligns top-left (what `F.scaled_dot_product_attention(is_causal=True)` does when Lq < Lk).
`is_causal=True` is never used here. The CUDA path is not run by the CPU tests; its offsets and its check are.

Why not the others:
- megatron-core's CP runs in Transformer Engine's attention (ring P2P / a2a / all-gather variants), CUDA only; this
  repo runs megatron's layers without TE (threed.model.attention) and its CPU path is the GPU path.
- Ulysses (all-to-all over heads) needs heads/tp divisible by cp and moves Q, K, V and the output; under GQA with
  tp the KV heads run out first (8 KV heads at tp 8 leave one). The all-gather moves only K and V.
- torchtitan's CP is torch's experimental `context_parallel` on DTensor: measured here, it does not run on CPU/gloo
  and takes plain causal only (stack notes); its FlexAttention variant needs torch.compile to be fast.
- Ring attention overlaps compute with P2P but needs an online-softmax merge per step; at Llama's GQA ratios the
  all-gather of K/V is cheap enough (Llama 3 paper) and the attention stays one exact kernel call per chunk.
"""

from __future__ import annotations

import inspect
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from threed.errors import ConfigError
from threed.model.rope import document_positions

# ----------------------------------------------------------------------------------------------------- the layout


def chunk_index(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2·cp per row) that CP rank `rank` holds, in the order it holds them."""
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is outside a group of {cp}")
    return rank, 2 * cp - 1 - rank


def check_divisible(seq: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """Refuse a sequence length the layout cannot cut: 2·cp equal chunks, and under Megatron's sequence parallelism
    each CP rank's share split again over tp (the issue's rule: seq divisible by 2·cp·tp)."""
    if cp < 1:
        raise ConfigError(f"context parallel size cp={cp} must be >= 1")
    sp_tp = tp if sequence_parallel else 1
    parts = (2 * cp if cp > 1 else 1) * sp_tp
    if seq % parts == 0:
        return
    if cp == 1:
        how, why = f"tp = {tp}", "--sequence-parallel splits each sequence over tp"
    else:
        how = f"2·cp·tp = 2·{cp}·{tp} = {parts}" if sequence_parallel else f"2·cp = 2·{cp} = {parts}"
        why = f"context parallelism: each of the {cp} CP ranks holds 2 of {2 * cp} equal chunks"
        why += ", which --sequence-parallel splits again over tp" if sequence_parallel else ""
    lower = seq // parts * parts
    near = f"{lower} or {lower + parts}" if lower else f"{parts}"
    raise ConfigError(f"seq_length {seq} is not a multiple of {how} ({why}); use a seq_length of {near}")


def split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's share of a full-row tensor: its two chunks along `dim`, concatenated. dim 1 for `[b, s]`
    (tokens, labels, loss masks, positions, segment ids), dim 0 for megatron's `[s, b, ...]` activations."""
    if cp == 1:
        return x
    check_divisible(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    first, second = chunk_index(cp, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def from_ranks(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full row from every CP rank's share (`split`'s inverse), given in rank order."""
    cp = len(parts)
    if cp == 1:
        return parts[0]
    return _row_order(torch.cat([p.movedim(dim, 0) for p in parts]), cp).movedim(0, dim)


def gather(x_local: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The full row, on every rank of the CP group, from each rank's share along `dim`. Not differentiable: for
    labels, masks, segment ids and tests (the attention's K/V gather is `_GatherRow`, which is)."""
    cp = dist.get_world_size(group)
    if cp == 1:
        return x_local
    return _row_order(_all_gather_rows(x_local.movedim(dim, 0), group), cp).movedim(0, dim)


def local_positions(seq: int, cp: int, rank: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """Global positions `[seq/cp]` (int64) of the tokens this rank holds, in the order it holds them."""
    return split(torch.arange(seq, device=device), cp, rank, dim=0)


def _row_order(rank_major: torch.Tensor, cp: int) -> torch.Tensor:
    """Rank-major shares along dim 0 (rank r: chunks r, 2cp-1-r) -> the row's chunk order 0 .. 2cp-1."""
    c = rank_major.shape[0] // (2 * cp)
    halves = rank_major.reshape(cp, 2, c, *rank_major.shape[1:])
    return torch.cat([halves[:, 0], halves[:, 1].flip(0)]).reshape(rank_major.shape)


def _rank_order(row: torch.Tensor, cp: int) -> torch.Tensor:
    """`_row_order`'s inverse: the row along dim 0 -> each rank's share, rank after rank."""
    c = row.shape[0] // (2 * cp)
    chunks = row.reshape(2 * cp, c, *row.shape[1:])
    return torch.stack([chunks[:cp], chunks[cp:].flip(0)], dim=1).reshape(row.shape)


# ---------------------------------------------------------------------------- the collectives (the one place)


def _all_gather_rows(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's `x` stacked along dim 0, rank after rank."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_rows(x: torch.Tensor, group) -> torch.Tensor:
    """The sum over ranks of `x`, this rank's 1/cp along dim 0."""
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    return out


class _GatherRow(torch.autograd.Function):
    """Local share `[s/cp, ...]` -> full row `[s, ...]` in row order; backward: the reduce-scatter (sum over ranks)
    of the row's gradient, back into this rank's share. K and V go through it: every rank's queries read every
    rank's keys, so a key's gradient is the sum of what each rank's queries put on it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _row_order(_all_gather_rows(x, group), dist.get_world_size(group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_rows(_rank_order(grad, dist.get_world_size(ctx.group)), ctx.group), None


# ------------------------------------------------------------------------------- what else sees the sequence


def local_inputs_and_labels(tokens: torch.Tensor, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of s+1 tokens `[b, s+1]` -> this rank's (inputs, labels) `[b, s/cp]`. The shift happens on the full row,
    then both are split: the label of a chunk's last token is the first token of the next chunk, which this rank
    does not hold. (megatron's datasets already return shifted labels: split those as they come.)"""
    return split(tokens[:, :-1], cp, rank), split(tokens[:, 1:], cp, rank)


def rope_positions(seq: int, cp: int, rank: int, segments: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RoPE positions of this rank's tokens: the global positions `[s/cp]`, or with full-row segment ids `[b, s]`
    (packed documents) the position inside each document `[b, s/cp]`, restarting at each document's first token
    (computed on the full row: a document may start on another rank). Feed `RotaryAngles.at_positions`."""
    if segments is None:
        return local_positions(seq, cp, rank)
    return split(document_positions(segments), cp, rank)


def share_micro_batch(batch: tuple, cp: int, rank: int) -> tuple:
    """A loader micro-batch of whole rows, `(inputs, targets)` (threed.data.loader.collate), -> this CP rank's share.
    Tokens, labels (already shifted on the whole row by the dataset) and loss masks are cut with the one index;
    packed rows' document ids stay whole (segments and positions are counted on the whole row, threed.model.layers),
    and evaluation's per-sample one-hot sources `[b, D]` are not per token."""
    if cp == 1:
        return batch
    inputs, targets = batch
    if isinstance(inputs, (tuple, list)):
        tokens, doc_ids = inputs
        inputs = (split(tokens, cp, rank), doc_ids)
    else:
        inputs = split(inputs, cp, rank)
    if isinstance(targets, torch.Tensor):
        return inputs, split(targets, cp, rank)
    return inputs, (split(targets[0], cp, rank), split(targets[1], cp, rank), *targets[2:])


def share_batches(batches: Iterable[tuple], cp: int, rank: int) -> Iterable[tuple]:
    """`share_micro_batch` of every micro-batch, lazily (the loader's iterator is endless)."""
    return batches if cp == 1 else (share_micro_batch(b, cp, rank) for b in batches)


def token_weighted_loss_sum(
    token_losses: torch.Tensor, loss_mask: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of loss x mask, number of loss tokens) over this rank's tokens; the sum keeps its graph, the count is
    fp64. Add them up over micro-batches, then `exact_token_mean` over the CP group."""
    if loss_mask is None:
        loss_mask = torch.ones_like(token_losses)
    mask = loss_mask.to(token_losses.dtype)
    return (token_losses * mask).sum(), loss_mask.sum(dtype=torch.float64)


def exact_token_mean(pairs: Iterable[tuple[torch.Tensor, torch.Tensor]], group) -> tuple[torch.Tensor, torch.Tensor]:
    """The token-weighted mean over every rank of `group` and every (sum, count) pair (micro-batch) given: sum of
    sums / sum of counts, and that total count (fp64, detached). The mean of per-rank means is not this whenever
    ranks hold different numbers of loss tokens, as SFT masks do chunk by chunk. For training, a rank's objective
    is its summed loss / the total count, and the CP ranks' gradients are summed."""
    pairs = list(pairs)
    total = torch.stack([sum(s.detach().to(torch.float64) for s, _ in pairs), sum(c for _, c in pairs)])
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total[0] / total[1].clamp(min=1.0), total[1]


# ------------------------------------------------------------------------------------------------- the attention


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group,
    segments: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of this CP rank's queries against the whole row, in SDPACoreAttention's layout:
    query `[s/cp, b, heads, d]`, key/value `[s/cp, b, kv_heads, d]` (this rank's share, `split` order) ->
    `[s/cp, b, heads*d]`. `segments`: None (plain causal) or integer segment ids of packed documents, of the full
    row `[b, s]` or this rank's share `[b, s/cp]` (then gathered: one more collective). Segment ids must be counted
    on the full row (threed.model.attention.document_segments), so that equal ids mean one document."""
    cp = dist.get_world_size(group)
    s_local, b, heads, d = query.shape
    seq = s_local * cp
    if segments is not None and (segments.is_floating_point() or segments.dtype == torch.bool or segments.dim() != 2):
        raise ValueError(f"segments must be integer ids [b, s], got {segments.dtype} {tuple(segments.shape)}")
    k_row, v_row = (_GatherRow.apply(t, group) if cp > 1 else t for t in (key, value))
    if segments is not None and segments.shape[1] != seq:
        segments = gather(segments, group)
    out, held = [], 0  # held: this rank's queries used so far (its first chunk, then its second)
    for start, length in _local_chunks(seq, cp, dist.get_rank(group)):
        end = start + length
        seg = None if segments is None else segments[:, :end]
        out.append(attend_prefix(query[held : held + length], k_row[:end], v_row[:end], seg, scale))
        held += length
    return torch.cat(out).reshape(s_local, b, heads * d)


def _local_chunks(seq: int, cp: int, rank: int) -> list[tuple[int, int]]:
    """(first position, length) of each chunk this rank holds: the whole row at cp 1."""
    if cp == 1:
        return [(0, seq)]
    check_divisible(seq, cp)
    c = seq // (2 * cp)
    return [(j * c, c) for j in chunk_index(cp, rank)]


def attend_prefix(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of a query chunk `[c, b, heads, d]` that is the tail of the key prefix `[L, b, kv_heads, d]`
    (query i sits at position L-c+i): query i sees keys 0 .. L-c+i of its own document. `segments` `[b, L]`: the
    prefix's segment ids, or None. -> `[c, b, heads, d]`."""
    if _varlen_usable(query):
        return _attend_varlen(query, key, value, segments, scale)
    c, L = query.shape[0], key.shape[0]
    q_pos = torch.arange(L - c, L, device=query.device)
    allowed = torch.arange(L, device=query.device)[None, :] <= q_pos[:, None]  # [c, L], from global positions
    if segments is not None:
        same_doc = segments[:, L - c :, None] == segments[:, None, :]  # [b, c, L]
        allowed = (allowed & same_doc)[:, None]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out.permute(2, 0, 1, 3)


# ------------------------------------------------------------------------------- CUDA half precision: varlen


def _varlen_usable(query: torch.Tensor) -> bool:
    """Flash varlen: CUDA, half precision, torch >= 2.9."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  (torch: CUDA-only kernel module)
    except ImportError:
        return False
    return True


def _attend_varlen(query, key, value, segments, scale, kernel: Optional[Callable] = None) -> torch.Tensor:
    """`attend_prefix` through varlen attention with offsets: no mask at all. `kernel`: varlen_attn's signature
    (the tests pass a CPU stand-in); checked once per device and dtype to align its causal mask bottom-right."""
    if kernel is None:
        from torch.nn.attention.varlen import varlen_attn as kernel  # torch: CUDA-only kernel module

    check_bottom_right(kernel, query.device, query.dtype)
    c, b, heads, d = query.shape
    L, kv_heads = key.shape[0], key.shape[2]
    if segments is None:
        segments = torch.zeros(b, L, dtype=torch.int64, device=query.device)  # a row is one document
    index, cu_q, cu_k, max_q, max_k = varlen_offsets(segments, L - c)
    q = query.transpose(0, 1).reshape(b * c, heads, d)
    k, v = (t.transpose(0, 1).reshape(b * L, kv_heads, d)[index] for t in (key, value))
    gqa = {}
    if kv_heads != heads and _takes_enable_gqa(kernel):
        gqa = {"enable_gqa": True}
    elif kv_heads != heads:
        # torch 2.11's varlen_attn has no enable_gqa: each K/V head serves heads / kv_heads consecutive query heads
        # (as SDPA's enable_gqa does), so the kernel gets them repeated. Same numbers, more K/V bytes.
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    out = kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=(-1, 0), **gqa)
    return out.reshape(b, c, heads, d).transpose(0, 1)


def _takes_enable_gqa(kernel: Callable) -> bool:
    """Whether `kernel` accepts `enable_gqa` (torch 2.13's varlen_attn does, 2.11's not): asked of the function."""
    try:
        params = inspect.signature(kernel).parameters
    except (TypeError, ValueError):  # no signature to read: repeating K/V works either way
        return False
    return "enable_gqa" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def varlen_offsets(segments: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int]:
    """Varlen sequences for the queries at positions [start, L) of each row against the keys before them, from the
    prefix's segment ids `[b, L]`. Each query chunk is cut into pieces at document edges; piece j (queries q0..q1-1
    of row r) attends to keys d0..q1-1 of row r, d0 its document's first position. Returns the key index into the
    flattened `[b*L]` prefix, int32 cumulative query and key lengths, and the longest of each (one host sync)."""
    b, L = segments.shape
    c = L - start
    q_seg = segments[:, start:]
    first = torch.ones_like(q_seg, dtype=torch.bool)
    first[:, 1:] = q_seg[:, 1:] != q_seg[:, :-1]
    flat = first.reshape(-1).nonzero().squeeze(1)  # each piece's first query in the flattened [b*c]
    cu_q = torch.cat([flat, flat.new_tensor([b * c])])
    q_len = cu_q[1:] - cu_q[:-1]
    row, q0 = flat // c, flat % c + start
    d0 = q0 - document_positions(segments)[row, q0]  # the first position of the piece's document
    k_len = q0 + q_len - d0
    cu_k = torch.cat([k_len.new_zeros(1), k_len.cumsum(0)])
    total, max_q, max_k = torch.stack([cu_k[-1], q_len.max(), k_len.max()]).tolist()
    within = torch.arange(total, device=segments.device) - cu_k[:-1].repeat_interleave(k_len, output_size=total)
    index = (row * L + d0).repeat_interleave(k_len, output_size=total) + within
    return index, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k


def preflight(cp: int, device: torch.device, dtype: str, kernel: Optional[Callable] = None) -> None:
    """Before a CP run builds anything (threed.train, after the config checks): the kernel its attention will take on
    `device` in `dtype` ("bf16" / "fp32") must align the causal mask bottom-right, or the run is refused in one line
    (`KernelRefused`). Only flash varlen can get it wrong; the masked SDPA path builds its mask from global
    positions. `kernel`: varlen_attn's signature (the tests pass CPU stand-ins); None: torch's, where it is used."""
    if cp == 1:
        return
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    if kernel is None:
        if not _varlen_usable(torch.empty(0, device=device, dtype=torch_dtype)):
            return
        from torch.nn.attention.varlen import varlen_attn as kernel  # torch: CUDA-only kernel module

    check_bottom_right(kernel, device, torch_dtype)


_BOTTOM_RIGHT: dict = {}  # (kernel, device, dtype) -> True once checked


class KernelRefused(ConfigError):
    """The attention kernel aligns its causal mask top-left when a query is shorter than its keys."""


def check_bottom_right(kernel: Callable, device: torch.device, dtype: torch.dtype) -> None:
    """Run `kernel` (varlen_attn's signature) once on one query against two equal keys with values 0 and 1: a
    bottom-right causal mask lets the query see both (output 0.5), a top-left one only the first (0). Refuses
    anything but 0.5: a kernel that silently drops keys would train a wrong model."""
    if _BOTTOM_RIGHT.get((kernel, str(device), dtype)):
        return
    q = torch.zeros(1, 1, 8, device=device, dtype=dtype)
    k = torch.zeros(2, 1, 8, device=device, dtype=dtype)
    v = torch.stack([torch.zeros(1, 8), torch.ones(1, 8)]).to(device=device, dtype=dtype)
    cu_q, cu_k = (torch.tensor(x, device=device, dtype=torch.int32) for x in ([0, 1], [0, 2]))
    with torch.no_grad():
        got = float(kernel(q, k, v, cu_q, cu_k, 1, 2, window_size=(-1, 0)).float().mean())
    if abs(got - 0.5) > 1e-2:
        name = getattr(kernel, "__qualname__", repr(kernel))
        raise KernelRefused(
            f"{name} on {device} {dtype} aligns its causal mask top-left when a query is shorter than its keys "
            f"(one query over two keys gave {got:.3f}, not 0.5); context parallelism needs it bottom-right. "
            f"Train in fp32 (the exact masked path) or use a torch whose flash varlen kernel aligns bottom-right"
        )
    _BOTTOM_RIGHT[(kernel, str(device), dtype)] = True
