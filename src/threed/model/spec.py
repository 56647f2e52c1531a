"""The Llama as threed builds it: the pipeline layer list and ONE parameter table.

Every fact about a parameter is a column of `PARAMETERS` (which pipeline layer holds it, its unsharded shape, how
tensor parallelism splits it, how it is initialised, what it is tied to); everything else is derived here from
that table, so adding a parameter kind is one row:

    shard_shapes(model, "block", tp)   what one TP rank holds (the init, the converter, the checkpoint reader)
    tp_segments(split, n, tp, rank)    which rows / columns of the unsharded tensor are rank r's (convert, init)
    parameter_count(model)             the HF model's count (tokens/s, MFU, logs, checkpoint size)
    stage_parameters(model, tp, ...)   per-rank (matrices, norms) of a stage (memory model, optimizer groups)
    layer_training_flops(...)          FLOPs per token, full or causal attention (partition, planner, metrics)
    universal_checkpoint_info(model)   DeepSpeed's patterns to merge / split TP shards (resume at another layout)

Where a layer lives among the stages is `threed.parallel.partition`'s job (from this layer list); the HF names of each
row are `threed.hf.names`' (the one table used in both directions).

FLOPs convention (stated once, used everywhere): training = forward + backward = 3 x forward; forward = 2 FLOPs
per multiply-accumulate of every matmul parameter (the LM head over the padded vocabulary: that is the matmul
that runs; the input embedding is a lookup and counts zero), plus the attention scores QK^T and AV, no recompute.
The attention scores come in two conventions (`ATTENTION`), both reported wherever MFU is:
  full    the whole seq x seq square, 4 * seq * hidden per token per block forward (12 * seq * hidden in training):
          torchtitan's `get_num_flop_per_token` (12 * l * h * q * t, "do not account for sparsity in causal
          attention"), PaLM's appendix B and Megatron-LM's `num_floating_point_operations` until mid-2025. The
          default: the planner, the partitioner and every figure measured before 2026-11-29 use it.
  causal  half the square (a causal mask leaves s/2 keys per query on average): Megatron-LM's formula since mid-2025
          ("causal mask (only half of the mask is non-zero)"), MaxText's since July 2025, FlashAttention's
          benchmarks. Closer to the work a causal kernel does (s(s+1)/2 entries, not s^2/2: the +s/2 is dropped).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import Iterable, Literal, Optional

from threed.config import ModelConfig

LayerKind = Literal["embedding", "block", "final_norm", "lm_head"]
# How the attention scores are counted (module docstring): the full seq x seq square, or its causal half.
Attention = Literal["full", "causal"]
ATTENTION: tuple[Attention, ...] = ("full", "causal")
LAYER_KINDS: tuple[LayerKind, ...] = ("embedding", "block", "final_norm", "lm_head")

# How tensor parallelism splits a parameter (megatron-core's layers decide; this names what they do):
#   vocab       rows; the vocabulary is padded to a multiple of make_vocab_size_divisible_by x tp (padding last)
#   column      rows (ColumnParallelLinear)
#   qkv         rows of megatron's grouped [q heads of group | k | v] layout: a rank owns whole KV groups, so its
#               shard is a contiguous row range, like `column`
#   gate_up     [gate_r; up_r] per rank: megatron's SwiGLU chunks its fc1 output in two halves
#   row         columns (RowParallelLinear)
#   replicated  the same on every rank (norms)
Split = Literal["vocab", "column", "qkv", "gate_up", "row", "replicated"]
# How a parameter is drawn from scratch (Megatron-LM's choices; threed.model.init draws them):
#   normal   N(0, init_std)      scaled   N(0, init_std / sqrt(2 * num_layers)) (the two output projections)
#   ones     norms
Init = Literal["normal", "scaled", "ones"]


@dataclass(frozen=True)
class PipelineLayer:
    index: int  # position in the PipelineModule's layer list == DeepSpeed checkpoint file index (layer_XX-...)
    kind: LayerKind
    block: int = -1  # transformer block number (0-based) for kind == "block"
    # The LM head of a tied model: it runs with the module of layer `tied_to` (the embedding; a copy of it on the
    # last stage, DeepSpeed's TiedLayerSpec), holds no parameter of its own and has no layer file.
    tied_to: Optional[int] = None

    @property
    def stored(self) -> bool:
        """Whether the layer's module holds parameters of its own, saved as layer files (`layer_XX-model_YY`)."""
        return self.tied_to is None


