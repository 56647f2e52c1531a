"""The training data checked before anything expensive: every problem megatron-core would meet deep inside its
builder (a missing prefix, a token beyond the vocabulary, a split too small for one sample, an SFT mask that does
not match its tokens, an unwritable or unshared index cache) and the ones it would never notice (an .idx that does
not describe its .bin, whatever the sizes; a loss mask or other 0/1 data given as tokens) as one ConfigError naming
the fix. Only the .idx files are read in full; of a .bin, at most a sample (the vocabulary check, and the sidecar's
fingerprint: a .bin or tokenizer that is not the one `threed preprocess` recorded, `threed.data.sidecar`).

    check_data(cfg, notes)               every bad input, before any process group or model exists (rank 0); the
                                         datasets that cannot be fully checked (no sidecar) noted in `notes`
    check_cache_visible(cache, rank)     every rank sees the index cache rank 0 builds (multi-node runs)

Why ours: megatron-core does not check its inputs (they fail with an assert or an IndexError), and on a multi-node
run whose cache is not shared it fails on the other nodes with a bare FileNotFoundError (Megatron-LM #907).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch.distributed as dist

from threed.config import DataConfig, RunConfig
from threed.data.prefixes import MASK_SUFFIX, TEXT_SUFFIX, mask_prefix
from threed.data.sidecar import check_sidecar
from threed.data.splits import Blend, DataSplits, read_data_flags
from threed.errors import ConfigError

# Above this many tokens per dataset, the vocabulary check reads a sample of documents instead of every token.
_FULL_VOCAB_SCAN_TOKENS = 256 * 2**20
# A dataset of at least this many values, all 0 or 1, is a mask (or other non-token data), not text.
_NON_TOKEN_MIN = 64
_IDX_HEADER_BYTES = 34  # magic (9), version (8), dtype code (1), sequence count (8), document count (8)
_IDX_CHUNK = 1 << 24  # index entries compared at a time: bounds the memory of the check on a huge index


def check_data(cfg: RunConfig, notes: Optional[list[str]] = None) -> DataSplits:
    """Every data problem as one ConfigError naming the fix, before any expensive work: the flags, every
    prefix's .bin/.idx, its sidecar (the .bin's fingerprint, the tokenizer), the token ids against the model's
    vocabulary, enough tokens for one sample, the cache. What could not be checked is appended to `notes`."""
    # megatron: heavy (all of megatron.core), only when the data is checked
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    splits = read_data_flags(cfg)
    seq = cfg.train.seq_length
    for blend in {b for b in splits.blends if b is not None}:
        for prefix in blend.prefixes:
            missing = [p for p in (prefix + ".idx", prefix + ".bin") if not Path(p).is_file()]
            if missing:
                raise ConfigError(
                    f"dataset {prefix}: {', '.join(missing)} not found; a dataset is a PREFIX.bin + "
                    f"PREFIX.idx pair made by `threed preprocess` (give the prefix, without the suffix)"
                )
            note = check_sidecar(prefix, cfg.data.tokenizer)
            if note and notes is not None:
                notes.append(note)
            try:
                ds = IndexedDataset(prefix, mmap=True)
            except Exception as e:  # megatron asserts on a bad header; name the file instead
                raise ConfigError(
                    f"dataset {prefix}: cannot read {prefix}.idx ({type(e).__name__}: {e}); rebuild it "
                    f"with `threed preprocess`"
                ) from None
            check_index(prefix, ds)
            _refuse_mask_as_tokens(prefix)
            tokens = int(ds.sequence_lengths.sum())
            if splits.sft:
                _check_sft_dataset(prefix, ds, seq)
            _check_split_ranges(splits, blend, prefix, ds, seq)
            if tokens < seq + 1 and not splits.sft:
                raise ConfigError(
                    f"dataset {prefix} holds {tokens} tokens, fewer than one sample of seq_length "
                    f"{seq} + 1; use more data or a shorter --seq-length"
                )
            top = _max_token(ds, tokens)
            if top <= 1 and tokens >= _NON_TOKEN_MIN and cfg.model.vocab_size > 2:
                raise ConfigError(
                    f"dataset {prefix} holds only the values 0 and 1 ({tokens:,} of them): a loss mask "
                    f"or another non-token dataset, not tokens; pass the token dataset (for `threed "
                    f"preprocess --sft` output, PREFIX{TEXT_SUFFIX})"
                )
            if top >= cfg.model.vocab_size:
                raise ConfigError(
                    f"dataset {prefix} contains token id {top}, beyond the model's vocab_size "
                    f"{cfg.model.vocab_size}: it was made with another tokenizer; re-run "
                    f"`threed preprocess` with the model's tokenizer"
                )
    check_cache_writable(cfg.data, splits)
    return splits


def check_index(prefix: str, ds: Any) -> None:
    """The .idx must describe its .bin exactly: its own size, documents that partition the sequences, sequences laid
    end to end from byte 0, and the last one ending at the last byte of the .bin. Reads only the index (memory-mapped
    by megatron already), in bounded chunks, never the .bin: an .idx beside another dataset's .bin (or a partial
    copy of either) is caught whatever the sizes."""
    idx = ds.index
    n, size = len(ds.sequence_lengths), idx.dtype_size
    docs = idx.document_indices
    fix = (
        "the pair comes from different runs or an incomplete copy; copy both files again, or rebuild them with "
        "`threed preprocess`"
    )

    def bad(what: str) -> ConfigError:
        return ConfigError(f"dataset {prefix}: {prefix}.idx does not describe {prefix}.bin ({what}); {fix}")

    idx_bytes = os.path.getsize(prefix + ".idx")
    if idx_bytes != _IDX_HEADER_BYTES + 12 * n + 8 * len(docs):
        raise bad(f".idx is {idx_bytes:,} bytes, its header says {_IDX_HEADER_BYTES + 12 * n + 8 * len(docs):,}")
    if len(docs) < 1 or docs[0] != 0 or docs[-1] != n:
        raise bad(f"its documents do not cover its {n:,} sequences")
    bin_bytes = os.path.getsize(prefix + ".bin")
    end = 0  # where the next sequence must start, in bytes
    for lo in range(0, n, _IDX_CHUNK):
        lengths = idx.sequence_lengths[lo : lo + _IDX_CHUNK].astype(np.int64)
        pointers = idx.sequence_pointers[lo : lo + _IDX_CHUNK]
        if lengths.min() < 0:
            raise bad(f"sequence {lo + int(lengths.argmin())} has a negative length")
        starts = end + np.concatenate(([0], np.cumsum(lengths[:-1] * size)))
        off = np.flatnonzero(pointers != starts)
        if len(off):
            i = int(off[0])
            raise bad(
                f"sequence {lo + i} starts at byte {int(pointers[i]):,}, not {int(starts[i]):,} where the one "
                f"before it ends"
            )
        end = int(starts[-1] + lengths[-1] * size)
    for lo in range(0, len(docs) - 1, _IDX_CHUNK):
        step = np.diff(docs[lo : lo + _IDX_CHUNK + 1])
        if len(step) and step.min() < 0:
            raise bad(f"document {lo + int(step.argmin()) + 1} starts before the one before it")
    if bin_bytes != end:
        kind = "truncated?" if bin_bytes < end else "another dataset's .bin?"
        raise bad(f".bin is {bin_bytes:,} bytes, the index describes {end:,}: {kind}")


def _refuse_mask_as_tokens(prefix: str) -> None:
    """A `threed preprocess --sft` loss mask (PREFIX_mask_document) named where tokens are expected."""
    text = prefix[: -len(MASK_SUFFIX)] + TEXT_SUFFIX
    if not prefix.endswith(MASK_SUFFIX) or not Path(text + ".idx").is_file():
        return  # a dataset merely named *_mask_document (json key "mask") is judged by its values (check_data)
    raise ConfigError(
        f"dataset {prefix} is the loss mask `threed preprocess --sft` writes beside {text}, not "
        f"tokens; pass {text} (its mask is found beside it)"
    )


def _check_sft_dataset(prefix: str, ds: Any, seq: int) -> None:
    """The loss mask must describe the same examples as the tokens, and every example must fit one sample."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # megatron: heavy

    mask = mask_prefix(prefix)
    redo = "re-make both with `threed preprocess --sft` (one run writes the pair)"
    if not Path(mask + ".bin").is_file():
        raise ConfigError(f"SFT dataset {prefix}: {mask}.bin not found; {redo}")
    try:
        mds = IndexedDataset(mask, mmap=True)
    except Exception as e:
        raise ConfigError(f"SFT dataset {prefix}: cannot read {mask}.idx ({type(e).__name__}: {e}); {redo}") from None
    if len(mds) != len(ds) or not np.array_equal(mds.sequence_lengths, ds.sequence_lengths):
        raise ConfigError(
            f"SFT dataset {prefix}: its loss mask {mask} describes other examples ({len(mds)} vs "
            f"{len(ds)} examples, or other lengths); {redo}"
        )
    longest = int(ds.sequence_lengths.max()) if len(ds) else 0
    if longest - 1 > seq:
        at = int(ds.sequence_lengths.argmax())
        raise ConfigError(
            f"SFT dataset {prefix}: example {at} has {longest} tokens, more than one sample of "
            f"seq_length {seq} + 1 holds; re-run `threed preprocess --sft --seq-length {seq}` with "
            f"--drop-long or --truncate-long, or raise --seq-length"
        )


