"""The Llama layers as pipeline-stage modules: embedding, transformer block, final norm, LM head (or the tied head,
run with the embedding's weight), and the loss.

Tensor parallelism is megatron-core's: the block is its `TransformerLayer` built from local (non-TE) layers, with
our SDPA core attention and our RoPE angles plugged in. Its linears (and the LM head) are megatron's
Column/RowParallelLinear whose weight gradient can be deferred for a zero-bubble schedule (`threed.model.wgrad`).
Between pipeline stages one tensor travels: hidden states `[s, b, h]`. Positions (RoPE) are rebuilt on each stage from
the sequence length; the causal mask is implicit. Packed SFT rows add a second, `doc_ids [b, s]` int32, from which each
stage rebuilds the block-diagonal mask and the per-document positions.

Context parallelism (threed.model.context): hidden states are this CP rank's share `[s/cp, b, h]` (its 2 of 2·cp
chunks; `[s/(cp·tp), b, h]` under sequence parallelism), while `doc_ids` stay the whole row's: positions and segments
are counted on the whole row (a document may start on another rank), then the positions are cut with the same index.
The loss of a micro-batch is this rank's token-loss sum over the whole row's token count (`causal_lm_loss`).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterable, Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.utils import VocabUtility
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

from threed.config import ModelConfig
from threed.model.attention import SDPACoreAttention, document_segments, reuse_per_tensor
from threed.model.rope import RotaryAngles, document_positions
from threed.model.context import rope_positions, split
from threed.model.wgrad import SplitColumnParallelLinear, SplitRowParallelLinear


def megatron_config(
    model: ModelConfig,
    tp: int,
    initialize: bool = True,
    fused_swiglu: bool = False,
    sequence_parallel: bool = False,
    selective_recompute: bool = False,
) -> TransformerConfig:
    """megatron-core's TransformerConfig for one Llama block.

    pipeline_model_parallel_size stays 1: DeepSpeed owns the pipeline, so megatron must not offset layer numbers
    or assert its own layer split. Parameters are created in fp32 on CPU from one master weight
    (`use_cpu_initialization`); DeepSpeed then casts and moves them. `initialize=False` skips megatron's random
    init (the pipeline always skips it and fills weights with `threed.model.init`, which does not depend on the
    layout). `sequence_parallel`: megatron's own (all-gather before the column-parallel linears, reduce-scatter after
    the row-parallel ones; the norms and the residual stream hold [s/tp, b, h]). `selective_recompute`:
    megatron's own (`--recompute-granularity selective`): its Attention runs the core attention (our SDPA) under
    `tensor_parallel.checkpoint` in training, keeping q, k, v and recomputing the rest in backward (CPU:
    `threed.parallel.megatron_device`).
    """
    with warnings.catch_warnings():
        # megatron warns, for "core_attn", that Transformer Engine's fused attention needs no recompute; the core
        # attention here is ours (SDPA), not TE's.
        warnings.filterwarnings("ignore", message="If you are using transformer_engine")
        return TransformerConfig(
            num_layers=model.num_layers,
            hidden_size=model.hidden_size,
            num_attention_heads=model.num_heads,
            num_query_groups=model.num_kv_heads,
            ffn_hidden_size=model.ffn_hidden_size,
            kv_channels=model.head_dim,
            normalization="RMSNorm",
            layernorm_epsilon=model.rms_norm_eps,
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            bias_activation_fusion=fused_swiglu,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            bias_dropout_fusion=False,
            persist_layer_norm=False,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=1,
            params_dtype=torch.float32,
            use_cpu_initialization=True,
            perform_initialization=initialize,
            gradient_accumulation_fusion=False,
            sequence_parallel=sequence_parallel and tp > 1,
            init_method_std=model.init_std,
            recompute_granularity="selective" if selective_recompute else None,
            recompute_modules=["core_attn"],
        )


class LlamaRMSNorm:
    """The norm of megatron's local spec (a ModuleSpec `module`, built as `LlamaRMSNorm(config, hidden_size, eps)`):
    torch's RMSNorm, as megatron's WrappedTorchNorm builds it, which however refuses sequence parallelism (its
    weight would not say that its gradient is partial). Under sequence parallelism each TP rank normalises its own
    part of the sequence, so the weight is tagged `sequence_parallel` (what megatron's TE and apex norms do); its
    gradient is summed over the TP group before the step (`threed.parallel.partition.StagedPipelineModule`)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused) -> torch.nn.Module:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        if config.sequence_parallel:
            norm.weight.sequence_parallel = True  # type: ignore[attr-defined]
        return norm


