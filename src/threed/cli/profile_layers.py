"""`threed profile-layers`: the command line of `threed.plan.profile` (what it measures, and why, is there).

    threed profile-layers --model tiny --pp 2 --micro-batch-size 1 --seq-length 128 [--threads 1]

It takes every training flag (the run it profiles for), plus --threads, --warmup and --repeats.
"""

from __future__ import annotations

import argparse

from threed.cli.flags import add_run_flags, run_config_from_args
from threed.config import ConfigError
from threed.errors import guarded
from threed.plan import profile
from threed.plan.profile import profile_layers, report


def _run(ns: argparse.Namespace) -> int:
    def go() -> None:
        cfg = run_config_from_args(ns)
        cfg.model.validate()
        cfg.parallel.validate(cfg.model, cfg.parallel.tp * cfg.parallel.pp)
        if ns.threads is not None and ns.threads < 1 or ns.repeats < 1 or ns.warmup < 0:
            raise ConfigError("--threads and --repeats must be >= 1, --warmup >= 0")
        profile = profile_layers(cfg, ns.threads, ns.warmup, ns.repeats)
        print("\n".join(report(profile, cfg)), flush=True)

    return guarded("threed", go, prefix="configuration error: ")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile-layers",
        description=profile.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="measure each layer kind's training cost; print --partition-method costs:...",
    )
    add_run_flags(p)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch threads while profiling (default: torch's current setting; the benchmarks use 1)",
    )
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed rounds first (default: 3)")
    p.add_argument("--repeats", type=int, default=10, metavar="N", help="timed rounds; medians (default: 10)")
    p.set_defaults(run=_run)
