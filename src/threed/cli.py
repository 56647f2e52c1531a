"""`threed` command line. Training flags are generated from the config dataclasses (one flag per field, e.g.
`--micro-batch-size`, `--tp`, `--save-interval`), so the CLI cannot drift from the config.

    threed train --model tiny --tp 2 --pp 2 --data runs/demo/tokens.bin --steps 50 --save runs/demo/ckpt
    threed tokenizer --text corpus.txt --vocab-size 512 --out runs/demo/tok
    threed tokenize --text corpus.txt --tokenizer runs/demo/tok.model --out runs/demo/tokens.bin
    threed demo-text --out runs/demo/corpus.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Any, Optional, Sequence

from threed.config import (CheckpointConfig, ConfigError, DataConfig, MetricsConfig, ParallelConfig, RunConfig,
                           TrainConfig)

# Modules that add subcommands: each defines `register(subparsers)` and sets `run` on its parsers.
COMMAND_MODULES = (
    "threed.convert.cli",  # convert / export / reshard / verify / make-tiny-hf
)

_SECTIONS = {"parallel": ParallelConfig, "train": TrainConfig, "data": DataConfig, "checkpoint": CheckpointConfig,
             "metrics": MetricsConfig}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {v!r}")


def _field_type(cls: type, f: dataclasses.Field) -> Any:
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Literal:
        return str
    base = args[0] if args and typing.get_origin(hint) is typing.Union else hint
    if typing.get_origin(base) is typing.Literal:
        return str
    return {bool: _bool, int: int, float: float, str: str}[base]


def add_run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name (llama3-8b, tiny, ...) or an HF config.json / dir")
    for section, cls in _SECTIONS.items():
        group = p.add_argument_group(section)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            group.add_argument(_flag(f.metadata.get("flag", f.name)), dest=f"{section}.{f.name}", type=_field_type(cls, f), default=default,
                               help=f"(default: {default})")


def run_config_from_args(ns: argparse.Namespace) -> RunConfig:
    from threed.presets import get_model_config

    values: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            values[section][name] = value
    return RunConfig(model=get_model_config(ns.model), **{s: _SECTIONS[s](**v) for s, v in values.items()})


def parse_run_config(argv: Sequence[str]) -> RunConfig:
    p = argparse.ArgumentParser(prog="threed train", description="3D-parallel Llama training")
    add_run_flags(p)
    return run_config_from_args(p.parse_args(list(argv)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="threed", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser("train", help="train (run under torchrun for several ranks)")
    add_run_flags(train_p)
    tok_p = sub.add_parser("tokenizer", help="train a sentencepiece tokenizer")
    tok_p.add_argument("--text", nargs="+", required=True)
    tok_p.add_argument("--vocab-size", type=int, required=True)
    tok_p.add_argument("--out", required=True, help="output prefix; writes PREFIX.model")
    tz_p = sub.add_parser("tokenize", help="text files -> flat token file for training")
    tz_p.add_argument("--text", nargs="+", required=True)
    tz_p.add_argument("--tokenizer", required=True)
    tz_p.add_argument("--out", required=True)
    demo_p = sub.add_parser("demo-text", help="write the demo corpus (Python's reference topics)")
    demo_p.add_argument("--out", required=True)
    import importlib

    for module in COMMAND_MODULES:  # each has `register(subparsers)`; the parser's `run(ns)` does the work
        importlib.import_module(module).register(sub)
    ns = p.parse_args(argv)
    try:
        if ns.command == "train":
            from threed.train import train

            train(run_config_from_args(ns))
        elif ns.command == "tokenizer":
            from threed.data.tokenizer import train_tokenizer

            print(train_tokenizer(ns.text, ns.vocab_size, ns.out))
        elif ns.command == "tokenize":
            from threed.data.flat import tokenize_files

            print(f"{tokenize_files(ns.text, ns.tokenizer, ns.out)} tokens -> {ns.out}")
        elif ns.command == "demo-text":
            from threed.demo_text import write_demo_text

            print(write_demo_text(ns.out))
        else:
            return ns.run(ns)
    except ConfigError as e:
        print(f"threed: configuration error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
