"""Training data: megatron-core's own indexed datasets (`.bin/.idx`), GPTDataset and blending, built from
Megatron-LM's flags (`threed.config.DataConfig`).

    check_data(cfg)              every bad input as one ConfigError, before any process group or model exists
    build_datasets(cfg, ...)     train / valid / test through BlendedMegatronDatasetBuilder (all ranks call it)

What is ours and why: megatron-core has the readers, the sample index, blending and caching; it does not check its
inputs (a missing prefix, a bad weight or a too-small dataset fail deep inside with an assert or an IndexError),
and on a multi-node run whose cache is not shared it fails on the other nodes with a bare FileNotFoundError
(Megatron-LM #907). `check_data` and `check_cache_visible` turn those into one clear line each.
"""
from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from threed.config import ConfigError, DataConfig, RunConfig

NO_EOD = -2  # no tokenizer given: no id is the end of a document (and none collides with the pad, -1)
# Megatron's default evaluation interval when a valid split exists and none is given.
DEFAULT_EVAL_INTERVAL = 1000
# Above this many tokens per dataset, the vocabulary check reads a sample of documents instead of every token.
_FULL_VOCAB_SCAN_TOKENS = 256 * 2**20


@dataclass(frozen=True)
class Blend:
    prefixes: tuple[str, ...]
    weights: Optional[tuple[float, ...]]  # None: in proportion to the datasets' sizes (Megatron's rule)

    def as_megatron(self) -> tuple[list[str], Optional[list[float]]]:
        return list(self.prefixes), list(self.weights) if self.weights else None


def parse_blend(words: Sequence[str], flag: str) -> Blend:
    """`PREFIX`, `PREFIX PREFIX ...`, or `WEIGHT PREFIX WEIGHT PREFIX ...` (Megatron's --data-path grammar)."""
    words = [w for w in words if w.strip()]
    if not words:
        raise ConfigError(f"{flag} is empty; give PREFIX or WEIGHT PREFIX WEIGHT PREFIX ...")
    numeric = [_is_number(w) for w in words]
    if len(words) % 2 == 0 and all(numeric[0::2]):
        weights = tuple(float(w) for w in words[0::2])
        prefixes = tuple(words[1::2])
        bad = [w for w in weights if not math.isfinite(w) or w < 0]
        if bad:
            raise ConfigError(f"{flag}: blend weights must be finite and >= 0, got {bad[0]:g}; e.g. "
                              f"{flag} 0.3 PREFIX_A 0.7 PREFIX_B")
        if sum(weights) <= 0:
            raise ConfigError(f"{flag}: the blend weights sum to 0; give at least one positive weight")
        return Blend(prefixes, weights)
    if any(numeric):
        first = words[numeric.index(True)]
        raise ConfigError(f"{flag}: cannot parse {' '.join(words)!r}: {first!r} looks like a weight, but weights "
                          f"and prefixes must alternate (WEIGHT PREFIX WEIGHT PREFIX ...), or give prefixes only")
    return Blend(tuple(words), None)


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def parse_split(split: str) -> list[float]:
    try:
        parts = [float(p) for p in split.replace("/", ",").split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"--split {split!r} is not a list of numbers; use e.g. --split 969,30,1") from None
    if not 1 <= len(parts) <= 3 or any(not math.isfinite(p) or p < 0 for p in parts):
        raise ConfigError(f"--split {split!r} needs up to three non-negative numbers train,valid,test; "
                          f"e.g. --split 969,30,1")
    if sum(parts) <= 0:
        raise ConfigError(f"--split {split!r} sums to 0: no document would go anywhere; e.g. --split 969,30,1")
    return parts + [0.0] * (3 - len(parts))


@dataclass(frozen=True)
class DataPlan:
    """What `check_data` found: the blend of each split (None: that split is empty) and the eval interval."""

    blends: tuple[Optional[Blend], Optional[Blend], Optional[Blend]]  # train, valid, test
    split: Optional[str]  # with --data-path; None with per-split paths
    eval_interval: int  # 0: no evaluation
    eod: int  # end-of-document id (NO_EOD: unknown, only allowed when nothing needs it)
    sft: bool = False  # `threed preprocess --sft` data (a loss-mask dataset beside each prefix): threed.data.sft_dataset

    @property
    def has_valid(self) -> bool:
        return self.blends[1] is not None


