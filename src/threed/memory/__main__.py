"""`python -m threed.memory --model M --tp T --pp P --dp D --micro B --gas G --seq S [--act-ckpt 1] [--all-stages]`:
the memory model's estimate per GPU (`threed.memory.model`, whose docstring lists every term), one line for the
heaviest stage or one per stage. recipes/launch.sh prints it before a run starts.
"""
from __future__ import annotations

import argparse
import sys

from threed.errors import ConfigError, guarded
from threed.memory.model import estimate, heaviest, quiet_deepspeed_import
from threed.memory import model as memory_model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="threed memory", description=memory_model.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    for name in ("tp", "pp", "dp", "micro", "gas", "seq"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--act-ckpt", default="0", help="1/true: activation checkpointing")
    p.add_argument("--all-stages", action="store_true", help="one line per pipeline stage")
    a = p.parse_args(argv)
    ckpt = a.act_ckpt.lower() in ("1", "true", "yes", "on")
    quiet_deepspeed_import()

    def run() -> None:
        if min(a.tp, a.pp, a.dp, a.micro, a.gas, a.seq) < 1:
            raise ConfigError("tp, pp, dp, micro, gas and seq must all be positive integers")
        mems = estimate(a.model, a.tp, a.pp, a.dp, a.micro, a.gas, a.seq, ckpt)
        for m in (mems if a.all_stages else [heaviest(mems)]):
            print(m.line(a.pp))

    return guarded("threed memory", run, prefix="")


if __name__ == "__main__":
    sys.exit(main())
