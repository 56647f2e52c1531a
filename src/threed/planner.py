"""`threed plan`: the (tp, pp, micro, gas, activation checkpointing) layouts of a model on a cluster, whether each
fits in GPU memory (`threed.memory`), ranked by a predicted step time; then the recipe lines of the best one.

    threed plan --model llama3.1-70b --nodes 4 --gpus-per-node 8 --gpu-memory 80 --seq 8192 --global-batch 512

Candidates: tp divides the heads and the KV heads and at most fills a node (TP all-reduces stay on NVLink);
pp <= layers; dp = world / (tp pp); micro x dp divides the global batch and gas = global / (micro dp).
A layout fits when its heaviest stage's peak (threed.memory, CUDA kernels) is at most --gpu-memory - --reserve.

Step time model (a ranking, not a promise; bf16, no sequence parallelism, no compute/communication overlap):

    step = (gas + pp - 1) x max over stages of t_micro(stage)  + t_dp + t_tied + t_optimizer
    t_micro(stage) = tokens x (blocks x F_block x (1 + recompute / 3) + last x F_head) / (tp x R)    compute
                   + n_allreduce x 2 (tp - 1) / tp x 2 s b h / B_tp                                TP all-reduces
                   + 2 x 2 s b h / tp / B_pp + 2 x all-gather of it over TP                           PP p2p (pp > 1)

  F_block, F_head: training FLOPs per token of a block and of the LM head, `threed.model.spec.layer_training_flops`
  (the repo's one FLOPs convention: 6 x matmul parameters, attention scores over the full seq x seq square, so
  causal attention's cost is overstated by 6 s h per block, as in every MFU figure); activation checkpointing
  recomputes the forward (+1/3). The first factor is the 1F1B schedule: the bubble is
  (pp - 1) / (gas + pp - 1) of the step, and the slowest stage sets the pace. n_allreduce per block: 2 forward
  (attention and MLP outputs) + 2 backward (their inputs' gradients) + 2 more when recomputing; plus the
  embedding's and the LM head's one each. DeepSpeed partitions what crosses stages over TP and gathers it on
  arrival. t_dp: all-reduce of the fp32 gradients (communication_data_type fp32) and all-gather of the bf16
  weights, 2 (dp - 1) / dp x 4 N + (dp - 1) / dp x 2 N bytes at B_dp. t_optimizer: AdamW on the fp32 shard
  and the norm/clip pass over the fp32 gradients, (36 N / dp + 12 N) bytes at the GPU's memory bandwidth.
  t_tied (tied embeddings, pp > 1): the first and the last stage each hold a copy of the embedding (N counts it
  on both) and all-reduce its fp32 gradient between them: 4 V h / tp bytes sent per rank (a two-rank ring).
  Bandwidths: NVLink (--nvlink-gbps) inside a node, the per-GPU network share (--network-gbps) across nodes;
  the DP and PP groups cross nodes when their rank stride (tp, tp dp) reaches a node.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Optional

from threed.config import ConfigError, ModelConfig
from threed.model.spec import layer_training_flops, shard_shape, tie_owners, tied
from threed.errors import guarded
from threed.flags import model_config
from threed.memory.model import GB, Memory, estimate, heaviest, quiet_deepspeed_import, stages


@dataclass(frozen=True)
class Hardware:
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    # Defaults: an H100 SXM node with one 400 Gb/s NIC per GPU.
    reserve_gb: float = 5.0  # CUDA context, NCCL buffers, allocator fragmentation
    tflops: float = 400.0  # sustained bf16 matmul TFLOP/s per GPU (~40% of the dense peak)
    nvlink_gbps: float = 370.0  # NCCL all-reduce bus bandwidth inside a node, GB/s
    network_gbps: float = 50.0  # per-GPU share of the inter-node network, GB/s
    hbm_gbps: float = 3350.0  # GPU memory bandwidth, GB/s

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def budget(self) -> float:
        return (self.gpu_memory_gb - self.reserve_gb) * GB


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    micro: int
    gas: int
    act_ckpt: bool
    memory: Memory  # the heaviest stage
    step_s: float
    fits: bool

    @property
    def bubble(self) -> float:
        return (self.pp - 1) / (self.gas + self.pp - 1)

    def name(self) -> str:
        ckpt = "with" if self.act_ckpt else "without"
        return (f"tp{self.tp} pp{self.pp} dp{self.dp}, micro {self.micro} x gas {self.gas}, {ckpt} activation "
                f"checkpointing")


def link_bytes_per_s(hw: Hardware, stride: int) -> float:
    """Bandwidth between ranks `stride` apart (ranks fill a node in order): NVLink inside a node, else the
    network share."""
    return (hw.nvlink_gbps if stride < hw.gpus_per_node else hw.network_gbps) * 1e9


def step_time(model: ModelConfig, hw: Hardware, tp: int, pp: int, dp: int, micro: int, gas: int, seq: int,
              act_ckpt: bool, params: int) -> float:
    """Predicted seconds per optimizer step (the model in the module docstring); `params`: the largest stage's
    parameters per GPU."""
    h = model.hidden_size
    f_block = layer_training_flops(model, "block", seq, tp) * (4 / 3 if act_ckpt else 1)
    f_head = layer_training_flops(model, "lm_head", seq, tp)
    tokens = seq * micro
    act_bytes = 2 * tokens * h
    rate = hw.tflops * 1e12
    allreduce = 2 * (tp - 1) / tp * act_bytes / (hw.nvlink_gbps * 1e9) if tp > 1 else 0.0

    slowest = 0.0
    for st in stages(model, pp, tp, seq):
        flops = tokens * (st.blocks * f_block + st.last * f_head)
        n_allreduce = st.blocks * (6 if act_ckpt else 4) + st.first + st.last
        t = flops / (tp * rate) + n_allreduce * allreduce
        if pp > 1:  # activations forward, gradients backward: a TP partition each, gathered over TP
            t += (2 * act_bytes / tp / link_bytes_per_s(hw, tp * dp)
                  + 2 * (tp - 1) / tp * act_bytes / (hw.nvlink_gbps * 1e9))
        slowest = max(slowest, t)
    t_dp = (2 * 4 * params + 2 * params) * (dp - 1) / dp / link_bytes_per_s(hw, tp)  # DP ranks are tp apart
    t_opt = (36 * params / dp + 12 * params) / (hw.hbm_gbps * 1e9)
    return (gas + pp - 1) * slowest + t_dp + tied_allreduce_s(model, hw, tp, pp, dp) + t_opt


def tied_allreduce_s(model: ModelConfig, hw: Hardware, tp: int, pp: int, dp: int) -> float:
    """DeepSpeed's ReduceTiedGrads: the tied weight's fp32 gradient all-reduced between its two copies (first and
    last stage, (pp - 1) tp dp ranks apart); nothing when untied or at pp = 1 (one module holds it)."""
    if not tied(model) or pp == 1:
        return 0.0
    rows, hidden = shard_shape(model, tie_owners()["embedding"], tp)
    return 4 * rows * hidden / link_bytes_per_s(hw, (pp - 1) * tp * dp)


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(model: ModelConfig, hw: Hardware, seq: int, global_batch: int, tp: Optional[int] = None,
               pp: Optional[int] = None, micro: Optional[int] = None,
               act_ckpt: Optional[bool] = None) -> list[Layout]:
    """Every valid layout (optionally restricted), fitting or not, fastest first."""
    out = []
    for t in _divisors(hw.gpus_per_node):
        if model.num_heads % t or model.num_kv_heads % t or (tp and t != tp):
            continue
        for p in _divisors(hw.world // t):
            if p > model.num_layers or (pp and p != pp):
                continue
            dp = hw.world // (t * p)
            for m in ([micro] if micro else [1, 2, 4, 8, 16]):
                if global_batch % (m * dp):
                    continue
                gas = global_batch // (m * dp)
                for ckpt in ([act_ckpt] if act_ckpt is not None else [False, True]):
                    mems = estimate(model, t, p, dp, m, gas, seq, ckpt)
                    seconds = step_time(model, hw, t, p, dp, m, gas, seq, ckpt, max(x.params for x in mems))
                    out.append(Layout(t, p, dp, m, gas, ckpt, heaviest(mems), seconds,
                                      heaviest(mems).peak <= hw.budget))
    return sorted(out, key=lambda la: la.step_s)


def _nodes_needed(model: ModelConfig, hw: Hardware, seq: int) -> Optional[int]:
    """The fewest nodes (doubling) on which the leanest layout fits: largest tp, all GPUs in the pipeline."""
    tp = max(t for t in _divisors(hw.gpus_per_node) if model.num_heads % t == 0 and model.num_kv_heads % t == 0)
    nodes = hw.nodes
    while nodes < 4096:
        nodes *= 2
        pp = min(nodes * hw.gpus_per_node // tp, model.num_layers)
        while (nodes * hw.gpus_per_node) % (tp * pp):
            pp -= 1
        dp = nodes * hw.gpus_per_node // (tp * pp)
        if heaviest(estimate(model, tp, pp, dp, 1, pp, seq, True)).peak <= hw.budget:
            return nodes
    return None


def plan(model: ModelConfig, hw: Hardware, seq: int, global_batch: int, **only) -> tuple[Layout, list[Layout]]:
    """(best, every candidate fastest first); ConfigError when nothing is valid or nothing fits."""
    restricted = {k: v for k, v in only.items() if v is not None}
    for what, value in (("--nodes", hw.nodes), ("--gpus-per-node", hw.gpus_per_node), ("--seq", seq),
                        ("--global-batch", global_batch), ("--gpu-memory", hw.gpu_memory_gb),
                        ("--tflops", hw.tflops), ("--nvlink-gbps", hw.nvlink_gbps),
                        ("--network-gbps", hw.network_gbps), ("--hbm-gbps", hw.hbm_gbps),
                        *((f"--{k.replace('_', '-')}", v) for k, v in restricted.items() if not isinstance(v, bool))):
        if value <= 0:
            raise ConfigError(f"{what} must be a positive number, got {value:g}")
    if not 0 <= hw.reserve_gb < hw.gpu_memory_gb:
        raise ConfigError(f"--reserve {hw.reserve_gb:g} GB must be >= 0 and below --gpu-memory "
                          f"{hw.gpu_memory_gb:g} GB")
    if seq > model.max_position_embeddings:
        raise ConfigError(f"--seq {seq} exceeds {model.name}'s max_position_embeddings "
                          f"{model.max_position_embeddings}; use --seq <= {model.max_position_embeddings}")
    every = candidates(model, hw, seq, global_batch, **only)
    where = f"{hw.nodes} node(s) x {hw.gpus_per_node} GPUs"
    given = "".join(f" --{k.replace('_', '-')} {str(v).lower()}" for k, v in restricted.items())
    if not every:
        raise ConfigError(f"no valid layout of {model.name} on {where} with --global-batch {global_batch}{given}: "
                          f"tp must divide {model.num_heads} heads, {model.num_kv_heads} KV heads and "
                          f"{hw.gpus_per_node} GPUs per node, pp <= {model.num_layers} layers, and micro x dp must "
                          f"divide the global batch; use a global batch that is a multiple of {hw.world}"
                          f"{' or drop' + given if given else ''}")
    fitting = [la for la in every if la.fits]
    if not fitting:
        leanest = min(every, key=lambda la: la.memory.peak)
        more = "" if restricted else _more_nodes(model, hw, seq)
        raise ConfigError(f"nothing fits: {model.name} at seq {seq} on {where} with {hw.gpu_memory_gb:g} GB needs "
                          f"at least {leanest.memory.peak / GB:.0f} GB per GPU ({leanest.name()}; "
                          f"{hw.reserve_gb:g} GB reserved); {more}use more nodes, a shorter --seq or larger GPUs")
    return fitting[0], every


def _more_nodes(model: ModelConfig, hw: Hardware, seq: int) -> str:
    nodes = _nodes_needed(model, hw, seq)
    return f"by this model it needs >= {nodes} nodes; " if nodes else ""


def recipe_lines(model: str, best: Layout, global_batch: int, seq: int) -> list[str]:
    """What to paste into a recipe (recipes/launch.sh's variables; GAS empty so GLOBAL decides it)."""
    values = {"MODEL": model, "TP": best.tp, "PP": best.pp, "MICRO": best.micro, "GAS": "", "GLOBAL": global_batch,
              "SEQ": seq, "ACT_CKPT": "true" if best.act_ckpt else "false"}
    return [f"{k}=${{{k}-{v}}}" for k, v in values.items()]


def _table(rows: list[Layout], budget: float) -> list[str]:
    """Fitting layouts are numbered in rank order; the ones that do not fit are marked, not numbered."""
    out = [f"{'rank':>4} {'tp':>3} {'pp':>3} {'dp':>4} {'micro':>5} {'gas':>5} {'ckpt':>4} {'GB/GPU':>7} "
           f"{'bubble':>7} {'step s':>8}  fits"]
    rank = 0
    for la in rows:
        rank += la.fits
        fits = "yes" if la.fits else f"NO: {la.memory.peak / GB:.0f} > {budget / GB:.0f} GB"
        out.append(f"{rank if la.fits else '-':>4} {la.tp:>3} {la.pp:>3} {la.dp:>4} {la.micro:>5} {la.gas:>5} "
                   f"{'yes' if la.act_ckpt else 'no':>4} {la.memory.peak / GB:>7.1f} {la.bubble:>7.1%} "
                   f"{la.step_s:>8.2f}  {fits}")
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="preset name, checkpoint dir or HF config.json")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory", type=float, required=True, help="GB per GPU, e.g. 80")
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--reserve", type=float, default=Hardware.reserve_gb, help="GB kept free per GPU (CUDA, NCCL)")
    p.add_argument("--tflops", type=float, default=Hardware.tflops, help="sustained bf16 TFLOP/s per GPU")
    p.add_argument("--nvlink-gbps", type=float, default=Hardware.nvlink_gbps, help="intra-node GB/s")
    p.add_argument("--network-gbps", type=float, default=Hardware.network_gbps, help="inter-node GB/s per GPU")
    p.add_argument("--hbm-gbps", type=float, default=Hardware.hbm_gbps, help="GPU memory bandwidth, GB/s")
    p.add_argument("--tp", type=int, help="only this tp")
    p.add_argument("--pp", type=int, help="only this pp")
    p.add_argument("--micro", type=int, help="only this micro-batch size")
    p.add_argument("--act-ckpt", choices=["true", "false"], help="only with / without activation checkpointing")
    p.add_argument("--top", type=int, default=15, help="rows to list")


