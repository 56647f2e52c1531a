"""Which bytes of which HF tensors make one TP rank's state dict: the converter's streaming form of
`mapping.layer_from_hf`, equal to it bit for bit (tests/unit/test_convert_slices.py checks every kind at every tp).

    for spec in rank_slices(cfg, layer, tp, rank):          # pure: names, shapes, source slices
        out[spec.name] = materialize(spec, reader, dtype)   # reader: HF files (positioned reads) or a dict

`layer_from_hf` builds every rank's shards from whole tensors (fused QKV, padded vocab: a few copies of the
layer). Here each rank's tensor is allocated once and filled straight from the source slices it is made of: a
row range (vocab, column, each KV group's q / k / v rows, gate and up halves) is one contiguous read, a column
range (row-parallel o_proj / down_proj) one read per row. So memory holds one rank's shard of one layer, and
every byte is copied once, from the page cache into the tensor that torch.save writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol

import torch

from threed.config import ModelConfig
from threed.hf.names import hf_names, hf_shapes
from threed.model.spec import PipelineLayer, full_shape, layer_parameters, shard_shape, split_axis, tp_segments


@dataclass(frozen=True)
class Piece:
    """HF tensor `hf_name`, indices [start, start + length) along `dim`, placed at output rows [dst, ...)
    (dim 0), or as the whole output (dim 1: a column block of a row-parallel weight)."""

    hf_name: str
    dim: int
    start: int
    length: int
    dst: int = 0


@dataclass(frozen=True)
class ShardSpec:
    name: str  # our state-dict key
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]  # output rows no piece covers are zeros (vocab padding)
    source: str = ""  # the HF tensor whose dtype the output takes (a padding-only shard has no pieces)


class PartReader(Protocol):
    def dtype(self, name: str) -> torch.dtype: ...

    def read_into(self, piece: Piece, out: torch.Tensor) -> None: ...


class DictReader:
    """A PartReader over in-memory (or meta, or memory-mapped) HF tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read_into(self, piece: Piece, out: torch.Tensor) -> None:
        out.copy_(self.tensors[piece.hf_name].narrow(piece.dim, piece.start, piece.length))


def rank_slices(cfg: ModelConfig, layer: PipelineLayer, tp: int, rank: int) -> list[ShardSpec]:
    """The slices of HF tensors that make TP rank `rank`'s state dict of `layer`: the spec's TP segments of each
    unsharded tensor (`threed.model.spec.tp_segments`), mapped onto the HF tensors it is fused from."""
    shapes = hf_shapes(cfg, layer)
    names_of = hf_names(layer)
    specs = []
    for p in layer_parameters(layer.kind):
        ours, names = p.name, names_of[p.name]
        shape = shard_shape(cfg, p, tp)
        axis = split_axis(p.split)
        if p.split == "qkv":
            specs.append(_qkv_spec(cfg, ours, names, tp, rank))
            continue
        pieces = []
        n = full_shape(cfg, p, tp)[axis or 0]
        for seg in tp_segments(p.split, n, tp, rank):
            if p.split == "gate_up":  # [gate; up]: the second half of the unsharded rows is the up tensor
                half = n // 2
                src, start = (names[0], seg.start) if seg.start < half else (names[1], seg.start - half)
                pieces.append(Piece(src, 0, start, seg.length, dst=seg.local))
            elif p.split == "vocab":  # rows past the true vocab stay zero (padding)
                real = max(0, min(seg.length, shapes[names[0]][0] - seg.start))
                if real:
                    pieces.append(Piece(names[0], 0, seg.start, real, dst=seg.local))
            else:  # replicated (whole tensor), column (rows), row (columns: dim 1)
                pieces.append(Piece(names[0], axis or 0, seg.start, seg.length, dst=seg.local))
        specs.append(ShardSpec(ours, shape, tuple(pieces), names[0]))
    return specs


