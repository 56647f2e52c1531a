"""The planner's step-time model: predicted seconds per optimizer step of a layout on a cluster, so that
`threed plan` (`threed.plan.planner`) can rank layouts. A ranking, not a promise: bf16, and the one
compute/communication overlap the engine has (below: megatron's linear backward under 1F1B).

    step = pipeline(schedule, pp, gas; F, B, W of the slowest stage)  + t_dp + t_tied + t_optimizer
    t_micro(stage) = F + B + W
                   = tokens x (blocks x M_block + recomputed x M_block / 3 + last x M_head) / (tp x R_mm)  compute
                   + tokens x (blocks + recomputed / 3) x A_block / (tp x R_attn)  +  c
                   + n_tp x 2 (tp - 1) / tp x 2 s b h / B_tp                                          TP collectives
                   + 2 x 2 s b h / tp / B_pp  (+ 2 x all-gather of it over TP without SP)               PP p2p (pp > 1)

  M_block, M_head: training matmul FLOPs per token of a block and of the LM head (6 x matmul parameters,
  `threed.model.spec.matmul_parameters`); A_block: a block's causal attention FLOPs per token (QK^T and AV below
  the diagonal, `threed.model.spec.attention_training_flops`: half the full square of the MFU convention). A
  recomputed block runs its forward once more: a third of its FLOPs (`threed.memory.recompute` says which blocks of
  a stage are recomputed). Rates: R_mm (matmuls), R_attn (causal attention) and c (seconds per micro-batch per
  stage, spread over F, B and W as their compute) are `Rates`, fitted to measured GPU runs by
  `threed.plan.calibration` (by default those of one H200, `DEFAULT_RATES`); `Rates.flat(R)` is the earlier model:
  one rate over the full square, no per-micro-batch cost.
  The passes (`threed.parallel.schedule`): F is a third of the FLOPs; of the backward, W (weight gradients) is the
  matmuls' forward FLOPs again (2 x matmul parameters per token) and B the rest (input gradients, the attention
  scores' backward, the recompute forward). Collectives: the forward ones and the p2p send are F's, the backward
  ones and the gradient send B's, SP's re-gathers for the weight gradients W's (under ZB-H1 also the row-parallel
  output gradients'). pipeline(): the step `threed.parallel.schedule.simulate` finds when every stage runs the
  slowest stage's passes (the slowest sets the pace): under 1F1B (gas + pp - 1)(F + B + W), a bubble of
  (pp - 1) / (gas + pp - 1); under ZB-H1 less. Interleaved (--vpp v > 1, 1F1B's order over v chunks per rank, each a
  v-th of the stage): (gas + (pp - 1) / v)(F + B + W), a bubble of (pp - 1) / (v gas + pp - 1), but each micro-batch
  crosses the stages v times: v p2p sends in F and in B where 1F1B has one.
  n_tp, in all-reduces of [s, b, h] (a ring all-reduce moves the bytes of one all-gather plus one reduce-scatter):
  per block 2 forward (attention and MLP outputs) + 2 backward (their inputs' gradients) + 2 more per recomputed
  block; plus the embedding's and the LM head's one each. Sequence parallelism (Megatron's) replaces each
  all-reduce by an all-gather before and a reduce-scatter after the pair of linears: the same bytes in a ring, so
  the same time; but megatron's backward all-gathers the input of both column-parallel linears once more for their
  weight gradients (it saved only its [s/tp, b, h] part): half an all-reduce each, +1 per block and +1/2 for the LM
  head. Overlap (`hidden_behind_gemms`): under 1F1B megatron's column-parallel backward (qkv, fc1, LM head) runs
  the input gradient's all-reduce (SP: reduce-scatter) beside the weight-gradient GEMM and SP's re-gather beside
  the input-gradient GEMM, so each is counted only where it outlasts that GEMM. Under ZB-H1 (pp > 1) B has no
  weight gradient to hide behind and W gathers before its GEMM (`threed.model.wgrad`): nothing is hidden, which is
  what it pays for its smaller bubble. What crosses stages: without SP DeepSpeed sends a TP partition and gathers
  it over TP on arrival; with SP each rank sends its own sequence part, and nothing is gathered.
  t_dp: all-reduce of the fp32 gradients (communication_data_type fp32) and all-gather of the bf16 weights,
  2 (dp - 1) / dp x 4 N + (dp - 1) / dp x 2 N bytes at B_dp. t_optimizer: AdamW on the fp32 shard and the
  norm/clip pass over the fp32 gradients, (36 N / dp + 12 N) bytes at the GPU's memory bandwidth. t_tied (tied
  embeddings, pp > 1): the first and the last stage each hold a copy of the embedding (N counts it on both) and
  all-reduce its fp32 gradient between them: 4 V h / tp bytes sent per rank (a two-rank ring).
  Context parallelism (cp > 1; `threed.model.context`): each rank holds s / cp tokens of every row, so tokens
  above are s b / cp and the compute divides by cp (the 2 cp zigzag chunks give every rank the same causal work;
  FLOPs per token stay the whole row's). Per block the forward all-gathers K and V of the rows, the backward
  reduce-scatters dK and dV, and a recomputed block's forward all-gathers again: each (cp - 1) / cp x 2 x 2 s b
  kv_heads d / tp bytes (`cp_collective_s`), in no overlap (the attention waits for its keys). The CP group's
  ranks are tp apart (megatron-core's order tp-cp-dp-pp): NVLink when tp cp fits in a node, else the network.
  Gradients reduce and ZeRO-1 shards over dp x cp (t_dp, t_optimizer with dp x cp).
  LoRA (--lora-rank; `threed.memory.lora` counts the adapters, a_block elements per block): the base is frozen, so
  there is no weight gradient of it: W is the adapters' alone (2 a_block per token of each block), F and B add the
  adapters' forward and input gradient (2 a_block each) and their own TP collectives of [s, b, h]
  (`threed.memory.lora.collectives_per_block`: the input gradient of each column-parallel base's adapters, the output
  of each row-parallel one's, gathered); megatron's frozen linear keeps no input, so SP re-gathers nothing for W and no
  collective hides behind a weight-gradient GEMM; t_dp and t_optimizer count the adapters only,
  and a frozen tied embedding is all-reduced by nobody. With W next to nothing ZB-H1 has nothing to defer, and
  training refuses it (threed.config.LoraConfig): the planner searches 1F1B.
  Bandwidths: NVLink (--nvlink-gbps) inside a node, the per-GPU network share (--network-gbps) across nodes; the
  DP and PP groups cross nodes when their rank stride (tp, tp cp dp) reaches a node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from threed.config import LoraConfig, ModelConfig
from threed.memory.lora import block_elements, collectives_per_block
from threed.memory.model import GB, kv_row_bytes, stages
from threed.memory.recompute import Recompute
from threed.model.spec import (
    LayerKind,
    attention_training_flops,
    layer_parameters,
    matmul_parameters,
    shard_shape,
    split_axis,
    tie_owners,
    tied,
)
from threed.parallel.schedule import simulate


@dataclass(frozen=True)
class Rates:
    """The compute part of the step-time model (the module docstring), and what it was fitted to."""

    mm_tflops: float  # sustained bf16 matmul TFLOP/s per GPU
    attn_tflops: float  # sustained TFLOP/s of the attention kernel, on causal attention FLOPs
    micro_s: float  # seconds each micro-batch costs a stage besides its FLOPs (host, launches, memory-bound work)
    fitted_to: str  # the device, the date and the measurements (or the flag) the rates come from

    @classmethod
    def flat(cls, tflops: float) -> "Rates":
        """One rate over the full attention square (causal FLOPs at half of it), no per-micro-batch cost."""
        return cls(tflops, tflops / 2, 0.0, f"no run (--tflops {tflops:g} over the full attention square, no c)")

    def line(self) -> str:
        return (
            f"step-time model fitted to {self.fitted_to}: matmuls {self.mm_tflops:.0f} TFLOP/s, attention "
            f"{self.attn_tflops:.0f} TFLOP/s on causal FLOPs, {1e3 * self.micro_s:.1f} ms per micro-batch"
        )


# `threed.plan.calibration.fit` of benchmarks/measured/2026-11-28-h200.json with the default Hardware below
# (tests/unit/test_calibration.py checks these are that fit): R_attn tied to R_mm / 2, as those runs cannot tell them
# apart (docs/performance.md).
DEFAULT_RATES = Rates(622.9, 311.4, 0.03606, "NVIDIA H200, 2026-11-28, bench_gpu.py (tp1, Llama-3.2-1B, seq 4K-8K)")


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    # Defaults: an H100 SXM node with one 400 Gb/s NIC per GPU.
    reserve_gb: float = 5.0  # CUDA context, NCCL buffers, allocator fragmentation
    rates: Rates = DEFAULT_RATES  # the compute model's rates (threed.plan.calibration fits them)
    nvlink_gbps: float = 370.0  # NCCL all-reduce bus bandwidth inside a node, GB/s
    network_gbps: float = 50.0  # per-GPU share of the inter-node network, GB/s
    hbm_gbps: float = 3350.0  # GPU memory bandwidth, GB/s

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def budget(self) -> float:
        return (self.gpu_memory_gb - self.reserve_gb) * GB


def link_bytes_per_s(hw: Hardware, stride: int) -> float:
    """Bandwidth between ranks `stride` apart (ranks fill a node in order): NVLink inside a node, else the
    network share."""
    return (hw.nvlink_gbps if stride < hw.gpus_per_node else hw.network_gbps) * 1e9


def pass_times(
    model: ModelConfig,
    hw: Hardware,
    tp: int,
    pp: int,
    dp: int,
    micro: int,
    seq: int,
    recompute: bool | Recompute,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    cp: int = 1,
    vpp: int = 1,
    lora: Optional[LoraConfig] = None,
) -> tuple[float, float, float]:
    """Seconds of one micro-batch's F, B and W passes on the slowest stage (the model in the module docstring);
    `recompute`: True (every block), False, or Megatron's flags; `cp`: context parallelism (dp excludes it); `vpp`:
    chunks per rank (the passes of all its chunks together, each chunk's sends counted); `lora`: --lora-rank's."""
    rc = Recompute.of(recompute)
    adapters = block_elements(model, lora)  # per block, all TP ranks; 0: a full fine-tune
    sp = sequence_parallel and tp > 1
    lora_f, lora_b = collectives_per_block(lora, sp)  # the adapters' own TP collectives, per block
    h = model.hidden_size
    tokens = seq * micro // cp  # this rank's share of each row; FLOPs per token stay those of the whole row
    kv_exchange = cp_collective_s(model, hw, tp, cp, seq, micro)
    act_bytes = 2 * tokens * h
    rate = hw.rates.mm_tflops * 1e12
    allreduce = 2 * (tp - 1) / tp * act_bytes / (hw.nvlink_gbps * 1e9) if tp > 1 else 0.0

    deferred = schedule != "1f1b" and pp > 1  # ZB-H1 splits the backward (at pp 1 it is refused: 1F1B's backward)
    slowest = (0.0, 0.0, 0.0)
    for st in stages(model, pp, tp, seq, None, vpp):
        recomputed = sum(rc.recomputed(c.blocks) for c in st.parts)  # Megatron's recompute counts per chunk
        f_tp = (2 + lora_f) * st.blocks + st.first  # attention and MLP outputs (LoRA: the adapters'); the embedding's
        # their inputs' gradients, the recompute's (LoRA: the adapters' forward collectives again); the LM head's
        b_tp = (2 + lora_b) * st.blocks + (2 + lora_f) * recomputed + st.last
        # megatron's re-gather of the column-parallel inputs; a deferred W (threed.model.wgrad) also re-gathers
        # the row-parallel output gradients it kept as sequence parts (two all-gathers: one all-reduce's worth)
        w_tp = sp * (st.blocks + st.last / 2 + deferred * st.blocks) * (not adapters)  # LoRA: nothing re-gathered
        flops = stage_flops(model, tp, seq, tokens, st.blocks, st.last, recomputed, adapters)
        compute = [mm / rate + attn / (hw.rates.attn_tflops * 1e12) for mm, attn in flops]
        stretch = 1 + hw.rates.micro_s / sum(compute) if sum(compute) else 1.0  # c spread over the passes' compute
        f, b, w = (t * stretch + n * allreduce for t, n in zip(compute, (f_tp, b_tp, w_tp)))
        # CP: K/V all-gathered in each block's forward (again in a recomputed block's), dK/dV reduce-scattered in B
        f, b = f + st.blocks * kv_exchange, b + (st.blocks + recomputed) * kv_exchange
        # ZB-H1's B and W run their collectives alone (threed.model.wgrad); so do LoRA's frozen linears (no wgrad GEMM)
        if not deferred and tp > 1 and not adapters:
            hidden_b, hidden_w = hidden_behind_gemms(model, tp, tokens, rate, allreduce, sp, st.blocks, st.last)
            b, w = b - hidden_b, w - hidden_w
        if pp > 1:  # activations forward (F), gradients backward (B): 1/tp of them each
            p2p = act_bytes / tp / link_bytes_per_s(hw, tp * cp * dp)  # stages are tp cp dp ranks apart
            if not sp:  # DeepSpeed's TP partition, all-gathered over TP on arrival
                p2p += (tp - 1) / tp * act_bytes / (hw.nvlink_gbps * 1e9)
            # interleaved (vpp > 1): a micro-batch crosses from each chunk to the next virtual stage, vpp sends
            f, b = f + vpp * p2p, b + vpp * p2p
        if f + b + w > sum(slowest):
            slowest = (f, b, w)
    return slowest


def stage_flops(
    model: ModelConfig, tp: int, seq: int, tokens: int, blocks: int, last: int, recomputed: int, adapters: int = 0
) -> tuple[tuple[float, float], ...]:
    """(matmul, causal attention) FLOPs on one TP rank of a stage's F, B and W passes for `tokens` tokens of rows of
    `seq`: F a third of the training FLOPs; W the matmuls' forward again (2 x matmul parameters per token, dgrad =
    wgrad = forward); B the rest, plus the recomputed blocks' forward. What `pass_times` divides by the rates and
    `threed.plan.calibration` fits them on. `adapters`: LoRA's elements per block (all TP ranks): their matmuls join
    F and B, and W is theirs alone (the base is frozen)."""
    m_block, m_head = (2.0 * matmul_parameters(model, kind, tp) for kind in ("block", "lm_head"))  # forward
    m_block += 2.0 * adapters
    attn = attention_training_flops(model, seq, "causal") / 3  # forward
    mm_fwd, attn_fwd = blocks * m_block + last * m_head, blocks * attn
    scale = tokens / tp
    wgrad = blocks * 2.0 * adapters if adapters else mm_fwd
    return (
        (scale * mm_fwd, scale * attn_fwd),
        (scale * (mm_fwd + recomputed * m_block), scale * (2 * attn_fwd + recomputed * attn)),
        (scale * wgrad, 0.0),
    )


def cp_in_node(hw: Hardware, tp: int, cp: int) -> bool:
    """Whether a CP group lies inside one node: in megatron-core's rank order (tp-cp-dp-pp) its cp ranks are tp
    apart, spanning tp x cp consecutive ranks, which share a node when they fit in one (tp divides a node)."""
    return tp * cp <= hw.gpus_per_node


def cp_collective_s(model: ModelConfig, hw: Hardware, tp: int, cp: int, seq: int, micro: int) -> float:
    """Seconds of one block's K/V all-gather over the CP group (the same for its dK/dV reduce-scatter): each rank
    receives (cp - 1) / cp of the rows' K and V (`threed.memory.model.kv_row_bytes`, per TP rank), over NVLink when
    the group is inside a node, else at the network share. 0 at cp 1."""
    if cp == 1:
        return 0.0
    link = hw.nvlink_gbps if cp_in_node(hw, tp, cp) else hw.network_gbps
    return (cp - 1) / cp * kv_row_bytes(model, tp, seq, micro) / (link * 1e9)


def column_gemm_seconds(model: ModelConfig, kind: LayerKind, tp: int, tokens: int, rate: float) -> list[float]:
    """Seconds of one GEMM (dgrad or wgrad: the same FLOPs) of each column-parallel linear of a layer of `kind`
    (qkv and fc1 of a block, the LM head), per TP rank: the GEMMs megatron's backward hides collectives behind."""
    out = []
    for p in layer_parameters(kind):
        if p.megatron_linear and split_axis(p.split) == 0:
            rows, cols = shard_shape(model, p, tp)
            out.append(2 * tokens * rows * cols / rate)
    return out


