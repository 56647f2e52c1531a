"""One parameter table (`threed.model.spec.PARAMETERS`): everything that needs a parameter's shape, TP split or
count derives from it, and all of it agrees with HF transformers' own `LlamaForCausalLM` — small models with GQA
and a vocabulary that needs padding, and the real 70B / 405B shapes on the meta device.

    .venv/bin/python -m pytest -q tests/unit/test_model_spec.py
"""

from __future__ import annotations

import dataclasses

import re

import pytest
import torch

from helpers import HF_CONFIGS, hf_model, model_config
from threed.parallel import partition
from threed.memory import model as memory
from threed.config import ModelConfig, ParallelConfig
from threed.convert.mapping import layer_from_hf
from threed.convert.slices import rank_slices
from threed.hf import names as hf_names_module
from threed.hf.names import hf_shapes
from threed.model import spec
from threed.model.init import shard_of
from threed.model.spec import (
    PARAMETERS,
    Param,
    layer_parameters,
    parameter_count,
    pipeline_layers,
    shard_shapes,
    stage_parameters,
    universal_patterns,
)
from threed.hf.config import from_hf_config, to_hf_config
from threed.model.presets import PRESETS

# A vocabulary of 1000 pads to 1024 at tp 1 (multiple 128) and to 1024 at tp 2 (256) / tp 4 (512): padding rows
# exist at every tp. GQA 8 heads / 2 KV heads; MHA 6 / 6 with an odd head_dim.
SMALL = {
    "gqa-odd-vocab": ModelConfig(
        name="gqa",
        vocab_size=1000,
        hidden_size=64,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        ffn_hidden_size=112,
        max_position_embeddings=64,
    ),
    "mha": ModelConfig(
        name="mha",
        vocab_size=515,
        hidden_size=84,
        num_layers=2,
        num_heads=6,
        num_kv_heads=6,
        ffn_hidden_size=100,
        max_position_embeddings=64,
        make_vocab_size_divisible_by=8,
    ),
}
LARGE = ("llama2-70b", "llama3.1-70b", "llama3.1-405b")


def hf_llama(cfg: ModelConfig, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(**{k: v for k, v in to_hf_config(cfg).items() if k not in ("architectures", "model_type")})
    with torch.device(device):
        return LlamaForCausalLM(hf_cfg)


def hf_params(cfg: ModelConfig, device: str) -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in hf_llama(cfg, device).named_parameters()}


def valid_tps(cfg: ModelConfig) -> list[int]:
    return [t for t in (1, 2, 4, 8) if cfg.num_heads % t == 0 and cfg.num_kv_heads % t == 0]


CASES = [(name, cfg, "cpu") for name, cfg in SMALL.items()] + [(p, PRESETS[p], "meta") for p in LARGE]


@pytest.mark.parametrize("name,cfg,device", CASES, ids=[c[0] for c in CASES])
def test_counts_and_hf_shapes_equal_hf_llama(name, cfg, device):
    hf = hf_params(cfg, device)
    assert parameter_count(cfg) == sum(torch.Size(s).numel() for s in hf.values())
    ours = {n: s for layer in pipeline_layers(cfg) for n, s in hf_shapes(cfg, layer).items()}
    assert ours == hf  # every HF tensor is some row's, with its shape, and nothing else


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_the_tests_model_config_is_what_transformers_reads(name):
    """helpers.model_config reads the test models' LlamaConfig kwargs itself (no transformers in a rank): the same
    config as from transformers' own LlamaConfig of the model the tests build (its defaults, its rope layout)."""
    hf = hf_model(name).config.to_dict()
    assert model_config(name) == dataclasses.replace(from_hf_config(hf, name=name), make_vocab_size_divisible_by=16)


@pytest.mark.parametrize("name,cfg,device", CASES, ids=[c[0] for c in CASES])
def test_shards_stages_and_converter_agree(name, cfg, device):
    meta = {n: torch.empty(s, device="meta") for n, s in hf_params(cfg, "meta").items()}
    for tp in valid_tps(cfg):
        padded = cfg.padded_vocab_size(tp)
        for layer in pipeline_layers(cfg)[:3] + pipeline_layers(cfg)[-2:]:
            want = shard_shapes(cfg, layer.kind, tp)
            per_rank = layer_from_hf(cfg, layer, {n: meta[n] for n in hf_shapes(cfg, layer)}, tp)
            for rank in range(tp):
                assert {k: tuple(v.shape) for k, v in per_rank[rank].items()} == want, (layer, tp, rank)
                assert {s.name: s.shape for s in rank_slices(cfg, layer, tp, rank)} == want, (layer, tp, rank)
        # Per-stage parameters of every stage, summed over the stages and TP ranks (norms are replicated):
        # the HF count plus the vocabulary padding of the embedding and the LM head.
        for pp in sorted({1, 2, min(cfg.num_layers, 4)}):
            total = 0
            for st in memory.stages(cfg, pp, tp, 64, "balanced"):
                matrices, norms = memory.stage_params(cfg, tp, st)
                total += matrices * tp + norms
            assert total == parameter_count(cfg) + 2 * (padded - cfg.vocab_size) * cfg.hidden_size, (tp, pp)


@pytest.mark.parametrize("name", list(SMALL))
def test_init_draws_the_shapes_of_the_table(name):
    cfg = SMALL[name]
    for tp in valid_tps(cfg):
        for layer in pipeline_layers(cfg):
            for p in layer_parameters(layer.kind):
                for rank in range(tp):
                    t = shard_of(cfg, layer.index, p, tp, rank, seed=1)
                    assert tuple(t.shape) == shard_shapes(cfg, layer.kind, tp)[p.name]