def _qkv_spec(cfg: ModelConfig, ours: str, names: tuple[str, ...], tp: int, rank: int) -> ShardSpec:
    """Megatron's grouped layout: the rank's row range of the fused tensor (`tp_segments`) is whole KV groups,
    each [its q heads | its k head | its v head]; every group is three contiguous reads."""
    d, h = cfg.head_dim, cfg.hidden_size
    q_rows = cfg.num_heads // cfg.num_kv_heads * d
    block = q_rows + 2 * d
    (seg,) = tp_segments("qkv", cfg.num_kv_heads * block, tp, rank)
    q, k, v = names
    pieces = []
    for j in range(seg.length // block):
        g = seg.start // block + j
        pieces += [
            Piece(q, 0, g * q_rows, q_rows, j * block),
            Piece(k, 0, g * d, d, j * block + q_rows),
            Piece(v, 0, g * d, d, j * block + q_rows + d),
        ]
    return ShardSpec(ours, (seg.length, h), tuple(pieces), q)


class ShardReader:
    """A PartReader over one layer's TP shards, the inverse of `rank_slices`: a slice of an HF tensor is copied
    out of whichever shards hold it. `load(rank)` returns that rank's state dict (memory-mapped, say); it is
    called lazily, once per rank. This is how export and reshard read checkpoints without merging whole layers."""

    def __init__(self, cfg: ModelConfig, layer: PipelineLayer, tp: int, load: Callable[[int], dict[str, torch.Tensor]]):
        self.load = load
        self._shards: dict[int, dict[str, torch.Tensor]] = {}
        self.index: dict[str, list[tuple[int, str, Piece]]] = {}
        seen = set()
        for rank in range(tp):
            for spec in rank_slices(cfg, layer, tp, rank):
                for p in spec.pieces:
                    if (p.hf_name, p.dim, p.start, p.length) in seen:
                        continue  # replicated tensors: every rank holds the same piece; read it from one
                    seen.add((p.hf_name, p.dim, p.start, p.length))
                    self.index.setdefault(p.hf_name, []).append((rank, spec.name, p))
        for parts in self.index.values():
            parts.sort(key=lambda x: x[2].start)

    def shard(self, rank: int) -> dict[str, torch.Tensor]:
        if rank not in self._shards:
            self._shards[rank] = self.load(rank)
        return self._shards[rank]

    def dtype(self, name: str) -> torch.dtype:
        rank, ours, _ = self.index[name][0]
        return self.shard(rank)[ours].dtype

    def split_dim(self, name: str) -> int:
        """0 when the HF tensor is split by rows across ranks (or replicated), 1 when by columns."""
        return self.index[name][0][2].dim

    def parts(self, name: str, dim: int, start: int, length: int) -> Iterator[tuple[torch.Tensor, int]]:
        """(view of a shard, offset in the request) for each shard slice within [start, start + length)."""
        for rank, ours, q in self.index[name]:
            if q.dim != dim:
                raise ValueError(f"internal: {name} is split along dim {q.dim}, asked for dim {dim}")
            a, b = max(start, q.start), min(start + length, q.start + q.length)
            if a < b:
                t = self.shard(rank)[ours]
                view = t.narrow(0, q.dst + a - q.start, b - a) if dim == 0 else t.narrow(1, a - q.start, b - a)
                yield view, a - start

    def read_into(self, piece: Piece, out: torch.Tensor) -> None:
        for src, offset in self.parts(piece.hf_name, piece.dim, piece.start, piece.length):
            out.narrow(piece.dim, offset, src.shape[piece.dim]).copy_(src)


class BufferPool:
    """Output tensors reused from one rank / layer to the next (torch.save has written them out by then).
    Fresh large allocations cost a page fault per 4 KiB on first touch (~0.4 s per GB here), more than reading
    the bytes; every block of a Llama has the same shard shapes, so one set of buffers serves them all. Buffers
    of another shape (embedding, LM head) replace the set, so memory stays at one rank's shard of one layer."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def start(self, specs: list[ShardSpec]) -> None:
        keep = {(s.name, s.shape) for s in specs}
        self.buffers = {k: v for k, v in self.buffers.items() if (k[0], k[1]) in keep}

    def get(self, spec: ShardSpec, dtype: torch.dtype, device: str) -> torch.Tensor:
        key = (spec.name, spec.shape, dtype)
        if key not in self.buffers or device != "cpu":
            self.buffers[key] = torch.empty(spec.shape, dtype=dtype, device=device)
        return self.buffers[key]


def materialize(
    spec: ShardSpec,
    reader: PartReader,
    dtype: Optional[torch.dtype] = None,
    device: str = "cpu",
    pool: Optional[BufferPool] = None,
) -> torch.Tensor:
    """Fill the output from its pieces (cast on the way when dtype differs); zeros where no piece lands."""
    src_dtype = reader.dtype(spec.source)
    out = pool.get(spec, src_dtype, device) if pool else torch.empty(spec.shape, dtype=src_dtype, device=device)
    covered = spec.shape[0] if any(p.dim == 1 for p in spec.pieces) else sum(p.length for p in spec.pieces)
    if covered < spec.shape[0]:
        out.zero_()
    for p in spec.pieces:
        reader.read_into(p, out if p.dim == 1 else out.narrow(0, p.dst, p.length))
    return out if dtype is None or dtype == out.dtype else out.to(dtype)
