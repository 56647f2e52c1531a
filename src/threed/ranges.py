"""Ranges of every numeric config field, checked by `RunConfig.validate` (so by training, the dry run and
`threed check-config` alike) before anything is built.

Every int / float field of every config section must be finite and >= 0 unless listed here: a new field gets that
rule without being added. The message names the command-line flag (`--steps`), or the model field for the model.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from threed.config import ConfigError

AT_LEAST_ONE = {"micro_batch_size", "grad_accum_steps", "global_batch_size", "seq_length", "log_interval", "tp",
                "pp", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                "max_position_embeddings", "make_vocab_size_divisible_by", "original_max_position_embeddings"}
ABOVE_ZERO = {"rope_theta", "rms_norm_eps", "adam_eps", "init_std", "dist_timeout_minutes", "factor",
              "low_freq_factor", "high_freq_factor"}
BELOW_ONE = {"beta1", "beta2"}  # Adam's betas lie in [0, 1)


def _flag(section: str, f: dataclasses.Field) -> str:
    if section == "model":
        return f"model field {f.name}"
    return "--" + f.metadata.get("flag", f.name).replace("_", "-")


def _check(section: str, obj: Any) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            _check(section, value)  # e.g. the model's rope_scaling
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        name = _flag(section, f)
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        if f.name in AT_LEAST_ONE and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
        if f.name in ABOVE_ZERO and value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")
        if value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
        if f.name in BELOW_ONE and value >= 1:
            raise ConfigError(f"{name} must be in [0, 1), got {value}")


def check_ranges(cfg: Any) -> None:
    """Raise a ConfigError naming the first numeric field out of its range."""
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            _check(f.name, section)
    t = getattr(cfg, "train", None)
    if t is not None and t.min_lr > t.lr:
        raise ConfigError(f"--min-lr {t.min_lr} is above --lr {t.lr}: the schedule decays from lr to min_lr; "
                          f"use --min-lr <= {t.lr}")
