"""Memory per GPU of a bf16 layout, term by term, as DeepSpeed 0.19.8 + megatron-core 0.16.1 + torch 2.13 allocate it.

    threed memory --model llama3.1-70b --tp 8 --pp 4 --dp 1 --micro-batch-size 1 --grad-accum-steps 512 \
        --seq-length 8192 --activation-checkpointing
    python -m threed.memory --model llama3.1-70b --tp 8 --pp 4 --dp 1 --micro-batch-size 1 --grad-accum-steps 512 \
        --seq-length 8192 --sequence-parallel --recompute-granularity full --recompute-method block \
        --recompute-num-layers 4

Per rank of pipeline stage s. tests/ranks/test_memory.py checks the static terms against the tensors of real CPU
engines (within 2%; they agree to the byte), tests/ranks/test_memory_tied.py the same for a tied model, and the
activation estimate is reported against a measured CPU peak; tests/ranks/test_memory_cp.py measures one stage's peak at
cp 2 against cp 1 (`activation_ratio`).

  stages       `threed.parallel.partition` (the run's --partition-method) over `threed.model.spec.pipeline_layers`:
               stage 0 adds the embedding, the last stage the final norm and LM head, both [padded V / tp, h].
               Matrices are split over TP; norms are replicated. Tied (Llama 3.2): the same bytes, as
               `stage_parameters` counts them: the last stage's head weight is its own copy of the embedding
               (DeepSpeed's TiedLayerSpec; every term below applies to it, and the tied all-reduce of its fp32
               gradient with stage 0's is in place), and one stage holding both (pp 1) holds it once.
  weights      2 B/param bf16 in BF16_Optimizer's flat buffer per param group (matrices / norms), each padded
               to a multiple of 2 x dp elements.
  grads        4 B/param: BF16_Optimizer's fp32 accumulation buffer, full size on every DP rank (ZeRO-1 shards
               only the optimizer). `immediate_grad_update` frees each bf16 .grad as soon as it is added in,
               so bf16 grads cost one parameter's worth at a time (counted with the activations).
  optimizer    12 B/param / dp: the fp32 master partition and AdamW's exp_avg and exp_avg_sq (ZeRO-1).
  buffers      the RoPE angle cache (fp32 [s, d] per block); the pipeline's one p2p buffer (receive and gradient
               buffers are both `_grad_layer_buf`), [s, b, h] / tp as DeepSpeed partitions what crosses stages
               over TP (pipe_partitioned, grad_partitioned). The last stage keeps no logits between micro-batches
               (`threed.parallel.lean_engine` drops them once the loss is computed; DeepSpeed's own engine kept
               the last two micro-batches' [s, b, V/tp], with their received inputs and gradients).
               Sequence parallelism: nothing crosses stages partitioned (DeepSpeed's pipe_partitioned is off, each
               rank's [s/tp, b, h] is its own part), so the p2p buffer is [s/tp, b, h] without a meta tensor and
               the last stage's input and gradient 2 x 2h / tp; and megatron's global memory buffer, into which
               each column-parallel linear all-gathers its input ([s, b, h] bf16, forward and again in backward
               for the weight gradient), allocated at first use and kept: 2 s b h on every stage with a linear.
  activations  bytes per token kept by one block, no sequence parallelism (h-sized tensors replicated over TP):
                 norms      2 x (2h input + 4 rstd + 2h output, kept by the next linear): torch's fused RMSNorm
                            on CUDA; the CPU composite keeps 4h fp32 input + 4 + 4h fp32 normalised + 2h output
                 attention  (2(h + 2 kv d) QKV output, alive as v's storage, + 2h q and 2 kv d k after RoPE
                            + 2h SDPA output + 4 heads logsumexp) / tp
                 MLP        megatron's unfused SwiGLU (CPU) keeps 5f/tp elements: fc1 output (2f), silu(gate),
                            up + glu_linear_offset, their product; the fused kernel (CUDA, `cuda_only`) 3f/tp
               plus RoPE cos/sin, 8 s d bytes per block. Per micro-batch a stage also keeps its received input
               (at tp 1 beside the forward's clone: 2h) and its output's TP partition (2h / tp); the last stage
               the final norm and the fp32 softmax of vocab_parallel_cross_entropy (4V/tp; --lm-head-chunks N: none,
               the loss's backward holds one chunk's softmax and logits gradient, 6V/tp per token / N, and the sum of
               the chunks' bf16 head weight gradients). With activation checkpointing a block keeps its input (2h)
               and backward recomputes one block at a time.
               Sequence parallelism (Korthikanti et al.): the norms and the residual stream hold [s/tp, b, h], so
               the h-sized terms (norms, received input, kept output, checkpointed input) are divided by tp too:
               every term of a block is then / tp (their 34 sbh / t; SDPA keeps no s x s scores, so there is no
               5as/(ht) term to remove). Partial recompute (`threed.memory.recompute`, Megatron's flags): of a
               stage's blocks the recomputed ones keep only each chunk's input and backward re-creates one chunk
               at a time; the others keep everything; selective recompute drops only the attention logsumexp.
               Held micro-batches (`threed.parallel.schedule.held`): 1F1B min(pp - s, gas) in flight; ZB-H1 the same,
               and each through B keeps its linears' W tensors till its W (`threed.memory.deferred`). Backward
               adds the MLP gradients (2 (3f/tp + h) per token) and one parameter's bf16 grad; the loss
               backward the logits' bf16 gradient (2V/tp).
  temporaries  after the last backward, never with the activations: DeepSpeed's DP all-reduce flattens the fp32
               grad groups into one copy when they share a 5e8-element bucket; torch's AdamW: none when fused
               (CUDA), two fp32 partitions in the CPU single-tensor path (`exp_avg_sq.sqrt() / c`).

Interleaved 1F1B (--vpp v > 1, `threed.parallel.schedule.interleaved_order`): a rank holds v chunks (`Stage.chunks`,
virtual stage c x pp + r), each keeping per micro-batch its own blocks' activations and its own edges (received
input, kept output: v of each per micro-batch), and one p2p buffer per chunk. Held micro-batches are counted per
chunk (`threed.parallel.schedule.held_per_chunk`) and weighed by what one keeps in that chunk; the peak is the
largest over the B of every chunk. Rank 0 warms up 2 (p - 1) + (v - 1) p + 1 chunk micro-batches: p (1 + (p - 1) /
(p v)) stages' worth, Korthikanti et al.'s factor (tests/unit/test_planner_vpp.py checks the two agree within 1.5%).

Context parallelism (cp > 1, `threed.model.context`): a rank holds s / cp tokens of every row, so every per-token
term above counts s b / cp tokens (the p2p buffer, the logits, RoPE's angles and cos/sin, megatron's SP buffer too).
The attention keeps q, each query chunk's SDPA output and their concatenation; the K/V all-gather keeps nothing of
its input, so the QKV output and the local k are freed. Per block the gathered K/V (`context_parallel_bytes`), and
in backward the gathered row's gradient before its reduce-scatter. ZeRO-1's shard and AdamW's temporaries divide by
dp x cp (CP ranks reduce gradients with the DP ranks); weights and fp32 grads stay whole.

Host memory (per node, not per GPU): --async-save keeps a copy of what each rank writes of a checkpoint, pinned on
CUDA (`host_copy_bytes`, `host_copy_line`: threed.checkpoint.format.node_checkpoint_bytes, the figure the run's
refusal of a node that cannot hold it uses).

LoRA (--lora-rank, `threed.memory.lora`): the base is frozen before the optimizer is made, so its weights are bf16
tensors of their own (2 B/param, unpadded) with no gradient, master or AdamW state; the adapters (r (out + in) per
target per block, 1/tp per rank) are BF16_Optimizer's one group and take every term above (weights, fp32 grads,
ZeRO-1's 12 B/param / dp, the temporaries); buffers add their int64 row indices. A block keeps its adapters' inputs
besides (`threed.memory.lora`), and the one-parameter bf16 .grad is the largest adapter's. tests/ranks/test_memory.py
checks the static terms against a LoRA engine's tensors.

Not included: CUDA context, NCCL/gloo buffers, allocator fragmentation (budget several GB). fp32 runs use
DeepSpeed's ZeRO optimizer instead of BF16_Optimizer and are not modelled.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import Literal, Sequence

from threed.checkpoint.format import node_checkpoint_bytes
from threed.config import LoraConfig, ModelConfig, ParallelConfig
from threed.convert.resolve import model_config
from threed.model.spec import LayerKind, largest_parameter, stage_parameters
from threed.memory.deferred import awaiting_w_bytes, deferred_bytes_per_token
from threed.memory import lora as lora_terms
from threed.memory.recompute import Recompute
from threed.parallel.device_policy import CudaOnly, cuda_only
from threed.parallel.partition import resolve_partition
from threed.parallel.schedule import distinct_before_backward
from threed.units import human_bytes

GB = 1e9
BF16 = 2
ALLREDUCE_BUCKET = 500_000_000  # deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE (elements per bucket)
Device = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class Stage:
    index: int
    blocks: int
    first: bool  # holds the embedding
    last: bool  # holds the final norm and the LM head
    # --vpp > 1: the pipeline rank's chunks (virtual stages, `index` their virtual stage), in chunk order; the rank's
    # totals above are their sums. Empty at vpp 1: the stage is its one chunk.
    chunks: tuple["Stage", ...] = ()

    @property
    def parts(self) -> tuple["Stage", ...]:
        """The chunks one micro-batch's activations are kept in: the stage itself at vpp 1."""
        return self.chunks or (self,)


