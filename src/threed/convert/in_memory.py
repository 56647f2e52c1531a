"""Copy an in-memory HF Llama state dict into this rank's pipeline layers: for small models (tests, benchmarks).
Real weights go through `threed convert` (streaming, on disk) and DeepSpeed's load_checkpoint instead."""
from __future__ import annotations

import torch

from threed.config import ModelConfig, RunConfig
from threed.convert.mapping import layer_from_hf, layer_to_hf
from threed.model.init import shard_of
from threed.model.spec import layer_parameters, stored_layers


def load_hf_state(module, cfg: ModelConfig, hf_state: dict[str, torch.Tensor], tp: int, tp_rank: int) -> None:
    """`module` is a DeepSpeed PipelineModule; only the layers of this rank's stage are filled. A tied model's
    last stage fills its copy of the embedding (its LM head's weight) from the embedding's HF tensor."""
    # deepspeed, megatron (through threed.pipeline): heavy; random_hf_state below needs neither
    from threed.pipeline import local_modules

    for layer, layer_module in local_modules(module, RunConfig(model=cfg)):
        layer_module.load_state_dict(layer_from_hf(cfg, layer, hf_state, tp)[tp_rank], strict=True)


def random_hf_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The HF state dict of a random init with `seed` (`threed.model.init`): what `threed export` of a run that
    started from random weights with this seed gives at any tp and pp, before its first step (a tied model: no
    lm_head.weight, as export writes it)."""
    out: dict[str, torch.Tensor] = {}
    for layer in stored_layers(cfg):
        ours = {p.name: shard_of(cfg, layer.index, p, 1, 0, seed) for p in layer_parameters(layer.kind)}
        out.update(layer_to_hf(cfg, layer, [ours]))
    return out
