"""Megatron-LM's data flags -> the blend of each split: `--data-path [WEIGHT] PREFIX ...` with `--split`, or
`--train-data-path` / `--valid-data-path` / `--test-data-path`, read as Megatron reads them, into `DataSplits`,
the one description of the training data that the checks (`threed.data.checks`), the dataset builder
(`threed.data.datasets`) and the training loop share.

    read_data_flags(cfg)    the flags' reading: cheap, the same on every rank; one ConfigError per bad flag

Refused as well, because they would silently do something else than asked: a dataset listed twice in one blend
(megatron builds it twice with the same shuffle, so each sample is read twice, in step: merge the weights), --split
with per-split paths, and --test-data-path (no test split is ever evaluated).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional, Sequence

from threed.config import DataConfig, RunConfig
from threed.data.prefixes import is_sft_prefix
from threed.data.tokenizer import Tokenizer
from threed.errors import ConfigError

NO_EOD = -2  # no tokenizer given: no id is the end of a document (and none collides with the pad, -1)
# Megatron's default evaluation interval when a valid split exists and none is given.
DEFAULT_EVAL_INTERVAL = 1000
# --split's default: told apart from a --split given with per-split paths, where it would be ignored.
_DEFAULT_SPLIT = next(f.default for f in dataclasses.fields(DataConfig) if f.name == "split")


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
            raise ConfigError(
                f"{flag}: blend weights must be finite and >= 0, got {bad[0]:g}; e.g. {flag} 0.3 PREFIX_A 0.7 PREFIX_B"
            )
        if sum(weights) <= 0:
            raise ConfigError(f"{flag}: the blend weights sum to 0; give at least one positive weight")
        _refuse_repeats(prefixes, weights, flag)
        return Blend(prefixes, weights)
    if any(numeric):
        first = words[numeric.index(True)]
        raise ConfigError(
            f"{flag}: cannot parse {' '.join(words)!r}: {first!r} looks like a weight, but weights "
            f"and prefixes must alternate (WEIGHT PREFIX WEIGHT PREFIX ...), or give prefixes only"
        )
    _refuse_repeats(tuple(words), None, flag)
    return Blend(tuple(words), None)


def _refuse_repeats(prefixes: Sequence[str], weights: Optional[Sequence[float]], flag: str) -> None:
    """One dataset listed twice in one blend (also as another spelling of the same path) is refused: megatron
    builds two identical datasets with the same shuffle, so every sample of it is read twice, in step, and the
    mixture is the one its merged weight gives. A weight says how much of a dataset is wanted in one number."""
    seen: dict[str, int] = {}
    for i, p in enumerate(prefixes):
        j = seen.setdefault(os.path.realpath(p), i)
        if j == i:
            continue
        if weights is None:
            fix = f"list it once (or give weights, e.g. {flag} 2 {p} 1 OTHER, to read it more often)"
        else:
            merged = sum(w for k, w in enumerate(weights) if os.path.realpath(prefixes[k]) == os.path.realpath(p))
            fix = f"list it once with the weights merged ({flag} ... {merged:g} {p} ...)"
        same = "" if prefixes[j] == p else f" (as {prefixes[j]})"
        raise ConfigError(f"{flag} lists {p} twice{same}: every sample of it would be read twice over; {fix}")


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
        raise ConfigError(
            f"--split {split!r} needs up to three non-negative numbers train,valid,test; e.g. --split 969,30,1"
        )
    if sum(parts) <= 0:
        raise ConfigError(f"--split {split!r} sums to 0: no document would go anywhere; e.g. --split 969,30,1")
    return parts + [0.0] * (3 - len(parts))


@dataclass(frozen=True)
class DataSplits:
    """What the data flags describe: the blend of each split (None: that split is empty), the eval interval, the
    end-of-document id, and whether the data is SFT data."""

    blends: tuple[Optional[Blend], Optional[Blend], Optional[Blend]]  # train, valid, test
    split: Optional[str]  # with --data-path; None with per-split paths
    eval_interval: int  # 0: no evaluation
    eod: int  # end-of-document id (NO_EOD: unknown, only allowed when nothing needs it)
    sft: bool = (
        False  # `threed preprocess --sft` data (a loss-mask dataset beside each prefix): threed.data.sft_dataset
    )

    @property
    def has_valid(self) -> bool:
        return self.blends[1] is not None


def read_data_flags(cfg: RunConfig) -> DataSplits:
    """The splits and blends the flags describe, checked for form. No dataset is read: only the tokenizer (for the
    end-of-document id) and whether a loss-mask dataset lies beside each prefix (SFT data)."""
    d, t = cfg.data, cfg.train
    blends, split = _split_blends(d)
    if d.test_data_path:
        raise ConfigError(
            "--test-data-path would be ignored: threed evaluates no test split (only --valid-data-path,"
            " every --eval-interval steps); drop it, or pass that blend as --valid-data-path"
        )
    has_valid = blends[1] is not None
    if t.eval_interval is not None and t.eval_interval > 0 and not has_valid:
        raise ConfigError(
            f"--eval-interval {t.eval_interval} needs a validation split: give --split with a "
            f"non-zero middle part (e.g. 969,30,1) or --valid-data-path"
        )
    interval = (t.eval_interval if t.eval_interval is not None else DEFAULT_EVAL_INTERVAL) if has_valid else 0
    if interval and t.eval_iters < 1:
        raise ConfigError(f"--eval-iters must be >= 1 when evaluating, got {t.eval_iters}")
    sft = _sft_kind(blends, d)
    return DataSplits(blends=blends, split=split, eval_interval=interval, eod=_eod_id(cfg), sft=sft)


def _split_blends(d: DataConfig) -> tuple[tuple[Optional[Blend], ...], Optional[str]]:
    """(train, valid, test) blends and the --split they came from (None with per-split paths): one --data-path
    blend cut by --split, or a blend of each split's own flag."""
    per_split = (d.train_data_path, d.valid_data_path, d.test_data_path)
    if d.data_path and any(per_split):
        raise ConfigError(
            "give either --data-path (with --split) or --train-data-path/--valid-data-path/--test-data-path, not both"
        )
    if d.data_path:
        blend = parse_blend(d.data_path, "--data-path")
        ratios = parse_split(d.split)
        if ratios[0] <= 0:
            raise ConfigError(f"--split {d.split!r} gives training no documents; e.g. --split 969,30,1")
        return tuple(blend if r > 0 else None for r in ratios), ",".join(f"{r:g}" for r in ratios)
    if d.train_data_path:
        if d.split != _DEFAULT_SPLIT:
            raise ConfigError(
                f"--split {d.split} applies to --data-path only; with --train-data-path/"
                f"--valid-data-path each split has its own blend: drop --split"
            )
        blends = tuple(
            parse_blend(p, f"--{n}-data-path") if p else None for p, n in zip(per_split, ("train", "valid", "test"))
        )
        return blends, None
    raise ConfigError(
        "no training data: pass --data-path PREFIX (a .bin/.idx pair made by `threed preprocess` "
        "or Megatron-LM's tools/preprocess_data.py), or --train-data-path"
    )