def data_plan(cfg: RunConfig) -> DataPlan:
    """The splits and blends the flags describe, checked for form (no file is read)."""
    d, t = cfg.data, cfg.train
    per_split = (d.train_data_path, d.valid_data_path, d.test_data_path)
    if d.data_path and any(per_split):
        raise ConfigError("give either --data-path (with --split) or --train-data-path/--valid-data-path/"
                          "--test-data-path, not both")
    if d.data_path:
        blend = parse_blend(d.data_path, "--data-path")
        ratios = parse_split(d.split)
        if ratios[0] <= 0:
            raise ConfigError(f"--split {d.split!r} gives training no documents; e.g. --split 969,30,1")
        blends = tuple(blend if r > 0 else None for r in ratios)
        split: Optional[str] = ",".join(f"{r:g}" for r in ratios)
    elif d.train_data_path:
        blends = tuple(parse_blend(p, f"--{n}-data-path") if p else None
                       for p, n in zip(per_split, ("train", "valid", "test")))
        split = None
    else:
        raise ConfigError("no training data: pass --data-path PREFIX (a .bin/.idx pair made by `threed preprocess` "
                          "or Megatron-LM's tools/preprocess_data.py), or --train-data-path")
    has_valid = blends[1] is not None
    if t.eval_interval is not None and t.eval_interval > 0 and not has_valid:
        raise ConfigError(f"--eval-interval {t.eval_interval} needs a validation split: give --split with a "
                          f"non-zero middle part (e.g. 969,30,1) or --valid-data-path")
    interval = (t.eval_interval if t.eval_interval is not None else DEFAULT_EVAL_INTERVAL) if has_valid else 0
    if interval and t.eval_iters < 1:
        raise ConfigError(f"--eval-iters must be >= 1 when evaluating, got {t.eval_iters}")
    sft = _sft_kind(blends, d)
    eod = NO_EOD
    if d.tokenizer:
        from threed.data.tokenizer import Tokenizer

        try:
            tok = Tokenizer(d.tokenizer)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer: {e}") from None
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(f"tokenizer {d.tokenizer} has {tok.vocab_size} tokens, more than the model's vocab_size "
                              f"{cfg.model.vocab_size}; use the model's own tokenizer")
        eod = tok.eos_id
    elif d.eod_mask_loss:
        raise ConfigError("--eod-mask-loss needs --tokenizer (the end-of-document id comes from it)")
    return DataPlan(blends=blends, split=split, eval_interval=interval, eod=eod, sft=sft)


def _sft_kind(blends, d: DataConfig) -> bool:
    """SFT data or not, from the files: every prefix has its loss-mask dataset, or none does."""
    from threed.data.sft_dataset import is_sft_prefix

    prefixes = sorted({p for b in blends if b for p in b.prefixes})
    kinds = {p: is_sft_prefix(p) for p in prefixes}
    if len(set(kinds.values())) > 1:
        sft = [p for p, k in kinds.items() if k]
        plain = [p for p, k in kinds.items() if not k]
        raise ConfigError(f"the data mixes SFT datasets ({sft[0]}, with a loss mask) and pretraining datasets "
                          f"({plain[0]}, without): train them in separate runs, or re-make {plain[0]} with "
                          f"`threed preprocess --sft`")
    sft = bool(prefixes) and all(kinds.values())
    if d.pack and not sft:
        raise ConfigError(f"--pack true needs SFT data (`threed preprocess --sft` writes PREFIX_text_document and "
                          f"PREFIX_mask_document; {prefixes[0]} has no mask dataset beside it); pretraining data "
                          f"is already packed by megatron's GPTDataset: drop --pack")
    if sft and d.eod_mask_loss:
        raise ConfigError("--eod-mask-loss is for pretraining data; SFT data carries its own loss mask (the "
                          "response tokens): drop --eod-mask-loss")
    return sft


def check_data(cfg: RunConfig) -> DataPlan:
    """Every data problem as one ConfigError naming the fix, before any expensive work: the flags, every
    prefix's .bin/.idx, the token ids against the model's vocabulary, enough tokens for one sample, the cache."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    plan = data_plan(cfg)
    seq = cfg.train.seq_length
    for blend in {b for b in plan.blends if b is not None}:
        for prefix in blend.prefixes:
            missing = [p for p in (prefix + ".idx", prefix + ".bin") if not Path(p).is_file()]
            if missing:
                raise ConfigError(f"dataset {prefix}: {', '.join(missing)} not found; a dataset is a PREFIX.bin + "
                                  f"PREFIX.idx pair made by `threed preprocess` (give the prefix, without the suffix)")
            try:
                ds = IndexedDataset(prefix, mmap=True)
            except Exception as e:  # megatron asserts on a bad header; name the file instead
                raise ConfigError(f"dataset {prefix}: cannot read {prefix}.idx ({type(e).__name__}: {e}); rebuild it "
                                  f"with `threed preprocess`") from None
            tokens = int(ds.sequence_lengths.sum())
            if plan.sft:
                _check_sft_dataset(prefix, ds, seq)
            _check_split_ranges(plan, blend, prefix, ds, seq)
            expect = int(ds.index.sequence_pointers[-1] + ds.sequence_lengths[-1] * ds.index.dtype_size) if len(ds) else 0
            if os.path.getsize(prefix + ".bin") < expect:
                raise ConfigError(f"dataset {prefix}: {prefix}.bin holds fewer bytes than {prefix}.idx describes "
                                  f"(truncated copy?); copy or rebuild it")
            if tokens < seq + 1 and not plan.sft:
                raise ConfigError(f"dataset {prefix} holds {tokens} tokens, fewer than one sample of seq_length "
                                  f"{seq} + 1; use more data or a shorter --seq-length")
            top = _max_token(ds, tokens)
            if top >= cfg.model.vocab_size:
                raise ConfigError(f"dataset {prefix} contains token id {top}, beyond the model's vocab_size "
                                  f"{cfg.model.vocab_size}: it was made with another tokenizer; re-run "
                                  f"`threed preprocess` with the model's tokenizer")
    check_cache_writable(cfg.data, plan)
    return plan


def _check_sft_dataset(prefix: str, ds, seq: int) -> None:
    """The loss mask must describe the same examples as the tokens, and every example must fit one sample."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from threed.data.sft_dataset import mask_prefix

    mask = mask_prefix(prefix)
    redo = "re-make both with `threed preprocess --sft` (one run writes the pair)"
    if not Path(mask + ".bin").is_file():
        raise ConfigError(f"SFT dataset {prefix}: {mask}.bin not found; {redo}")
    try:
        mds = IndexedDataset(mask, mmap=True)
    except Exception as e:
        raise ConfigError(f"SFT dataset {prefix}: cannot read {mask}.idx ({type(e).__name__}: {e}); {redo}") from None
    if len(mds) != len(ds) or not np.array_equal(mds.sequence_lengths, ds.sequence_lengths):
        raise ConfigError(f"SFT dataset {prefix}: its loss mask {mask} describes other examples ({len(mds)} vs "
                          f"{len(ds)} examples, or other lengths); {redo}")
    longest = int(ds.sequence_lengths.max()) if len(ds) else 0
    if longest - 1 > seq:
        at = int(ds.sequence_lengths.argmax())
        raise ConfigError(f"SFT dataset {prefix}: example {at} has {longest} tokens, more than one sample of "
                          f"seq_length {seq} + 1 holds; re-run `threed preprocess --sft --seq-length {seq}` with "
                          f"--drop-long or --truncate-long, or raise --seq-length")


