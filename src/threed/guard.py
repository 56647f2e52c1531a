"""Stop loudly: what ends a run that has gone wrong, instead of letting it burn the allocation.

    guard = RunGuard(cfg, rt.rank, engine, stop)       # before the training loop
    guard.after_step(step + 1, loss, grad_norm)         # once per step, on every rank, before the stop check

- Non-finite loss or gradient norm: DeepSpeed already skips the optimizer step when the gradient norm is not
  finite (ZeRO's overflow check in fp32, BF16_Optimizer's invalid-norm check in bf16), so the weights are
  unchanged; up to `--skip-nonfinite N` such batches are skipped with a warning, the next one stops the run with
  exit status 3 and a message naming the step and the last good checkpoint. Nothing is saved on that path.
- `--exit-duration-in-mins M`: once the time since start plus one more step and one save would pass M minutes,
  the guard raises the run's stop request, so the loop saves and exits 0 like after SIGUSR1.
- Watchdog: a thread per rank that, when a step runs far longer than usual (max(--watchdog-min-seconds,
  --watchdog-factor x the median step)), prints every thread's Python stack (faulthandler) and exits with status
  4, so `srun --kill-on-bad-exit` ends the job. Every rank of a stuck collective times out the same way, so every
  rank's stacks are printed. Only the engine's train_batch / eval_batch calls are timed: validation bookkeeping
  and saving between steps never count.
"""
from __future__ import annotations

import contextlib
import faulthandler
import io
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

EXIT_DIVERGED = 3
EXIT_HUNG = 4
_STARTED = time.time()  # import time of this module: close enough to the process start for a time budget


class RunAborted(SystemExit):
    """Ends every rank with a non-zero status and no traceback (the reason was printed once, by rank 0)."""


_last_save_seconds = 0.0


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """Around a checkpoint save: remember how long it took (the time budget keeps room for one more)."""
    global _last_save_seconds
    t0 = time.time()
    try:
        yield
    finally:
        _last_save_seconds = time.time() - t0


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

    def run(self) -> None:
        while True:
            time.sleep(self.poll)
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


_watchdog: Optional[Watchdog] = None


class RunGuard:
    def __init__(self, cfg, rank: int, engine, stop=None, device: Optional[torch.device] = None):
        global _watchdog
        ck = cfg.control
        self.cfg, self.rank, self.engine, self.stop = cfg, rank, engine, stop
        self.device = device or torch.device("cpu")
        self.skipped = 0
        self.last_step_time = time.monotonic()
        self.step_seconds = 0.0
        self.out_of_time = False
        try:
            faulthandler.enable()  # a crash in native code prints the Python stacks too
        except (ValueError, io.UnsupportedOperation):  # stderr without a file descriptor (captured by a test)
            pass
        if ck.watchdog_factor > 0:
            if _watchdog is None:
                _watchdog = Watchdog(rank, ck.watchdog_factor, ck.watchdog_min_seconds)
                _watchdog.start()
            for name in ("train_batch", "eval_batch"):
                if hasattr(engine, name):
                    _watchdog.wrap(engine, name)

    def _log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, file=sys.stderr, flush=True)

    def last_checkpoint(self) -> str:
        save = self.cfg.checkpoint.save
        if not save:
            return "none (the run has no --save)"
        latest = Path(save) / "latest"
        return f"{save}/{latest.read_text().strip()}" if latest.is_file() else f"none yet in {save}"

    def after_step(self, step: int, loss: float, grad_norm: Optional[float]) -> bool:
        """Call on every rank after each step. Raises RunAborted on a non-finite step beyond the allowance;
        returns True (and raises the stop request) when the time budget says save and exit now."""
        now = time.monotonic()
        self.step_seconds, self.last_step_time = now - self.last_step_time, now
        if _watchdog is not None:
            _watchdog.step = step
        norm = float("nan") if grad_norm is None else float(grad_norm)
        applied = getattr(self.engine, "was_step_applied", lambda: True)()
        bad = not (math.isfinite(loss) and math.isfinite(norm) and applied)
        budget = self.cfg.control.exit_duration_in_mins * 60
        late = bool(budget) and (time.time() - _STARTED) + self.step_seconds + _last_save_seconds >= budget
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Every rank must take the same branch (an abort or a save is collective): agree on both flags.
            flags = torch.tensor([float(bad), float(late)], device=self.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            bad, late = bool(flags[0].item()), bool(flags[1].item())
        if bad:
            self.skipped += 1
            what = f"loss {loss} / grad norm {norm} at step {step}"
            allowed = self.cfg.control.skip_nonfinite
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
            self._log(f"threed: --exit-duration-in-mins {self.cfg.control.exit_duration_in_mins:g} is near "
                      f"({(time.time() - _STARTED) / 60:.1f} min elapsed): saving and exiting")
            if self.stop is not None:
                self.stop.flag = True
        return late
