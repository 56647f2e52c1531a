"""Sequence parallelism and recompute on CPU: step time with Megatron's sequence parallelism against without it
(tp 2 pp 2, 4 ranks, one thread each, bf16, a small Llama), every block recomputed against none, and the first N
blocks of each stage recomputed (Megatron's full / block / N, --partial N, default 2 of 4; 0 skips it) against
every block. All ratios from one run.

    .venv/bin/python benchmarks/bench_sp.py [--steps 6] [--seq 512] [--partial 2]

A CPU number is not a GPU number: gloo's all-gather / reduce-scatter on 2 shared cores against NCCL on NVLink,
and CPU kernels whose speed depends on other things than a GPU's. The ratios say that the code paths run and
what they cost here, not what an H100 node will see (`threed plan`'s step-time model is for that).
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


def cases(partial: int) -> dict[str, dict]:
    """name -> (ParallelConfig, TrainConfig) extra fields."""
    out = {
        "tp": ({}, {}),
        "sp": ({"sequence_parallel": True}, {}),
        "sp_full": ({"sequence_parallel": True}, {"activation_checkpointing": True}),
    }
    if partial:
        out["sp_partial"] = (
            {"sequence_parallel": True},
            {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": partial},
        )
    return out


def worker(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from threed.config import ModelConfig, ParallelConfig, RunConfig, TrainConfig
    from threed.parallel.distributed import init_distributed
    from threed.engine.build import build_engine
    from threed.engine.resolved import resolve

    rt = init_distributed()
    gen = torch.Generator().manual_seed(0)
    result = {}
    for name, (parallel, train) in cases(a.partial).items():
        cfg = RunConfig(
            model=ModelConfig(name="bench", **MODEL),
            parallel=ParallelConfig(tp=2, pp=2, **parallel),
            train=TrainConfig(
                dtype="bf16", micro_batch_size=1, grad_accum_steps=a.gas, seq_length=a.seq, steps=a.steps + 2, **train
            ),
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
        result[name] = {"step_s": statistics.median(times), "loss": loss}
        del engine
    Path(a.out, f"rank{rt.rank}.json").write_text(json.dumps(result))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=6, help="timed steps per case (median), after 2 warm-up steps")
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument(
        "--partial",
        type=int,
        default=2,
        metavar="N",
        help="also recompute the first N blocks of each stage (0: skip that case)",
    )
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    from threed.parallel.launch import run_ranks

    with tempfile.TemporaryDirectory() as out:
        run_ranks(
            4,
            os.path.abspath(__file__),
            [
                "--worker",
                "--out",
                out,
                "--steps",
                str(a.steps),
                "--gas",
                str(a.gas),
                "--seq",
                str(a.seq),
                "--partial",
                str(a.partial),
            ],
            env={"OMP_NUM_THREADS": "1"},
            timeout=3600,
        )
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(4)]
    step = {name: max(r[name]["step_s"] for r in ranks) for name in ranks[0]}  # a step ends on the slowest rank
    print(
        f"model hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers, seq {a.seq}, bf16, tp 2 pp 2, "
        f"micro 1 x gas {a.gas}, 1 thread per rank, median of {a.steps} steps (CPU: not a GPU number)"
    )
    for name, s in step.items():
        print(f"{name}: {s * 1000:.0f} ms/step, loss {ranks[-1][name]['loss']:.4f}")
    print(f"sequence parallel / tensor parallel: {step['sp'] / step['tp']:.3f}x step time")
    print(f"every block recomputed / none (with SP): {step['sp_full'] / step['sp']:.3f}x step time")
    if "sp_partial" in step:
        print(
            f"first {a.partial} blocks per stage recomputed / every block (with SP): "
            f"{step['sp_partial'] / step['sp_full']:.3f}x step time"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
