"""The pytest side of tests/ranks/dispatch_worker.py: one torchrun launch per world size, started when a test first
needs that many ranks and kept for the session, so that the worker runs of every module that needs N ranks share
one start-up of N processes (each ~15 s of importing torch, DeepSpeed and megatron-core on 2 busy cores) instead
of paying it per module. `RankPool.run` takes what threed.parallel.launch.run_ranks takes and answers as it does: a
CompletedProcess whose stdout is what the ranks printed during this run, or RanksFailed with the worker's
traceback and the output tail.

A failed run fails only its own caller: the launch it broke (a rank that raised ends its process, and the others
may be stuck in a collective) is torn down, and the next run starts a fresh one. A run that outlives its timeout
is killed the same way. `fresh=True` asks for a launch that has run nothing yet (what measures every live tensor
of its process). The session fixture `rank_pool` (tests/ranks/conftest.py) makes one pool and closes it.

Every request's wall time and the CPU seconds its ranks spent on it (summed over the ranks) are kept in
`RankPool.requests`; with `--junitxml` the fixture writes them beside the XML (`<name>.rank-pool.json`), and
tools/test_durations.py lists the costliest. A module-scoped worker run counts in the JUnit file towards one test
only, and its CPU on N ranks not at all: these are where the pooled half of the suite's CPU goes."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence

from threed.atomic import write_atomic
from threed.parallel.launch import RanksFailed, torchrun_command

DISPATCH = Path(__file__).resolve().parent / "dispatch_worker.py"
MODULE_WORKER = DISPATCH.parent / "module_worker.py"  # `python -m MODULE`: RankPool.run_ranks
POLL_SECONDS = 0.1
DEFAULT_TIMEOUT = 1800.0  # run_ranks' callers without a timeout of their own
STOP_GRACE = 60.0  # how long a launch may take to end after a stop request or a failed rank
TAIL = 8000  # characters of output a failure shows, as run_ranks does
# Continues every rank of the pool once the pytest process ($1) is gone (killed, say), so that a launch stopped
# between requests (Launch._signal_ranks) sees its --parent gone and exits instead of staying stopped for ever.
WATCHDOG = (
    'while kill -0 "$1" 2>/dev/null; do sleep 2; done; '
    'for f in "$2"/*/inbox/rank*.pid; do kill -CONT "$(cat "$f")"; done'
)


def _launch_env() -> dict[str, str]:
    """run_ranks' environment: this process's, one OpenMP thread unless set."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"),
    }


def timing(nproc: int, worker: str, argv: list[str], done: list[dict]) -> dict:
    """One request's time from its ranks' done files: the slowest rank's seconds, the ranks' CPU seconds summed.
    The arguments without absolute paths (a test's temporary folders): what names the request across sessions."""
    return {
        "world": nproc,
        "request": " ".join([worker, *(a for a in argv if not a.startswith("/"))]),
        "seconds": max(d["seconds"] for d in done),
        "cpu_seconds": round(sum(d["cpu_seconds"] for d in done), 3),
    }