def hidden_behind_gemms(
    model: ModelConfig, tp: int, tokens: int, rate: float, allreduce: float, sp: bool, blocks: int, last: int
) -> tuple[float, float]:
    """(from B, from W) seconds of a stage's backward TP collectives that megatron's linear backward (1F1B) runs
    beside a GEMM of the same column-parallel linear (async_op, in order on one queue: CUDA_DEVICE_MAX_CONNECTIONS=1),
    each hidden up to that GEMM's time. Without SP: the input gradient's all-reduce, beside the weight-gradient GEMM.
    With SP: the input gradient's reduce-scatter beside the weight-gradient GEMM, and the re-gather of the saved
    input beside the input-gradient GEMM (half an all-reduce each); the all-gather of the row-parallel linears'
    output gradient runs alone. Under ZB-H1 none of this: B has no weight gradient to run beside, and W's gathers
    precede its GEMM (threed.model.wgrad)."""
    hidden_b = hidden_w = 0.0
    for kind, count in (("block", blocks), ("lm_head", last)):
        for gemm in column_gemm_seconds(model, kind, tp, tokens, rate):  # type: ignore[arg-type]
            if sp:
                hidden_b += count * min(allreduce / 2, gemm)
                hidden_w += count * min(allreduce / 2, gemm)
            else:
                hidden_b += count * min(allreduce, gemm)
    return hidden_b, hidden_w


