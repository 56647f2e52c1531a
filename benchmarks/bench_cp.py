"""Context parallelism on CPU: one long sequence through threed.model.context's attention (Llama 3's all-gather-K/V,
2·cp zigzag chunks) at cp 1, 2 and 4, forward + backward, bf16, one thread per rank; per-rank time and bytes moved
as ratios from one run, and the bytes checked against the planner's count (`threed.memory.model.kv_row_bytes`, the
K/V all-gather and dK/dV reduce-scatter that `threed.plan.steptime.cp_collective_s` prices).

    .venv/bin/python benchmarks/bench_cp.py [--seq 4096] [--repeats 5]

Training-level CP is not wired yet (issue 27's other half), so this runs the attention core alone: the layer whose
work and traffic CP changes (the linears and norms only see s / cp tokens). One CP group runs at a time, the other
ranks wait: cp 4 puts 4 ranks on this machine's 2 cores, so its wall time includes waiting for a core; its CPU time
(process time, one thread) does not, and is the per-rank work to compare.

A CPU number is not a GPU number: gloo on 2 shared cores against NCCL on NVLink, an exact masked SDPA that builds a
chunk x prefix mask against flash varlen without one. That masked SDPA computes every score it is given, masked or
not: at cp 1 the whole s x s square, at cp > 1 each query chunk against its key prefix, (2cp+1)/(4cp^2) of the
square per rank (5/16 at cp 2: less than half, because the prefixes skip most of the masked triangle). A causal
kernel skips the triangle at any cp, and there the zigzag layout's share is 1/cp per rank (what the step-time model
counts). So the ratios say that CP divides each rank's attention work and that the bytes it moves are the model's,
not what an H100 node will see (`threed plan`'s step-time model is for that).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64  # a GQA ratio of Llama's (4 query heads per KV head)
DEGREES = (1, 2, 4)
WORLD = max(DEGREES)


def _count_collectives(context, moved: dict[str, int]) -> None:
    """Wrap the CP module's two collectives (its one place for them) to add the bytes each rank sends or receives:
    an all-gather receives (cp - 1) / cp of its output, a reduce-scatter sends (cp - 1) / cp of its input."""
    gather, scatter = context._all_gather_rows, context._reduce_scatter_rows

    def counted_gather(x, group):
        out = gather(x, group)
        moved["gather"] += out.numel() * out.element_size() - x.numel() * x.element_size()
        return out

    def counted_scatter(x, group):
        out = scatter(x, group)
        moved["scatter"] += x.numel() * x.element_size() - out.numel() * out.element_size()
        return out

    context._all_gather_rows, context._reduce_scatter_rows = counted_gather, counted_scatter


def _one_case(a: argparse.Namespace, cp: int, group, rank: int) -> dict:
    """Forward + backward of this rank's share, `a.repeats` times after one warm-up: median wall and CPU seconds,
    and the bytes the CP collectives moved per pass."""
    import torch

    import threed.model.context as context

    gen = torch.Generator().manual_seed(0)  # the same row on every rank; each takes its share
    q, k, v = (
        torch.randn(a.seq, 1, n, HEAD_DIM, generator=gen).to(torch.bfloat16) for n in (HEADS, KV_HEADS, KV_HEADS)
    )
    local = [context.split(t, cp, rank % cp, dim=0).requires_grad_() for t in (q, k, v)]
    moved = {"gather": 0, "scatter": 0}
    _count_collectives(context, moved)
    wall, cpu = [], []
    for i in range(a.repeats + 1):
        moved.update(gather=0, scatter=0)
        t0, c0 = time.perf_counter(), time.process_time()
        out = context.context_parallel_attention(*local, group)
        out.float().square().mean().backward()
        if i:  # the first is a warm-up
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu), **moved}


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from threed.parallel.distributed import init_distributed

    rt = init_distributed()
    # Every rank makes every group, in one order (torch's rule); a cp group is ranks [g cp, (g + 1) cp).
    groups = {cp: [dist.new_group(list(range(g * cp, (g + 1) * cp))) for g in range(WORLD // cp)] for cp in DEGREES}
    result = {}
    for cp in DEGREES:
        dist.barrier()
        if rt.rank < cp:  # one group at a time: the first
            result[cp] = _one_case(a, cp, groups[cp][0], rt.rank)
        dist.barrier()
    Path(a.out, f"rank{rt.rank}.json").write_text(json.dumps(result))


def predicted_bytes(seq: int, cp: int) -> int:
    """The planner's bytes per rank for one all-gather of K and V (and the same for the reduce-scatter of dK, dV)."""
    from threed.config import ModelConfig
    from threed.memory.model import kv_row_bytes

    h = HEADS * HEAD_DIM  # the rest is the config's required fields; the count reads KV heads and head_dim only
    model = ModelConfig("bench", 256, h, 1, HEADS, KV_HEADS, 4 * h, seq)
    return kv_row_bytes(model, 1, seq, 1) * (cp - 1) // cp


def report(a: argparse.Namespace, ranks: list[dict]) -> None:
    per = {cp: [r[str(cp)] for r in ranks if str(cp) in r] for cp in DEGREES}
    print(
        f"seq {a.seq}, {HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}, bf16, attention core forward + backward, "
        f"1 thread per rank, median of {a.repeats} (CPU: not a GPU number)"
    )
    base = per[1][0]
    for cp, rows in per.items():
        wall, cpu = max(r["wall_s"] for r in rows), max(r["cpu_s"] for r in rows)  # a step ends on the slowest
        gather, scatter = rows[0]["gather"], rows[0]["scatter"]
        want = predicted_bytes(a.seq, cp)
        ok = all(r["gather"] == r["scatter"] == want for r in rows)
        square = (2 * cp + 1) / (4 * cp * cp) if cp > 1 else 1.0  # of the s x s scores this rank's SDPA computes
        print(
            f"cp{cp}: per rank {cpu * 1000:.0f} ms CPU ({cpu / base['cpu_s']:.3f}x cp1; scores computed "
            f"{square:.3f}x, a causal kernel's work {1 / cp:.3f}x), "
            f"{wall * 1000:.0f} ms wall ({wall / base['wall_s']:.3f}x); moved per rank: all-gather {gather:,} B, "
            f"reduce-scatter {scatter:,} B; the model's count {want:,} B each: {'equal' if ok else 'DIFFERENT'}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--seq", type=int, default=4096, help="tokens of the one sequence (a multiple of 2 x 4)")
    p.add_argument("--repeats", type=int, default=5, help="timed forward + backward passes per degree (median)")
    a = p.parse_args()
    if a.worker:
        worker(a)
        return 0
    from threed.parallel.launch import run_ranks

    with tempfile.TemporaryDirectory() as out:
        argv = ["--worker", "--out", out, "--seq", str(a.seq), "--repeats", str(a.repeats)]
        run_ranks(WORLD, os.path.abspath(__file__), argv, env={"OMP_NUM_THREADS": "1"}, timeout=3600)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]
    report(a, ranks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
