"""Stop loudly: what ends a run that has gone wrong, instead of letting it burn the allocation, and what ends a
run on request (a signal, a STOP file, the time budget) with a checkpoint first.

    stop = StopRequest(cfg.checkpoint.save)             # installs the SIGUSR1 / SIGTERM handlers
    guard = RunGuard(cfg, rt.rank, engine, stop)        # before the training loop
    stop_now = guard.after_step(step + 1, loss, grad_norm)   # once per step, on every rank
    guard.saved(save(...).seconds)                      # after each save (threed.checkpoint.save.save)

- One control all-reduce per step: `after_step` agrees on [stop requested, step not finite, out of time] across
  all ranks in one tiny MAX all-reduce, so every rank takes the same branch (an abort or a save is collective).
  A stop request raised after that point in a step (during validation, say) is acted on at the next step.
- Stop request: SIGUSR1 / SIGTERM (Slurm's --signal, scancel, torchrun's forwarded SIGTERM) or a file named `STOP`
  in the save directory on any rank: every rank saves at the step boundary and exits 0.
- Non-finite loss or gradient norm: DeepSpeed already skips the optimizer step when the gradient norm is not
  finite (ZeRO's overflow check in fp32, BF16_Optimizer's invalid-norm check in bf16), so the weights are
  unchanged; up to `--skip-nonfinite N` such batches are skipped with a warning, the next one stops the run with
  exit status 3 and a message naming the step and the last good checkpoint. Nothing is saved on that path.
- `--exit-duration-in-mins M`: once the time since start plus one more step and one save (the last save's
  duration, which the loop reports through `saved`) would pass M minutes, the guard raises the run's stop request,
  so the loop saves and exits 0 like after SIGUSR1.
- Watchdog: a thread per rank that, when a step runs far longer than usual (max(--watchdog-min-seconds,
  --watchdog-factor x the median step)), prints every thread's Python stack (faulthandler) and exits with status
  4, so `srun --kill-on-bad-exit` ends the job. Every rank of a stuck collective times out the same way, so every
  rank's stacks are printed. Only the engine's train_batch / eval_batch calls are timed: validation bookkeeping
  and saving between steps never count. The RunGuard owns its watchdog thread (`close` stops it).
"""
from __future__ import annotations

import contextlib
import faulthandler
import io
import math
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from threed.checkpoint.format import read_latest
from threed.config import RunConfig

EXIT_DIVERGED = 3
EXIT_HUNG = 4
_STARTED = time.time()  # import time of this module: close enough to the process start for a time budget


class RunAborted(SystemExit):
    """Ends every rank with a non-zero status and no traceback (the reason was printed once, by rank 0)."""


class StopRequest:
    """Set by SIGUSR1 / SIGTERM / SIGINT (Ctrl-C) on this rank, or by a `STOP` file in the save directory;
    RunGuard.after_step agrees on it across ranks.

    Ctrl-C saves as SIGTERM does. Under torchrun one Ctrl-C reaches a worker twice (the terminal signals the whole
    process group, and torchrun forwards its own), so a second SIGINT within `SIGINT_REPEAT_SECONDS` of the first
    counts as the same request; a later one is the user insisting: KeyboardInterrupt, no save (exit 130)."""

    SIGINT_REPEAT_SECONDS = 5.0

    def __init__(self, save_dir: Optional[str]):
        self.flag = False
        self.interrupted_at: Optional[float] = None  # the first Ctrl-C's time
        self.stop_file = Path(save_dir) / "STOP" if save_dir else None
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self.interrupted_at is None:
                self.interrupted_at = now
                if os.environ.get("RANK", "0") == "0":  # os.write: print is not safe inside a signal handler
                    os.write(2, b"threed: Ctrl-C: saving a checkpoint at the end of this step, then exiting; "
                                b"press Ctrl-C again to exit at once without saving\n")
            elif now - self.interrupted_at > self.SIGINT_REPEAT_SECONDS:
                raise KeyboardInterrupt
        self.flag = True

    @staticmethod
    @contextlib.contextmanager
    def restoring_handlers() -> Iterator[None]:
        """The signal handlers as they were before the block, once it ends (threed.train: a run in a notebook or a
        test process gives Ctrl-C back when it is over)."""
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                if handler is not None:
                    signal.signal(sig, handler)

    def requested(self) -> bool:
        """This rank's view: a signal arrived, or the STOP file exists."""
        return self.flag or bool(self.stop_file and self.stop_file.exists())