def step_time(
    model: ModelConfig,
    hw: Hardware,
    tp: int,
    pp: int,
    dp: int,
    micro: int,
    gas: int,
    seq: int,
    recompute: bool | Recompute,
    params: int,
    sequence_parallel: bool = False,
    schedule: str = "1f1b",
    passes: Optional[tuple[float, float, float]] = None,
    cp: int = 1,
    vpp: int = 1,
    lora: Optional[LoraConfig] = None,
) -> float:
    """Predicted seconds per optimizer step (the model in the module docstring); `params`: the largest stage's
    trainable parameters per GPU (under LoRA its adapters); `recompute`: True (every block), False, or Megatron's
    flags; `schedule`: `threed.parallel.schedule`'s; `passes`: `pass_times` of the same arguments, when the caller
    has them already; `cp`: context parallelism (gradients reduce and ZeRO-1 shards over dp x cp); `vpp`:
    interleaved chunks per rank; `lora`: --lora-rank's (the base frozen)."""
    passes = passes or pass_times(
        model, hw, tp, pp, dp, micro, seq, recompute, sequence_parallel, schedule, cp, vpp, lora
    )
    pipeline, _ = simulate(schedule, pp, gas, *passes, vpp)
    return pipeline + once_per_step_s(model, hw, tp, pp, dp * cp, params, frozen=block_elements(model, lora) > 0)