def pipeline_layers(model: ModelConfig) -> list[PipelineLayer]:
    """The one layer list: embedding, the blocks, final norm, LM head. File indices, stage boundaries, the
    LayerSpecs and the converters all come from it, so they can never disagree."""
    kinds: list[tuple[LayerKind, int]] = [("embedding", -1)]
    kinds += [("block", i) for i in range(model.num_layers)]
    kinds += [("final_norm", -1), ("lm_head", -1)]
    layers = [PipelineLayer(index=i, kind=k, block=b) for i, (k, b) in enumerate(kinds)]
    if tied(model):
        layers[-1] = PipelineLayer(index=layers[-1].index, kind="lm_head", tied_to=0)
    return layers


def stored_layers(model: ModelConfig) -> list[PipelineLayer]:
    """The layers with a layer file per TP rank (every layer but a tied LM head): what the converters write and
    read, what a checkpoint holds."""
    return [layer for layer in pipeline_layers(model) if layer.stored]


def tied(model: ModelConfig) -> bool:
    """Whether the LM head's weight is the embedding's (one parameter; table rows sharing a `tie` key)."""
    return model.tie_word_embeddings


@dataclass(frozen=True)
class Param:
    layer: LayerKind  # the pipeline layer kind whose module holds it
    name: str  # its key in that module's state dict (megatron-core's names)
    split: Split
    init: Init
    # Shape of the unsharded tensor as a function of the model (vocab: padded by the caller), see `full_shape`.
    dims: tuple[str, ...]
    # True for megatron-core linear layers: their state dicts also hold `<module>._extra_state` (None).
    megatron_linear: bool = False
    # Parameters sharing a tie key are one weight when the model ties them (Llama 3.2's embedding and LM head);
    # counted once, drawn once. None: never tied.
    tie: Optional[str] = None

    @property
    def module(self) -> str:
        """The owning submodule's path (`mlp.linear_fc1` for `mlp.linear_fc1.weight`)."""
        return self.name.rsplit(".", 1)[0]


PARAMETERS: tuple[Param, ...] = (
    Param("embedding", "word_embeddings.weight", "vocab", "normal", ("vocab", "hidden"), tie="embedding"),
    Param("block", "input_layernorm.weight", "replicated", "ones", ("hidden",)),
    Param("block", "self_attention.linear_qkv.weight", "qkv", "normal", ("qkv", "hidden"), megatron_linear=True),
    Param("block", "self_attention.linear_proj.weight", "row", "scaled", ("hidden", "q"), megatron_linear=True),
    Param("block", "pre_mlp_layernorm.weight", "replicated", "ones", ("hidden",)),
    Param("block", "mlp.linear_fc1.weight", "gate_up", "normal", ("2ffn", "hidden"), megatron_linear=True),
    Param("block", "mlp.linear_fc2.weight", "row", "scaled", ("hidden", "ffn"), megatron_linear=True),
    Param("final_norm", "norm.weight", "replicated", "ones", ("hidden",)),
    Param("lm_head", "lm_head.weight", "vocab", "normal", ("vocab", "hidden"), megatron_linear=True, tie="embedding"),
)


# LoRA's adapters (threed.model.lora) are submodules `lora` of the base linears they adapt, so a LoRA run's block state
# dict (and layer file) holds `<base linear>.lora.A.<target>` / `.B.<target>` beside the table's rows.
LORA_ADAPTER = "lora"


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key (or parameter name) is a LoRA adapter's, not a row of the table."""
    return f".{LORA_ADAPTER}." in f".{name}"


@cache
def layer_parameters(kind: LayerKind) -> tuple[Param, ...]:
    return tuple(p for p in PARAMETERS if p.layer == kind)


def parameter(kind: LayerKind, name: str) -> Param:
    for p in layer_parameters(kind):
        if p.name == name:
            return p
    raise KeyError(f"no parameter {name!r} in a {kind} layer; the table is threed.model.spec.PARAMETERS")


