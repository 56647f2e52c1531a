"""Which pipeline stage holds which layers: `--partition-method`.

    balanced          (default) contiguous stages minimising the largest stage's training FLOPs per token
                      (`threed.model.spec.layer_training_flops`: a block costs its matmuls plus attention scores,
                      the LM head 6·h·V; the embedding (a lookup) and the norms count as zero). Every stage keeps
                      at least one transformer block.
    layers:5,3        explicit transformer blocks per stage (one number per stage, summing to num_layers); the
                      embedding goes with the first stage, the final norm and LM head with the last.
    costs:block=1,lm_head=1.2,...
                      as balanced, over given relative costs per layer kind (embedding, block, final_norm, lm_head;
                      a missing kind costs 0): what `threed profile-layers` measured (`threed.parallel.layer_costs`).
    parameters        balance parameter counts (DeepSpeed's method; counted from the config, nothing is built).
    uniform           equal numbers of pipeline layers (embedding, each block, norm and head count one each).
    type:REGEX        balance the layers whose class name matches (DeepSpeed's method). `type:LlamaBlock` spreads the
                      blocks evenly and leaves the LM head and loss on top of the last stage: the old default.

Why balanced: the last stage's LM head + loss costs 6·h·V FLOPs per token, 0.65 of a Llama-2-7B block and 2.4 of a
Llama-3-8B block (their vocabularies are 32k and 128k), and 1F1B runs at the pace of the slowest stage.
`benchmarks/bench_pipeline.py` measures the effect.

DeepSpeed's PipelineModule knows only its own methods, so `threed.parallel.staged.StagedPipelineModule` takes the
resolved boundaries as `partition_method="parts:0,6,11"` (layer indices where each stage starts, then the end).

Full recompute (Megatron-LM's `--recompute-granularity full --recompute-method uniform|block --recompute-num-layers
N`) counts the blocks of each stage, so it lives here too: `recompute_summary` checks N against the stages before
anything is built, and `StagedPipelineModule` (threed.parallel.staged) runs the recomputed chunks (`recompute_chunks`).
"""

from __future__ import annotations

import contextlib
import io
import re
from typing import Optional

from threed.config import ModelConfig, TrainConfig
from threed.errors import ConfigError
from threed.parallel.layer_costs import COSTS_PREFIX, parse_costs
from threed.model.spec import PipelineLayer, layer_training_flops, pipeline_layers, stage_parameters

PARTS_PREFIX = "parts:"
CLASS_NAMES = {
    "embedding": "EmbeddingPipe",
    "block": "LlamaBlock",
    "final_norm": "FinalNormPipe",
    "lm_head": "LMHeadPipe",
}
METHODS = "balanced, layers:N1,N2,..., costs:block=1,lm_head=X,..., parameters, uniform, type:REGEX"


def layer_params(model: ModelConfig, layer: PipelineLayer, tp: int) -> int:
    """Elements of one pipeline layer's parameters on one TP rank (DeepSpeed's `parameters` method balances these)."""
    matrices, norms = stage_parameters(model, tp, [layer.kind])
    return matrices + norms


def min_max_partition(costs: list[float], parts: int, has_block: list[bool]) -> list[int]:
    """Contiguous split of `costs` into `parts` segments, each holding a block, minimising the largest segment's
    sum (ties: the earliest boundaries). Dynamic programming over (segments, prefix length)."""
    n = len(costs)
    prefix = [0.0]
    blocks = [0]
    for c, b in zip(costs, has_block):
        prefix.append(prefix[-1] + c)
        blocks.append(blocks[-1] + int(b))
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(1, n + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or blocks[i] == blocks[j]:
                    continue
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i] - 1e-9 * abs(worst):
                    best[k][i], cut[k][i] = worst, j
    if best[parts][n] == inf:
        raise ConfigError(f"cannot split {sum(has_block)} blocks into {parts} stages that each hold one")
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def _explicit(spec: str, model: ModelConfig, pp: int) -> list[int]:
    # pp: the stages to fill, pp x vpp virtual stages at --vpp > 1 (one count each, in virtual-stage order)
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ConfigError(
            f"partition_method layers:{spec}: expected comma-separated block counts per stage, e.g. "
            f"layers:{','.join([str(model.num_layers // pp)] * pp)}"
        ) from None
    if len(counts) != pp or min(counts) < 1 or sum(counts) != model.num_layers:
        raise ConfigError(
            f"partition_method layers:{spec} gives {len(counts)} stages holding {sum(counts)} blocks; "
            f"this run has {pp} pipeline stages (pp x vpp) and {model.num_layers} blocks: give {pp} counts, each "
            f">= 1, summing to {model.num_layers}"
        )
    # Layer 0 is the embedding (stage 0); the norm and head after the last block belong to the last stage.
    bounds, block = [0], 0
    for c in counts[:-1]:
        block += c
        bounds.append(1 + block)
    return bounds + [model.num_layers + 3]


