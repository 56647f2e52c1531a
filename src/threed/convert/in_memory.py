"""Copy an in-memory HF Llama state dict into this rank's pipeline layers: for small models (tests, benchmarks).
Real weights go through `threed convert` (streaming, on disk) and DeepSpeed's load_checkpoint instead."""

from __future__ import annotations

import torch

from threed.config import ModelConfig
from threed.convert.mapping import layer_from_hf, layer_to_hf
from threed.hf.names import tied_hf_names
from threed.model.init import shard_of
from threed.model.spec import layer_parameters, stored_layers


def load_hf_state(module, cfg: ModelConfig, hf_state: dict[str, torch.Tensor], tp: int, tp_rank: int) -> None:
    """`module` is a DeepSpeed PipelineModule; only the modules of this rank's stage are filled. A tied model's
    last stage fills its copy of the embedding (its LM head's weight) from the embedding's HF tensor."""
    # deepspeed, megatron (through threed.parallel.pipeline): heavy; random_hf_state below needs neither
    from threed.parallel.pipeline import local_modules

    for layer, layer_module in local_modules(module, cfg):
        layer_module.load_state_dict(layer_from_hf(cfg, layer, hf_state, tp)[tp_rank], strict=True)


def random_hf_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The HF state dict of a random init with `seed` (`threed.model.init`): what `threed export` of a run that
    started from random weights with this seed gives at any tp and pp, before its first step. A tied model's dict
    also holds the LM head's name bound to the embedding's tensor, as transformers' own state_dict does (its
    strict load_state_dict asks for both names; export writes only the embedding)."""
    out: dict[str, torch.Tensor] = {}
    for layer in stored_layers(cfg):
        ours = {p.name: shard_of(cfg, layer.index, p, 1, 0, seed) for p in layer_parameters(layer.kind)}
        out.update(layer_to_hf(cfg, layer, [ours]))
    for tied_name, owner_name in tied_hf_names(cfg).items():
        out[tied_name] = out[owner_name]
    return out
