"""Random-init time of one Llama 3.1 70B pipeline stage (tp8 pp4: 20 blocks per stage) on CPU, measured on one
block and extrapolated (every block has the same shapes, and blocks are drawn one after another), ours vs
megatron-core's `use_cpu_initialization` (each TP rank draws the full unsharded master weight, then keeps 1/tp).

    .venv/bin/python benchmarks/bench_init.py [--model llama3.1-70b --tp 8 --pp 4 --threads 2]

Ours draws only the rank's shard, row by row on a thread pool (`threed.model.init`). The baseline is timed with
the same torch normal_ on the full master shapes, on one thread as megatron does.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from threed.model.init import shard_of
from threed.convert.resolve import model_config
from threed.model.spec import full_shape, layer_parameters


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3.1-70b")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    m = model_config(a.model)
    params = layer_parameters("block")
    blocks_per_stage = m.num_layers // a.pp

    os.environ["THREED_INIT_THREADS"] = str(a.threads)
    t0 = time.perf_counter()
    ours_bytes = 0
    for param in params:
        t = shard_of(m, 1, param, a.tp, 0, seed=1234)
        ours_bytes += t.numel() * 4
    ours = time.perf_counter() - t0

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    peak = 0
    for param in params:
        master = torch.empty(*full_shape(m, param, a.tp)).normal_(0, 0.02)  # megatron's _initialize_affine_weight_cpu
        peak = max(peak, master.numel() * 4)
        del master
    base = time.perf_counter() - t0
    print(
        f"{a.model} tp{a.tp} pp{a.pp}: one block on one rank: ours {ours:.2f} s ({a.threads} threads, "
        f"{ours_bytes / 2**20:.0f} MiB drawn), megatron full-master {base:.2f} s (largest master "
        f"{peak / 2**30:.2f} GiB)"
    )
    print(
        f"one stage = {blocks_per_stage} blocks: ours ~{ours * blocks_per_stage:.0f} s, megatron "
        f"~{base * blocks_per_stage:.0f} s; ratio ours/megatron = {ours / base:.3f}"
    )


if __name__ == "__main__":
    main()
