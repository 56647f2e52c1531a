"""Expected memory per GPU for a recipe's layout (what the recipe headers quote; `THREED_DRY_RUN=1` prints it).

    python -m threed.memory --model llama3.1-70b --tp 8 --pp 4 --dp 1 --micro 1 --gas 512 --seq 8192 --act-ckpt 1

The model of memory, per GPU of the heaviest pipeline stage (stages hold ceil(layers / PP) blocks; the first adds
the embedding, the last the final norm and LM head; tensors are split over TP, norms are replicated):

  weights      2 B/param   bf16 parameters
  grads        6 B/param   bf16 .grad (2 B) + DeepSpeed BF16_Optimizer's fp32 accumulation buffer (4 B, not sharded)
  optimizer   12 B/param / DP   fp32 master copy + AdamW m and v, sharded over DP by ZeRO-1
  activations  bf16, per micro-batch and block, without sequence parallelism, flash-style attention (no s x s
               scores): 2 s b (4 h + (2 h + 3 kv d) / TP + h / TP + 3 f / TP) bytes; 1F1B keeps min(PP, GAS)
               micro-batches in flight on the first stage. With activation checkpointing a block keeps only its
               input (2 s b h) and one block at a time is recomputed in full. The last stage adds fp32
               vocab-parallel logits for one micro-batch (4 s b V / TP).

Not included: CUDA context, NCCL buffers, allocator fragmentation (budget several GB) and communication buffers of
DeepSpeed's pipeline (a few s b h tensors).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from threed.presets import get_model_config

GB = 1e9


@dataclass(frozen=True)
class Estimate:
    params: int  # parameters on the heaviest GPU
    weights: float  # bytes
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    def line(self) -> str:
        unit, scale = ("GB", GB) if self.total >= GB else ("MB", 1e6)
        parts = " + ".join(f"{name} {value / scale:.1f}" for name, value in (
            ("weights", self.weights), ("grads", self.grads), ("optimizer", self.optimizer),
            ("activations", self.activations)))
        params = f"{self.params / 1e9:.2f}B" if self.params >= 1e8 else f"{self.params / 1e6:.2f}M"
        return (f"~{self.total / scale:.0f} {unit}/GPU = {parts} ({params} params on the heaviest GPU; "
                f"plus CUDA/NCCL overhead)")


def estimate(model: str, tp: int, pp: int, dp: int, micro: int, gas: int, seq: int, act_ckpt: bool) -> Estimate:
    m = get_model_config(model)
    h, f, d, kv = m.hidden_size, m.ffn_hidden_size, m.head_dim, m.num_kv_heads
    block_split = h * (m.num_heads * d) + 2 * h * (kv * d) + (m.num_heads * d) * h + 3 * h * f  # split over TP
    block = block_split // tp + 2 * h  # + two replicated RMSNorm weights
    layers = math.ceil(m.num_layers / pp)
    vocab = m.padded_vocab_size(tp) * h // tp
    first = layers * block + vocab
    last = layers * block + vocab + h if pp > 1 else first + vocab + h
    params = max(first, last)

    s, b = seq, micro
    per_block = 2 * s * b * (4 * h + (2 * h + 3 * kv * d) // tp + h // tp + 3 * f // tp)
    in_flight = min(pp, gas) if pp > 1 else 1
    if act_ckpt:
        stored = layers * in_flight * 2 * s * b * h + per_block
    else:
        stored = layers * in_flight * per_block
    logits = 4 * s * b * m.padded_vocab_size(tp) // tp
    # The first stage holds the most micro-batches; the last stage holds one, plus the logits.
    last_stage_act = (layers * 2 * s * b * h + per_block if act_ckpt else layers * per_block) + logits
    activations = max(stored, last_stage_act) if pp > 1 else stored + logits
    return Estimate(params=params, weights=2.0 * params, grads=6.0 * params, optimizer=12.0 * params / dp,
                    activations=float(activations))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    for name in ("tp", "pp", "dp", "micro", "gas", "seq"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--act-ckpt", default="0", help="1/true: activation checkpointing")
    a = p.parse_args(argv)
    ckpt = a.act_ckpt.lower() in ("1", "true", "yes", "on")
    print(estimate(a.model, a.tp, a.pp, a.dp, a.micro, a.gas, a.seq, ckpt).line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