def run(ns: argparse.Namespace) -> int:
    quiet_deepspeed_import()
    model = model_config(ns.model)
    hw = Hardware(ns.nodes, ns.gpus_per_node, ns.gpu_memory, ns.reserve, ns.tflops, ns.nvlink_gbps, ns.network_gbps,
                  ns.hbm_gbps)
    if ns.top < 1:
        raise ConfigError(f"--top must be a positive number, got {ns.top}")
    ckpt = None if ns.act_ckpt is None else ns.act_ckpt == "true"
    best, every = plan(model, hw, ns.seq, ns.global_batch, tp=ns.tp, pp=ns.pp, micro=ns.micro, act_ckpt=ckpt)
    tokens = ns.seq * ns.global_batch
    fitting = [la for la in every if la.fits]
    print(f"{model.name} on {hw.nodes} x {hw.gpus_per_node} GPUs ({hw.gpu_memory_gb:g} GB, {hw.reserve_gb:g} "
          f"reserved), seq {ns.seq}, global batch {ns.global_batch} ({tokens / 1e6:.2f}M tokens): "
          f"{len(fitting)} of {len(every)} layouts fit. Fastest first, with up to 5 faster ones that do not fit:")
    shown = fitting[:ns.top] + [la for la in every if not la.fits and la.step_s < best.step_s][:5]
    print("\n".join(_table(sorted(shown, key=lambda la: la.step_s), hw.budget)))
    if len(fitting) > ns.top:
        print(f"({len(fitting) - ns.top} slower layouts that fit not shown; --top N lists more)")
    print(f"\nbest: {best.name()}: {best.step_s:.1f} s/step predicted ({tokens / best.step_s:,.0f} tokens/s), "
          f"bubble {best.bubble:.1%}, {best.memory.line(best.pp)}")
    print("recipe lines (recipes/<model>.sh):")
    print("\n".join(recipe_lines(ns.model, best, ns.global_batch, ns.seq)))
    print(f"launch: NNODES={hw.nodes} GPUS_PER_NODE={hw.gpus_per_node} recipes/launch.sh RECIPE "
          f"(or sbatch --nodes={hw.nodes} slurm/train.sh RECIPE)")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="rank (tp, pp, micro, gas, checkpointing) layouts for a cluster",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(run=run)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="threed plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    ns = p.parse_args(argv)
    return guarded("threed plan", lambda: run(ns), prefix="")


if __name__ == "__main__":
    sys.exit(main())
