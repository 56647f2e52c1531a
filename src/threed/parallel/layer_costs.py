"""`--partition-method costs:embedding=E,block=B,final_norm=N,lm_head=H`: stages balanced on measured (or any
given) relative costs per layer kind instead of `balanced`'s FLOP formula.

Why: the formula prices the LM head + loss at 6·h·V and the embedding and norms at zero, but what 1F1B waits on is
time, and time is not FLOPs (on the benchmark's model the head measured 0.98-1.0 blocks, not the formula's 1.3; the
embedding's backward is not free). `threed profile-layers` measures each kind and prints this string; the split
itself is `threed.parallel.partition.min_max_partition`'s, as for `balanced`. The numbers are part of the flag, not
measured at start-up, so a resumed run given the same flag gets the same stages.

    threed profile-layers --model tiny --pp 2          # prints --partition-method costs:...
    threed check-config --world 2 --model tiny --pp 2 --partition-method costs:block=1,lm_head=1.2

A missing kind costs 0, except `block`, which is required and > 0 (the costs are relative to it).
"""

from __future__ import annotations

import math

from threed.errors import ConfigError
from threed.model.spec import LAYER_KINDS, LayerKind

COSTS_PREFIX = "costs:"
EXAMPLE = "costs:embedding=0.05,block=1,final_norm=0.01,lm_head=1.2"


def parse_costs(spec: str) -> dict[LayerKind, float]:
    """`embedding=0.05,block=1,...` (after the `costs:` prefix) -> a cost for every layer kind; ConfigError names
    the first problem and the fix."""
    where = f"partition_method {COSTS_PREFIX}{spec}"
    kinds = ", ".join(LAYER_KINDS)
    if not spec.strip():
        raise ConfigError(f"{where}: no costs given; e.g. {EXAMPLE} (or run threed profile-layers)")
    out: dict[LayerKind, float] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            raise ConfigError(f"{where}: an empty entry; write KIND=COST pairs separated by commas, e.g. {EXAMPLE}")
        name, eq, value = item.partition("=")
        name = name.strip().lower()
        if not eq:
            raise ConfigError(f"{where}: {item!r} is not KIND=COST; e.g. {EXAMPLE}")
        kind = next((k for k in LAYER_KINDS if k == name), None)
        if kind is None:
            raise ConfigError(f"{where}: unknown layer kind {name!r}; the kinds are {kinds}")
        if kind in out:
            raise ConfigError(f"{where}: {kind} is given twice; give each kind once")
        try:
            cost = float(value)
        except ValueError:
            raise ConfigError(
                f"{where}: {kind}={value.strip()!r} is not a number; give a relative cost >= 0, e.g. {kind}=1.2"
            ) from None
        if not math.isfinite(cost) or cost < 0:
            raise ConfigError(f"{where}: {kind}={value.strip()} must be a finite number >= 0")
        out[kind] = cost
    if "block" not in out:
        raise ConfigError(
            f"{where}: no block cost; the costs are relative to a block, so give one, e.g. {COSTS_PREFIX}block=1,{spec}"
        )
    if out["block"] == 0:
        raise ConfigError(f"{where}: block=0; the costs are relative to a block, so give it a cost > 0, e.g. block=1")
    return {k: out.get(k, 0.0) for k in LAYER_KINDS}


def format_costs(costs: dict[LayerKind, float]) -> str:
    """The flag value for per-kind costs (any unit): relative to a block, 4 significant digits, every kind named."""
    block = costs["block"]
    return COSTS_PREFIX + ",".join(f"{k}={costs[k] / block:.4g}" for k in LAYER_KINDS)
