"""`threed generate / eval-harness --lora` on 4 ranks for tests/ranks/test_lora_serving.py: each case is a command
line of one of them, checked by the command's own `prepare` and run by its ranks' function (`run_generate`,
`run_harness`: the engine built from the base with the adapters put on it at the case's tp / pp); rank 0 writes the
case's --output.

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/lora_serve_worker.py serve --out /tmp/s \
        --cases C.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# worker_setup first: it puts tests/ on sys.path
from worker_setup import run_worker
from threed.cli.generate import prepare
from threed.cli.main import parser
from threed.generate.run import run_generate
from threed.parallel.distributed import Runtime


def serve(args: argparse.Namespace, rt: Runtime) -> None:
    for argv in json.loads(args.cases.read_text()).values():
        request, tokenizer = prepare(parser().parse_args(["generate", *argv]))
        run_generate(request, tokenizer, rt)


def harness(args: argparse.Namespace, rt: Runtime) -> None:
    from threed.cli import eval_harness  # lm-eval: only this scenario scores
    from threed.harness.run import run_harness

    for argv in json.loads(args.cases.read_text()).values():
        request, tokenizer = eval_harness.prepare(parser().parse_args(["eval-harness", *argv]))
        run_harness(request, tokenizer, rt)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", type=Path, required=True, help="JSON: case name -> `threed generate` arguments")


if __name__ == "__main__":
    raise SystemExit(run_worker({"serve": serve, "harness": harness}, add_arguments))