def _eod_id(cfg: RunConfig) -> int:
    """The end-of-document id, from --tokenizer (whose vocabulary must fit the model's); NO_EOD without one, which
    --eod-mask-loss cannot do with."""
    d = cfg.data
    if d.tokenizer:
        try:
            tok = Tokenizer(d.tokenizer)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--tokenizer: {e}") from None
        if tok.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"tokenizer {d.tokenizer} has {tok.vocab_size} tokens, more than the model's vocab_size "
                f"{cfg.model.vocab_size}; use the model's own tokenizer"
            )
        return tok.eos_id
    if d.eod_mask_loss:
        raise ConfigError("--eod-mask-loss needs --tokenizer (the end-of-document id comes from it)")
    return NO_EOD


def _sft_kind(blends: Sequence[Optional[Blend]], d: DataConfig) -> bool:
    """SFT data or not, from the files: every prefix has its loss-mask dataset, or none does."""
    prefixes = sorted({p for b in blends if b for p in b.prefixes})
    kinds = {p: is_sft_prefix(p) for p in prefixes}
    if len(set(kinds.values())) > 1:
        sft = [p for p, k in kinds.items() if k]
        plain = [p for p, k in kinds.items() if not k]
        raise ConfigError(
            f"the data mixes SFT datasets ({sft[0]}, with a loss mask) and pretraining datasets "
            f"({plain[0]}, without): train them in separate runs, or re-make {plain[0]} with "
            f"`threed preprocess --sft`"
        )
    sft = bool(prefixes) and all(kinds.values())
    if d.pack and not sft:
        raise ConfigError(
            f"--pack true needs SFT data (`threed preprocess --sft` writes PREFIX_text_document and "
            f"PREFIX_mask_document; {prefixes[0]} has no mask dataset beside it); pretraining data "
            f"is already packed by megatron's GPTDataset: drop --pack"
        )
    if sft and d.eod_mask_loss:
        raise ConfigError(
            "--eod-mask-loss is for pretraining data; SFT data carries its own loss mask (the "
            "response tokens): drop --eod-mask-loss"
        )
    return sft
