"""LoRA against a full fine-tune on CPU: the step time of `--lora-rank R` (adapters on every linear, the base frozen)
against training every weight, at the same layout (tp 2 pp 2, 4 ranks, one thread each, bf16, a small Llama), in one
run; the trainable elements of each beside.

    .venv/bin/python benchmarks/bench_lora.py [--steps 6] [--seq 512] [--rank 16]

What LoRA saves per step: the base's weight-gradient GEMMs (a third of a block's matmul FLOPs), its fp32 gradient
accumulation, the DP all-reduce and AdamW over the base (`threed.plan.steptime` models the same: W is the adapters'
alone). What it adds: the adapters' small matmuls and their TP collectives. A CPU number is not a GPU number: gloo on
2 shared cores and CPU kernels; the ratio says what the code path costs here (`threed memory --lora-rank` and `threed
plan --lora-rank` give the model's GPU figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

MODEL = dict(
    vocab_size=2048,
    hidden_size=256,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden_size=704,
    max_position_embeddings=1024,
)


def time_case(a: argparse.Namespace, rt, lora_rank: int) -> dict:
    """One engine (full fine-tune at rank 0, else LoRA), 2 warm-up steps, then the median of `a.steps`."""
    import torch

    from threed.config import LoraConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
    from threed.engine.build import build_engine
    from threed.engine.resolved import resolve

    gen = torch.Generator().manual_seed(0)
    cfg = RunConfig(
        model=ModelConfig(name="bench", **MODEL),
        parallel=ParallelConfig(tp=2, pp=2),
        train=TrainConfig(
            dtype="bf16", micro_batch_size=1, grad_accum_steps=a.gas, seq_length=a.seq, steps=a.steps + 2, lr=1e-4
        ),
        lora=LoraConfig(lora_rank=lora_rank, lora_alpha=2.0 * max(lora_rank, 1)),
    )
    engine = build_engine(resolve(cfg, rt.world_size), rt).engine

    def batches():
        while True:
            tokens = torch.randint(0, MODEL["vocab_size"], (1, a.seq + 1), generator=gen)
            yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    it = batches() if engine.is_first_stage() or engine.is_last_stage() else None
    times, loss = [], 0.0
    for step in range(a.steps + 2):  # 2 warm-up steps
        t0 = time.perf_counter()
        loss = engine.train_batch(data_iter=it).item()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in engine.module.parameters())
    return {"step_s": statistics.median(times), "loss": loss, "trainable": trainable, "total": total}


def worker(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from threed.parallel.distributed import init_distributed

    rt = init_distributed()
    result = {"full": time_case(a, rt, 0), "lora": time_case(a, rt, a.rank)}
    Path(a.out, f"rank{rt.rank}.json").write_text(json.dumps(result))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=6, help="timed steps per case (median), after 2 warm-up steps")
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (a multiple of tp 2)")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    from threed.parallel.launch import run_ranks

    args = ["--worker", "--steps", str(a.steps), "--gas", str(a.gas), "--seq", str(a.seq), "--rank", str(a.rank)]
    with tempfile.TemporaryDirectory() as out:
        run_ranks(4, os.path.abspath(__file__), [*args, "--out", out], env={"OMP_NUM_THREADS": "1"}, timeout=3600)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]
    step = {name: max(r[name]["step_s"] for r in ranks) for name in ranks[0]}  # a step ends on the slowest rank
    print(
        f"model hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers, seq {a.seq}, bf16, tp 2 pp 2, "
        f"micro 1 x gas {a.gas}, 1 thread per rank, median of {a.steps} steps (CPU: not a GPU number)"
    )
    for name, s in step.items():
        # each TP/PP rank holds its own shard: the sum over ranks is the model (TP-replicated norms counted twice)
        trainable, total = (sum(r[name][k] for r in ranks) for k in ("trainable", "total"))
        print(
            f"{name}: {s * 1000:.0f} ms/step, loss {ranks[-1][name]['loss']:.4f}, trainable {trainable:,} of "
            f"{total:,} elements over the 4 ranks"
        )
    print(f"LoRA rank {a.rank} / full fine-tune: {step['lora'] / step['full']:.3f}x step time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
