"""argv <-> RunConfig: the training flags, generated from the config dataclasses, and `--model` resolution.

One flag per config field (`--micro-batch-size`, `--tp`, `--save-interval`), its help, metavar, range and
Megatron-LM alias read from the field's metadata (`threed.config.meta`), so the command line cannot drift from the
config. `threed train`, `python -m threed.train` and `threed check-config` all parse through here. It sits below
`threed.train` (layer 4) so that `python -m threed.train` parses its flags without importing the CLI above it.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path
from typing import Any, Optional, Sequence

from threed.config import SECTIONS, ConfigError, ModelConfig, RunConfig, field_meta, flag_name
from threed.hf.config import from_hf_config
from threed.presets import PRESETS

_METAVARS = {int: "N", float: "X", str: "STR"}


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def _field_type(cls: type, f: dataclasses.Field) -> tuple[Any, Optional[list[str]], bool]:
    """(argparse type, choices, takes several values) of a config field."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is typing.Literal:
        return str, [str(a) for a in typing.get_args(hint)], False
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], None, True
    return {bool: _bool, int: int, float: float, str: str}[hint], None, False


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """`--model` and one flag per field of every RunConfig section (dest `section.field`)."""
    p.add_argument("--model", required=True, metavar="NAME|DIR",
                   help="preset (llama3.1-8b, tiny, ...), an HF config.json / dir, or a checkpoint dir")
    for section, cls in SECTIONS.items():
        group = p.add_argument_group(section)
        for f in dataclasses.fields(cls):
            m = field_meta(f)
            default = f.default if f.default is not dataclasses.MISSING else None
            kind, choices, several = _field_type(cls, f)
            shown = " ".join(default) if isinstance(default, tuple) else default
            names = [flag_name(f)] + ([m.alias] if m.alias else [])
            metavar = m.metavar or ("{true,false}" if kind is _bool else
                                    "{" + ",".join(choices) + "}" if choices else _METAVARS.get(kind, "VALUE"))
            # A bare boolean flag means true (Megatron-LM's store_true flags: `--sequence-parallel`,
            # `--eod-mask-loss`); `--flag false` turns a default-on one off.
            extra: dict[str, Any] = {"nargs": "?", "const": True} if kind is _bool else {
                "nargs": "+" if several else None}
            group.add_argument(*names, dest=f"{section}.{f.name}", type=kind, default=default, choices=choices,
                               metavar=metavar, **extra,
                               help=f"{m.help} (default: {shown})" if m.help else f"(default: {shown})")


def run_config_from_args(ns: argparse.Namespace) -> RunConfig:
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            values[section][name] = tuple(value) if isinstance(value, list) else value
    return RunConfig(model=model_config(ns.model), **{s: SECTIONS[s](**v) for s, v in values.items()})


def parse_run_config(argv: Sequence[str]) -> RunConfig:
    # No abbreviations: Megatron's flags share prefixes (--data-path, --data-cache-path) and a guessed one would
    # silently mean something else.
    p = argparse.ArgumentParser(prog="threed train", description="3D-parallel Llama training", allow_abbrev=False)
    add_run_flags(p)
    return run_config_from_args(p.parse_args(list(argv)))


def model_config(name_or_path: str) -> ModelConfig:
    """What `--model` names: a preset; a converted or trained checkpoint directory (its recorded model, vocab
    padding included); or a path to an HF config.json / model directory."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if Path(name_or_path).is_dir():
        # torch (threed.checkpoint.format reads .pt files): only for a checkpoint directory, so that
        # `threed --help` and a preset name stay fast.
        from threed.checkpoint.format import read_model_config

        recorded = read_model_config(name_or_path)
        if recorded is not None:
            return recorded
    if Path(name_or_path).exists():
        return from_hf_config(name_or_path)
    raise ConfigError(
        f"unknown model {name_or_path!r}: use one of {', '.join(PRESETS)}, a checkpoint directory or a path "
        f"to an HF config.json"
    )
