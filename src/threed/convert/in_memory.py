"""Copy an in-memory HF Llama state dict into this rank's pipeline layers: for small models (tests, benchmarks).
Real weights go through `threed convert` (streaming, on disk) and DeepSpeed's load_checkpoint instead."""
from __future__ import annotations

import torch

from threed.config import ModelConfig
from threed.convert.mapping import layer_from_hf
from threed.pipeline import pipeline_layers


def load_hf_state(module, cfg: ModelConfig, hf_state: dict[str, torch.Tensor], tp: int, tp_rank: int) -> None:
    """`module` is a DeepSpeed PipelineModule; only the layers of this rank's stage are filled."""
    layers = pipeline_layers(cfg)
    for idx, layer_module in zip(range(module._local_start, module._local_stop), module.forward_funcs):
        layer_module.load_state_dict(layer_from_hf(cfg, layers[idx], hf_state, tp)[tp_rank], strict=True)


def random_hf_state(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """The HF state dict of a random init with `seed` (`threed.model.init`): what `threed export` of a run that
    started from random weights with this seed gives at any tp and pp, before its first step."""
    from threed.convert.mapping import layer_to_hf
    from threed.model.init import shard_of
    from threed.model.sharding import SHARDING, parameter_shapes

    out: dict[str, torch.Tensor] = {}
    for layer in pipeline_layers(cfg):
        shapes = parameter_shapes(cfg, layer.kind)
        ours = {name: shard_of(cfg, layer.index, name, kind, shapes[name], 1, 0, seed)
                for name, kind in SHARDING[layer.kind].items()}
        out.update(layer_to_hf(cfg, layer, [ours]))
    return out

