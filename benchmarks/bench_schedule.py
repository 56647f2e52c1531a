"""Pipeline schedules against each other: the benchmark model of `bench_pipeline.py` (its worker, one thread per
rank, fp32, synthetic batches, the metrics writer's per-stage timings) at pp2 and pp4 with gas = 2·pp, under
`--pipeline-schedule 1f1b`, `zb-h1` and interleaved 1F1B at `--vpp 2` (one launch each, alternating `--rounds`
times). Prints each stage's idle fraction (time blocked on its neighbours / time in the pipelined phase,
`threed.metrics.stages`) under each, next to what `threed.parallel.schedule.simulate` predicts in unit costs, and
each schedule's step-time ratio and mean idle against 1f1b's.

    .venv/bin/python benchmarks/bench_schedule.py [--pps 2,4] [--gas 0] [--rounds 2] [--wait-quiet 120]

On a machine with fewer cores than ranks (pp4 on 2 cores) the ranks take turns on the cores: a stage that idles
lends its core to another, so the step time shows little of any bubble and the ratio says nothing about a GPU
cluster; the idle fractions still count the waits.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import MODEL, launch, measured_partition, sample_run_queue  # noqa: E402  (its worker and model)

# name -> (--pipeline-schedule, --vpp)
SCHEDULES = {"1f1b": ("1f1b", 1), "zb-h1": ("zb-h1", 1), "1f1b-vpp2": ("1f1b", 2)}


def measure(a: argparse.Namespace, pp: int, gas: int, schedule: str, out: str) -> dict:
    """One launch: the step time (median chunk; a step ends on the slowest rank) and the writer's per-stage idle
    fractions, over the chunks that ran alone under --wait-quiet."""
    b = copy.copy(a)
    b.gas, (b.schedule, b.vpp) = gas, SCHEDULES[schedule]
    ranks = launch(b, pp, out)
    quiet = [i for i, q in enumerate(ranks[0]["queues"]) if not a.wait_quiet or q <= pp + 1] or list(range(a.repeats))
    steps = [max(r["chunks"][i] for r in ranks) for i in quiet]
    writer = next(r for r in ranks if r["writer"])
    idle = [statistics.mean(writer["idle"][i][f"stage{s}/idle-fraction"] for i in quiet) for s in range(pp)]
    compute = [statistics.mean(writer["idle"][i][f"stage{s}/compute-time"] for i in quiet) for s in range(pp)]
    return {
        "step": statistics.median(steps),
        "idle": idle,
        "compute": compute,
        "chunks": len(quiet),
        "loss": writer["loss"],
    }


def main() -> int:
    import threading

    from threed.parallel.schedule import simulate

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pps", default="2,4")
    p.add_argument("--gas", type=int, default=0, help="0: 2·pp")
    p.add_argument("--micro", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=MODEL["num_layers"])
    p.add_argument(
        "--vocab",
        type=int,
        default=MODEL["vocab_size"],
        help="the LM head's size: at 4096 it costs 1.3 blocks and no partition balances the two ranks (1.16x)",
    )
    p.add_argument(
        "--partition",
        default="balanced",
        help="--partition-method, or `measured` (threed profile-layers' costs:..., as bench_pipeline.py)",
    )
    p.add_argument("--repeats", type=int, default=3, help="chunks per launch")
    p.add_argument("--steps", type=int, default=6, help="steps per chunk")
    p.add_argument("--rounds", type=int, default=1, help="launches per schedule and layout (alternating)")
    p.add_argument("--wait-quiet", type=float, default=0, metavar="SECONDS")
    a = p.parse_args()
    if a.partition == "measured":
        a.partition = measured_partition(a)
    queue: list[int] = []
    sampling = threading.Event()
    threading.Thread(target=sample_run_queue, args=(queue, sampling), daemon=True).start()
    print(
        f"model hidden {MODEL['hidden_size']}, {a.layers} layers, vocab {a.vocab}, seq {a.seq}, fp32, "
        f"micro {a.micro}, 1 thread per rank, partition {a.partition}; {os.cpu_count()} cores",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out:
        for pp in (int(x) for x in a.pps.split(",")):
            gas = a.gas or 2 * pp
            runs: dict[str, list[dict]] = {s: [] for s in SCHEDULES}
            for _ in range(a.rounds):
                for schedule in SCHEDULES:
                    runs[schedule].append(measure(a, pp, gas, schedule, out))
            got = {
                s: {
                    "step": statistics.median(r["step"] for r in rs),
                    "idle": [statistics.mean(r["idle"][k] for r in rs) for k in range(pp)],
                    "compute": [statistics.mean(r["compute"][k] for r in rs) for k in range(pp)],
                }
                for s, rs in runs.items()
            }
            for s, (schedule, vpp) in SCHEDULES.items():
                unit = simulate(schedule, pp, gas, vpp=vpp)[1]
                print(
                    f"pp{pp} gas{gas} {s:>5}: step {got[s]['step'] * 1000:.0f} ms; idle per stage "
                    + " ".join(f"{x * 100:.1f}%" for x in got[s]["idle"])
                    + f" (unit-cost model {unit[0] * 100:.1f}%); compute per stage "
                    + " ".join(f"{x * 1000:.0f}" for x in got[s]["compute"])
                    + " ms",
                    flush=True,
                )
            base = got["1f1b"]
            for s in list(SCHEDULES)[1:]:
                print(
                    f"pp{pp} gas{gas}: {s} speed-up over 1f1b {base['step'] / got[s]['step']:.3f}x; mean idle "
                    f"{statistics.mean(got[s]['idle']) * 100:.1f}% vs {statistics.mean(base['idle']) * 100:.1f}% "
                    f"({statistics.mean(got[s]['idle']) / statistics.mean(base['idle']):.2f} of 1f1b's); losses "
                    f"{runs['1f1b'][0]['loss']:.6f} / {runs[s][0]['loss']:.6f}",
                    flush=True,
                )
    sampling.set()
    if queue:
        mean = statistics.mean(queue)
        print(f"run queue during the runs: mean {mean:.1f}, max {max(queue)} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