LLAMA_BLOCK_SUBMODULES = TransformerLayerSubmodules(
    input_layernorm=LlamaRMSNorm,
    self_attention=ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=SplitColumnParallelLinear,
            core_attention=SDPACoreAttention,
            linear_proj=SplitRowParallelLinear,
            q_layernorm=IdentityOp,
            k_layernorm=IdentityOp,
        ),
    ),
    self_attn_bda=get_bias_dropout_add,
    pre_mlp_layernorm=LlamaRMSNorm,
    mlp=ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=SplitColumnParallelLinear, linear_fc2=SplitRowParallelLinear)
    ),
    mlp_bda=get_bias_dropout_add,
)


def mark_tensor_parallel(module: torch.nn.Module) -> None:
    """Tag megatron's TP weights with `tensor_model_parallel` even when their random init was skipped.

    megatron-core 0.16.1 sets the tag only inside its init functions, so with `perform_initialization=False`
    (loading a checkpoint) the tag is missing and DeepSpeed's gradient norm counts TP shards of rank 0 only:
    wrong clipping after every resume. Found by tests/ranks/test_training.py::test_resume_is_bit_exact.
    """
    for sub in module.modules():
        dim = next(
            (
                d
                for cls, d in ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))
                if isinstance(sub, cls)
            ),
            None,
        )
        weight = getattr(sub, "weight", None)
        if dim is not None and weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=dim, stride=1)


class EmbeddingPipe(torch.nn.Module):
    """First stage: token ids `[b, s]` -> hidden `[s, b, h]` (megatron's sequence-first layout); under sequence
    parallelism this TP rank's `[s/tp, b, h]`: megatron's embedding reduce-scatters the partial lookups along the
    sequence instead of all-reducing them (as its LanguageModelEmbedding does)."""

    def __init__(self, model: ModelConfig, mcore: TransformerConfig):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(
            model.padded_vocab_size(mcore.tensor_model_parallel_size),
            model.hidden_size,
            init_method=mcore.init_method,
            config=mcore,
            reduce_scatter_embeddings=mcore.sequence_parallel,
        )
        mark_tensor_parallel(self)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.word_embeddings(tokens)
        if self.word_embeddings.reduce_scatter_embeddings:
            return out  # megatron transposed it before the reduce-scatter: [s/tp, b, h]
        return out.transpose(0, 1).contiguous()

    def forward(self, tokens):
        """Packed SFT rows come as `(tokens, doc_ids [b, s] int32)`: the ids travel on with the hidden states
        (float first, see `LlamaBlock.forward`), 4 bytes per token, the same shape every micro-batch (the whole
        sequence's ids on every TP rank: attention sees the whole sequence)."""
        if isinstance(tokens, (tuple, list)):
            tokens, doc_ids = tokens
            return self._embed(tokens), doc_ids
        return self._embed(tokens)


class LlamaBlock(TransformerLayer):
    """megatron-core's TransformerLayer taking and returning one tensor, with RoPE angles built per stage."""

    def __init__(self, model: ModelConfig, mcore: TransformerConfig, layer_number: int):
        super().__init__(config=mcore, submodules=LLAMA_BLOCK_SUBMODULES, layer_number=layer_number)
        mark_tensor_parallel(self)
        self.rotary = RotaryAngles(model)
        # Under sequence parallelism a block's input is [s/tp, b, h]; attention (after the QKV all-gather) sees s.
        self.sequence_shards = mcore.tensor_model_parallel_size if mcore.sequence_parallel else 1
        # Context parallelism: (cp, this rank's place in the CP group) from the group megatron gave the attention.
        group = self.self_attention.core_attention.cp_group
        self.context = (1, 0) if group is None else (group.size(), group.rank())

    def forward(self, hidden):  # type: ignore[override]
        """`hidden [s, b, h]` -> `[s, b, h]` (`[s/tp, b, h]` under sequence parallelism, `[s/cp, b, h]` under
        context parallelism); or, packed sequences, `(hidden, doc_ids [b, s] int)` -> the same tuple: attention
        stays inside each document and RoPE positions restart at each (float first: see the stack notes on
        DeepSpeed's pipeline buffers)."""
        if not isinstance(hidden, torch.Tensor):
            return self._forward_packed(*hidden)
        cp, rank = self.context
        # The whole row's angles cut like the hidden states: the very numbers a cp 1 run uses at those positions.
        angles = split(self.rotary(hidden.shape[0] * self.sequence_shards * cp, hidden.device), cp, rank, dim=0)
        out, _ = super().forward(hidden, attention_mask=None, rotary_pos_emb=angles)
        return out

    def _forward_packed(self, hidden: torch.Tensor, doc_ids: torch.Tensor):
        segments, angles = _packed_geometry(doc_ids, self.rotary, hidden.device, self.context)
        out, _ = super().forward(hidden, attention_mask=segments, rotary_pos_emb=angles)
        return out, doc_ids


