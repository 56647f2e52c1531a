"""One torchrun launch that serves, one after another, every worker run a pytest session asks of its world size
(tests/ranks/rank_pool.py is the pytest side): each rank pays torch's, DeepSpeed's and megatron-core's start-up
once, instead of once per module. The ranks join the process group once, then wait for numbered requests in
--inbox and run each as torchrun would have run the worker script (`runpy`, as `__main__`, the request's argv in
sys.argv; the worker's run_worker finds the process group made), with the request's environment changes applied
for its duration. Between two requests they destroy what the worker left (`tear_down`: its engines and
megatron-core's state).

Process groups are shared by membership (`share_groups_by_membership`): a `new_group` call for ranks, backend and
timeout that an earlier call of this launch already made returns that group. One process of a real job builds one
engine and so makes each group once; a launch here builds dozens (several per request: 1F1B then ZB-H1, a run then
its resume), and each made afresh ~20 gloo groups per rank, each with three threads, one of them waking 100 times a
second (gloo's event loop polls with a 10 ms timeout). At 8 ranks on 2 cores those idle wake-ups took a third of
the CPU (`strace -c`: 155k epoll_wait calls in 20 s on one rank holding 475 threads; `perf stat -a`: 130k context
switches a second). Shared, test_context_parallel.py's launch went from 149 s to 79 s, with the same results.

Each rank writes its pid as inbox/rank<R>.pid first (torchrun starts each rank in a session of its own, so the
pytest side kills a hung launch's ranks by pid). Per request NNNN (inbox/NNNN.json) each rank writes
inbox/NNNN.rank<R>.done (seconds taken, this rank's CPU seconds, threads and resident memory after the tear-down)
or, when the worker raises or exits non-zero, inbox/NNNN.rank<R>.error (the traceback) and then ends its process:
the other ranks may be waiting in a collective that will never complete, so torchrun tears the launch down and the
pytest side starts a new one for the next request. A request {"stop": true} ends the launch; so does the pytest
process (--parent) going away. By hand (a request: {"worker": "dist_worker.py", "argv": ["parity", "--out",
"/tmp/x"]} as /tmp/in/0000.json):

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/dispatch_worker.py --inbox /tmp/in --parent $$
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import runpy
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch.distributed as dist
from torch.distributed import distributed_c10d

# worker_setup first: it puts tests/ on sys.path, as for any worker
import worker_setup  # noqa: F401
from threed.atomic import write_atomic
from threed.config import RunControlConfig
from threed.parallel.distributed import init_distributed

HERE = Path(__file__).resolve().parent
POLL_SECONDS = 0.2


def publish(path: Path, text: str) -> None:
    """`text` as `path`, whole or not at all (threed.atomic, as every file threed publishes). The pytest side polls for
    these names, reads the files at once and then SIGSTOPs the ranks, so a name it sees must already hold its text: a
    rank stopped between `open` and `write` left an empty done file (a JSONDecodeError in `make test`, 2026-11-30).
    The temporary name is hidden, so no poll's pattern matches it."""
    write_atomic(path, text)


def next_request(inbox: Path, seq: int, parent: int) -> Optional[dict]:
    """Request `seq` once the pytest side has written it; None for a stop, or when the pytest process is gone."""
    path = inbox / f"{seq:04d}.json"
    while not path.exists():
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return None
        time.sleep(POLL_SECONDS)
    request = json.loads(path.read_text())
    return None if request.get("stop") else request


@contextmanager
def environment(set_: dict[str, str], unset: list[str]) -> Iterator[None]:
    """os.environ as the request's caller had it, for the request's duration. A variable a library reads once, when
    it is imported, only takes effect if this request is the first to import it."""
    saved = {k: os.environ.get(k) for k in [*set_, *unset]}
    os.environ.update(set_)
    for k in unset:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_script(request: dict) -> int:
    """The worker script as `python SCRIPT ARGV...` would run it: its exit status."""
    script = HERE / request["worker"]
    saved_argv = sys.argv
    sys.argv = [str(script), *request["argv"]]
    try:
        with environment(request.get("set", {}), request.get("unset", [])):
            runpy.run_path(str(script), run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # SystemExit("message"): what the interpreter would print, exit 1
        return 1
    finally:
        sys.argv = saved_argv


def share_groups_by_membership() -> None:
    """`torch.distributed.new_group` returns the group an earlier call made for the same ranks, backend, timeout and
    options, instead of a new one (megatron-core and DeepSpeed both call it through the module attribute, at call
    time). Every rank calls new_group in the same order with the same arguments (torch requires it), so every rank
    finds or makes the same groups in step. Collectives of two users of one group run in their order on this
    rank's one thread, as they would on two groups."""
    made: dict[str, object] = {}
    make = distributed_c10d.new_group

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, **kw):
        settings = {k: v for k, v in kw.items() if k != "group_desc"}  # a group's name does not change what it is
        key = repr(
            (sorted(ranks) if ranks is not None else None, timeout, backend, pg_options, sorted(settings.items()))
        )
        if key not in made:
            made[key] = make(ranks=ranks, timeout=timeout, backend=backend, pg_options=pg_options, **kw)
        return made[key]

    distributed_c10d.new_group = dist.new_group = new_group