def resolve_partition(method: str, model: ModelConfig, pp: int, seq_length: int, tp: int = 1) -> list[int]:
    """Stage boundaries over `pipeline_layers(model)`: stage s holds layers [bounds[s], bounds[s+1]). At --vpp > 1
    the caller passes pp x vpp: the method splits the layers into virtual stages (threed.parallel.dims)."""
    layers = pipeline_layers(model)
    is_block = [layer.kind == "block" for layer in layers]
    m = method.strip()
    if m.lower() == "balanced":
        return min_max_partition([layer_training_flops(model, la.kind, seq_length, tp) for la in layers], pp, is_block)
    if m.lower().startswith("layers:"):
        return _explicit(m[len("layers:") :], model, pp)
    if m.lower().startswith(COSTS_PREFIX):
        costs = parse_costs(m[len(COSTS_PREFIX) :])
        return min_max_partition([costs[la.kind] for la in layers], pp, is_block)
    # DeepSpeed's own methods, computed with its own split functions (imported here: the three above need no
    # DeepSpeed, so `threed check-config` can resolve them cheaply). Quietly: its import prints start-up lines
    # ("Setting accelerator to CPU") that would come before a command's own output or its one-line error.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        from deepspeed.runtime import utils as ds_utils  # deepspeed: heavy, only for its own methods

    if m.lower() == "parameters":
        return [int(b) for b in ds_utils.partition_balanced([layer_params(model, la, tp) for la in layers], pp)]
    if m.lower() == "uniform":
        return [int(b) for b in ds_utils.partition_uniform(len(layers), pp)]
    if m.lower().startswith("type:"):
        try:
            pattern = re.compile(m[len("type:") :], re.IGNORECASE)
        except re.error as e:
            raise ConfigError(f"partition_method {m}: bad regular expression ({e})") from None
        weights = [1 if pattern.search(CLASS_NAMES[la.kind]) else 0 for la in layers]
        if not any(weights):
            raise ConfigError(
                f"partition_method {m} matches no layer; the layer classes are {', '.join(CLASS_NAMES.values())}"
            )
        return [int(b) for b in ds_utils.partition_balanced(weights, pp)]
    raise ConfigError(f"unknown partition_method {method!r}; use one of: {METHODS}")


def describe_layers(layers: list[PipelineLayer]) -> str:
    """`embedding + blocks 0-4`: a run of consecutive pipeline layers."""
    blocks = [la.block for la in layers if la.kind == "block"]
    names = [la.kind for la in layers if la.kind == "embedding"]
    if blocks:
        names.append(f"blocks {blocks[0]}-{blocks[-1]}" if len(blocks) > 1 else f"block {blocks[0]}")
    names += [la.kind for la in layers if la.kind in ("final_norm", "lm_head")]
    return " + ".join(names) or "nothing"


def describe(bounds: list[int], model: ModelConfig, pp: Optional[int] = None) -> str:
    """`0: embedding + blocks 0-4 | 1: blocks 5-7 + final_norm + lm_head` (for the start-up log). With `pp` below
    the virtual stages in `bounds` (--vpp > 1), per rank its chunks in chunk order (virtual stage c x pp + r):
    `0: embedding + block 0, block 2 | 1: block 1, block 3 + final_norm + lm_head`."""
    layers = pipeline_layers(model)
    virtual = len(bounds) - 1
    pp = pp or virtual
    out = []
    for r in range(pp):
        chunks = [describe_layers(layers[bounds[k] : bounds[k + 1]]) for k in range(r, virtual, pp)]
        out.append(f"{r}: {', '.join(chunks)}")
    return " | ".join(out)


def stage_boundaries(bounds) -> str:
    """The `partition_method` argument for `StagedPipelineModule`: the resolved bounds (threed.parallel.dims)."""
    return PARTS_PREFIX + ",".join(str(b) for b in bounds)


