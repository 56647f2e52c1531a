"""Streaming writer of an HF model directory: sharded safetensors + `model.safetensors.index.json`, tokenizer
files (`config.json`: threed.hf.config.write_config).

    w = ShardedSafetensorsWriter(out_dir, plan_shards(planned, max_bytes=5 << 30))
    for name, tensor in tensors_in_plan_order:  w.write(name, tensor)
    w.close()                                    # checks every planned tensor was written, writes the index

The shapes and dtypes of every tensor are known before any data (from the config and the checkpoint's
headers), so each shard's header is written first and tensor bytes follow as they are produced: memory holds
one layer, never a whole shard.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional

import torch

from threed.hf.format import SAFETENSORS_INDEX, ST_NAMES, HFError


@dataclass(frozen=True)
class Planned:
    """One tensor of the output, known (name, dtype, shape) before its data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


def plan_shards(tensors: list[Planned], max_bytes: int) -> list[list[Planned]]:
    """Consecutive groups of at most max_bytes (a bigger tensor gets a shard of its own), in the given order."""
    shards: list[list[Planned]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def parse_size(s: str) -> int:
    """'5GB' / '500MB' / '2GiB' / '1000000' -> bytes (--max-shard-size)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    s = s.strip().upper()
    for unit, mult in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


def _header(shard: list[Planned]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in shard:
        header[t.name] = {
            "dtype": ST_NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header so tensor data starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


class ShardedSafetensorsWriter:
    """Writes the planned shards' files in order, tensor by tensor (or part by part), then the index."""

    def __init__(self, out_dir: Path, shards: list[list[Planned]]):
        self.out_dir = out_dir
        self.shards = shards
        n = len(shards)
        self.file_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.order = [(i, t) for i, shard in enumerate(shards) for t in shard]
        self.next = 0
        self.current: Optional[BinaryIO] = None
        self.current_shard = -1
        self.part_bytes = 0  # of the tensor being written

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The whole of the next planned tensor."""
        planned = self.order[self.next][1] if self.next < len(self.order) else None
        if planned is None or planned.name != name or tuple(tensor.shape) != planned.shape:
            raise HFError(f"internal: wrote {name} {list(tensor.shape)}, planned {planned}")
        self.write_part(name, tensor)

    def write_part(self, name: str, chunk: torch.Tensor) -> None:
        """The next bytes of the next planned tensor (e.g. one TP shard's rows): no assembly buffer needed."""
        if self.next >= len(self.order):
            raise HFError(f"internal: {name} written after the planned tensors")
        shard, planned = self.order[self.next]
        if planned.name != name:
            raise HFError(f"internal: wrote {name}, planned {planned.name}")
        if shard != self.current_shard:
            if self.current is not None:
                self.current.close()
            self.current = open(self.out_dir / self.file_names[shard], "wb")
            self.current.write(_header(self.shards[shard]))
            self.current_shard = shard
        assert self.current is not None
        data = chunk.to(planned.dtype).contiguous().reshape(-1).view(torch.uint8)
        if self.part_bytes + data.numel() > planned.nbytes:
            raise HFError(f"internal: {name} got more than its {planned.nbytes} bytes")
        self.current.write(data.numpy().data)
        self.part_bytes += data.numel()
        if self.part_bytes == planned.nbytes:
            self.next += 1
            self.part_bytes = 0

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None
        if self.next != len(self.order):
            raise HFError(f"internal: {len(self.order) - self.next} planned tensors were not written")
        weight_map = {t.name: self.file_names[i] for i, t in self.order}
        total = sum(t.nbytes for _, t in self.order)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (self.out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def copy_files(files: list[Path], out_dir: Path) -> list[str]:
    """Copy those of `files` that exist into out_dir; returns their names."""
    copied = []
    for f in files:
        if f.is_file():
            shutil.copyfile(f, out_dir / f.name)
            copied.append(f.name)
    return copied


def write_sentencepiece_tokenizer(model_file: Path, out_dir: Path) -> list[str]:
    """A sentencepiece model from `threed tokenizer` as an HF Llama tokenizer (tokenizer.model + config)."""
    import sentencepiece as spm  # sentencepiece: optional, only for a sentencepiece tokenizer

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    shutil.copyfile(model_file, out_dir / "tokenizer.model")
    piece = lambda i: sp.id_to_piece(i) if 0 <= i < sp.get_piece_size() else None  # noqa: E731
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": piece(sp.bos_id()),
        "eos_token": piece(sp.eos_id()),
        "unk_token": piece(sp.unk_id()),
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 1 << 30,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.model", "tokenizer_config.json"]
