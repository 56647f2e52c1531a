"""How the Llama is parallelised: its layers as DeepSpeed `LayerSpec`s in a `PipelineModule` over a
(pipe, data, model) topology, with megatron-core TP inside each layer.

The layer list and every parameter's TP split are `threed.model.spec`'s; this module only turns them into DeepSpeed
objects (one `LayerSpec` per layer of `spec.pipeline_layers`, so checkpoint file indices are spec positions).
"""

from __future__ import annotations

import torch

import threed.parallel.distributed  # noqa: F401  (first: the device policy's setup before deepspeed and megatron)
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from threed.config import ModelConfig, TrainConfig
from threed.model.compiled import compile_stage
from threed.model.init import init_pipeline_layers_
from threed.model.layers import (
    EmbeddingPipe,
    FinalNormPipe,
    LlamaBlock,
    LMHeadPipe,
    TiedLMHead,
    causal_lm_loss,
    megatron_config,
    token_weighted_loss,
)
from threed.model.spec import PipelineLayer, pipeline_layers, tie_owners, tied, universal_checkpoint_info
from threed.parallel.dims import RunDims
from threed.parallel.partition import stage_boundaries
from threed.parallel.staged import StagedPipelineModule


def make_topology(tp: int, pp: int, dp: int, cp: int = 1) -> PipeModelDataParallelTopology:
    # Axes (pipe, data, model): model (tp) varies fastest, then data, then pipe == megatron-core's order. The data
    # axis holds dp x cp ranks, CP ranks next to each other (megatron's tp-cp-dp-pp): CP ranks hold the same
    # weights, so DeepSpeed reduces their gradients and shards ZeRO-1 over them as over data-parallel ranks.
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp * cp)


def build_pipeline_module(
    model: ModelConfig,
    dims: RunDims,
    train: TrainConfig,
    sequence_parallel: bool = False,
    initialize: bool = True,
    fused_swiglu: bool = False,
    token_weighted: bool = False,
) -> PipelineModule:
    """Each rank instantiates only the LayerSpecs of its own stage (`dims.bounds`). `fused_swiglu` is CUDA-only
    (`threed.parallel.distributed.cuda_only`). `token_weighted` (SFT data): the loss takes per-token weights from the
    data side (`threed.model.layers.token_weighted_loss`)."""
    mcore = run_megatron_config(model, dims.tp, train, sequence_parallel, fused_swiglu)
    specs = [layer_spec(layer, model, mcore, train.lm_head_chunks) for layer in pipeline_layers(model)]
    module = StagedPipelineModule(
        layers=specs,
        loss_fn=token_weighted_loss if token_weighted else causal_lm_loss,
        topology=make_topology(dims.tp, dims.pp, dims.dp, dims.cp),
        # Stage boundaries resolved once by threed.parallel.dims (--partition-method; DeepSpeed's PipelineModule
        # underneath); with --vpp V > 1 the pp x V virtual stages', rank r holding virtual stages r, r + pp, ...
        # (its chunks, `dims.chunks(r)`).
        partition_method=stage_boundaries(dims.bounds),
        vpp=dims.vpp,
        # Full recompute (Megatron's uniform / block, --activation-checkpointing = uniform 1): which blocks, and in
        # which chunks, is StagedPipelineModule's; interval 1 only tells DeepSpeed's engine that it is on.
        activation_checkpoint_interval=1 if dims.recompute else 0,
        recompute=dims.recompute,
        # Explicit, because DeepSpeed otherwise guesses from class names (it looks for "ParallelTransformerLayerPipe").
        checkpointable_layers=["LlamaBlock"],
        base_seed=train.seed,
    )
    if initialize:
        init_pipeline_layers_(
            local_modules(module, model), model, dims.tp, parallel_state.get_tensor_model_parallel_rank(), train.seed
        )
    # --torch-compile: the stage's norms and RoPE, or its blocks, compiled at their first call (none: nothing).
    compile_stage([fn for _, fn in local_modules(module, model)], train.torch_compile)
    # How each parameter is split over TP; DeepSpeed saves it in every mp_rank file, and its universal checkpoint
    # conversion (resume at another tp / pp / dp) needs it: threed.checkpoint.universal.
    module.universal_checkpoint_info = universal_checkpoint_info(model)
    return module


def run_megatron_config(
    model: ModelConfig, tp: int, train: TrainConfig, sequence_parallel: bool = False, fused_swiglu: bool = False
) -> TransformerConfig:
    """megatron-core's config for the run's layers: its tp, sequence parallelism and selective recompute. megatron's
    own init is always skipped: it draws full master weights from the global generator, which every stage seeds
    alike (copied blocks) and which changes with tp. `threed.model.init` replaces it."""
    return megatron_config(
        model,
        tp,
        initialize=False,
        fused_swiglu=fused_swiglu,
        sequence_parallel=sequence_parallel,
        selective_recompute=train.recompute_granularity == "selective",
    )


def layer_spec(layer: PipelineLayer, model: ModelConfig, mcore: TransformerConfig, head_chunks: int = 1) -> LayerSpec:
    """The DeepSpeed spec of one layer of `pipeline_layers` (its `build()` makes the module; `threed profile-layers`
    builds one of each kind with it). `head_chunks` (`--lm-head-chunks`): the LM head leaves its logits to the loss,
    which makes them that many chunks at a time (`threed.model.layers.DeferredLogits`)."""
    if tied(model) and layer.kind in ("embedding", "lm_head"):
        # Llama 3.2: the first and the last stage each build the embedding module (at pp=1 one serves both);
        # DeepSpeed sums the weight's gradient over the two copies before the step (the tied group, fp32
        # `_hp_grad` under bf16), counts it once in the gradient norm (`ds_pipe_replicated` on the last
        # stage's copy) and keeps the copies equal. Only the first stage's copy is saved (layer_00): the
        # head is a function, not a module (gpt-neox ties the same way; megatron-core's
        # share_embeddings_and_output_weights is the same idea without DeepSpeed).
        owner = tie_owners()["embedding"]
        forward_fn = TiedLMHead(model, mcore, head_chunks) if layer.kind == "lm_head" else None
        return TiedLayerSpec(owner.tie, EmbeddingPipe, model, mcore, forward_fn=forward_fn, tied_weight_attr=owner.name)
    if layer.kind == "embedding":
        return LayerSpec(EmbeddingPipe, model, mcore)
    if layer.kind == "block":
        return LayerSpec(LlamaBlock, model, mcore, layer.block + 1)
    if layer.kind == "final_norm":
        return LayerSpec(FinalNormPipe, model, mcore)
    return LayerSpec(LMHeadPipe, model, mcore, head_chunks)


def local_modules(module: StagedPipelineModule, model: ModelConfig) -> list[tuple[PipelineLayer, torch.nn.Module]]:
    """This stage's layer modules (of every chunk under --vpp), each once, with the spec layer whose parameters it
    holds: a tied head's entry is the embedding module it runs with (the last stage's copy; at pp=1 the embedding
    itself, listed once)."""
    layers = pipeline_layers(model)
    out: list[tuple[PipelineLayer, torch.nn.Module]] = []
    for index, fn in module.indexed_layers():
        layer = layers[index]
        if layer.tied_to is not None:
            layer = layers[layer.tied_to]
            fn = module.tied_modules["embedding"]  # the TiedLayerSpec key above
        if all(fn is not seen for _, seen in out):
            out.append((layer, fn))
    return out
