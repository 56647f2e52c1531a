"""`threed` command line. Training flags are generated from the config dataclasses (one flag per field, e.g.
`--micro-batch-size`, `--tp`, `--save-interval`), so the CLI cannot drift from the config.

    threed train --model tiny --tp 2 --pp 2 --data-path runs/demo/a_text_document --steps 50 --save runs/demo/ckpt
    threed tokenizer --text corpus.txt --vocab-size 512 --out runs/demo/tok
    threed preprocess --input corpus.txt --tokenizer runs/demo/tok.model --append-eod --output-prefix runs/demo/a
    threed demo-text --out runs/demo/corpus.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from typing import Any, Optional, Sequence

from threed.config import (CheckpointConfig, ConfigError, DataConfig, MetricsConfig, ParallelConfig, RunConfig,
                           TrainConfig)

# Modules that add subcommands: each defines `register(subparsers)` and sets `run` on its parsers.
COMMAND_MODULES = (
    "threed.commands.convert",  # convert / export / reshard / verify / make-tiny-hf
    "threed.data.cli",  # preprocess
    "threed.check_config",  # check-config: training's checks at a world size, nothing built (recipes/launch.sh)
    "threed.report",  # report: plots and a summary from a run's metrics.jsonl
    "threed.plan",
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


# One line of `threed train --help` per field without its own metadata help, and Megatron-LM's name for the flag
# where it differs (accepted as an alias, so a Megatron command line carries over).
_HELP: dict[str, str] = {
    "parallel.tp": "tensor-parallel size (divides heads and KV heads)",
    "parallel.pp": "pipeline-parallel size (stages; <= layers)",
    "train.micro_batch_size": "sequences per micro-batch per data-parallel rank",
    "train.grad_accum_steps": "micro-batches per step (or give --global-batch-size)",
    "train.global_batch_size": "sequences per step = micro x grad-accum x dp, dp = world / (tp x pp)",
    "train.seq_length": "tokens per sequence",
    "train.steps": "optimizer steps to train to",
    "train.lr": "peak learning rate",
    "train.min_lr": "learning rate at the end of the cosine decay",
    "train.warmup_steps": "linear warmup steps",
    "train.weight_decay": "AdamW weight decay (not on norms)",
    "train.beta1": "AdamW beta1",
    "train.beta2": "AdamW beta2",
    "train.adam_eps": "AdamW epsilon",
    "train.grad_clip": "clip the global gradient norm to this (0: off)",
    "train.dtype": "compute dtype; bf16 keeps fp32 master weights and gradient accumulation",
    "train.grad_accum_dtype": "gradient accumulation dtype (fp32 only)",
    "train.seed": "seed of the weights' random init and the data order",
    "train.log_interval": "steps between log lines",
    "train.activation_checkpointing": "recompute each block in backward (less memory, ~1/3 more compute)",
    "train.partition_method": "which stage holds which layers: balanced (evens out the LM head) | "
                              "layers:N1,N2,... | parameters | uniform | type:REGEX",
    "train.zero_stage": "ZeRO stage (0 or 1; DeepSpeed pipelines allow no more)",
    "train.eval_interval": "steps between validations (default 1000 with a valid split)",
    "train.eval_iters": "global batches per validation",
    "checkpoint.save": "checkpoint directory (a run there is resumed)",
    "checkpoint.save_interval": "steps between checkpoints (0: only at the end)",
    "checkpoint.load": "resume from this checkpoint directory (weights, optimizer, step, data position)",
    "checkpoint.init_from": "start from these weights only (e.g. `threed convert` output)",
    "checkpoint.auto_resume": "resume from --save when it holds a checkpoint",
    "checkpoint.overwrite": "train from scratch into a --save that holds a run, deleting its checkpoints",
    "checkpoint.keep_last": "keep only the newest N complete checkpoints (0: all)",
    "checkpoint.skip_nonfinite": "skip up to N steps with a non-finite loss or grad norm before stopping",
    "checkpoint.exit_duration_in_mins": "save and exit after this many minutes of wall time (0: no limit)",
    "checkpoint.dist_timeout_minutes": "timeout of collectives and the start-up rendezvous",
    "checkpoint.watchdog_factor": "a step this many times the median step time dumps stacks and exits (0: off)",
    "checkpoint.watchdog_min_seconds": "the watchdog never fires on a step shorter than this",
    "metrics.tensorboard_dir": "TensorBoard event directory (default: SAVE/tensorboard)",
    "metrics.tensorboard": "write TensorBoard events",
    "metrics.wandb_project": "Weights & Biases project (optional; needs `pip install wandb`)",
    "metrics.wandb_name": "Weights & Biases run name",
    "metrics.wandb_mode": "Weights & Biases mode: online, offline or disabled",
    "metrics.stage_timing": "time compute and pipeline waits per stage (idle fraction vs the ideal bubble)",
}
_METAVAR_BY_KEY = {"checkpoint.save": "DIR", "checkpoint.load": "DIR", "checkpoint.init_from": "DIR",
                   "metrics.tensorboard_dir": "DIR", "train.partition_method": "METHOD"}
_MEGATRON_NAMES = {
    "parallel.tp": "--tensor-model-parallel-size", "parallel.pp": "--pipeline-model-parallel-size",
    "train.steps": "--train-iters", "train.warmup_steps": "--lr-warmup-iters", "train.grad_clip": "--clip-grad",
    "train.beta1": "--adam-beta1", "train.beta2": "--adam-beta2",
}
_METAVARS = {int: "N", float: "X", str: "STR"}


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
    p.add_argument("--model", required=True, metavar="NAME|DIR",
                   help="preset (llama3.1-8b, tiny, ...), an HF config.json / dir, or a checkpoint dir")
    for section, cls in _SECTIONS.items():
        group = p.add_argument_group(section)
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            default = f.default if f.default is not dataclasses.MISSING else None
            kind, choices, several = _field_type(cls, f)
            text = f.metadata.get("help") or _HELP.get(key, "")
            shown = " ".join(default) if isinstance(default, tuple) else default
            names = [_flag(f.metadata.get("flag", f.name))] + ([_MEGATRON_NAMES[key]] if key in _MEGATRON_NAMES else [])
            metavar = f.metadata.get("metavar") or _METAVAR_BY_KEY.get(key) or ("{true,false}" if kind is _bool else
                                                    "{" + ",".join(choices) + "}" if choices else
                                                    _METAVARS.get(kind, "VALUE"))
            group.add_argument(*names, dest=key, type=kind, default=default, choices=choices, metavar=metavar,
                               nargs="+" if several else None,
                               help=f"{text} (default: {shown})" if text else f"(default: {shown})")


def run_config_from_args(ns: argparse.Namespace) -> RunConfig:
    from threed.presets import get_model_config

    values: dict[str, dict[str, Any]] = {s: {} for s in _SECTIONS}
    for key, value in vars(ns).items():
        if "." in key:
            section, name = key.split(".", 1)
            values[section][name] = tuple(value) if isinstance(value, list) else value
    return RunConfig(model=get_model_config(ns.model), **{s: _SECTIONS[s](**v) for s, v in values.items()})


def parse_run_config(argv: Sequence[str]) -> RunConfig:
    # No abbreviations: Megatron's flags share prefixes (--data-path, --data-cache-path) and a guessed one would
    # silently mean something else.
    p = argparse.ArgumentParser(prog="threed train", description="3D-parallel Llama training", allow_abbrev=False)
    add_run_flags(p)
    return run_config_from_args(p.parse_args(list(argv)))


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="threed", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser("train", help="train (run under torchrun for several ranks)", allow_abbrev=False)
    add_run_flags(train_p)
    from threed.commands.convert import positive_int

    tok_p = sub.add_parser("tokenizer", help="train a sentencepiece tokenizer")
    tok_p.add_argument("--text", nargs="+", required=True)
    tok_p.add_argument("--vocab-size", type=positive_int, required=True)
    tok_p.add_argument("--out", required=True, help="output prefix; writes PREFIX.model")
    demo_p = sub.add_parser("demo-text", help="write the demo corpus (Python's reference topics)")
    demo_p.add_argument("--out", required=True)
    import importlib

    for module in COMMAND_MODULES:  # each has `register(subparsers)`; the parser's `run(ns)` does the work
        importlib.import_module(module).register(sub)
    ns = p.parse_args(argv)
    try:
        if ns.command == "train":
            from threed.distributed import shutdown_distributed
            from threed.train import train

            try:
                train(run_config_from_args(ns))
            finally:
                shutdown_distributed()
        elif ns.command == "tokenizer":
            from threed.data.tokenizer import train_tokenizer

            missing = [t for t in ns.text if not os.path.isfile(t)]
            if missing:
                raise ConfigError(f"--text {missing[0]}: no such file; give the text files to train on")

            print(train_tokenizer(ns.text, ns.vocab_size, ns.out))
        elif ns.command == "demo-text":
            from threed.demo_text import write_demo_text

            print(write_demo_text(ns.out))
        else:
            return ns.run(ns)
    except ConfigError as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every rank fails alike: one line, from rank 0
            print(f"threed: configuration error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
