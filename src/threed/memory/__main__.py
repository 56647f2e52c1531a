"""`python -m threed.memory --model M --tp T --pp P --dp D --micro B --gas G --seq S [--act-ckpt 1]
[--sequence-parallel] [--recompute-granularity full --recompute-method block --recompute-num-layers N]
[--pipeline-schedule 1f1b|zb-h1] [--all-stages]`: the memory model's estimate per GPU (`threed.memory.model`, whose
docstring lists every term), one line for the heaviest stage or one per stage. recipes/launch.sh prints it before a
run starts, with the run's own flags (the recompute ones are Megatron-LM's, as `threed train` takes them).
"""
from __future__ import annotations

import argparse
import sys

from threed.config import TrainConfig
from threed.errors import ConfigError, guarded
from threed.flags import model_config
from threed.memory.model import estimate, heaviest, quiet_deepspeed_import
from threed.memory import model as memory_model
from threed.memory.recompute import Recompute
from threed.schedule import SCHEDULES

TRUE = ("1", "true", "yes", "on")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="threed memory", description=memory_model.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    for name in ("tp", "pp", "dp", "micro", "gas", "seq"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--act-ckpt", default="0", help="1/true: activation checkpointing (full uniform 1)")
    p.add_argument("--sequence-parallel", nargs="?", const="1", default="0",
                   help="Megatron's sequence parallelism (bare, or 1/true; needs tp > 1)")
    p.add_argument("--recompute-granularity", choices=["full", "selective"])
    p.add_argument("--recompute-method", choices=["uniform", "block"])
    p.add_argument("--recompute-num-layers", type=int)
    p.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b", help="threed.schedule's")
    p.add_argument("--all-stages", action="store_true", help="one line per pipeline stage")
    a = p.parse_args(argv)
    sp = a.sequence_parallel.lower() in TRUE
    quiet_deepspeed_import()

    def run() -> None:
        if min(a.tp, a.pp, a.dp, a.micro, a.gas, a.seq) < 1:
            raise ConfigError("tp, pp, dp, micro, gas and seq must all be positive integers")
        if sp and a.tp == 1:
            raise ConfigError("--sequence-parallel needs tp > 1 (it splits the sequence over the tensor-parallel "
                              "group); drop it or raise --tp")
        model = model_config(a.model)
        train = TrainConfig(seq_length=1, activation_checkpointing=a.act_ckpt.lower() in TRUE,
                            recompute_granularity=a.recompute_granularity, recompute_method=a.recompute_method,
                            recompute_num_layers=a.recompute_num_layers)
        train.validate(model)  # the recompute flags' checks (seq_length 1 passes the others), as training's
        mems = estimate(model, a.tp, a.pp, a.dp, a.micro, a.gas, a.seq, Recompute.from_train(train),
                        sequence_parallel=sp, schedule=a.pipeline_schedule)
        for m in (mems if a.all_stages else [heaviest(mems)]):
            print(m.line(a.pp))

    return guarded("threed memory", run, prefix="")


if __name__ == "__main__":
    sys.exit(main())
