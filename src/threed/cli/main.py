"""`threed` command line: one parser, the sub-commands of every module that adds some, one exit policy.

    threed train --nproc-per-node 4 --model tiny --tp 2 --pp 2 --data-path runs/demo/a_text_document --steps 50 \
        --save runs/demo/ckpt
    threed tokenizer --text corpus.txt --vocab-size 512 --out runs/demo/tok
    threed preprocess --input corpus.txt --tokenizer runs/demo/tok.model --append-eod --output-prefix runs/demo/a
    threed demo-text --out runs/demo/corpus.txt

Training flags are generated from the config dataclasses (`threed.cli.flags`), so the CLI cannot drift from the config.
Bad input is one `threed: configuration error: ...` line and exit 2 (`threed.errors.guarded`).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Optional, Sequence

from threed.cli.check_config import register as register_check_config
from threed.config import ConfigError, RunConfig
from threed.cli.convert import positive_int, register as register_convert
from threed.cli.preprocess import register as register_preprocess
from threed.data.tokenizer import train_tokenizer
from threed.data.demo_text import write_demo_text
from threed.errors import guarded
from threed.cli.flags import add_run_flags, dash_values, run_config_from_args, unknown_flags_line
from threed.cli.generate import register as register_generate
from threed.cli.eval_harness import register as register_eval_harness
from threed.train.preflight import check_config, check_steps
from threed.parallel.launch import NPROC_FLAG, refuse_nested_launch, run_local_ranks, without_nproc
from threed.cli.memory import register as register_memory
from threed.cli.plan import register as register_plan
from threed.cli.profile_layers import register as register_profile_layers
from threed.cli.report import register as register_report

# Modules that add sub-commands: each `register(subparsers)` sets `run(ns)` on its parsers.
REGISTER: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    register_convert,  # convert / export / reshard / verify / make-tiny-hf
    register_preprocess,
    register_check_config,  # check-config: training's checks at a world size, nothing built (recipes/launch.sh)
    register_report,  # report: plots and a summary from a run's metrics.jsonl
    register_plan,  # plan: rank layouts for a cluster (the memory model + the step-time model)
    register_memory,  # memory: the memory model's estimate for one layout
    register_profile_layers,  # profile-layers: measured per-layer costs -> --partition-method costs:...
    register_generate,  # generate: continuations of prompts from a checkpoint at any tp / pp
    register_eval_harness,  # eval-harness: lm-evaluation-harness scores on the training engine
)


def _train(cfg: RunConfig) -> None:
    """One rank of `threed train` (under torchrun, or a world of one): the config is checked and resolved at the
    world torchrun names before torch, DeepSpeed or megatron-core are imported, so a refusal takes a second."""
    check_steps(cfg.train)
    run = check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    # torch, deepspeed, megatron: only for `threed train`, so that `threed --help` and the light commands stay fast.
    from threed.parallel.distributed import shutdown_distributed
    from threed.train.loop import train

    try:
        train(run)
    finally:
        shutdown_distributed()


def _train_ranks(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    """`threed train --nproc-per-node N ...`: the config checks once here (one line, before any rank starts), then
    N local ranks of `threed train ...` under torchrun, ending as the ranks do: a refusal is rank 0's one line and
    exit 2, without torchrun's ChildFailedError traceback (threed.parallel.launch.torchrun_main)."""
    refuse_nested_launch()
    cfg = run_config_from_args(ns)
    check_steps(cfg.train)
    check_config(cfg, ns.nproc_per_node)
    return run_local_ranks(ns.nproc_per_node, without_nproc(argv))


def _tokenizer(ns: argparse.Namespace) -> None:
    missing = [t for t in ns.text if not os.path.isfile(t)]
    if missing:
        raise ConfigError(f"--text {missing[0]}: no such file; give the text files to train on")
    print(train_tokenizer(ns.text, ns.vocab_size, ns.out))


def _command(ns: argparse.Namespace, argv: Sequence[str]) -> int:
    if ns.command == "train" and ns.nproc_per_node:
        return _train_ranks(ns, argv)
    if ns.command == "train":
        _train(run_config_from_args(ns))
    elif ns.command == "tokenizer":
        _tokenizer(ns)
    elif ns.command == "demo-text":
        print(write_demo_text(ns.out))
    else:
        ns.argv = list(argv)  # generate / eval-harness --nproc-per-node start N ranks of this same command line
        return ns.run(ns)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="threed", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    train_p = sub.add_parser(
        "train", help="train (--nproc-per-node N: on N local ranks; or run it under torchrun)", allow_abbrev=False
    )
    add_run_flags(train_p)
    train_p.add_argument(
        NPROC_FLAG,
        type=positive_int,
        default=None,
        metavar="N",
        help="start N local ranks of this command with torchrun (one machine); a refusal ends "
        "with one line and exit 2, as in one process. Not a config field",
    )
    tok_p = sub.add_parser("tokenizer", help="train a sentencepiece tokenizer")
    tok_p.add_argument("--text", nargs="+", required=True)
    tok_p.add_argument("--vocab-size", type=positive_int, required=True)
    tok_p.add_argument("--out", required=True, help="output prefix; writes PREFIX.model")
    demo_p = sub.add_parser("demo-text", help="write the demo corpus (Python's reference topics)")
    demo_p.add_argument("--out", required=True)
    for register in REGISTER:
        register(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = dash_values(sys.argv[1:] if argv is None else argv)
    p = parser()
    ns, unknown = p.parse_known_args(args)
    if unknown:  # argparse's usage dump, as one line naming the flag meant (eval-harness's name given to train, ...)
        command = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[ns.command]
        options = [o for a in command._actions for o in a.option_strings]
        print(unknown_flags_line(f"threed {ns.command}", unknown, options), file=sys.stderr)
        return 2
    return guarded("threed", lambda: _command(ns, args), prefix="configuration error: ")


if __name__ == "__main__":
    sys.exit(main())
