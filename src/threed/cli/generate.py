"""`threed generate`: continuations of prompts from a checkpoint, on the training engine at any tp / pp.

    threed generate --load CKPT --prompt "The capital of France is" --max-new-tokens 16
    threed generate --load CKPT --prompts prompts.jsonl --max-new-tokens 64 --temperature 0.7 --top-p 0.9 --seed 1 \
        --output out.jsonl --nproc-per-node 4 --tp 2 --pp 2
    threed generate --lora LORA_RUN --prompt "..." --max-new-tokens 16     # base + adapters, at any tp / pp
    threed generate --load BASE --lora PEFT_DIR --prompt "..." --max-new-tokens 16

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
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from threed.generate.prompts import GenerateRequest, Tokenizer
from threed.parallel.launch import NPROC_FLAG, run_local_ranks, without_nproc
from threed.parallel.launch import refuse_nested_launch as refuse_launched_ranks


def prepare(ns: argparse.Namespace) -> "tuple[GenerateRequest, Tokenizer]":
    """The request and its tokenizer, or one ThreedError line; nothing heavy is built."""
    # the checks and the tokenizer (transformers) load only when the command runs, not for `threed --help`
    from threed.generate.prompts import GenerateRequest, Tokenizer, check_lengths, check_output, check_tokenizer
    from threed.generate.prompts import check_adapters, pinned_checkpoint, read_prompts, sampling_of, tokenizer_path

    sampling = sampling_of(ns.greedy, ns.temperature, ns.top_p, ns.seed)
    texts = read_prompts(ns.prompt, ns.prompts)
    check_output(ns.output, "--output")
    resolve_lora(ns)
    model, tp, pp, tag = pinned_checkpoint(ns.load, ns.tp, ns.pp)
    tok_path = tokenizer_path(ns.load, ns.tokenizer, "an HF directory or .model file")
    if not os.path.exists(tok_path):
        raise ThreedError(f"--tokenizer {tok_path}: no such file or directory")
    tokenizer = Tokenizer(tok_path)
    check_tokenizer(ns.load, ns.tokenizer, model, ns.allow_other_tokenizer)
    ids = [tokenizer.encode(t) for t in texts]
    check_lengths(ids, ns.max_new_tokens, model)
    check_world(ns.nproc_per_node, model, tp, pp)
    check_adapters(ns.adapters, model, tp, pp)
    request = GenerateRequest(
        **request_fields(ns, model, tp, pp, tag),
        texts=texts,
        prompt_ids=ids,
        max_new_tokens=ns.max_new_tokens,
        sampling=sampling,
        no_kv_cache=ns.no_kv_cache,
    )
    return request, tokenizer


def resolve_lora(ns: argparse.Namespace) -> None:
    """--load and --lora (threed.generate.prompts.lora_request): `ns.load` becomes the checkpoint whose base the
    engine loads (a LoRA run's checkpoint holds its own), `ns.adapters` the adapters put on it (None without
    --lora); every later check reads the base there."""
    from threed.generate.prompts import lora_request  # its tokenizer needs transformers: only when the command runs

    ns.load, ns.adapters = lora_request(ns.load, ns.lora)


def request_fields(ns: argparse.Namespace, model: ModelConfig, tp: int, pp: int, tag: str) -> dict[str, Any]:
    """What every request to the ranks carries (GenerateRequest, threed.harness.run.HarnessRequest): the
    checkpoint, its tag pinned at the start, its model, the layout it runs at, where the output goes, the batch size,
    the compute dtype and --lora's adapters."""
    return {
        "load": ns.load,
        "tag": tag,
        "model": model,
        "tp": tp,
        "pp": pp,
        "output": ns.output,
        "batch_size": ns.batch_size,
        "dtype": ns.dtype,
        "lora": ns.adapters,
    }


def rank_argv(ns: argparse.Namespace, tp: int, pp: int) -> list[str]:
    """This command line for each rank, without --nproc-per-node, with the layout resolved here (a later --tp / --pp
    wins in argparse: the same values when they were given)."""
    return without_nproc(getattr(ns, "argv", sys.argv[1:])) + ["--tp", str(tp), "--pp", str(pp)]