def _packed_geometry(doc_ids: torch.Tensor, rotary: RotaryAngles, device: torch.device, context=(1, 0)):
    """Segments (of the whole row) and RoPE angles (of this CP rank's tokens) of a micro-batch, built once per stage
    (not per block); the same segments object then lets the core attention reuse its mask / varlen lengths too."""
    cp, rank = context

    def build(ids: torch.Tensor):
        segments = document_segments(ids.to(device))
        positions = document_positions(segments) if cp == 1 else rope_positions(ids.shape[1], cp, rank, segments)
        return segments, rotary.at_positions(positions)

    return reuse_per_tensor(doc_ids, ("rope", rotary.key, str(device), cp, rank), build)


class FinalNormPipe(torch.nn.Module):
    def __init__(self, model: ModelConfig, mcore: TransformerConfig):
        super().__init__()
        self.norm = LlamaRMSNorm(config=mcore, hidden_size=model.hidden_size, eps=model.rms_norm_eps)

    def forward(self, hidden) -> torch.Tensor:
        if isinstance(hidden, (tuple, list)):  # packed rows: the document ids end here
            hidden = hidden[0]
        return self.norm(hidden)


class PaddedLogits:
    """Sets the logits of vocabulary padding rows to -inf, so they take no probability mass: the loss and
    gradients equal the unpadded model's, whatever values the padding rows hold."""

    def __init__(self, model: ModelConfig, tp: int):
        per_rank = model.padded_vocab_size(tp) // tp
        start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
            per_rank, parallel_state.get_tensor_model_parallel_rank(), tp
        )
        self.first_padded_column = max(0, min(per_rank, model.vocab_size - start))
        self.columns = per_rank

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.first_padded_column < self.columns:
            pad = torch.zeros(self.columns, dtype=torch.bool, device=logits.device)
            pad[self.first_padded_column :] = True
            logits = logits.masked_fill(pad, float("-inf"))
        return logits


def vocab_parallel_linear(
    model: ModelConfig, mcore: TransformerConfig, own_weight: bool = True
) -> SplitColumnParallelLinear:
    """The LM head's linear, hidden -> this TP rank's columns of the padded vocab, un-gathered (the loss is
    vocab-parallel). `own_weight=False`: no weight is allocated, the tied head passes the embedding's at each call."""
    return SplitColumnParallelLinear(
        model.hidden_size,
        model.padded_vocab_size(mcore.tensor_model_parallel_size),
        config=mcore,
        init_method=mcore.init_method,
        bias=False,
        gather_output=False,
        skip_weight_param_allocation=not own_weight,
    )


class DeferredLogits(NamedTuple):
    """The last stage's output under `--lm-head-chunks N` (N > 1) in place of its logits: what makes them, so that
    the loss runs the head and the cross-entropy one chunk of tokens at a time (`chunked_token_losses`) and the logits
    `[s, b, V/tp]` are never whole, in forward or in backward.

    The two tensors the loss differentiates, then the rest. DeepSpeed's engine hooks its backward prologue (ZeRO's
    bookkeeping, its timers) on the tensors of the stage's output, and that must run before any parameter's gradient
    hook, as it does on the logits. So the weight travels as a view of the parameter: all N chunks' weight gradients
    meet in the view's own autograd node, whose hook runs before the parameter's AccumulateGrad."""

    hidden: torch.Tensor  # the final norm's output [s, b, h] (this TP rank's [s/tp, b, h] under sequence parallelism)
    weight: torch.Tensor  # a view of the head's weight [V/tp, h] (the embedding's, tied)
    head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (hidden rows, weight) -> their masked logits
    chunks: int
    shards: int  # TP ranks whose sequence parts the head all-gathers (sequence parallelism), else 1