@functools.lru_cache(maxsize=1024)
def stage_bounds(model: ModelConfig, pp: int, tp: int, seq: int, method: str | None = None) -> tuple[int, ...]:
    """Where each stage starts in `pipeline_layers(model)`, as the run splits it (`threed.parallel.partition`)."""
    # DeepSpeed, imported on the way, logs to stdout; ours is parsed (recipes/launch.sh captures the estimate).
    with contextlib.redirect_stdout(sys.stderr):
        return tuple(resolve_partition(method or ParallelConfig().partition_method, model, pp, seq, tp))


def stages(model: ModelConfig, pp: int, tp: int, seq: int, method: str | None = None, vpp: int = 1) -> list[Stage]:
    """One `Stage` per pipeline rank; at vpp > 1 with its chunks, virtual stage c x pp + r being chunk c of rank r
    (`threed.parallel.dims`: the partition method splits the layers into pp x vpp virtual stages)."""
    bounds = stage_bounds(model, pp * vpp, tp, seq, method)
    last_index = model.num_layers + 2  # pipeline_layers: 0 embedding, 1..L blocks, L+1 final norm, L+2 LM head
    virtual = []
    for s in range(pp * vpp):
        lo, hi = bounds[s], bounds[s + 1]
        blocks = max(0, min(hi, model.num_layers + 1) - max(lo, 1))
        virtual.append(Stage(index=s, blocks=blocks, first=lo == 0 < hi, last=lo <= last_index < hi))
    if vpp == 1:
        return virtual
    out = []
    for r in range(pp):
        mine = tuple(virtual[r::pp])
        first, last = any(c.first for c in mine), any(c.last for c in mine)
        out.append(Stage(index=r, blocks=sum(c.blocks for c in mine), first=first, last=last, chunks=mine))
    return out