def _check_split_ranges(splits: DataSplits, blend: Blend, prefix: str, ds: Any, seq: int) -> None:
    """Each split this run reads must hold one sample of this dataset (megatron-core loops forever building a split
    whose document range is empty, and fails obscurely on one shorter than a sample)."""
    names = ("train", "valid")
    if splits.split is not None:
        # megatron: heavy; its own split arithmetic, so the ranges checked are the ones it builds
        from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix
        from megatron.core.datasets.utils import normalize

        matrix = convert_split_vector_to_split_matrix(normalize([float(x) for x in splits.split.split(",")]))
        docs = len(ds.document_indices) - 1
        per_doc = np.add.reduceat(ds.sequence_lengths, ds.document_indices[:-1]) if docs else np.zeros(0)
        for i, name in enumerate(names):
            if splits.blends[i] is None or matrix[i] is None:
                continue
            beg, end = (int(round(b * docs)) for b in matrix[i])
            got = int(per_doc[beg:end].sum())
            if splits.sft and end <= beg:
                raise ConfigError(
                    f"SFT dataset {prefix}: its {name} split (--split {splits.split}: documents "
                    f"{beg}..{end} of {docs}) holds no example; use more data, another --split, or "
                    f"--train-data-path/--valid-data-path"
                )
            if got < seq + 1 and not splits.sft:
                raise ConfigError(
                    f"dataset {prefix}: its {name} split (--split {splits.split}: documents {beg}..{end} "
                    f"of {docs}) holds {got} tokens, fewer than one sample of seq_length {seq} + 1; "
                    f"use more data, another --split, or --train-data-path/--valid-data-path"
                )