def refuse_nested_launch(ns: argparse.Namespace) -> None:
    if ns.nproc_per_node:
        refuse_launched_ranks()


def check_world(nproc: "int | None", model: "ModelConfig", tp: int, pp: int) -> None:
    """The layout against the model and the world (--nproc-per-node, or the launcher's), as training checks it."""
    ParallelConfig(tp=tp, pp=pp).validate(model, nproc or int(os.environ.get("WORLD_SIZE", "1")))


def run_command(ns: argparse.Namespace, prepare: Callable, ranks: Callable[[], Callable]) -> int:
    """The body of `threed generate` and `threed eval-harness`: refuse a nested launch, `prepare` the request (one
    line for what is wrong, no engine), then start --nproc-per-node local ranks of this command, or run the ranks'
    function on this one. `ranks()` imports that function: its torch, deepspeed and megatron load only now."""
    refuse_nested_launch(ns)
    request, tokenizer = prepare(ns)
    if ns.nproc_per_node:
        return run_local_ranks(ns.nproc_per_node, rank_argv(ns, request.tp, request.pp))
    run = ranks()
    # torch, deepspeed: only once the request is known good
    from threed.parallel.distributed import init_distributed, shutdown_distributed

    try:
        return run(request, tokenizer, init_distributed())
    finally:
        shutdown_distributed()


def _ranks() -> Callable:
    from threed.generate.run import run_generate  # torch, deepspeed, megatron: only once the request is known good

    return run_generate


def checkpoint_parser(
    sub: argparse._SubParsersAction, name: str, about: str, tokenizer: str
) -> argparse.ArgumentParser:
    """The parser of a command that runs a checkpoint on the engine (generate, eval-harness), with the flags they
    share first: --load, and --tokenizer with the `tokenizer` kinds the command reads."""
    p = sub.add_parser(name, help=about, allow_abbrev=False)
    p.add_argument("--load", default=None, help="checkpoint directory (threed train --save, or threed convert)")
    p.add_argument(
        "--lora",
        default=None,
        metavar="DIR",
        help="LoRA adapters: a LoRA run's checkpoint, or a PEFT folder (+ --load)",
    )
    p.add_argument("--tokenizer", default=None, help=f"{tokenizer} (default: the ckpt's)")
    p.add_argument(
        "--allow-other-tokenizer", action="store_true", help="a --tokenizer that is not the checkpoint's is intended"
    )
    return p


def add_layout_arguments(p: argparse.ArgumentParser, batch_size: int, batch_help: str) -> None:
    """The flags those commands share after their own: local ranks, the layout, and the batch on each replica."""
    p.add_argument(NPROC_FLAG, type=positive_int, default=None, metavar="N", help="start N local ranks (torchrun)")
    p.add_argument("--tp", type=positive_int, default=None, help="tensor parallel size (default: the checkpoint's)")
    p.add_argument("--pp", type=positive_int, default=None, help="pipeline stages (default: the checkpoint's)")
    p.add_argument("--batch-size", type=positive_int, default=batch_size, help=batch_help)


def register(sub: argparse._SubParsersAction) -> None:
    about = "continue prompts from a checkpoint (any tp / pp; greedy or sampled)"
    p = checkpoint_parser(sub, "generate", about, "HF tokenizer dir, tokenizer.json or .model")
    p.add_argument("--prompt", default=None, help="one prompt")
    p.add_argument("--prompts", default=None, metavar="FILE.jsonl", help='a JSONL file of {"prompt": ...} lines')
    p.add_argument("--max-new-tokens", type=positive_int, required=True)
    p.add_argument("--greedy", action="store_true", help="the most likely token each step (the default)")
    p.add_argument("--temperature", type=float, default=None, help="sample at this temperature (> 0)")
    p.add_argument("--top-p", type=float, default=None, help="sample from the nucleus of this mass (default 1)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same tokens at every layout")
    p.add_argument("--output", default=None, metavar="FILE.jsonl", help="lines of prompt, text, tokens")
    add_layout_arguments(p, 8, "prompts per batch on each replica")
    p.add_argument("--no-kv-cache", action="store_true", help="rerun the whole sequence each step (a reference)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (default fp32)")
    p.set_defaults(run=lambda ns: guarded("threed generate", lambda: run_command(ns, prepare, _ranks)))