def defer_logits(head, linear: SplitColumnParallelLinear, weight, hidden: torch.Tensor, chunks: int) -> DeferredLogits:
    """`head`'s logits of `hidden`, left for the loss to make in `chunks` (the head's `linear` says whether it gathers
    the sequence over TP)."""
    shards = parallel_state.get_tensor_model_parallel_world_size() if linear.sequence_parallel else 1
    return DeferredLogits(hidden, weight.view_as(weight), head, chunks, shards)


class LMHeadPipe(torch.nn.Module):
    """Column-parallel LM head: `[s, b, h]` -> vocab-parallel logits `[s, b, padded_vocab / tp]`, padding masked; or,
    with `chunks` > 1 (`--lm-head-chunks`), `DeferredLogits` for the loss to make chunk by chunk."""

    def __init__(self, model: ModelConfig, mcore: TransformerConfig, chunks: int = 1):
        super().__init__()
        self.lm_head = vocab_parallel_linear(model, mcore)
        mark_tensor_parallel(self)
        self.mask_padding = PaddedLogits(model, mcore.tensor_model_parallel_size)
        self.loss_chunks = chunks  # 1 under `whole_sequences`: generation and scoring need the logits themselves

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | DeferredLogits:
        if self.loss_chunks > 1:
            return defer_logits(self.logits, self.lm_head, self.lm_head.weight, hidden, self.loss_chunks)
        logits, _ = self.lm_head(hidden)
        return self.mask_padding(logits)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The masked logits of `hidden` with `weight` (the parameter's view a `DeferredLogits` carries)."""
        logits, _ = self.lm_head(hidden, weight=weight)
        return self.mask_padding(logits)


class TiedLMHead:
    """The LM head of a tied model (Llama 3.2): DeepSpeed's TiedLayerSpec `forward_fn`, called as
    `head(embedding_module, hidden)` with the stage's copy of the embedding. It is megatron's own tied head
    (GPTModel with share_embeddings_and_output_weights): a ColumnParallelLinear that allocates no weight and is
    run with the embedding's. Not a Module, so it adds nothing to any state dict (the tied head has no layer file);
    it holds no tensor, so it needs no device move. `chunks` > 1: `DeferredLogits`, as `LMHeadPipe`."""

    def __init__(self, model: ModelConfig, mcore: TransformerConfig, chunks: int = 1):
        self.linear = vocab_parallel_linear(model, mcore, own_weight=False)
        self.mask_padding = PaddedLogits(model, mcore.tensor_model_parallel_size)
        self.loss_chunks = chunks  # as LMHeadPipe's

    def __call__(self, embedding: "EmbeddingPipe", hidden: torch.Tensor) -> torch.Tensor | DeferredLogits:
        weight = embedding.word_embeddings.weight
        if self.loss_chunks > 1:
            return defer_logits(self.logits, self.linear, weight, hidden, self.loss_chunks)
        return self.logits(hidden, weight)

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        logits, _ = self.linear(hidden, weight=weight)
        return self.mask_padding(logits)


# megatron-core 0.16.1's module attributes that split the sequence over TP, each read at every forward:
# Column/RowParallelLinear's `sequence_parallel` (all-gather the input / reduce-scatter the output, instead of an
# identity / all-reduce; threed.model.wgrad's split backward reads it too), VocabParallelEmbedding's
# `reduce_scatter_embeddings` (reduce-scatter the lookups instead of all-reducing them), and `scatter_to_sequence_
# parallel` (its embedding modules; none here). The list megatron's own `set_model_to_sequence_parallel` switches.
SEQUENCE_SPLIT_ATTRIBUTES = ("sequence_parallel", "scatter_to_sequence_parallel", "reduce_scatter_embeddings")


@contextlib.contextmanager
def whole_sequences(layers: Iterable[Any]) -> Iterator[None]:
    """For the duration, every module of `layers` (a stage's callables: modules, or a tied head with the embedding
    it runs with) runs whole sequences on every rank, as if built without sequence parallelism and without context
    parallelism; on exit, however it is left, every attribute it changed holds its own value again.

    Generation and scoring (threed.generate.decode) feed `[s, b, h]` with s the prompt, or one new token: it cannot
    be cut over tp or into 2·cp chunks. Without sequence parallelism the linears all-reduce where they would
    reduce-scatter and all-gather (the same sums), and each CP rank holds the full weights, so it can run whole rows
    alone. Switched, as megatron does for inference: the `SEQUENCE_SPLIT_ATTRIBUTES` of every module, its
    TransformerConfig's `sequence_parallel`; and threed's own: `LlamaBlock.sequence_shards` and `.context` (the RoPE
    angles' length and CP cut), `SDPACoreAttention.cp_group` (None: no K/V all-gather over the CP group).
    Left alone: the norms' `weight.sequence_parallel` tag, read only when gradients are reduced after a backward
    (`threed.parallel.staged`); what runs inside this has no backward (torch.no_grad). The LM head returns its logits
    (`loss_chunks` 1): `--lm-head-chunks` defers them to the training loss, and these callers read the logits."""
    layers = list(layers)  # walked twice (modules, then heads); a caller may pass a generator
    saved: list[tuple[Any, str, Any]] = []
    seen: set[tuple[int, str]] = set()

    def put(obj: Any, name: str, value: Any) -> None:
        if (id(obj), name) in seen or getattr(obj, name) == value:
            return
        seen.add((id(obj), name))
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        for module in _stage_modules(layers):
            for name in SEQUENCE_SPLIT_ATTRIBUTES:
                if getattr(module, name, None) is True:
                    put(module, name, False)
            config = getattr(module, "config", None)
            if isinstance(config, TransformerConfig):
                put(config, "sequence_parallel", False)
            if isinstance(module, LlamaBlock):
                put(module, "sequence_shards", 1)
                put(module, "context", (1, 0))
            if isinstance(module, SDPACoreAttention):
                put(module, "cp_group", None)
        for layer in layers:
            head = layer.func if isinstance(layer, functools.partial) else layer
            if isinstance(head, (LMHeadPipe, TiedLMHead)):
                put(head, "loss_chunks", 1)
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _stage_modules(layers: Iterable[Any]) -> Iterator[torch.nn.Module]:
    """Every module `layers` run: modules and their submodules, a DeepSpeed tied layer's `partial(head, embedding)`
    both, and a TiedLMHead's linear (the head is no Module, so no module tree holds that linear)."""
    for layer in layers:
        if isinstance(layer, torch.nn.Module):
            yield from layer.modules()
        elif isinstance(layer, functools.partial):
            yield from _stage_modules([layer.func, *layer.args])
        elif isinstance(layer, TiedLMHead):
            yield from layer.linear.modules()


def token_losses(logits: torch.Tensor | DeferredLogits, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy `[b, s]` in fp32 from vocab-parallel logits `[s, b, v/tp]` and labels `[b, s]`,
    without gathering the vocabulary; from `DeferredLogits` (`--lm-head-chunks`) chunk by chunk, the same values
    (`chunked_token_losses`)."""
    if isinstance(logits, DeferredLogits):
        return chunked_token_losses(logits, labels)
    return sequence_losses(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1)


def sequence_losses(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy `[s, b]` in fp32 of vocab-parallel logits `[s, b, v/tp]` and targets `[s, b]` (sequence first).

    bf16 logits go to megatron-core's fused cross-entropy as they are. It upcasts them inside its first kernel (on
    CUDA megatron's `jit_fuser` compiles cast and max into one pass, where the unfused path writes an fp32 copy and
    reads it back), sums the TP partial sums in one all-reduce instead of two, and returns the logits' gradient in
    bf16, as the cast's backward did. Its one fp32 tensor, the softmax kept for backward, is the unfused path's
    too: fewer passes over the logits, not less memory. Off CUDA its steps run eagerly, the unfused path's
    operations in the same order, so on CPU both give the same bits (tests/unit/test_loss_bytes.py). Other dtypes
    keep the unfused path: the fused backward casts the gradient to bf16, which an fp32 run must not (for fp32
    logits `.float()` is the tensor itself, no copy)."""
    if logits.dtype == torch.bfloat16:
        group = parallel_state.get_tensor_model_parallel_group()
        return fused_vocab_parallel_cross_entropy(logits, target, group)
    return vocab_parallel_cross_entropy(logits.float(), target)


def chunked_token_losses(deferred: DeferredLogits, labels: torch.Tensor) -> torch.Tensor:
    """`token_losses` of the logits `deferred` would make, made `deferred.chunks` chunks of tokens at a time.

    Each chunk (its head matmul, padding mask and cross-entropy) runs under torch's non-reentrant checkpoint: forward
    keeps only its inputs, views of the hidden states and the weight, and backward recomputes the chunk's logits and
    softmax when it reaches it. Autograd runs the newest nodes first, so backward takes the chunks one at a time, last
    to first: one chunk's logits, softmax and logits gradient exist at once, 1/N of the whole. A token's loss is the
    same arithmetic on the same logits row, so the returned `[b, s]` and every reduction of it are unchanged; the
    weight's gradient is the sum of N partial products, in another order than one matmul's (tests/unit/
    test_lm_head_chunks.py measures it). Under sequence parallelism the head all-gathers each chunk of the TP ranks'
    parts, so chunk j's rows are rank 0's chunk j, then rank 1's, ...: targets are taken, and losses put back, so."""
    hidden, weight, head, chunks, shards = deferred
    rows = hidden.shape[0] // chunks
    if rows * chunks != hidden.shape[0]:  # the config check refuses it first (threed.config.check_lm_head_chunks)
        raise ValueError(f"--lm-head-chunks {chunks} does not divide the head's {hidden.shape[0]} tokens per row")
    target = labels.transpose(0, 1).contiguous().view(shards, chunks, rows, labels.shape[0])
    losses = [
        checkpoint(
            _chunk_losses,
            head,
            hidden[j * rows : (j + 1) * rows],
            weight,
            target[:, j].reshape(shards * rows, -1).contiguous(),  # megatron views it flat
            use_reentrant=False,
            preserve_rng_state=False,  # nothing random runs in the head or the loss
        ).view(shards, rows, -1)
        for j in range(chunks)
    ]
    return torch.stack(losses, dim=1).view(shards * chunks * rows, -1).transpose(0, 1)


def _chunk_losses(head, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return sequence_losses(head(hidden, weight), target)


def token_weighted_loss(logits: torch.Tensor, targets) -> torch.Tensor:
    """The pipeline's loss_fn for SFT data: training targets `(labels, weights)` give sum(token loss x weight), the
    weights set by the data side so that every response token of the global batch weighs the same
    (`threed.data.loader.token_weighted`); evaluation targets as in `causal_lm_loss`."""
    if isinstance(targets, (tuple, list)) and len(targets) == 2:
        labels, weights = targets
        return (token_losses(logits, labels) * weights.float()).sum()
    return causal_lm_loss(logits, targets)


def context_token_count(mask: torch.Tensor) -> torch.Tensor:
    """The loss tokens of this micro-batch's whole rows, divided by cp (at least 1/cp): the divisor that makes each CP
    rank's sum of token losses, averaged over the CP ranks (DeepSpeed averages over its data axis, which holds them),
    the micro-batch's exact masked mean. Per-rank means averaged would weigh a token of a rank holding few loss tokens
    (SFT masks differ chunk by chunk) more. One scalar all-reduce over the CP group; no gradient flows through it."""
    count = mask.sum().detach().clamp(min=1.0)
    group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None or group.size() == 1:
        return count
    count = mask.sum(dtype=torch.float64).detach()
    torch.distributed.all_reduce(count, group=group)
    return (count.clamp(min=1.0) / group.size()).to(mask.dtype)


def causal_lm_loss(logits: torch.Tensor, targets) -> torch.Tensor:
    """The pipeline's loss_fn. `targets` is what the data loader put second in each micro-batch:

    - labels `[b, s]`: the mean token loss;
    - (labels, loss_mask): the masked mean, sum(loss * mask) / sum(mask) (Megatron's loss);
    - (labels, loss_mask, dataset_onehot `[b, D]`), for evaluation: not a mean but the sums that reduce exactly
      over micro-batches and data-parallel ranks, `[sum(loss*mask), sum(mask), per-dataset sums (D),
      per-dataset token counts (D)]` (threed.train.evaluate).
    """
    if isinstance(targets, torch.Tensor):
        return token_losses(logits, targets).mean()  # under CP every rank holds as many tokens: DeepSpeed's mean
    labels, mask = targets[0], targets[1].float()
    losses = token_losses(logits, labels) * mask
    if len(targets) == 2:
        return losses.sum() / context_token_count(mask)
    onehot = targets[2].float()
    per_sample_loss, per_sample_count = losses.sum(dim=1), mask.sum(dim=1)
    return torch.cat(
        [losses.sum().reshape(1), mask.sum().reshape(1), per_sample_loss @ onehot, per_sample_count @ onehot]
    )