def stage_kinds(stage: Stage) -> list[LayerKind]:
    """The layer kinds a stage holds, one entry per layer."""
    return ["embedding"] * stage.first + ["block"] * stage.blocks + ["final_norm", "lm_head"] * stage.last


def stage_params(model: ModelConfig, tp: int, stage: Stage) -> tuple[int, int]:
    """(matrices, norms) parameters on one rank of `stage`: `threed.engine.build.make_optimizer`'s two groups."""
    return stage_parameters(model, tp, stage_kinds(stage))


@dataclass(frozen=True)
class Memory:
    """Bytes on one rank of one stage; `peak` is what the run needs (plus CUDA/NCCL overhead)."""

    stage: Stage
    params: int
    weights: float
    grads: float
    optimizer: float
    buffers: float
    activations: float  # the peak of the forward/backward phase, its transients included
    reduce_temp: float  # DP all-reduce flatten copy
    step_temp: float  # AdamW temporaries
    adapters: int = 0  # --lora-rank: the adapters' elements, the only trainable ones (`params` is then the frozen base)

    @property
    def trainable(self) -> int:
        """Elements with a gradient and optimizer state: the adapters under LoRA, else every parameter."""
        return self.adapters or self.params

    @property
    def model_states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def static(self) -> float:
        return self.model_states + self.buffers

    @property
    def phase(self) -> tuple[str, float]:
        """The largest of the phases that never overlap: forward/backward, gradient all-reduce, optimizer step."""
        return max(
            (
                ("activations", self.activations),
                ("all-reduce copy", self.reduce_temp),
                ("AdamW temporaries", self.step_temp),
            ),
            key=lambda kv: kv[1],
        )

    @property
    def peak(self) -> float:
        return self.static + self.phase[1]

    def line(self, pp: int) -> str:
        unit, scale = ("GB", GB) if self.peak >= GB else ("MB", 1e6)
        name, value = self.phase
        parts = " + ".join(
            f"{k} {v / scale:.1f}"
            for k, v in (
                ("weights", self.weights),
                ("grads", self.grads),
                ("optimizer", self.optimizer),
                ("buffers", self.buffers),
                (name, value),
            )
        )
        params = f"{self.params / 1e9:.2f}B" if self.params >= 1e8 else f"{self.params / 1e6:.2f}M"
        if self.adapters:  # --lora-rank
            params += f" frozen + {self.adapters / 1e6:.2f}M LoRA"
        chunks = f", {len(self.stage.chunks)} chunks" if self.stage.chunks else ""  # --vpp
        return (
            f"~{self.peak / scale:.0f} {unit}/GPU = {parts} (stage {self.stage.index} of {pp}{chunks}, {params} "
            f"params; plus CUDA/NCCL overhead)"
        )