def _dim(model: ModelConfig, dim: str, vocab: int) -> int:
    d = model.head_dim
    return {
        "vocab": vocab,
        "hidden": model.hidden_size,
        "q": model.num_heads * d,
        "qkv": (model.num_heads + 2 * model.num_kv_heads) * d,
        "ffn": model.ffn_hidden_size,
        "2ffn": 2 * model.ffn_hidden_size,
    }[dim]


def full_shape(model: ModelConfig, p: Param, tp: Optional[int] = 1) -> tuple[int, ...]:
    """The unsharded tensor's shape: the vocabulary padded for `tp`, or the true (HF) vocabulary with tp=None."""
    vocab = model.vocab_size if tp is None else model.padded_vocab_size(tp)
    return tuple(_dim(model, d, vocab) for d in p.dims)


def split_axis(split: Split) -> Optional[int]:
    """The axis TP splits (None: replicated)."""
    return None if split == "replicated" else 1 if split == "row" else 0


def shard_shape(model: ModelConfig, p: Param, tp: int) -> tuple[int, ...]:
    shape = list(full_shape(model, p, tp))
    axis = split_axis(p.split)
    if axis is not None:
        shape[axis] //= tp
    return tuple(shape)


def shard_shapes(model: ModelConfig, kind: LayerKind, tp: int = 1) -> dict[str, tuple[int, ...]]:
    """Shapes of a pipeline layer's parameters on one of `tp` ranks (tp=1: the full tensors, vocab padded for 1):
    what the random init draws, what a converted or trained checkpoint's layer file holds."""
    return {p.name: shard_shape(model, p, tp) for p in layer_parameters(kind)}


@dataclass(frozen=True)
class Segment:
    """Indices [start, start + length) of the unsharded tensor along the split axis, held by the rank at
    [local, local + length) of its shard along the same axis."""

    start: int
    length: int
    local: int


