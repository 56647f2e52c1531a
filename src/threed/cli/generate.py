"""`threed generate`: continuations of prompts from a checkpoint, on the training engine at any tp / pp.

    threed generate --load CKPT --prompt "The capital of France is" --max-new-tokens 16
    threed generate --load CKPT --prompts prompts.jsonl --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 1 \
        --output out.jsonl --nproc-per-node 4 --tp 2 --pp 2

Everything the command can refuse (checkpoint, prompts, tokenizer, lengths, sampling flags) is checked here, in one
line, before a rank builds an engine. `--nproc-per-node N` starts N local ranks of this same command under torchrun
(as `threed train` does); under torchrun or srun leave it out and every rank runs it. Each output line holds
`prompt`, `text` and `tokens` (the new ids); without --output they go to stdout and the tokens/s line to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

from threed.cli.convert import positive_int
from threed.config import ModelConfig, ParallelConfig
from threed.errors import ThreedError, guarded
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from threed.generate.prompts import GenerateRequest, Tokenizer
from threed.parallel.launch import NPROC_FLAG, run_local_ranks, without_nproc
from threed.parallel.launch import refuse_nested_launch as refuse_launched_ranks


def prepare(ns: argparse.Namespace) -> "tuple[GenerateRequest, Tokenizer]":
    """The request and its tokenizer, or one ThreedError line; nothing heavy is built."""
    # the checks and the tokenizer (transformers) load only when the command runs, not for `threed --help`
    from threed.generate.prompts import GenerateRequest, Tokenizer, check_checkpoint, check_lengths
    from threed.generate.prompts import checkpoint_tokenizer, read_prompts, sampling_of

    sampling = sampling_of(ns.greedy, ns.temperature, ns.top_p, ns.seed)
    texts = read_prompts(ns.prompt, ns.prompts)
    model, tp, pp = check_checkpoint(ns.load, ns.tp, ns.pp)
    tok_path = ns.tokenizer or checkpoint_tokenizer(ns.load)
    if tok_path is None:
        raise ThreedError(f"--load {ns.load} holds no tokenizer: pass --tokenizer (an HF directory or .model file)")
    if not os.path.exists(tok_path):
        raise ThreedError(f"--tokenizer {tok_path}: no such file or directory")
    tokenizer = Tokenizer(tok_path)
    ids = [tokenizer.encode(t) for t in texts]
    check_lengths(ids, ns.max_new_tokens, model)
    check_world(ns.nproc_per_node, model, tp, pp)
    request = GenerateRequest(
        load=ns.load,
        model=model,
        tp=tp,
        pp=pp,
        texts=texts,
        prompt_ids=ids,
        max_new_tokens=ns.max_new_tokens,
        sampling=sampling,
        output=ns.output,
        batch_size=ns.batch_size,
        no_kv_cache=ns.no_kv_cache,
        dtype=ns.dtype,
    )
    return request, tokenizer


def rank_argv(ns: argparse.Namespace, request: "GenerateRequest") -> list[str]:
    """This command line for each rank, without --nproc-per-node, with the layout resolved here (a later --tp / --pp
    wins in argparse: the same values when they were given)."""
    return without_nproc(getattr(ns, "argv", sys.argv[1:])) + ["--tp", str(request.tp), "--pp", str(request.pp)]


def refuse_nested_launch(ns: argparse.Namespace) -> None:
    if ns.nproc_per_node:
        refuse_launched_ranks()


def check_world(nproc: "int | None", model: "ModelConfig", tp: int, pp: int) -> None:
    """The layout against the model and the world (--nproc-per-node, or the launcher's), as training checks it."""
    ParallelConfig(tp=tp, pp=pp).validate(model, nproc or int(os.environ.get("WORLD_SIZE", "1")))


def _generate(ns: argparse.Namespace) -> int:
    refuse_nested_launch(ns)
    request, tokenizer = prepare(ns)
    if ns.nproc_per_node:
        return run_local_ranks(ns.nproc_per_node, rank_argv(ns, request))
    # torch, deepspeed, megatron: only once the request is known good
    from threed.generate.run import run_generate
    from threed.parallel.distributed import init_distributed, shutdown_distributed

    try:
        return run_generate(request, tokenizer, init_distributed())
    finally:
        shutdown_distributed()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="continue prompts from a checkpoint (any tp / pp; greedy or sampled)", allow_abbrev=False
    )
    p.add_argument("--load", required=True, help="checkpoint directory (threed train --save, or threed convert)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir, tokenizer.json or .model (default: the ckpt's)")
    p.add_argument("--prompt", default=None, help="one prompt")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl", help='a JSONL file of {"prompt": ...} lines')
    p.add_argument("--max-new-tokens", type=positive_int, required=True)
    p.add_argument("--greedy", action="store_true", help="the most likely token each step (the default)")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (> 0)")
    p.add_argument("--top-p", type=float, default=None, help="sample from the nucleus of this mass (default 1)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same tokens at every layout")
    p.add_argument("--output", default=None, metavar="FILE.jsonl", help="lines of prompt, text, tokens")
    p.add_argument(NPROC_FLAG, type=positive_int, default=None, metavar="N", help="start N local ranks (torchrun)")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor parallel size (default: the checkpoint's)")
    p.add_argument("--pp", type=positive_int, default=None, help="pipeline stages (default: the checkpoint's)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="prompts per batch on each replica")
    p.add_argument("--no-kv-cache", action="store_true", help="rerun the whole sequence each step (a reference)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (default fp32)")
    p.set_defaults(run=lambda ns: guarded("threed generate", lambda: _generate(ns)))