def tear_down() -> None:
    """What the next request must not inherit: megatron-core's state and the engines the worker built. No engine is
    ever freed on its own: DeepSpeed's gradient hooks and the backward hooks on its outputs, held by torch's
    autograd, point back at it. The process groups stay, shared by membership for the next request
    (`share_groups_by_membership`): a launch holds at most one group per membership it was asked for, ~70 threads
    per rank at 8 ranks, however many requests it serves."""
    from deepspeed.runtime.engine import DeepSpeedEngine  # heavy: imported by every worker already
    from megatron.core import parallel_state  # heavy: as deepspeed above

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # No collection before the search: an engine is never garbage (above).
    for engine in [o for o in gc.get_objects() if isinstance(o, DeepSpeedEngine)]:
        engine.destroy()  # removes its gradient hooks
        engine.__dict__.clear()  # what the hooks still reach is an empty shell: its module, groups, buffers go
    gc.collect()
    gc.freeze()  # what outlived this request (modules it imported first): as `serve` says, out of later passes


def process_status() -> dict[str, int]:
    """This rank's thread count and resident memory (kB) after a request, from /proc where there is one: what a
    launch accumulates over the requests it serves."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in lines if ":" in line)
    return {"threads": int(fields["Threads"]), "rss_kb": int(fields["VmRSS"].split()[0])}


def serve(inbox: Path, parent: int) -> int:
    # Before joining: a rank that hangs in the rendezvous must be killable too.
    publish(inbox / f"rank{os.environ['RANK']}.pid", str(os.getpid()))
    share_groups_by_membership()
    init_distributed(RunControlConfig().dist_timeout_minutes)
    # Everything alive now (torch's, DeepSpeed's, megatron-core's module objects: ~0.5M) into the collector's
    # permanent generation: its passes, the automatic ones, tear_down's and the workers' own (memory_worker's
    # searches), then walk only what the requests made. A pass over a rank's imports costs ~0.4 s: an empty request
    # on 2 ranks took 0.9 CPU-s, now 0.01; the pooled modules' requests 885 -> 779 CPU-s (2026-11-30).
    # No frozen object is ever collected, which a process that ends by os._exit after flushing does not need, and
    # gc.get_objects() no longer lists them: the worker's searches (tear_down's engines, memory_worker's live tensors)
    # look for what a request made, and memory_worker leaves out what was alive before its request anyway.
    gc.freeze()
    rank = dist.get_rank()
    seq = 0
    while (request := next_request(inbox, seq, parent)) is not None:
        started, cpu = time.perf_counter(), time.process_time()
        try:
            rc = run_script(request)
            if rc != 0:
                raise RuntimeError(f"{request['worker']} exited {rc}")
            tear_down()
        except BaseException:
            publish(inbox / f"{seq:04d}.rank{rank}.error", traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            # A peer may be waiting for this rank in a collective: end the launch (torchrun stops the others).
            os._exit(1)
        sys.stdout.flush()
        sys.stderr.flush()
        taken = {"seconds": round(time.perf_counter() - started, 3), "cpu_seconds": round(time.process_time() - cpu, 3)}
        done = {**taken, **process_status()}
        publish(inbox / f"{seq:04d}.rank{rank}.done", json.dumps(done))
        seq += 1
    # Stopped: every request's files are written and closed. Skip the interpreter's shutdown, which in a process
    # holding torch, DeepSpeed and megatron-core costs ~1.7 s of CPU (0.04 s this way), paid by every rank of every
    # launch when the session ends, on cores the last tests still use.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--inbox", required=True, type=Path)
    p.add_argument("--parent", required=True, type=int, help="the pytest process: the ranks end when it does")
    args = p.parse_args()
    raise SystemExit(serve(args.inbox, args.parent))