def _max_token(ds: Any, tokens: int) -> int:
    """Largest token id: every token of a small dataset; of large ones, 1,000 documents spread evenly through it
    (a full scan of a TB corpus would take longer than many runs; the training batches are checked as well)."""
    if tokens <= _FULL_VOCAB_SCAN_TOKENS:
        return int(np.frombuffer(ds.bin_reader._bin_buffer, dtype=ds.index.dtype).max()) if tokens else 0
    picks = np.linspace(0, len(ds) - 1, num=min(1000, len(ds))).astype(np.int64)
    return max(int(ds[int(i)].max()) for i in picks)


def check_cache_writable(data: DataConfig, splits: DataSplits) -> None:
    """megatron writes its sample-index cache on first use: the directory must be writable (or creatable)."""
    if data.data_cache_path:
        where = Path(data.data_cache_path)
        fix = "give a writable --data-cache-path on a filesystem every node sees"
    else:
        # Without a cache path GPTDataset writes its index cache beside the data (PREFIX_DIR/cache/...).
        prefixes = [p for b in splits.blends if b for p in b.prefixes]
        where = Path(prefixes[0]).resolve().parent / "cache"
        fix = "pass --data-cache-path DIR (shared by all nodes), or make the data directory writable"
    probe_dir = where
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir() or not os.access(probe_dir, os.W_OK | os.X_OK):
        raise ConfigError(
            f"dataset index cache {where} is not writable ({probe_dir} is not a writable directory); {fix}"
        )


def check_cache_visible(cache_dir: str, rank: int) -> None:
    """Rank 0 writes a probe file into the cache directory; every rank must then see it. Called by every rank,
    between two barriers, before megatron builds (rank 0) and loads (everyone else) its index caches."""
    probe = Path(cache_dir) / f".threed-visible-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    if rank == 0:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(socket.gethostname())
    dist.barrier()
    seen = probe.is_file()
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, (seen, socket.gethostname()))
    if rank == 0:
        probe.unlink(missing_ok=True)
    blind = [f"{r} ({host})" for r, (ok, host) in enumerate(flags) if not ok]
    if blind:
        raise ConfigError(
            f"the dataset index cache {cache_dir} built by rank 0 is not visible to rank(s) "
            f"{', '.join(blind)}: --data-cache-path must be on a filesystem shared by all nodes"
        )