def full_recompute(train: TrainConfig) -> Optional[tuple[str, int]]:
    """(method, N) of full recompute, or None. `--activation-checkpointing` is Megatron's full / uniform / 1."""
    if train.activation_checkpointing:
        return "uniform", 1
    if train.recompute_granularity == "full":
        return str(train.recompute_method), int(train.recompute_num_layers or 0)
    return None


def stage_blocks(bounds: list[int], model: ModelConfig) -> list[int]:
    """Transformer blocks on each stage."""
    layers = pipeline_layers(model)
    return [sum(la.kind == "block" for la in layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def stage_name(stage: int, pp: int, stages: int) -> str:
    """`pipeline stage 3`, or at --vpp > 1 (more `stages` than `pp`) `virtual stage 3 (rank 1, chunk 1)`."""
    return (
        f"pipeline stage {stage}" if stages <= pp else f"virtual stage {stage} (rank {stage % pp}, chunk {stage // pp})"
    )


def recompute_phrase(train: TrainConfig, bounds: list[int], model: ModelConfig, pp: Optional[int] = None) -> str:
    """What backward recomputes, as a phrase for the start-up line; ConfigError when --recompute-num-layers does not
    fit the stages `bounds`. Megatron asks for N "between 1 and num_layers_per_pipeline_rank": with `block` each
    stage must hold N blocks (a stage with fewer would silently recompute fewer); with `uniform` a chunk never crosses
    a stage, so N above the largest stage's blocks means nothing (a smaller stage is one chunk, as in Megatron). At
    --vpp > 1 `bounds` are the virtual stages (pass `pp` to name them): Megatron counts N per virtual stage."""
    if train.recompute_granularity == "selective":
        return "selective (the core attention of every block)"
    plan = full_recompute(train)
    if plan is None:
        return "none"
    method, n = plan
    counts = stage_blocks(bounds, model)
    flags = f"--recompute-method {method} --recompute-num-layers {n}"
    pp = pp or len(counts)
    if method == "uniform":
        most = max(counts)
        if n > most:
            raise ConfigError(
                f"{flags}: a recompute chunk lies within one pipeline stage and the largest, "
                f"{stage_name(counts.index(most), pp, len(counts)).removeprefix('pipeline ')}, holds {most} blocks; "
                f"use --recompute-num-layers {most} or fewer"
            )
        return f"full, uniform: every block, in chunks of {n}"
    for stage, blocks in enumerate(counts):
        if n > blocks:
            raise ConfigError(
                f"{flags}: {stage_name(stage, pp, len(counts))} holds {blocks} block{'s' * (blocks != 1)}, fewer "
                f"than {n} to recompute; use --recompute-num-layers {min(counts)} or fewer (the "
                f"smallest stage's blocks), or --recompute-method uniform to recompute every block"
            )
    if len(set(counts)) == 1:
        virtual = "virtual " * (len(counts) > pp)
        return f"full, block: the first {n} of {counts[0]} blocks on each of {len(counts)} {virtual}stages"
    return "full, block " + ", ".join(
        f"{n} of {blocks} block{'s' * (blocks != 1)} on {stage_name(stage, pp, len(counts)).removeprefix('pipeline ')}"
        for stage, blocks in enumerate(counts)
    )


def recompute_chunks(checkpointable: list[bool], method: str, n: int) -> list[tuple[int, int, bool]]:
    """A stage's layers as runs `(start, stop, recomputed)` covering them in order: Megatron's full recompute over
    the stage's blocks (`checkpointable`, contiguous). `uniform`: every block, in chunks of n from the stage's first
    block (the last may be shorter); `block`: each of the first n blocks on its own, the others not."""
    blocks = [i for i, c in enumerate(checkpointable) if c]
    assert blocks == list(range(blocks[0], blocks[0] + len(blocks))) if blocks else True, checkpointable
    if method == "block":
        spans = [(i, i + 1) for i in blocks[:n]]
    else:
        spans = [(blocks[k], blocks[min(k + n, len(blocks)) - 1] + 1) for k in range(0, len(blocks), n)]
    chunks, at = [], 0
    for start, stop in spans:
        if start > at:
            chunks.append((at, start, False))
        chunks.append((start, stop, True))
        at = stop
    if at < len(checkpointable):
        chunks.append((at, len(checkpointable), False))
    return chunks