class Launch:
    """One torchrun of dispatch_worker.py on `nproc` ranks, its output appended to `log`."""

    def __init__(self, nproc: int, root: Path) -> None:
        self.nproc, self.inbox, self.log = nproc, root / "inbox", root / "ranks.log"
        self.inbox.mkdir(parents=True)
        self.env = _launch_env()
        self.seq = 0
        self.stopping = False
        argv = ["--inbox", str(self.inbox), "--parent", str(os.getpid())]
        with open(self.log, "ab") as log:  # append mode: every rank writes at the end, none over another
            self.proc = subprocess.Popen(
                torchrun_command(nproc, str(DISPATCH), argv),
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # one process group: a kill reaches torchrun and every rank
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _signal_ranks(self, sig: signal.Signals) -> None:
        """SIGSTOP to every rank once a request is done, SIGCONT before the next: a launch waiting between requests
        costs nothing. Idle, its ranks are not idle: each gloo group's event loop wakes 100 times a second (see
        dispatch_worker.py), ~1.5% of a core per rank measured on 4 idle ranks, and the session holds launches
        of 2, 4 and 8 ranks, most of them waiting while another runs. The watchdog (RankPool) continues them if
        this process dies, so that they see their --parent gone and exit."""
        for f in self.inbox.glob("rank*.pid"):
            try:
                os.kill(int(f.read_text()), sig)
            except (ProcessLookupError, ValueError):
                pass

    def _post(self, request: dict) -> int:
        self._signal_ranks(signal.SIGCONT)
        seq, self.seq = self.seq, self.seq + 1
        # Whole or absent: the ranks poll for this name.
        write_atomic(self.inbox / f"{seq:04d}.json", json.dumps(request))
        return seq

    def _output(self, start: int) -> str:
        with open(self.log, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def run(self, worker: str, argv: list[str], env: dict[str, str], timeout: float) -> tuple[str, dict]:
        """Run `worker argv` on every rank: what they printed meanwhile, and the request's time (`timing`). Raises
        RanksFailed (the launch then ends)."""
        wanted = {**_launch_env(), **env}
        request = {
            "worker": worker,
            "argv": argv,
            "set": {k: v for k, v in wanted.items() if self.env.get(k) != v},
            "unset": [k for k in self.env if k not in wanted],
        }
        start = self.log.stat().st_size
        seq = self._post(request)
        what = f"{worker} {' '.join(argv)} (request {seq} of the {self.nproc}-rank launch, log {self.log})"
        deadline = time.monotonic() + timeout
        while True:
            done = [self.inbox / f"{seq:04d}.rank{r}.done" for r in range(self.nproc)]
            if all(d.exists() for d in done):
                self._signal_ranks(signal.SIGSTOP)
                return self._output(start), timing(self.nproc, worker, argv, [json.loads(d.read_text()) for d in done])
            errors = sorted(self.inbox.glob(f"{seq:04d}.rank*.error"))
            if errors or not self.alive():
                self.close(grace=STOP_GRACE if errors else 0)
                tracebacks = "\n".join(f"{e.name}:\n{e.read_text()}" for e in errors)
                raise RanksFailed(f"{what} failed; {tracebacks}output tail:\n{self._output(start)[-TAIL:]}")
            if time.monotonic() > deadline:
                self.close(grace=0)
                raise RanksFailed(
                    f"{what} did not finish in {timeout:.0f} s; output tail:\n{self._output(start)[-TAIL:]}"
                )
            time.sleep(POLL_SECONDS)

    def ask_to_stop(self) -> None:
        """The request that ends the launch once its ranks are between requests (once only)."""
        if self.alive() and not self.stopping:
            self._post({"stop": True})
            self.stopping = True

    def close(self, grace: float = STOP_GRACE) -> None:
        """Ask the ranks to stop, wait up to `grace` seconds, then kill what is left."""
        if self.alive() and grace > 0:
            self.ask_to_stop()
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        if self.alive():
            self._kill()
        self.proc.wait()

    def _kill(self) -> None:
        """SIGKILL to torchrun's process group and to every rank: torchrun starts each rank in a session of its own
        (so a kill of torchrun's group alone leaves them running), and each wrote its pid once it had joined."""
        pids = [int(f.read_text()) for f in self.inbox.glob("rank*.pid")]
        for kill, target in [(os.killpg, self.proc.pid)] + [(os.kill, pid) for pid in pids]:
            try:
                kill(target, signal.SIGKILL)
            except ProcessLookupError:
                pass


class RankPool:
    """The session's launches, one per world size; `launches` counts every launch started (a failed run's
    replacement included)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.current: dict[int, Launch] = {}
        self.launches = 0
        self.requests: list[dict] = []  # `timing` of every request served, in order
        self._ids = itertools.count()
        self.watchdog = subprocess.Popen(
            ["sh", "-c", WATCHDOG, "watchdog", str(os.getpid()), str(root)],
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # not in the launches' group, which a failed run kills
        )

    def _launch(self, nproc: int, fresh: bool) -> Launch:
        launch = self.current.get(nproc)
        if launch is not None and launch.alive() and not (fresh and launch.seq > 0):
            return launch
        if launch is not None:
            launch.close()
        launch = Launch(nproc, self.root / f"world{nproc}_launch{next(self._ids)}")
        self.current[nproc] = launch
        self.launches += 1
        return launch

    def run(
        self,
        nproc: int,
        worker: str | Path,
        args: Sequence[str],
        env: Optional[dict[str, str]] = None,
        timeout: Optional[float] = None,
        fresh: bool = False,
    ) -> subprocess.CompletedProcess:
        """`worker` (a script of tests/ranks/) with `args` on `nproc` ranks, as run_ranks would run it."""
        script = Path(worker)
        if script.resolve().parent != DISPATCH.parent:
            raise ValueError(f"{worker}: the pool runs the worker scripts of {DISPATCH.parent} only")
        launch = self._launch(nproc, fresh)
        argv = [str(a) for a in args]
        stdout, took = launch.run(script.name, argv, env or {}, timeout or DEFAULT_TIMEOUT)
        self.requests.append(took)
        return subprocess.CompletedProcess([str(script), *argv], 0, stdout=stdout)

    def run_ranks(
        self,
        nproc: int,
        module: str,
        args: Sequence[str],
        env: Optional[dict[str, str]] = None,
        timeout: Optional[float] = None,
        capture: bool = True,
    ) -> subprocess.CompletedProcess:
        """threed.parallel.launch.run_ranks, served by this pool: a worker script of tests/ranks/, or a dotted module
        (`python -m module`, through module_worker.py). What the tests hand to threed's own launchers in its place
        (tests/ranks/conftest.py `verify_in_pool`). The output is always captured."""
        if module.endswith(".py"):
            return self.run(nproc, module, args, env=env, timeout=timeout)
        proc = self.run(nproc, MODULE_WORKER, [module, *args], env=env, timeout=timeout)
        return subprocess.CompletedProcess([module, *proc.args[1:]], 0, stdout=proc.stdout)

    def close(self) -> None:
        """Stop every launch: all asked first, so that they wind down together."""
        for launch in self.current.values():
            launch.ask_to_stop()
        for launch in self.current.values():
            launch.close()
        self.current.clear()
        self.watchdog.kill()
        self.watchdog.wait()