def _switches(device: Device) -> CudaOnly:
    return cuda_only(device)  # the one place that decides the CUDA-only kernels


def _norm_bytes(h: int, device: Device) -> int:
    """Per token kept by one RMSNorm and the linear after it (which keeps the norm's output)."""
    if device == "cuda":
        return BF16 * h + 4 + BF16 * h  # fused kernel: bf16 input and fp32 rstd
    return 4 * h + 4 + 4 * h + BF16 * h  # composite: fp32 upcast input, rstd, fp32 normalised (input not kept)


def block_bytes_per_token(
    model: ModelConfig,
    tp: int,
    device: Device = "cuda",
    sequence_parallel: bool = False,
    selective: bool = False,
    cp: int = 1,
) -> int:
    """Activation bytes one Llama block keeps for backward per token (RoPE's cos/sin apart); per token of the
    whole sequence, so under sequence parallelism the norms' share is / tp like the rest. Under context
    parallelism per token of the rank's share; the gathered K/V are `context_parallel_bytes`."""
    h, f, heads = model.hidden_size, model.ffn_hidden_size, model.num_heads
    kv = model.num_kv_heads * model.head_dim
    lse = 0 if selective else 4 * heads  # selective recompute: the core attention keeps only its inputs
    if cp > 1:
        # threed.model.context: the local k and v go into the all-gather, which keeps nothing of its input, so
        # the QKV output and the local k are freed; kept are q (after RoPE), each query chunk's SDPA output and
        # their concatenation (linear_proj's input), and the logsumexp.
        attention = BF16 * h + BF16 * h + BF16 * h + lse
    else:
        attention = BF16 * (h + 2 * kv) + BF16 * h + BF16 * kv + BF16 * h + lse  # qkv, q, k, out, lse
    swiglu = 3 if _switches(device).fused_swiglu else 5
    norms = 2 * _norm_bytes(h, device) // (tp if sequence_parallel else 1)
    return norms + attention // tp + swiglu * f * BF16 // tp


def kv_row_bytes(model: ModelConfig, tp: int, seq: int, micro: int) -> int:
    """K and V of whole rows, bf16, per TP rank: what context parallelism all-gathers per block (and
    reduce-scatters as dK, dV); `threed.plan.steptime` and benchmarks/bench_cp.py count the same bytes."""
    return 2 * BF16 * micro * seq * model.num_kv_heads * model.head_dim // tp


def context_parallel_bytes(model: ModelConfig, tp: int, cp: int, seq: int, micro: int, device: Device = "cuda") -> int:
    """Bytes one block keeps for backward beyond its per-token terms under context parallelism (0 at cp 1), as
    `threed.model.context.context_parallel_attention` allocates them (bf16), per TP rank. Each query chunk
    attends to its key prefix, so the whole row's K and V [s, b, kv_heads / tp, d] are gathered:
      cuda  flash varlen (`_attend_varlen`) indexes each chunk's prefix into a copy and keeps it: chunks i and
            2cp-1-i have prefixes (i+1) and (2cp-i) chunks long, (2cp+1) of the 2cp chunks of a row for K and V
            each; the gathered row itself is then freed
      cpu   SDPA keeps views of the gathered K and V (the whole row) and its mask, which a boolean mask becomes
            in the query's dtype: chunk x prefix per query chunk, c x (2cp+1) c with c = s / 2cp (measured)."""
    if cp == 1:
        return 0
    row = kv_row_bytes(model, tp, seq, micro)
    if device == "cuda":
        return row * (2 * cp + 1) // (2 * cp)
    c = seq // (2 * cp)
    return row + BF16 * c * (2 * cp + 1) * c


