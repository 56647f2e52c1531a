"""`threed generate --lora` on 4 ranks for tests/ranks/test_lora_serve.py: each case is a `threed generate` command
line, checked by the command's own `prepare` and run by its ranks' `run_generate` (the engine built from the base
with the adapters put on it at the case's tp / pp), the continuations written by rank 0 to the case's --output.

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/lora_serve_worker.py --out /tmp/s --cases C.json
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", type=Path, required=True, help="JSON: case name -> `threed generate` arguments")


if __name__ == "__main__":
    raise SystemExit(run_worker({"serve": serve}, add_arguments))
