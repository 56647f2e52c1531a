"""Lazy reading of an HF Llama directory: sharded or single safetensors, or old `pytorch_model*.bin` files.

    src = HFSource("Meta-Llama-3-8B")          # reads headers only: names, dtypes, shapes, offsets
    src.check(model_cfg, expected_shapes)      # missing / unexpected / wrong-shaped tensors, named
    src.read_slice(name, dim, start, length, out)   # a slice, read now (threed.convert.slices reads through this)

Safetensors are read with our own header parser and positioned reads straight into the output tensor's
memory: one copy from the page cache, no memory map that would keep the whole shard resident (and counted in
RSS), and a truncated or corrupt file is detected from its header before any tensor is converted.

This module knows files and tensor names, not our model: which tensors a ModelConfig implies is passed in
(threed.convert computes it from the HF name table).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Protocol

import torch

from threed.config import ModelConfig
from threed.hf.format import BIN_INDEX, IGNORED_SUFFIXES, SAFETENSORS_INDEX, ST_DTYPES, HFError

_MAX_READ = 1 << 30  # Linux reads at most ~2 GiB per call; read big tensors in 1 GiB pieces


class TensorSlice(Protocol):
    """[start, start + length) of HF tensor `hf_name` along `dim` (threed.convert.slices.Piece is one)."""

    @property
    def hf_name(self) -> str: ...

    @property
    def dim(self) -> int: ...

    @property
    def start(self) -> int: ...

    @property
    def length(self) -> int: ...


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int = 0  # absolute byte offset in a safetensors file
    nbytes: int = 0


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one safetensors header against the file's size (truncation, bad offsets, bad JSON)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise HFError(f"{path} is truncated ({size} bytes): not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise HFError(f"{path} is truncated or corrupt: its header claims {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HFError(f"{path} has a corrupt safetensors header ({e}); re-download the file") from None
    data_start, data_size = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = meta["dtype"], tuple(int(s) for s in meta["shape"]), meta["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise HFError(f"{path}: corrupt header entry for {name}: {meta!r}") from None
        if dtype not in ST_DTYPES:
            raise HFError(f"{path}: {name} has dtype {dtype}; only float tensors (F32/BF16/F16) convert")
        numel = 1
        for s in shape:
            numel *= s
        if end - begin != numel * ST_DTYPES[dtype].itemsize or begin < 0:
            raise HFError(f"{path}: corrupt header: {name} {dtype}{list(shape)} spans bytes {begin}..{end}")
        if end > data_size:
            raise HFError(
                f"{path} is truncated: {name} ends at byte {end} of the data, the file holds "
                f"{data_size}; re-download or re-copy it"
            )
        out[name] = TensorInfo(name, path, ST_DTYPES[dtype], shape, data_start + begin, end - begin)
    return out


def read_range(fd: int, info: TensorInfo, dim: int, start: int, length: int, out: torch.Tensor) -> None:
    """Positioned reads of a row range (dim 0: one read) or a column range (dim 1: one read per row) of a
    safetensors tensor straight into `out`, a contiguous tensor of the same dtype."""
    if out.dtype != info.dtype or not out.is_contiguous():
        raise ValueError(f"internal: read_into {info.name} needs a contiguous {info.dtype} output")
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    row_bytes = info.nbytes // info.shape[0] if info.shape else info.nbytes
    if dim == 0:
        _pread(fd, view, info.offset + start * row_bytes, info)
        return
    item = info.dtype.itemsize
    size = length * item
    base = info.offset + start * item
    for i in range(info.shape[0]):
        _pread(fd, view[i * size : (i + 1) * size], base + i * row_bytes, info)


def _pread(fd: int, view: memoryview, offset: int, info: TensorInfo) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done : done + _MAX_READ]], offset + done)
        if n <= 0:
            raise HFError(f"{info.file} ended while reading {info.name}: the file is truncated")
        done += n


class HFSource:
    """The tensors of an HF model directory, indexed from headers; tensor data is read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise HFError(
                f"--hf {self.path} is not a directory: pass an HF model directory "
                f"(config.json + *.safetensors or pytorch_model*.bin)"
            )
        self.format, files = self._find_files()
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        self._bin_cache: tuple[Optional[Path], dict[str, torch.Tensor]] = (None, {})
        self._fds: dict[Path, int] = {}
        for f in files:
            infos = read_safetensors_header(f) if self.format == "safetensors" else self._bin_infos(f)
            for name, info in infos.items():
                if name in self.tensors:
                    raise HFError(f"{name} is stored twice: in {self.tensors[name].file.name} and {f.name}")
                self.tensors[name] = info
        self._check_index()

    # ------------------------------------------------------------------------------------------- discovery
    def _find_files(self) -> tuple[str, list[Path]]:
        p = self.path
        for fmt, index, single, pattern in (
            ("safetensors", SAFETENSORS_INDEX, "model.safetensors", "*.safetensors"),
            ("bin", BIN_INDEX, "pytorch_model.bin", "pytorch_model*.bin"),
        ):
            if (p / index).is_file():
                self.index = self._read_index(p / index)
                files = sorted({p / f for f in self.index.values()})
                missing = [f.name for f in files if not f.is_file()]
                if missing:
                    raise HFError(f"{index} names files that are not in {p}: {', '.join(missing)}")
                return fmt, files
            found = [p / single] if (p / single).is_file() else sorted(p.glob(pattern))
            if found:
                self.index = {}
                return fmt, found
        if list(p.glob("consolidated.*.pth")):
            raise HFError(
                f"{p} holds Meta's original consolidated.*.pth weights; convert them to HF format "
                f"first (transformers' convert_llama_weights_to_hf.py), which also permutes q/k"
            )
        raise HFError(f"{p} holds no model.safetensors[.index.json] and no pytorch_model*.bin")

    @staticmethod
    def _read_index(path: Path) -> dict[str, str]:
        try:
            return dict(json.loads(path.read_text())["weight_map"])
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise HFError(f"{path} is not a valid index (needs a weight_map): {e}") from None

    def _check_index(self) -> None:
        for name, fname in self.index.items():
            info = self.tensors.get(name)
            if info is None or info.file.name != fname:
                raise HFError(
                    f"the index maps {name} to {fname}, but {fname} does not hold it: the "
                    f"download is incomplete or the index is stale"
                )

    def _load_bin(self, path: Path) -> dict[str, torch.Tensor]:
        """A torch .bin file, memory-mapped when it is in the zip format (pickle parsed, data left on disk)."""
        if self._bin_cache[0] == path:
            return self._bin_cache[1]
        self._bin_cache = (None, {})  # drop the previous file's mapping first: one shard resident at a time
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise HFError(f"cannot read {path}: {_first_sentence(e)} (the file is truncated or corrupt)") from None
            sd = self._load_bin_plain(path)  # legacy (pre-zip) format: cannot be mapped, read whole
        except Exception as e:  # pickle/zip errors of many kinds: a truncated or corrupt file
            raise HFError(f"cannot read {path}: {_first_sentence(e)} (the file is truncated or corrupt)") from None
        if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise HFError(f"{path} is not a state dict of tensors")
        self._bin_cache = (path, sd)
        return sd

    @staticmethod
    def _load_bin_plain(path: Path) -> dict[str, torch.Tensor]:
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise HFError(f"cannot read {path}: {_first_sentence(e)}") from None

    def _bin_infos(self, path: Path) -> dict[str, TensorInfo]:
        sd = self._load_bin(path)
        for name, t in sd.items():
            if not t.is_floating_point():
                raise HFError(f"{path}: {name} has dtype {t.dtype}; only float tensors convert")
        return {n: TensorInfo(n, path, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size()) for n, t in sd.items()}

    # ------------------------------------------------------------------------------------------------ access
    def nbytes(self, names: Iterable[str]) -> int:
        return sum(self.tensors[n].nbytes for n in names)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def read_slice(self, name: str, dim: int, start: int, length: int, out: torch.Tensor) -> None:
        """Fill `out` with [start, start + length) of HF tensor `name` along `dim` (0 or 1)."""
        info = self.tensors[name]
        if self.format != "safetensors":
            out.copy_(self._load_bin(info.file)[name].narrow(dim, start, length))
            return
        if info.file not in self._fds:
            self._fds[info.file] = os.open(info.file, os.O_RDONLY)
        read_range(self._fds[info.file], info, dim, start, length, out)

    def read_into(self, piece: TensorSlice, out: torch.Tensor) -> None:
        """read_slice for a Piece: the PartReader protocol of threed.convert.slices."""
        self.read_slice(piece.hf_name, piece.dim, piece.start, piece.length, out)

    def prefetch(self, names: Iterable[str]) -> None:
        """Ask the kernel to start reading these tensors now (asynchronously, in large sequential requests):
        the disk then works on the next layer while this one is being written, and the one-read-per-row
        column slices of row-parallel weights hit the page cache instead of each waiting for the disk."""
        if self.format != "safetensors" or not hasattr(os, "posix_fadvise"):
            return
        for name in names:
            info = self.tensors[name]
            if info.file not in self._fds:
                self._fds[info.file] = os.open(info.file, os.O_RDONLY)
            os.posix_fadvise(self._fds[info.file], info.offset, info.nbytes, os.POSIX_FADV_WILLNEED)

    def read(self, name: str) -> torch.Tensor:
        info = self.tensors[name]
        out = torch.empty(info.shape, dtype=info.dtype)
        self.read_slice(name, 0, 0, info.shape[0] if info.shape else 1, out)
        return out

    def read_many(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {n: self.read(n) for n in names}

    def same_values(self, a: str, b: str, block_bytes: int = 64 << 20) -> bool:
        """Whether tensors `a` and `b` have the same shape and values (compared in row blocks of about
        `block_bytes`, in the wider of their dtypes): memory holds one block of each, never a whole tensor."""
        ia, ib = self.tensors[a], self.tensors[b]
        if ia.shape != ib.shape:
            return False
        if not ia.shape:
            return torch.equal(self.read(a).double(), self.read(b).double())
        rows = ia.shape[0]
        step = max(1, block_bytes // max(1, max(ia.nbytes, ib.nbytes) // max(rows, 1)))
        wide = torch.promote_types(ia.dtype, ib.dtype)
        for start in range(0, rows, step):
            n = min(step, rows - start)
            x, y = (torch.empty((n, *ia.shape[1:]), dtype=i.dtype) for i in (ia, ib))
            self.read_slice(a, 0, start, n, x)
            self.read_slice(b, 0, start, n, y)
            if not torch.equal(x.to(wide), y.to(wide)):
                return False
        return True

    def close(self) -> None:
        self._bin_cache = (None, {})
        for fd in self._fds.values():
            os.close(fd)
        self._fds = {}

    # ------------------------------------------------------------------------------------------- validation
    def check(
        self,
        cfg: ModelConfig,
        expected: dict[str, tuple[int, ...]],
        optional: Optional[dict[str, tuple[int, ...]]] = None,
    ) -> None:
        """Every tensor the config implies (`expected`: HF name -> shape) is present with the right shape, and
        nothing else is (but IGNORED_SUFFIXES, and the `optional` ones, checked for shape when present: a tied
        model's lm_head.weight, which some writers save anyway)."""
        optional = optional or {}
        present = {n for n in self.tensors if not n.endswith(IGNORED_SUFFIXES)}
        problems = []
        missing = sorted(set(expected) - present)
        if missing:
            problems.append(f"{len(missing)} missing: {_names(missing)}")
        unexpected = sorted(present - set(expected) - set(optional))
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected: {_names(unexpected)}")
        shapes = {**optional, **expected}
        wrong = [
            f"{n} is {list(self.tensors[n].shape)}, expected {list(s)}"
            for n, s in shapes.items()
            if n in self.tensors and self.tensors[n].shape != s
        ]
        if wrong:
            problems.append(f"{len(wrong)} wrong-shaped: {_names(wrong)}")
        if problems:
            raise HFError(
                f"{self.path} does not match its config.json ({cfg.num_layers} layers, hidden "
                f"{cfg.hidden_size}, vocab {cfg.vocab_size}): " + "; ".join(problems)
            )


def _first_sentence(e: BaseException) -> str:
    return f"{e.__class__.__name__}: {str(e).split('. ')[0][:300]}"


def _names(items: list[str], limit: int = 8) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