class Watchdog(threading.Thread):
    """Times each call of the engine's `train_batch` / `eval_batch` while it runs; time between calls (logging,
    validation bookkeeping, saving) is not a step and is never counted. Each kind is armed after its first call
    finished (the first includes warm-up) and measured against the median of its own recent calls."""

    def __init__(self, rank: int, factor: float, min_seconds: float, poll: float = 1.0):
        super().__init__(name="threed-watchdog", daemon=True)
        self.rank, self.factor, self.min_seconds, self.poll = rank, factor, min_seconds, poll
        self.durations: dict[str, list[float]] = {}
        self.current: Optional[tuple[str, float]] = None  # (kind, start) of the call in flight
        self.step = 0
        self.stopped = threading.Event()

    def enter(self, kind: str) -> None:
        self.current = (kind, time.monotonic())

    def leave(self) -> None:
        if self.current is not None:
            kind, start = self.current
            self.current = None
            self.durations[kind] = (self.durations.get(kind, []) + [time.monotonic() - start])[-50:]

    def limit(self, kind: str = "train_batch") -> float:
        return max(self.min_seconds, self.factor * statistics.median(self.durations[kind]))

    def wrap(self, engine, name: str) -> None:
        original = getattr(engine, name)

        def timed(*args, **kwargs):
            self.enter(name)
            try:
                return original(*args, **kwargs)
            finally:
                self.leave()
        setattr(engine, name, timed)

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        while not self.stopped.wait(self.poll):
            current = self.current
            if current is None or current[0] not in self.durations:
                continue
            kind, start = current
            waited, limit = time.monotonic() - start, self.limit(kind)
            if waited > limit:
                what = f"step {self.step + 1}" if kind == "train_batch" else f"an eval batch after step {self.step}"
                print(f"threed: watchdog: rank {self.rank}: {what} has run for {waited:.0f} s (median "
                      f"{statistics.median(self.durations[kind]):.2f} s, limit {limit:.0f} s = max("
                      f"--watchdog-min-seconds, --watchdog-factor x median)); Python stacks of every thread follow, "
                      f"then exit {EXIT_HUNG}", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_HUNG)


class RunGuard:
    """The run's control point, once per step on every rank: divergence (exit 3), the time budget and the stop
    request (save and exit 0), and the watchdog (exit 4) it owns."""

    def __init__(self, cfg: RunConfig, rank: int, engine, stop: Optional[StopRequest] = None,
                 device: Optional[torch.device] = None):
        ctl = cfg.control  # the run-control fields
        self.cfg, self.rank, self.engine, self.stop = cfg, rank, engine, stop
        self.skip_nonfinite = ctl.skip_nonfinite
        self.exit_duration_in_mins = ctl.exit_duration_in_mins
        self.device = device or torch.device("cpu")
        self.skipped = 0
        self.last_step_time = time.monotonic()
        self.step_seconds = 0.0
        self.save_seconds = 0.0  # the last checkpoint save's duration on this rank (told through `saved`)
        self.out_of_time = False
        try:
            faulthandler.enable()  # a crash in native code prints the Python stacks too
        except (ValueError, io.UnsupportedOperation):  # stderr without a file descriptor (captured by a test)
            pass
        self.watchdog: Optional[Watchdog] = None
        if ctl.watchdog_factor > 0:
            self.watchdog = Watchdog(rank, ctl.watchdog_factor, ctl.watchdog_min_seconds)
            self.watchdog.start()
            for name in ("train_batch", "eval_batch"):
                if hasattr(engine, name):
                    self.watchdog.wrap(engine, name)

    def close(self) -> None:
        """Stop the watchdog thread (the run is over)."""
        if self.watchdog is not None:
            self.watchdog.stop()

    def _log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def last_checkpoint(self) -> str:
        save = self.cfg.checkpoint.save
        if not save:
            return "none (the run has no --save)"
        latest = read_latest(save)
        return f"{save}/{latest}" if latest is not None else f"none yet in {save}"

    def saved(self, seconds: float) -> None:
        """A checkpoint save took `seconds`: the time budget keeps room for one more."""
        self.save_seconds = seconds

    def _agree(self, *flags: bool) -> list[bool]:
        """The step's one control all-reduce: each flag is true on every rank if it is true on any."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return list(flags)
        t = torch.tensor([float(f) for f in flags], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [bool(v) for v in t.tolist()]

    def after_step(self, step: int, loss: float, grad_norm: Optional[float]) -> bool:
        """Call on every rank after each step. Raises RunAborted on a non-finite step beyond the allowance;
        returns True when every rank should save and exit now (a stop request on any rank, or the time budget,
        which also raises the stop request)."""
        now = time.monotonic()
        self.step_seconds, self.last_step_time = now - self.last_step_time, now
        if self.watchdog is not None:
            self.watchdog.step = step
        norm = float("nan") if grad_norm is None else float(grad_norm)
        applied = getattr(self.engine, "was_step_applied", lambda: True)()
        bad = not (math.isfinite(loss) and math.isfinite(norm) and applied)
        budget = self.exit_duration_in_mins * 60
        late = bool(budget) and (time.time() - _STARTED) + self.step_seconds + self.save_seconds >= budget
        stop = self.stop is not None and self.stop.requested()
        stop, bad, late = self._agree(stop, bad, late)
        if bad:
            self.skipped += 1
            what = f"loss {loss} / grad norm {norm} at step {step}"
            allowed = self.skip_nonfinite
            if self.skipped > allowed:
                self._log(f"threed: error: non-finite {what}: stopping without saving (the run diverged; "
                          f"{self.skipped} non-finite step(s), --skip-nonfinite {allowed}). Last good checkpoint: "
                          f"{self.last_checkpoint()}. Resume from it with a lower --lr or more --warmup-steps, or "
                          f"allow skipping such batches with --skip-nonfinite N")
                raise RunAborted(EXIT_DIVERGED)
            self._log(f"threed: warning: non-finite {what}: the optimizer step was skipped (weights unchanged); "
                      f"{self.skipped} of --skip-nonfinite {allowed}")
        if late and not self.out_of_time:
            self.out_of_time = True
            self._log(f"threed: --exit-duration-in-mins {self.exit_duration_in_mins:g} is near "
                      f"({(time.time() - _STARTED) / 60:.1f} min elapsed): saving and exiting")
            if self.stop is not None:
                self.stop.flag = True
        return stop or late