def _full_block_bytes(
    model: ModelConfig, tp: int, device: Device, sp: bool, rc: Recompute, cp: int, seq: int, micro: int, tokens: int
) -> int:
    """What one block that is not recomputed keeps for backward, on this rank's `tokens`."""
    return (
        block_bytes_per_token(model, tp, device, sp, rc.selective, cp) * tokens
        + 4 * BF16 * seq // cp * model.head_dim  # RoPE cos/sin of the rank's positions
        + context_parallel_bytes(model, tp, cp, seq, micro, device)
    )


def _edge_bytes(
    stage: Stage, h: int, part: int, tokens: int, tp: int, sp: bool, device: Device, recomputed: int
) -> int:
    """Per micro-batch, what a stage keeps at its edges beside its blocks: its input (the token ids, or what it
    received) and its output's TP / sequence part, kept for backward (the last stage sends none)."""
    if stage.first:
        extras = 16 * tokens  # token ids + the engine's clone
    elif sp:  # the received [s/tp, b, h] is a copy beside the forward's clone, as at tp 1
        extras = BF16 * part * tokens
    else:  # the received input: a copy beside the forward's clone (tp 1), else the gathered input itself,
        # which block 0 keeps anyway unless it is the CPU norm without checkpointing it
        extras = BF16 * h * tokens * (tp == 1 or (device == "cpu" and recomputed == 0))
    extras += 0 if stage.last else BF16 * part * tokens  # the output (its TP / sequence part), kept for backward
    return extras


def _held_before_b(
    schedule: str, pp: int, gas: int, stage: Stage, tokens: int, h: int, tp: int, per_micro: list, awaiting_w: int
) -> list:
    """Per chunk of the stage: the most the other micro-batches hold when a B of that chunk starts (1F1B:
    min(pp - s, gas) - 1 in flight at vpp 1; exact, as integers), each chunk's micro-batches weighed by what one keeps
    there (`per_micro`), plus under ZB-H1 the gradients still in flight to the stage before."""
    deferred = schedule != "1f1b"
    # ZB-H1 sends without waiting for the receiver (threed.parallel.schedule): the gradients a later stage sent stay
    # alive until the stage before has received them, and are let go at its next send; during a B that is the last two
    # micro-batches' (1/tp of [s, b, h] each per TP rank; measured: tests/ranks/test_memory_zb.py).
    in_send = deferred * (stage.index > 0) * min(2, gas - 1) * BF16 * tokens * h // tp
    most: list = [None] * len(per_micro)
    for chunk, live, waiting in distinct_before_backward(schedule, pp, gas, stage.index, len(per_micro)):
        held = sum((n - (c == chunk)) * kept for c, (n, kept) in enumerate(zip(live, per_micro)))
        held += waiting * awaiting_w
        most[chunk] = held if most[chunk] is None else max(most[chunk], held)
    return [in_send + m for m in most]