def once_per_step_s(
    model: ModelConfig, hw: Hardware, tp: int, pp: int, shards: int, params: int, frozen: bool = False
) -> float:
    """What a step costs besides its micro-batches: t_dp + t_tied + t_optimizer (the module docstring); `shards`:
    dp x cp (CP ranks hold the same weights: they reduce gradients with the DP ranks); `frozen`: LoRA's base, whose
    tied embedding has no gradient to all-reduce."""
    t_dp = (2 * 4 * params + 2 * params) * (shards - 1) / shards / link_bytes_per_s(hw, tp)  # ranks tp apart
    t_opt = (36 * params / shards + 12 * params) / (hw.hbm_gbps * 1e9)
    return t_dp + (0.0 if frozen else tied_allreduce_s(model, hw, tp, pp, shards)) + t_opt


def tied_allreduce_s(model: ModelConfig, hw: Hardware, tp: int, pp: int, dp: int) -> float:
    """DeepSpeed's ReduceTiedGrads: the tied weight's fp32 gradient all-reduced between its two copies (first and
    last stage, (pp - 1) tp dp ranks apart); nothing when untied or at pp = 1 (one module holds it)."""
    if not tied(model) or pp == 1:
        return 0.0
    rows, hidden = shard_shape(model, tie_owners()["embedding"], tp)
    return 4 * rows * hidden / link_bytes_per_s(hw, (pp - 1) * tp * dp)