def tp_segments(split: Split, n: int, tp: int, rank: int) -> tuple[Segment, ...]:
    """Which part of the unsharded tensor (n = its length along `split_axis`, vocab padded) TP rank `rank` holds.
    The one definition of every TP slice: the converter's shard/unshard and streaming slices, and the random
    init, all read it."""
    if split == "replicated":
        return (Segment(0, n, 0),)
    if n % tp:
        raise ValueError(f"tp={tp} does not divide {n} (a {split} split); the layout checks should have caught it")
    if split == "gate_up":  # [gate; up] unsharded, [gate_r; up_r] on rank r
        half = n // 2 // tp
        return (Segment(rank * half, half, 0), Segment(n // 2 + rank * half, half, half))
    size = n // tp
    return (Segment(rank * size, size, 0),)


# ------------------------------------------------------------------------------------------------ counts


def parameter_count(model: ModelConfig, tp: Optional[int] = None) -> int:
    """Parameters of the (unpadded, HF) model, or with tp given, of the model a run at that tp holds (its
    vocabulary padded; each tensor once, however TP splits it): what a checkpoint stores. A tied weight counts
    once."""
    total, seen = 0, set()
    for layer in pipeline_layers(model):
        for p in layer_parameters(layer.kind):
            if p.tie and tied(model):
                if p.tie in seen:
                    continue
                seen.add(p.tie)
            total += math.prod(full_shape(model, p, tp))
    return total


def optimizer_parameters(model: ModelConfig, tp: int, pp: int) -> int:
    """Parameters the optimizers of all stages hold (vocabulary padded for `tp`): each once, except a tied weight at
    pp > 1, of which the first and the last stage each hold a copy with its own master weights and moments."""
    extra = 0
    if tied(model) and pp > 1:
        for owner in tie_owners().values():
            extra += math.prod(full_shape(model, owner, tp))
    return parameter_count(model, tp) + extra


@cache
def _layer_sizes(model: ModelConfig, tp: int, params: tuple[Param, ...]) -> tuple[tuple[Optional[str], bool, int], ...]:
    """(tie group or None, a matrix?, elements on one TP rank) of each of a layer's parameters: the sizes
    `stage_parameters` adds up, worked out once per shape (a planner's search asks for them about a million times).
    Keyed by the rows themselves, so that a changed table is never answered from the cache."""
    out = []
    for p in params:
        shape = shard_shape(model, p, tp)
        out.append((p.tie if tied(model) else None, len(shape) > 1, math.prod(shape)))
    return tuple(out)


def stage_parameters(model: ModelConfig, tp: int, kinds: list[LayerKind]) -> tuple[int, int]:
    """(matrices, norms) elements on one TP rank of a stage holding these layers (one entry per layer, a block
    once per block): `threed.engine.build`'s two optimizer groups (decay / no decay). Vocabulary padded for `tp`.
    A tied weight is held once per stage: the last stage of a tied model holds the embedding's copy in place of
    an LM head weight (the same shape), a single stage holding both holds it once."""
    matrices = norms = 0
    seen: set[str] = set()
    for kind in kinds:
        for tie, matrix, n in _layer_sizes(model, tp, layer_parameters(kind)):
            if tie:
                if tie in seen:
                    continue
                seen.add(tie)
            if matrix:
                matrices += n
            else:
                norms += n
    return matrices, norms


def largest_parameter(model: ModelConfig, tp: int, kinds: list[LayerKind]) -> int:
    """Elements of the largest single parameter one TP rank of such a stage holds (its bf16 .grad is the
    transient the memory model adds)."""
    sizes = [0]
    for kind in set(kinds):
        sizes += [math.prod(shape) for shape in shard_shapes(model, kind, tp).values()]
    return max(sizes)


# ------------------------------------------------------------------------------------------------ FLOPs


def matmul_parameters(model: ModelConfig, kind: LayerKind, tp: int = 1) -> int:
    """Unsharded elements of a layer's matmul weights (2-D parameters, vocab padded for `tp`); the embedding is
    a lookup, not a matmul."""
    if kind == "embedding":
        return 0
    n = 0
    for p in layer_parameters(kind):
        shape = full_shape(model, p, tp)
        if len(shape) == 2:
            n += shape[0] * shape[1]
    return n


def attention_training_flops(model: ModelConfig, seq_length: int, attention: Attention = "full") -> float:
    """Training FLOPs per token of one block's attention scores (QK^T and AV, every head): forward 2 matmuls x 2
    FLOPs x seq x hidden over the full square, x 3 for training; half of it in the causal convention (what a causal
    kernel computes: the step-time model's attention rate is fitted on these, `threed.plan.calibration`)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention convention {attention!r}: one of {', '.join(ATTENTION)}")
    full = 3.0 * 4.0 * seq_length * model.hidden_size
    return full / 2 if attention == "causal" else full


def layer_training_flops(
    model: ModelConfig, kind: LayerKind, seq_length: int, tp: int = 1, attention: Attention = "full"
) -> float:
    """Training FLOPs per token of one pipeline layer, the whole layer (all TP ranks): see the module docstring."""
    flops = 6.0 * matmul_parameters(model, kind, tp)
    if kind == "block":
        flops += attention_training_flops(model, seq_length, attention)
    return flops


def training_flops_per_token(model: ModelConfig, seq_length: int, tp: int = 1, attention: Attention = "full") -> float:
    """The whole model's training FLOPs per token (what MFU divides by), in one attention convention."""
    layers = pipeline_layers(model)
    return sum(layer_training_flops(model, layer.kind, seq_length, tp, attention) for layer in layers)


# ------------------------------------------------------------------------------ DeepSpeed universal checkpoint

# Which DeepSpeed universal-checkpoint rule merges / splits each split kind over TP. `column` and `qkv` shards
# are plain row ranges: DeepSpeed's default (concatenate on dim 0) is right for them, so they are named nowhere.
# A 2-D parameter of any other split that no pattern names would be concatenated on dim 0 silently
# (DeepSpeed #6503): `universal_checkpoint_info` derives every pattern from the table, so none can be missed.
_UNIVERSAL_KEY: dict[Split, Optional[str]] = {
    "replicated": "TP_REPLICATED_PARAMETER_PATTERNS",
    "row": "PARAMETER_WITH_ROW_PARALLELISM_PATTERNS",
    "gate_up": "PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0",
    "vocab": "VOCABULARY_PARAMETER_PATTERNS",
    "column": None,
    "qkv": None,
}


# DeepSpeed's PipelineModule registers a TiedLayerSpec's module as `tied_modules.<key>` (its parameters are named
# `tied_modules.<key>.<name>` on every stage holding a copy), not under a layer index; threed.parallel.pipeline uses the
# table's `tie` value as the key.
TIED_MODULES = "tied_modules"


def tie_owners() -> dict[str, Param]:
    """Tie key -> the row whose module holds the tied weight (the first row with that key: the embedding)."""
    owners: dict[str, Param] = {}
    for p in PARAMETERS:
        if p.tie:
            owners.setdefault(p.tie, p)
    return owners


def deepspeed_prefix(model: ModelConfig, p: Param) -> str:
    """Regex of what precedes `p.name` in DeepSpeed's parameter name: the pipeline layer index (`3.`), or for a
    tied weight its tied module (`tied_modules.embedding.`)."""
    return rf"{TIED_MODULES}\.{p.tie}\." if p.tie and tied(model) else r"\d+\."


def held_parameters(model: ModelConfig) -> tuple[Param, ...]:
    """The rows that are parameters of the model's modules: a tied model's LM head row is not (its weight is the
    embedding's)."""
    owners = tie_owners()
    return tuple(p for p in PARAMETERS if not (p.tie and tied(model) and owners[p.tie] is not p))


def universal_patterns(model: ModelConfig) -> dict[str, list[str]]:
    """DeepSpeed constant name -> regexes (`re.match` on DeepSpeed's names: `3.self_attention.linear_proj.weight`,
    the pipeline layer index then the parameter's name; a tied weight `tied_modules.embedding.word_embeddings.weight`).
    ds_to_universal refuses a pattern that matches nothing, so only the model's own parameters are named. A tied
    weight is also pipeline-replicated: ds_to_universal takes it from the first stage only (the last stage's copy
    is the same tensor with the same optimizer state: DeepSpeed sums the two gradients before the step)."""
    out: dict[str, list[str]] = {}
    for p in held_parameters(model):
        pattern = deepspeed_prefix(model, p) + p.name.replace(".", r"\.") + "$"
        keys = [_UNIVERSAL_KEY[p.split]]
        if p.tie and tied(model):
            keys.append("PIPELINE_REPLICATED_PARAMETER_PATTERNS")
        for key in keys:
            if key is not None and pattern not in out.setdefault(key, []):
                out[key].append(pattern)
    return out


def adapter_universal_patterns(adapters: Iterable[tuple[str, int]]) -> dict[str, list[str]]:
    """The patterns of a LoRA run, whose optimizer holds only the adapters: ds_to_universal sees no base parameter
    (the frozen base has no optimizer state; a resume reads it from the base, threed.engine.lora), and a
    pattern naming one would match nothing. `adapters`: each adapter parameter's name in a block
    (`self_attention.linear_proj.lora.A.o`) and the dim TP splits it on. No adapter is replicated over TP
    (Megatron-Bridge's layout) and every shard is an even range of the unsharded tensor: dim 0, DeepSpeed's default
    (named nowhere), or dim 1 (a row-parallel base's A)."""
    rows = [r"\d+\." + name.replace(".", r"\.") + "$" for name, dim in adapters if dim == 1]
    return {"PARAMETER_WITH_ROW_PARALLELISM_PATTERNS": rows} if rows else {}


def is_adapter_pattern(pattern: str) -> bool:
    """Whether a universal pattern names a LoRA adapter's parameter (`adapter_universal_patterns`)."""
    return rf"\.{LORA_ADAPTER}\." in pattern


def universal_checkpoint_info(model: ModelConfig, patterns: Optional[dict[str, list[str]]] = None) -> dict[str, object]:
    """What `deepspeed.checkpoint.ds_to_universal` needs to know about our parameters (the PipelineModule carries
    it as `universal_checkpoint_info`; DeepSpeed saves it in every mp_rank file). `patterns`: a LoRA run's
    (`adapter_universal_patterns`); by default the whole model's (`universal_patterns`)."""
    # deepspeed: heavy (imported where a model is built anyway); its constants are the keys it reads.
    from deepspeed.checkpoint import constants

    info: dict[str, object] = {
        # 0.2: the version Megatron-DeepSpeed's GPT model declares; our patterns use no newer feature.
        constants.UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.2,
        # Padding rows of the vocabulary are cut to the true size and re-added for the new tp on load.
        "original_vocab_size": model.vocab_size,
    }
    for name, named in (universal_patterns(model) if patterns is None else patterns).items():
        info[getattr(constants, name)] = named
    return info