@pytest.mark.parametrize("tie", [False, True])
def test_universal_patterns_name_every_split_that_is_not_a_row_range(tie):
    # ds_to_universal concatenates any TP-sharded parameter that no pattern names on dim 0 (DeepSpeed #6503):
    # right only for row ranges (column, qkv). Every other split must be named by exactly its own rule; a pattern
    # that names nothing the model holds is refused (strict), so a tied model has no LM head pattern.
    rule = {
        "replicated": "TP_REPLICATED_PARAMETER_PATTERNS",
        "row": "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
        "gate_up": "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0",
        "vocab": "VOCABULARY_PARAMETER_PATTERNS",
    }
    cfg = dataclasses.replace(SMALL["gqa-odd-vocab"], tie_word_embeddings=tie)
    patterns = universal_patterns(cfg)
    # DeepSpeed's names: `<layer index>.<name>`; a TiedLayerSpec's module is `tied_modules.<key>` on every stage.
    names = {}
    for layer in pipeline_layers(cfg):
        for p in layer_parameters(layer.kind):
            if tie and p.tie:
                if layer.tied_to is None:
                    names[f"tied_modules.{p.tie}.{p.name}"] = p
            else:
                names[f"{layer.index}.{p.name}"] = p
    assert ("tied_modules.embedding.word_embeddings.weight" in names) == tie
    assert any(n.endswith("lm_head.weight") for n in names) != tie
    used = set()
    for full, p in names.items():
        matched = {
            k
            for k, pats in patterns.items()
            if k != "PIPELINE_REPLICATED_PARAMETER_PATTERNS" and any(re.match(x, full) for x in pats)
        }
        assert matched == ({rule[p.split]} if p.split in rule else set()), (full, matched)
        used |= {x for pats in patterns.values() for x in pats if re.match(x, full)}
    assert used == {x for pats in patterns.values() for x in pats}  # every pattern names a parameter
    replicated = patterns.get("PIPELINE_REPLICATED_PARAMETER_PATTERNS", [])
    assert [n for n in names if any(re.match(x, n) for x in replicated)] == (
        ["tied_modules.embedding.word_embeddings.weight"] if tie else []
    )
    info = spec.universal_checkpoint_info(cfg)
    from deepspeed.checkpoint import constants

    for key, pats in patterns.items():
        assert info[getattr(constants, key)] == pats
    assert info["original_vocab_size"] == cfg.vocab_size


def test_a_new_row_reaches_every_derived_fact(monkeypatch):
    """Adding a parameter kind is one row of the table (plus its HF name): counts, shard shapes, per-stage
    parameters, the partition's cost, the universal patterns and the init all see it."""
    cfg = SMALL["gqa-odd-vocab"]
    before = {
        "count": parameter_count(cfg),
        "shards": shard_shapes(cfg, "block", 2),
        "stage": stage_parameters(cfg, 2, ["block"]),
        "flops": spec.layer_training_flops(cfg, "block", 64),
        "patterns": universal_patterns(cfg),
    }
    extra = Param("block", "mlp.linear_extra.weight", "row", "scaled", ("hidden", "ffn"), megatron_linear=True)
    monkeypatch.setattr(spec, "PARAMETERS", PARAMETERS + (extra,))
    monkeypatch.setitem(hf_names_module.HF_NAMES, ("block", extra.name), ("model.layers.{i}.mlp.extra.weight",))
    spec.layer_parameters.cache_clear()
    try:
        h, f = cfg.hidden_size, cfg.ffn_hidden_size
        assert parameter_count(cfg) == before["count"] + cfg.num_layers * h * f
        assert shard_shapes(cfg, "block", 2) == {**before["shards"], extra.name: (h, f // 2)}
        assert stage_parameters(cfg, 2, ["block"]) == (before["stage"][0] + h * f // 2, before["stage"][1])
        assert spec.layer_training_flops(cfg, "block", 64) == before["flops"] + 6 * h * f
        assert partition.layer_params(cfg, pipeline_layers(cfg)[1], 2) == sum(stage_parameters(cfg, 2, ["block"]))
        rows = universal_patterns(cfg)["PARAMETER_WITH_ROW_PARALLELISM_PATTERNS"]
        assert rows == before["patterns"]["PARAMETER_WITH_ROW_PARALLELISM_PATTERNS"] + [
            r"\d+\.mlp\.linear_extra\.weight$"
        ]
        assert hf_shapes(cfg, pipeline_layers(cfg)[1])["model.layers.0.mlp.extra.weight"] == (h, f)
        assert tuple(shard_of(cfg, 1, extra, 2, 1, seed=0).shape) == (h, f // 2)
    finally:
        spec.layer_parameters.cache_clear()


def test_tp_segments_cover_each_tensor_once():
    for split in ("vocab", "column", "qkv", "gate_up", "row"):
        for tp in (1, 2, 4, 8):
            n = 64
            covered = sorted(
                i
                for r in range(tp)
                for s in spec.tp_segments(split, n, tp, r)
                for i in range(s.start, s.start + s.length)
            )
            assert covered == list(range(n)), (split, tp)
            for r in range(tp):
                locals_ = [(s.local, s.length) for s in spec.tp_segments(split, n, tp, r)]
                assert sum(length for _, length in locals_) == n // tp


def test_layouts_of_the_presets_validate():
    for name in LARGE:
        ParallelConfig(tp=8, pp=4).validate(PRESETS[name], 32)
