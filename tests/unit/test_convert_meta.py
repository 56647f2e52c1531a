"""Conversion at real 70B / 405B shapes on the meta device: every output file's name, every tensor's name and
shape, and no memory used (the same `convert_stream` the converter writes from, fed meta tensors).

    .venv/bin/python -m pytest -q tests/unit/test_convert_meta.py
"""

from __future__ import annotations

import math
import resource

import pytest
import torch

from threed.config import ModelConfig, ParallelConfig
from threed.checkpoint.format import layer_file
from threed.convert.from_hf import convert_stream
from threed.convert.ds_checkpoint import EXTRA_STATE, checkpoint_files
from threed.convert.slices import DictReader
from threed.hf.names import hf_names, hf_shapes
from threed.model.spec import parameter_count, pipeline_layers, shard_shapes
from threed.model.presets import PRESETS


def expected(cfg: ModelConfig, kind: str, tp: int) -> dict[str, tuple[int, ...]]:
    """Written out from the Megatron layout, independently of the converter."""
    h, f, d, nh, nkv = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    multiple = 128 * tp
    vocab = math.ceil(cfg.vocab_size / multiple) * multiple
    return {
        "embedding": {"word_embeddings.weight": (vocab // tp, h)},
        "block": {
            "input_layernorm.weight": (h,),
            "pre_mlp_layernorm.weight": (h,),
            "self_attention.linear_qkv.weight": ((nh + 2 * nkv) * d // tp, h),
            "self_attention.linear_proj.weight": (h, nh * d // tp),
            "mlp.linear_fc1.weight": (2 * f // tp, h),
            "mlp.linear_fc2.weight": (h, f // tp),
        },
        "final_norm": {"norm.weight": (h,)},
        "lm_head": {"lm_head.weight": (vocab // tp, h)},
    }[kind]


def meta_reader(cfg: ModelConfig) -> DictReader:
    return DictReader(
        {
            n: torch.empty(s, dtype=torch.bfloat16, device="meta")
            for layer in pipeline_layers(cfg)
            for n, s in hf_shapes(cfg, layer).items()
        }
    )


@pytest.mark.parametrize(
    "preset,tp,pp", [("llama2-70b", 8, 4), ("llama3-70b", 8, 4), ("llama3.1-405b", 8, 8), ("llama3.1-405b", 8, 16)]
)
def test_meta_conversion_at_real_shapes(preset, tp, pp):
    cfg = PRESETS[preset]
    ParallelConfig(tp=tp, pp=pp).validate(cfg, tp * pp)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    written: list[str] = []
    n_params = 0
    for layer, rank, sd in convert_stream(meta_reader(cfg), cfg, tp, device="meta"):
        want = expected(cfg, layer.kind, tp)
        tensors = {k: v for k, v in sd.items() if v is not None}
        assert {k: tuple(v.shape) for k, v in tensors.items()} == want, (layer, rank)
        assert all(v.is_meta and v.dtype == torch.bfloat16 for v in tensors.values())
        assert sorted(k for k, v in sd.items() if v is None) == sorted(
            f"{m}._extra_state" for m in EXTRA_STATE[layer.kind]
        )
        written.append(layer_file(layer.index, rank))
        n_params += sum(v.numel() for k, v in tensors.items() if "norm" not in k or rank == 0)
    # No magic offsets: layer files are numbered 0 .. L+2 straight from the pipeline's layer list.
    assert written == checkpoint_files(cfg, tp, pp)[: len(written)]
    assert written[0] == "layer_00-model_00-model_states.pt"
    assert written[-1] == f"layer_{cfg.num_layers + 2:02d}-model_{tp - 1:02d}-model_states.pt"
    mp = checkpoint_files(cfg, tp, pp)[len(written) :]
    assert mp == [f"mp_rank_{r:02d}_model_states.pt" for r in range(tp * pp)]
    # Every parameter of the model (plus vocab padding) lands in exactly one shard.
    padded = math.ceil(cfg.vocab_size / (128 * tp)) * 128 * tp
    assert n_params == parameter_count(cfg) + 2 * (padded - cfg.vocab_size) * cfg.hidden_size
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100_000  # KiB: < 100 MB
    # The shape table the random init and the in-memory loaders use says the same.
    for kind in ("embedding", "block", "final_norm", "lm_head"):
        assert shard_shapes(cfg, kind, tp) == expected(cfg, kind, tp), kind


def test_hf_names_cover_every_hf_tensor_once():
    cfg = PRESETS["llama3-70b"]
    names = [n for layer in pipeline_layers(cfg) for ns in hf_names(layer).values() for n in ns]
    assert len(names) == len(set(names)) == 9 * cfg.num_layers + 3
