"""Scenarios that misbehave on purpose, for tests/ranks/test_rank_pool.py: `ok` writes each rank's rank and world size
as OUT/probe_rank<R>.json, `raise` makes the last rank raise while the others wait for it in a barrier (a collective
that will never complete), `sleep` outlives any short timeout, `exit3` exits 3 on every rank. `groups` (no
misbehaviour: the launch's group sharing) makes megatron-core's groups and a pair group twice, named differently,
and writes whether the second calls returned the first calls' groups, and the process's thread count. `spin` keeps
each rank's CPU busy for SPIN_CPU_SECONDS (what the pool's request timings must count on every rank).

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/probe_worker.py raise --out /tmp/p
"""

from __future__ import annotations

import argparse
import time

import torch.distributed as dist
from megatron.core import parallel_state

# worker_setup first: the shared start of every worker
from worker_setup import rank_json, run_worker
from dispatch_worker import process_status
from threed.parallel.distributed import Runtime, init_megatron_parallel_state


def ok(args: argparse.Namespace, rt: Runtime) -> None:
    dist.barrier()
    rank_json(args.out, "probe", {"rank": rt.rank, "world": rt.world_size})


def raise_on_last(args: argparse.Namespace, rt: Runtime) -> None:
    if rt.rank == rt.world_size - 1:
        raise ValueError(f"planted failure on rank {rt.rank}")
    dist.barrier()


SPIN_CPU_SECONDS = 0.5


def spin(args: argparse.Namespace, rt: Runtime) -> None:
    end = time.process_time() + SPIN_CPU_SECONDS
    while time.process_time() < end:
        pass


def sleep(args: argparse.Namespace, rt: Runtime) -> None:
    time.sleep(3600)


def groups(args: argparse.Namespace, rt: Runtime) -> None:
    made = []
    for name in ("first", "second"):
        init_megatron_parallel_state(tp=rt.world_size, pp=1)
        made.append((parallel_state.get_tensor_model_parallel_group(), dist.new_group([0, 1], group_desc=name)))
    threads = process_status()["threads"]  # what each request's .done file records
    rank_json(args.out, "groups", {"same": [a is b for a, b in zip(*made)], "threads": threads})


def exit3(args: argparse.Namespace, rt: Runtime) -> int:
    return 3


if __name__ == "__main__":
    raise SystemExit(
        run_worker({"ok": ok, "raise": raise_on_last, "sleep": sleep, "exit3": exit3, "groups": groups, "spin": spin})
    )
