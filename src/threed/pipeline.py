"""How the Llama is parallelised: its layers as DeepSpeed `LayerSpec`s in a `PipelineModule` over a
(pipe, data, model) topology, with megatron-core TP inside each layer.

`pipeline_layers(model)` is the single source of the layer list. The converter derives checkpoint file indices
(`layer_XX-model_YY-model_states.pt`) from it, so the two can never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from threed.config import ModelConfig, RunConfig

if TYPE_CHECKING:  # DeepSpeed is imported lazily: the converters need only the layer list
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

LayerKind = Literal["embedding", "block", "final_norm", "lm_head"]


@dataclass(frozen=True)
class PipelineLayer:
    index: int  # position in the PipelineModule's layer list == DeepSpeed checkpoint file index
    kind: LayerKind
    block: int = -1  # transformer block number (0-based) for kind == "block"


def pipeline_layers(model: ModelConfig) -> list[PipelineLayer]:
    kinds: list[tuple[LayerKind, int]] = [("embedding", -1)]
    kinds += [("block", i) for i in range(model.num_layers)]
    kinds += [("final_norm", -1), ("lm_head", -1)]
    return [PipelineLayer(index=i, kind=k, block=b) for i, (k, b) in enumerate(kinds)]


def make_topology(tp: int, pp: int, dp: int) -> "PipeModelDataParallelTopology":
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    # Axes (pipe, data, model): model (tp) varies fastest, then data, then pipe == megatron-core's order.
    return PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)


def build_pipeline_module(cfg: RunConfig, world_size: int, initialize: bool = True,
                          fused_swiglu: bool = False, token_weighted: bool = False) -> "PipelineModule":
    """Each rank instantiates only the LayerSpecs of its own stage. `fused_swiglu` is CUDA-only
    (`threed.distributed.cuda_only`). `token_weighted` (SFT data): the loss takes per-token weights from the data
    side (`threed.model.layers.token_weighted_loss`)."""
    from deepspeed.pipe import LayerSpec

    from threed.model.layers import (EmbeddingPipe, FinalNormPipe, LlamaBlock, LMHeadPipe, causal_lm_loss,
                                     megatron_config, token_weighted_loss)

    # megatron's own init is always skipped: it draws full master weights from the global generator, which
    # every stage seeds alike (copied blocks) and which changes with tp. `threed.model.init` replaces it.
    mcore = megatron_config(cfg.model, cfg.parallel.tp, initialize=False, fused_swiglu=fused_swiglu)
    specs: list = []
    for layer in pipeline_layers(cfg.model):
        if layer.kind == "embedding":
            specs.append(LayerSpec(EmbeddingPipe, cfg.model, mcore))
        elif layer.kind == "block":
            specs.append(LayerSpec(LlamaBlock, cfg.model, mcore, layer.block + 1))
        elif layer.kind == "final_norm":
            specs.append(LayerSpec(FinalNormPipe, cfg.model, mcore))
        else:
            specs.append(LayerSpec(LMHeadPipe, cfg.model, mcore))
    topology = make_topology(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp(world_size))
    from threed.partition import stage_boundaries, staged_pipeline_module

    # Stage boundaries resolved by threed.partition (--partition-method; DeepSpeed's PipelineModule underneath).
    module = staged_pipeline_module()(
        layers=specs,
        loss_fn=token_weighted_loss if token_weighted else causal_lm_loss,
        topology=topology,
        partition_method=stage_boundaries(cfg),
        activation_checkpoint_interval=1 if cfg.train.activation_checkpointing else 0,
        # Explicit, because DeepSpeed otherwise guesses from class names (it looks for "ParallelTransformerLayerPipe").
        checkpointable_layers=["LlamaBlock"],
        base_seed=cfg.train.seed,
    )
    if initialize:
        from megatron.core import parallel_state

        from threed.model.init import init_pipeline_layers_

        kinds = {layer.index: layer.kind for layer in pipeline_layers(cfg.model)}
        local = zip(range(module._local_start, module._local_stop), module.forward_funcs)
        init_pipeline_layers_(local, kinds, cfg.model, cfg.parallel.tp,
                              parallel_state.get_tensor_model_parallel_rank(), cfg.train.seed)
    # How each parameter is split over TP; DeepSpeed saves it in every mp_rank file, and its universal checkpoint
    # conversion (resume at another tp / pp / dp) needs it: threed.checkpoint.universal.
    from threed.checkpoint.universal import universal_info

    module.universal_checkpoint_info = universal_info(cfg.model)
    return module
