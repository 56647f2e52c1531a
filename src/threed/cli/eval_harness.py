"""`threed eval-harness`: lm-evaluation-harness scores of a checkpoint, computed on the training engine at any tp /
pp (no export, no second stack).

    threed eval-harness --load CKPT --tasks hellaswag,arc_easy --limit 100 --nproc-per-node 4 --tp 2 --pp 2
    threed eval-harness --load CKPT --tasks my_task --include-path tasks/ --output scores.json
    threed eval-harness --lora LORA_RUN --tasks arc_easy      # or --load BASE --lora PEFT_DIR: base + adapters

Checked here, in one line, before a rank builds an engine: lm-eval installed (the `threed[eval]` extra), the
checkpoint, the tokenizer (an HF one: lm-eval's requests are HF tokenizer calls), every task known and its data
loadable (offline: from the cache). The output is lm-eval's results dict, as JSON beside the checkpoint
(CKPT/harness/<tag>_<time>.json) unless --output says where.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable, Optional

from threed.cli.generate import add_layout_arguments, check_world, checkpoint_parser, request_fields, resolve_lora
from threed.cli.generate import run_command
from threed.errors import ThreedError, guarded


def prepare(ns: argparse.Namespace):
    """The request and its HF tokenizer, or one ThreedError line; no engine is built."""
    # lm-eval (the optional extra), torch, transformers: only when the command runs, not for `threed --help`
    from threed.harness.tasks import default_output, load_tasks, require_lm_eval, split_tasks, task_manager
    from threed.generate.prompts import check_adapters, check_output, check_tokenizer, hf_tokenizer, pinned_checkpoint
    from threed.generate.prompts import tokenizer_path

    require_lm_eval()
    names = split_tasks(ns.tasks)
    docs, shots = limit(ns.limit), num_fewshot(ns.num_fewshot)
    resolve_lora(ns)
    model, tp, pp, tag = pinned_checkpoint(ns.load, ns.tp, ns.pp)
    check_world(ns.nproc_per_node, model, tp, pp)
    check_adapters(ns.adapters, model, tp, pp)
    output = ns.output or str(default_output(ns.load, tag))
    try:
        check_output(output, "--output" if ns.output else "the results' default place", makes_parent=not ns.output)
    except ThreedError as e:
        raise ThreedError(f"{e}{'' if ns.output else ' with --output FILE.json'}") from None
    tok = tokenizer_path(ns.load, ns.tokenizer, "an HF tokenizer directory")
    if not os.path.exists(tok) or (Path(tok).is_file() and Path(tok).suffix == ".model"):
        why = "no such file or directory" if not os.path.exists(tok) else "a sentencepiece .model"
        raise ThreedError(
            f"tokenizer {tok}: {why}; lm-eval needs an HF tokenizer (a directory or tokenizer.json): "
            f"`threed export --ckpt {ns.load} --out DIR` writes one, then pass --tokenizer DIR"
        )
    check_tokenizer(ns.load, ns.tokenizer, model, ns.allow_other_tokenizer)
    load_tasks(names, task_manager(names, ns.include_path))

    # the request type lives with the ranks' code (lm-eval imported there too)
    from threed.harness.run import HarnessRequest

    fields = dict(request_fields(ns, model, tp, pp, tag), output=output)
    request = HarnessRequest(
        **fields,
        tasks=names,
        tokenizer=tok,
        include_path=ns.include_path,
        limit=docs,
        num_fewshot=shots,
        log_samples=ns.log_samples,
    )
    return request, hf_tokenizer(tok)


def _ranks() -> Callable:
    from threed.harness.run import run_harness  # torch, deepspeed, megatron, lm-eval: once the request is known good

    return run_harness


def limit(text: Optional[str]) -> "float | int | None":
    """--limit: documents per task (a whole number >= 1), or a fraction of each task (0 < x < 1), as lm-eval takes
    it; anything else (0, a negative, inf, nan, 2.5) is one line saying what is accepted."""
    if text is None:
        return None
    accepted = "give a whole number of documents per task (>= 1) or a fraction of each task in (0, 1), e.g. 100 or 0.1"
    try:
        value = float(text)
    except ValueError:
        raise ThreedError(f"--limit {text}: not a number; {accepted}") from None
    if not math.isfinite(value) or not value > 0 or (value >= 1 and value != int(value)):
        raise ThreedError(f"--limit {text} cannot be scored; {accepted}")
    return int(value) if value >= 1 else value


def num_fewshot(value: Optional[int]) -> Optional[int]:
    """--num-fewshot: examples before each question, 0 or more (None: each task's own)."""
    if value is not None and value < 0:
        raise ThreedError(
            f"--num-fewshot {value}: few-shot examples cannot be negative; give 0 or more, or leave it out for each "
            f"task's own"
        )
    return value


def register(sub: argparse._SubParsersAction) -> None:
    about = "lm-evaluation-harness scores of a checkpoint on the training engine"
    p = checkpoint_parser(sub, "eval-harness", about, "HF tokenizer dir or tokenizer.json")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (stock or local)")
    p.add_argument("--include-path", default=None, metavar="DIR", help="folder of local task YAML files")
    p.add_argument("--limit", default=None, help="documents per task (>= 1), or a fraction of each (0 < x < 1)")
    p.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's)")
    p.add_argument("--output", default=None, metavar="FILE.json", help="default: CKPT/harness/<tag>_<time>.json")
    p.add_argument("--log-samples", action="store_true", help="keep every request and answer in the JSON")
    add_layout_arguments(p, 16, "requests per batch on each replica")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="compute dtype (default fp32)")
    p.set_defaults(run=lambda ns: guarded("threed eval-harness", lambda: run_command(ns, prepare, _ranks)))
