"""A run's configuration, validated once and resolved into one frozen value that is handed down: the config
itself, its parallel dimensions (dp, micro-batch, gas, global batch, stage bounds, recompute split, schedule:
threed.parallel.dims) and the DeepSpeed config (threed.engine.ds_config).

    run = resolve(cfg, world)        # ConfigError (one line) before anything heavy is imported or built
    build_engine(run, rt, ...)       # threed.engine.build; the loop, metrics and logs read run.dims

`threed train` resolves once per process, before torch, DeepSpeed or megatron-core are imported (threed.cli.main),
and every wing below takes this value or the section it needs; nothing re-derives the batch or the stages, and
the DeepSpeed config recorded in run_config.json is the one the engine was built with. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from threed.config import RunConfig
from threed.engine.ds_config import deepspeed_config
from threed.parallel.dims import RunDims, resolve_dims


@dataclass(frozen=True)
class ResolvedRun:
    cfg: RunConfig  # as validated; nothing below changes it
    dims: RunDims
    ds_config: Mapping[str, Any]  # the training run's DeepSpeed config (read-only; engine_config copies it)

    @property
    def world(self) -> int:
        return self.dims.world


def resolve(cfg: RunConfig, world: int) -> ResolvedRun:
    """Validates `cfg` at `world` ranks (every range, the layout, the batch, the stages, recompute) and derives
    what the run needs from it, once."""
    cfg.validate(world)
    dims = resolve_dims(cfg, world)
    ds = deepspeed_config(dims, cfg.train, cfg.parallel, cfg.data.pack)
    return ResolvedRun(cfg=cfg, dims=dims, ds_config=MappingProxyType(ds))