def _check_split_ranges(plan: DataPlan, blend: Blend, prefix: str, ds, seq: int) -> None:
    """Each split this run reads must hold one sample of this dataset (megatron-core loops forever building a split
    whose document range is empty, and fails obscurely on one shorter than a sample)."""
    names = ("train", "valid")
    if plan.split is not None:
        from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix
        from megatron.core.datasets.utils import normalize

        matrix = convert_split_vector_to_split_matrix(normalize([float(x) for x in plan.split.split(",")]))
        docs = len(ds.document_indices) - 1
        per_doc = np.add.reduceat(ds.sequence_lengths, ds.document_indices[:-1]) if docs else np.zeros(0)
        for i, name in enumerate(names):
            if plan.blends[i] is None or matrix[i] is None:
                continue
            beg, end = (int(round(b * docs)) for b in matrix[i])
            got = int(per_doc[beg:end].sum())
            if plan.sft and end <= beg:
                raise ConfigError(f"SFT dataset {prefix}: its {name} split (--split {plan.split}: documents "
                                  f"{beg}..{end} of {docs}) holds no example; use more data, another --split, or "
                                  f"--train-data-path/--valid-data-path")
            if got < seq + 1 and not plan.sft:
                raise ConfigError(f"dataset {prefix}: its {name} split (--split {plan.split}: documents {beg}..{end} "
                                  f"of {docs}) holds {got} tokens, fewer than one sample of seq_length {seq} + 1; "
                                  f"use more data, another --split, or --train-data-path/--valid-data-path")


def _max_token(ds, tokens: int) -> int:
    """Largest token id: every token of a small dataset; of large ones, 1,000 documents spread evenly through it
    (a full scan of a TB corpus would take longer than many runs; the training batches are checked as well)."""
    if tokens <= _FULL_VOCAB_SCAN_TOKENS:
        return int(np.frombuffer(ds.bin_reader._bin_buffer, dtype=ds.index.dtype).max()) if tokens else 0
    picks = np.linspace(0, len(ds) - 1, num=min(1000, len(ds))).astype(np.int64)
    return max(int(ds[int(i)].max()) for i in picks)


def check_cache_writable(data: DataConfig, plan: DataPlan) -> None:
    if data.data_cache_path:
        where = Path(data.data_cache_path)
        fix = "give a writable --data-cache-path on a filesystem every node sees"
    else:
        # Without a cache path GPTDataset writes its index cache beside the data (PREFIX_DIR/cache/...).
        prefixes = [p for b in plan.blends if b for p in b.prefixes]
        where = Path(prefixes[0]).resolve().parent / "cache"
        fix = "pass --data-cache-path DIR (shared by all nodes), or make the data directory writable"
    probe_dir = where
    while not probe_dir.exists():
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir() or not os.access(probe_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"dataset index cache {where} is not writable ({probe_dir} is not a writable "
                          f"directory); {fix}")


def check_cache_visible(cache_dir: str, rank: int) -> None:
    """Rank 0 writes a probe file into the cache directory; every rank must then see it. Called by every rank,
    between two barriers, before megatron builds (rank 0) and loads (everyone else) its index caches."""
    import torch.distributed as dist

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
        raise ConfigError(f"the dataset index cache {cache_dir} built by rank 0 is not visible to rank(s) "
                          f"{', '.join(blind)}: --data-cache-path must be on a filesystem shared by all nodes")
