"""HF transformers' Llama names for threed's parameters: ONE table, read in both directions (convert: HF -> ours,
export: ours -> HF), in the manner of torchtitan's state_dict_adapter.

Each row of `threed.model.spec.PARAMETERS` is made of one or more HF tensors, fused in the order listed:
  qkv       q_proj, k_proj, v_proj   -> megatron's grouped layout (threed.convert.mapping.fuse_qkv)
  gate_up   gate_proj, up_proj       -> [gate; up] (cat on rows)
  others    one tensor, same shape (vocab unpadded)
HF already uses rotate-half RoPE, so no q/k permutation is needed (Meta's raw weights would need one). Entries of
an HF checkpoint that are not weights (`IGNORED_SUFFIXES`) are `threed.hf.format`'s.
"""

from __future__ import annotations

from threed.config import LoraConfig, ModelConfig
from threed.model.spec import (
    PARAMETERS,
    LayerKind,
    PipelineLayer,
    full_shape,
    held_parameters,
    layer_parameters,
    pipeline_layers,
    tie_owners,
)

# (layer kind, our name) -> HF name templates; "{i}" is the block number.
HF_NAMES: dict[tuple[LayerKind, str], tuple[str, ...]] = {
    ("embedding", "word_embeddings.weight"): ("model.embed_tokens.weight",),
    ("block", "input_layernorm.weight"): ("model.layers.{i}.input_layernorm.weight",),
    ("block", "self_attention.linear_qkv.weight"): (
        "model.layers.{i}.self_attn.q_proj.weight",
        "model.layers.{i}.self_attn.k_proj.weight",
        "model.layers.{i}.self_attn.v_proj.weight",
    ),
    ("block", "self_attention.linear_proj.weight"): ("model.layers.{i}.self_attn.o_proj.weight",),
    ("block", "pre_mlp_layernorm.weight"): ("model.layers.{i}.post_attention_layernorm.weight",),
    ("block", "mlp.linear_fc1.weight"): (
        "model.layers.{i}.mlp.gate_proj.weight",
        "model.layers.{i}.mlp.up_proj.weight",
    ),
    ("block", "mlp.linear_fc2.weight"): ("model.layers.{i}.mlp.down_proj.weight",),
    ("final_norm", "norm.weight"): ("model.norm.weight",),
    ("lm_head", "lm_head.weight"): ("lm_head.weight",),
}

assert set(HF_NAMES) == {(p.layer, p.name) for p in PARAMETERS}, "every parameter of the spec needs its HF names"


def hf_names(layer: PipelineLayer) -> dict[str, tuple[str, ...]]:
    """our name -> the HF names it is made of, for one pipeline layer."""
    return {
        p.name: tuple(t.format(i=layer.block) for t in HF_NAMES[(layer.kind, p.name)])
        for p in layer_parameters(layer.kind)
    }


def hf_shapes(cfg: ModelConfig, layer: PipelineLayer) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> its shape, for one pipeline layer (to check a source, or to lay out an export)."""
    out: dict[str, tuple[int, ...]] = {}
    for p in layer_parameters(layer.kind):
        names = hf_names(layer)[p.name]
        rows, *rest = full_shape(cfg, p, None)
        if p.split == "qkv":
            d = cfg.head_dim
            parts = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
        elif p.split == "gate_up":
            parts = [rows // 2, rows // 2]
        else:
            parts = [rows]
        assert sum(parts) == rows and len(parts) == len(names), (p.name, parts, names)
        out.update({n: (r, *rest) for n, r in zip(names, parts)})
    return out


def lora_target_shapes(model: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """Each chosen LoRA target's base weight, unsharded [out, in]: HF's `<target>_proj` of a block (PEFT's module
    name), read off this table as threed.convert.lora reads it to cut PEFT tensors into TP shards."""
    block = next(ly for ly in pipeline_layers(model) if ly.kind == "block")
    shapes = hf_shapes(model, block)
    out = {}
    for target in lora.lora_targets:
        (shape,) = [s for name, s in shapes.items() if name.endswith(f".{target}_proj.weight")]
        out[target] = (shape[0], shape[1])
    return out


def lora_block_elements(model: ModelConfig, lora: LoraConfig, tp: int = 1) -> int:
    """Adapter elements of one block on one TP rank: r (out + in) per target, / tp (every adapter element lives on
    one TP rank). What the memory model counts and what a LoRA checkpoint holds (threed.checkpoint.format)."""
    return sum(lora.lora_rank * (rows + cols) for rows, cols in lora_target_shapes(model, lora).values()) // tp


def tied_hf_names(cfg: ModelConfig) -> dict[str, str]:
    """HF name of each weight a tied model does not hold -> HF name of the weight it is (Llama 3.2:
    `lm_head.weight` -> `model.embed_tokens.weight`); empty for an untied model. transformers saves a tied model
    without the first; a file that has it anyway must hold the same tensor (threed.convert.from_hf checks)."""
    held, owners = held_parameters(cfg), tie_owners()
    out: dict[str, str] = {}
    for p in PARAMETERS:
        if p not in held:
            owner = owners[p.tie]  # type: ignore[index]  # a row not held is a tied one
            for ours, theirs in zip(HF_NAMES[(p.layer, p.name)], HF_NAMES[(owner.layer, owner.name)]):
                assert "{i}" not in ours + theirs, "a tied weight of a block would need the block number"
                out[ours] = theirs
    return out