def _kept_per_micro(
    model: ModelConfig,
    tp: int,
    chunk: Stage,
    tokens: int,
    full_block: int,
    rc: Recompute,
    sp: bool,
    device: Device,
    head_chunks: int,
) -> tuple[float, float]:
    """(what one micro-batch keeps in `chunk` from its F to its B, of which the last stage's head) on this rank's
    `tokens`: its blocks (recomputed ones: their chunks' inputs), its edges and, on the last stage, the head's."""
    h, v = model.hidden_size, model.padded_vocab_size(tp) // tp
    # DeepSpeed partitions p2p activations over TP (pipe_partitioned); sequence parallelism splits them instead.
    part = h // tp if tp > 1 else h
    recomputed = rc.recomputed(chunk.blocks)
    chunk_input = BF16 * (part if sp else h) * tokens  # what a checkpointed chunk keeps
    kept_blocks = (chunk.blocks - recomputed) * full_block + rc.kept_inputs(chunk.blocks) * chunk_input
    extras = _edge_bytes(chunk, h, part, tokens, tp, sp, device, recomputed)
    # Last stage: final norm (on [s/tp] under sequence parallelism), fp32 softmax, labels. The bf16 logits live
    # through the loss's forward only (threed.parallel.lean_engine): 2V/tp, as much as their gradient in the loss's
    # backward (`head_phase`), which is the larger phase.
    kept_logits, _ = logits_bytes(v, tokens, head_chunks)
    head = (_norm_bytes(h, device) // (tp if sp else 1) + 8) * tokens + kept_logits if chunk.last else 0.0
    return kept_blocks + extras + head, head


def logits_bytes(v: int, tokens: int, chunks: int = 1) -> tuple[int, int]:
    """(kept, loss backward): the last stage's bytes of the logits of one micro-batch's `tokens`, `v` = V/tp columns.
    Kept for backward from the loss's forward: the fp32 softmax of vocab_parallel_cross_entropy (4V/tp per token).
    Added in the loss's backward: the logits' bf16 gradient (2V/tp). `--lm-head-chunks N`
    (threed.model.layers.chunked_token_losses): forward keeps nothing of the logits, and backward recomputes one chunk
    at a time, its softmax and then its gradient, so the same 6V/tp bytes per token count on tokens / N."""
    if chunks == 1:
        return 4 * v * tokens, BF16 * v * tokens
    return 0, (4 + BF16) * v * tokens // chunks


def stage_activations(
    model: ModelConfig,
    tp: int,
    pp: int,
    stage: Stage,
    micro: int,
    gas: int,
    seq: int,
    act_ckpt: bool | Recompute,
    device: Device = "cuda",
    max_param: int = 0,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    cp: int = 1,
    head_chunks: int = 1,
    lora: LoraConfig | None = None,
) -> float:
    """Peak bytes of the forward/backward phase on one rank of `stage`, beyond the static terms. `act_ckpt`: True
    (every block recomputed), False, or a `Recompute` (Megatron's flags); `schedule`: `threed.parallel.schedule`'s;
    `cp`: context parallelism, each rank holding seq / cp tokens of every row; `head_chunks`: `--lm-head-chunks`;
    `lora`: --lora-rank's adapters, what they keep added to each block (`threed.memory.lora`).
    A stage with chunks (--vpp > 1) weighs each chunk's micro-batches in flight by what one keeps in that chunk
    (`threed.parallel.schedule.held_per_chunk`), and its peak is the largest over the B of each chunk."""
    rc = Recompute.of(act_ckpt)
    sp = sequence_parallel and tp > 1
    h, f, v = model.hidden_size, model.ffn_hidden_size, model.padded_vocab_size(tp) // tp
    tokens = seq * micro // cp  # this rank's tokens: everything per token below is per local token
    full_block = _full_block_bytes(model, tp, device, sp, rc, cp, seq, micro, tokens)
    full_block += lora_terms.activation_bytes_per_token(model, lora, tp, sp) * tokens
    kept = [_kept_per_micro(model, tp, c, tokens, full_block, rc, sp, device, head_chunks) for c in stage.parts]
    _, loss_backward = logits_bytes(v, tokens, head_chunks)
    grad = BF16 * max_param  # one parameter's bf16 .grad before the hook adds it to the fp32 buffer
    deferred = schedule != "1f1b"  # under 1F1B, B computes the weight gradients: nothing awaits W
    awaiting_w = deferred * awaiting_w_bytes(model, tp, stage_kinds(stage), sp) * tokens
    others = _held_before_b(schedule, pp, gas, stage, tokens, h, tp, [k for k, _ in kept], awaiting_w)
    # Context parallelism: the gathered K/V's gradient, [s, b, kv_heads / tp, d] each, before its reduce-scatter.
    cp_grad = kv_row_bytes(model, tp, seq, micro) if cp > 1 else 0
    # The loss backward's chunked head: autograd sums the chunks' gradients of the head's weight [V/tp, h] before
    # its AccumulateGrad, beside each chunk's own (measured: tests/ranks/test_memory_head.py).
    chunk_sum = BF16 * v * h if head_chunks > 1 else 0
    phases = []
    for chunk, (per_micro, head), held in zip(stage.parts, kept, others):
        # Backward through the blocks: the loss's tensors of this micro-batch are gone by then (ZB-H1: but the LM
        # head's W tensors); a recomputed chunk is re-created (one at a time). Blocks go last to first, so by the
        # recomputed ones (`block`: the first N) the kept blocks of this micro-batch are freed. ZB-H1: a block past B
        # holds its W tensors instead, so the larger end counts (with recompute, W's tensors outweigh a chunk's
        # input). Assumed: ZB-H1's B makes 1F1B's gradient transients; the bf16 .grad (`grad`) moves to W.
        head_w = deferred * chunk.last * deferred_bytes_per_token(model, tp, "lm_head", sp) * tokens
        # (ZB-H1: B runs on its own copy of the received output gradient, one [s/tp, b, h], threed.parallel.schedule.)
        this = max(per_micro - head + head_w, awaiting_w) + deferred * (not chunk.last) * BF16 * tokens * h // tp
        recomputed = rc.recomputed(chunk.blocks)
        recreated = max(0, rc.live_blocks(chunk.blocks) - (chunk.blocks - recomputed)) * full_block
        phases.append(held + this + recreated + BF16 * (3 * f // tp + h) * tokens + grad + cp_grad)
        if chunk.last:  # the loss backward: the logits' bf16 gradient (ZB-H1: the LM head's output gradient, for W)
            phases.append(held + per_micro + loss_backward + grad + chunk_sum)
    return max(phases)


def reduce_copy_bytes(groups: Sequence[int]) -> int:
    """DeepSpeed's allreduce_no_retain over the fp32 grad groups: a bucket of two or more tensors is flattened
    (copied) into one; a single tensor is reduced in place."""
    worst, count, numel = 0, 0, 0
    for n in [*groups, None]:
        if n is not None:
            count, numel = count + 1, numel + n
        if numel and (n is None or numel > ALLREDUCE_BUCKET):
            worst = max(worst, 4 * numel if count > 1 else 0)
            count, numel = 0, 0
    return worst


def stage_memory(
    model: ModelConfig,
    tp: int,
    pp: int,
    dp: int,
    micro: int,
    gas: int,
    seq: int,
    act_ckpt: bool | Recompute,
    stage: Stage,
    device: Device = "cuda",
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    cp: int = 1,
    head_chunks: int = 1,
    lora: LoraConfig | None = None,
) -> Memory:
    h, d = model.hidden_size, model.head_dim
    tokens = seq * micro // cp  # this rank's tokens (seq / cp of each row)
    sp = sequence_parallel and tp > 1
    groups = [n for n in stage_params(model, tp, stage) if n]  # make_optimizer drops empty groups
    base, frozen = sum(groups), 0
    max_param = largest_parameter(model, tp, stage_kinds(stage))
    if lora_terms.active(lora):  # --lora-rank: the base frozen (bf16 tensors of its own), the adapters the one group
        assert lora is not None
        adapters = lora_terms.block_elements(model, lora, tp) * stage.blocks
        groups, frozen = [adapters] if adapters else [], base
        max_param = lora_terms.largest_adapter(model, lora, tp) if adapters else 0
    # CP ranks hold the same weights and reduce gradients with the DP ranks: ZeRO-1 shards over dp x cp.
    shards = dp * cp
    align = 2 * shards  # BF16_Optimizer aligns each flat group to nccl_start_alignment_factor (2) x dp
    padded = [math.ceil(n / align) * align for n in groups]
    buffers = 4 * seq // cp * d * stage.blocks  # RoPE angles cached per block (fp32), the rank's positions
    if not (stage.first and stage.last):  # p2p buffer: a TP partition of [s, b, h] and its meta tensor
        # (--vpp > 1: one per chunk, each receiving from its own virtual stage before)
        buffers += len(stage.parts) * (BF16 * tokens * h if tp == 1 else BF16 * tokens * (h // tp) + (0 if sp else 72))
    if sp and (stage.blocks or stage.last):  # megatron's all-gather buffer of the column-parallel linears' input
        buffers += BF16 * tokens * h
    buffers += lora_terms.index_bytes(model, lora, tp) * stage.blocks  # --lora-rank: the adapters' row indices
    adamw_temps = 0 if _switches(device).fused_adamw else 2 if device == "cpu" else 1
    return Memory(
        stage=stage,
        params=base,
        weights=float(BF16 * (sum(padded) + frozen)),
        grads=float(4 * sum(padded)),
        optimizer=float(12 * sum(padded) // shards + 4 * len(groups)),  # + AdamW's fp32 `step` per group
        buffers=float(buffers),
        activations=stage_activations(
            model, tp, pp, stage, micro, gas, seq, act_ckpt, device, max_param, sp, schedule, cp, head_chunks, lora
        ),
        reduce_temp=float(reduce_copy_bytes(padded)),
        step_temp=float(4 * max((p // shards for p in padded), default=0) * adamw_temps),
        adapters=sum(groups) if frozen else 0,
    )


def estimate(
    model: ModelConfig | str,
    tp: int,
    pp: int,
    dp: int,
    micro: int,
    gas: int,
    seq: int,
    act_ckpt: bool | Recompute,
    device: Device = "cuda",
    partition_method: str | None = None,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    cp: int = 1,
    head_chunks: int = 1,
    vpp: int = 1,
    lora: LoraConfig | None = None,
) -> list[Memory]:
    """Memory of every stage (one rank each; the TP and CP ranks of a stage hold equal shards) under `schedule`;
    `dp` excludes `cp` (world = tp x pp x cp x dp); `head_chunks`: `--lm-head-chunks`; `vpp`: chunks per rank;
    `lora`: --lora-rank's (None or rank 0: a full fine-tune)."""
    if isinstance(model, str):
        model = model_config(model)
    return [
        stage_memory(
            model, tp, pp, dp, micro, gas, seq, act_ckpt, s, device, sequence_parallel, schedule, cp, head_chunks, lora
        )
        for s in stages(model, pp, tp, seq, partition_method, vpp)
    ]


def activation_ratio(
    model: ModelConfig, tp: int, pp: int, stage: int, micro: int, gas: int, seq: int, cp: int, device: Device = "cpu"
) -> float:
    """One stage's activation peak at `cp` over the same at cp 1 (same sequence, no recompute, 1F1B): the factor the
    CP memory check (tests/ranks/test_memory_cp.py) compares its measured CPU peaks with."""
    st = stages(model, pp, tp, seq)[stage]
    at = [stage_activations(model, tp, pp, st, micro, gas, seq, False, device, cp=c) for c in (cp, 1)]
    return at[0] / at[1]


def heaviest(mems: list[Memory]) -> Memory:
    return max(mems, key=lambda m: m.peak)


# --------------------------------------------------------------------------- host memory: --async-save's copies


def host_copy_bytes(
    model: ModelConfig,
    tp: int,
    pp: int,
    dp: int,
    seq: int,
    ranks: range,
    cp: int = 1,
    vpp: int = 1,
    partition_method: str | None = None,
    dtype: str = "bf16",
    lora: LoraConfig | None = None,
) -> int:
    """Host memory (pinned on CUDA) that --async-save's copy of a checkpoint takes on the ranks `ranks`: what each
    of them writes (threed.checkpoint.format.node_checkpoint_bytes, the figure threed.checkpoint.async_save refuses
    a node by; `lora`: a LoRA run's adapter-only checkpoint). Not a GPU term: per node, in the host's RAM."""
    kinds = [stage_kinds(s) for s in stages(model, pp, tp, seq, partition_method, vpp)]
    return node_checkpoint_bytes(model, dtype, (tp, dp, cp), kinds, ranks, lora)


def host_copy_line(
    model: ModelConfig, tp: int, pp: int, dp: int, seq: int, ranks_per_node: int, cp: int = 1, **kw
) -> str:
    """`memory: host ...`: the host memory of --async-save's copies on the heaviest node (ranks numbered node by
    node, `ranks_per_node` each) and on the heaviest rank; `kw`: `host_copy_bytes`' vpp, partition_method, dtype."""
    world = tp * pp * cp * dp
    per = max(1, min(ranks_per_node, world))
    each = [host_copy_bytes(model, tp, pp, dp, seq, range(r, r + 1), cp, **kw) for r in range(world)]
    node = max(sum(each[n : n + per]) for n in range(0, world, per))
    return (
        f"memory: host ~{human_bytes(node)} per node of {per} rank(s) for --async-save's checkpoint copies (pinned "
        f"on CUDA; the heaviest rank's {human_bytes(max(each))}: its ZeRO shard, and its stage's weights on "
        f"data-parallel rank 0)"
    )
