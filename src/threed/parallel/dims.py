"""A run's parallel dimensions, computed once from a validated config and handed down (torchtitan's ParallelDims):
the layout (tp, pp, cp, dp), the batch arithmetic (micro x gas x dp = global), which layers each pipeline stage
holds (and at --vpp > 1 which chunks: `chunks`), what backward recomputes and the pipeline schedule.

Before this value, each wing re-derived the batch triple and the stage bounds from the whole config (seven and
four places); now `resolve_dims` is the one place that derives them, and a function below the training loop takes
this value (or the config section it needs), never the whole `RunConfig` to recompute it. Pure: no torch, so the
launcher, check-config and the planner resolve a layout in milliseconds.

    dims = resolve_dims(cfg, world)      # after cfg.validate(world): threed.engine.resolved.resolve does both
    dims.dp, dims.micro, dims.gas, dims.global_batch, dims.bounds, dims.recompute, dims.schedule, dims.vpp
    dims.chunks(rank)                    # [(start, stop), ...]: that pipeline rank's chunks of pipeline layers
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from threed.config import RunConfig
from threed.parallel.partition import describe, full_recompute, recompute_phrase, resolve_partition


@dataclass(frozen=True)
class RunDims:
    world: int
    tp: int
    pp: int
    cp: int
    dp: int  # data-parallel replicas: world / (tp x pp x cp)
    micro: int  # sequences per micro-batch per data-parallel rank
    gas: int  # micro-batches per step (gradient accumulation)
    global_batch: int  # sequences per step: micro x gas x dp
    seq_length: int
    # Virtual stage k holds the pipeline layers [bounds[k], bounds[k + 1]); there are pp x vpp of them, virtual stage
    # k = c x pp + r being chunk c of rank r (Megatron's round robin). At vpp 1 a virtual stage is a rank's stage.
    bounds: tuple[int, ...]
    recompute: Optional[tuple[str, int]]  # full recompute as (method, N), or None
    recompute_phrase: str  # what backward recomputes, for the start-up line
    schedule: str  # --pipeline-schedule
    vpp: int = 1  # --vpp: chunks (virtual stages) per pipeline rank

    def chunks(self, stage: int) -> list[tuple[int, int]]:
        """The pipeline-layer ranges [start, stop) of pipeline rank `stage`'s chunks, in chunk order: chunk c is
        virtual stage c x pp + stage. The embedding is in chunk 0 of rank 0, the final norm and the LM head in the
        last chunk of rank pp - 1."""
        assert 0 <= stage < self.pp, (stage, self.pp)
        return [(self.bounds[k], self.bounds[k + 1]) for k in range(stage, self.pp * self.vpp, self.pp)]

    @property
    def layout(self) -> str:
        """`tp 2 x pp 2 x cp 2 x dp 1`: the factors of the world (cp named when it splits the sequences), for the
        summaries of train, check-config and the launcher, which must multiply to the world they print."""
        return f"tp {self.tp} x pp {self.pp} x " + (f"cp {self.cp} x " if self.cp > 1 else "") + f"dp {self.dp}"

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_length

    def stages(self, model) -> str:
        """`0: embedding + blocks 0-4 | 1: ...`: which layers each stage holds, for logs (at vpp > 1 each rank's
        chunks, `0: embedding + block 0, blocks 4-5 | ...`)."""
        return describe(list(self.bounds), model, self.pp)


def resolve_dims(cfg: RunConfig, world: int) -> RunDims:
    """The dimensions of `cfg` at `world` ranks; ConfigError (one line) when the batch, the stages or the recompute
    split do not fit. `cfg` is validated already (`RunConfig.validate`: ranges, heads, layers, world)."""
    p, t = cfg.parallel, cfg.train
    dp = p.dp(world)
    micro, gas, glob = t.resolve_batch(dp)
    bounds = tuple(resolve_partition(p.partition_method, cfg.model, p.pp * p.vpp, t.seq_length, p.tp))
    return RunDims(
        world=world,
        tp=p.tp,
        pp=p.pp,
        cp=p.cp,
        dp=dp,
        micro=micro,
        gas=gas,
        global_batch=glob,
        seq_length=t.seq_length,
        bounds=bounds,
        recompute=full_recompute(t),
        recompute_phrase=recompute_phrase(t, list(bounds), cfg.model, p.pp),
        schedule=p.pipeline_schedule,
        vpp=p.vpp,
    )
