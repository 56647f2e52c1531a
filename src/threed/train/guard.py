"""Stop loudly: what ends a run that has gone wrong, instead of letting it burn the allocation, and what ends a
run on request (a signal, a STOP file, the time budget) with a checkpoint first.

    stop = StopRequest(cfg.checkpoint.save)             # installs the SIGUSR1 / SIGTERM handlers
    guard = RunGuard(cfg.control, cfg.checkpoint.save, rt.rank, engine, stop)   # before the training loop
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
- An absent value is never a non-finite one: DeepSpeed reports no gradient norm for fp32 without ZeRO (its
  clipping there discards the norm it computes), so `report_grad_norm` computes the model's global norm before
  the optimizer step (`global_grad_norm`: every rank's shards once, summed over the model-parallel group). A norm
  still missing turns the checks that read it off, with one line.
- Finite divergence: a blow-up often stays finite (weights at 1e10, then the loss stuck at ln(vocab) with a
  gradient norm of 0). Three checks stop it with exit status 3, before the step is saved, naming the step, what
  was seen and the last good checkpoint: a gradient norm at most `--dead-grad-norm` on a step with loss tokens (a
  dead, saturated model), a step that multiplies a rank's weight norm by more than `--weight-jump-factor` (one
  pass over the rank's parameters per step), and a loss spike that lasts. 0 turns each off; the message says
  which way makes its check less sensitive (a lower --dead-grad-norm, a higher factor).
- A loss spike alone never stops a run: a loss above `--spike-factor` x the median of the last 50 finite losses
  (after 10 steps; Megatron-LM's spiky-loss check compares against 10x) is logged with the step and the batch's
  sources, and it stops the run only when the loss stays above that bound for `--spike-confirm-steps` steps in a
  row. A healthy run's spike is one batch: a blend's rarer, harder source at a small global batch sends single
  batches far above the median (issue 29: 0.97 / 0.03 at lr 3e-3 spiked 33x at step 68 and went on learning);
  a diverged run's loss stays up. Megatron re-runs the step to tell a hardware fault from the data; on one
  deterministic device a re-run reproduces the spike either way, so persistence is the test here. While a spike
  is unconfirmed, interval saves wait (`holding`), so `latest` never names weights the spike may have ruined.
- The guard's history (the recent losses, an unconfirmed spike, the skipped-batch count) is saved in each
  checkpoint (`state` / `load_state`), so a resume judges against the run's history, not a 10-step window.
- ... unless the resume changed what the losses depend on (`run_identity`, saved beside the history): the training
  data (the blend, its paths, each dataset's sidecar fingerprint or size), the learning-rate schedule (its kind,
  --lr, --min-lr, --warmup-steps and --steps, where the cosine decay ends) or the model's init (--init-from). New,
  harder data makes the loss higher while it falls, so the old window would read it as a lasting spike: the spike
  window starts afresh, said in one line, and a stop names the change as the likely cause. The weight-jump,
  dead-gradient and non-finite checks need no history and stay on through the change.
- Every save also refuses weights that are not finite or beyond `--max-weight` (threed.checkpoint.save).
  A loss is computed with the previous step's weights: when the checkpoint just before a loss-based stop is the
  latest, the message says so.
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
import dataclasses
import faulthandler
import io
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist

from threed.checkpoint.format import read_latest
from threed.checkpoint.save import EXIT_DIVERGED, weight_norm  # exit 3 (a save refuses diverged weights too)
from threed.config import ConfigError, RunConfig, RunControlConfig
from threed.data.sidecar import read_sidecar
from threed.data.splits import DataSplits
from threed.parallel.distributed import is_multi_rank

EXIT_HUNG = 4
_STARTED = time.time()  # import time of this module: close enough to the process start for a time budget
SPIKE_WINDOW = 50  # the loss spike check compares against the median of this many recent finite losses
SPIKE_WARMUP = 10  # ... once it has seen this many
SPIKE_MIN_NATS = 1.0  # ... and only a rise of at least this much counts (a near-zero median loss is noisy)
Sources = Union[str, Callable[[], str]]  # a batch's make-up for the spike warning, or how to look it up
# The learning-rate schedule's fields in `run_identity`, by the flag that sets each (threed.engine.optimizer: linear
# warm-up, then a cosine decay that ends at --steps).
SCHEDULE_FLAGS = {"kind": "schedule", "lr": "--lr", "min_lr": "--min-lr", "warmup_steps": "--warmup-steps"}
SCHEDULE_FLAGS["decay_end"] = "--steps (the cosine decay's end)"
# What a resume can change (`identity_changes`), and the way back a stop after it names.
CHANGE_FIXES = {
    "data": "the previous data, or check the new data (its tokenizer and content: `threed check-config --paths`)",
    "schedule": "the previous learning-rate schedule, or a lower --lr or more --warmup-steps",
    "init": "the previous --init-from weights",
}
# If the run was healthy: the way each finite-divergence check becomes less sensitive.
HINTS = {
    "jump": "raise --weight-jump-factor (0 turns its check off)",
    "dead": "lower --dead-grad-norm: the check stops a step whose gradient norm is at most it (0 turns it off)",
    "spike": "raise --spike-factor or --spike-confirm-steps (--spike-factor 0 turns the check off)",
}


@dataclass
class Spike:
    """An unconfirmed loss spike: where it began, the bound it broke and how many steps in a row stayed above."""

    start: int
    median: float  # the history's median when it began (the reference while it lasts)
    window: int  # how many losses that median came from
    bound: float
    losses: list[float]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def global_grad_norm(engine) -> torch.Tensor:
    """The model's global L2 gradient norm, as DeepSpeed's BF16_Optimizer computes it: each rank's gradients
    once (parameters tied across stages counted on one stage only, TP-replicated ones on TP rank 0 only), the
    squares summed over the model-parallel group (TP x PP). Data-parallel replicas already hold the averaged
    gradients. A rank without gradients adds 0 but still joins the all-reduce."""
    # deepspeed: heavy; the guard's unit tests run without an engine
    from deepspeed.runtime.utils import is_model_parallel_parameter
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank

    mpu = getattr(engine, "mpu", None)
    tp_rank = bwc_tensor_model_parallel_rank(mpu)
    grads = [
        p.grad
        for p in engine.module.parameters()
        if p.grad is not None
        and not getattr(p, "ds_pipe_replicated", False)
        and (tp_rank == 0 or is_model_parallel_parameter(p))
    ]
    device = next(engine.module.parameters()).device
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        squares += torch.linalg.vector_norm(g, dtype=torch.float32).square()
    if mpu is not None and is_multi_rank():
        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=mpu.get_model_parallel_group())
    return squares.sqrt()


def report_grad_norm(engine) -> bool:
    """Make `engine.get_global_grad_norm()` report the gradient norm where DeepSpeed leaves it None (fp32 without
    ZeRO: its clipping computes the norm and drops it, and without clipping nothing computes it). The norm is
    taken before the optimizer step (before clipping, as ZeRO and BF16_Optimizer report it). True when installed."""
    step = getattr(engine, "_take_model_step", None)
    if step is None or engine.bfloat16_enabled() or engine.fp16_enabled() or engine.zero_optimization():
        return False

    def take_model_step(*args, **kwargs):
        norm = float(global_grad_norm(engine))
        out = step(*args, **kwargs)
        engine._global_grad_norm = norm
        return out

    engine._take_model_step = take_model_step
    return True


def _content(prefix: str) -> str:
    """What a dataset's content is known by: its sidecar's fingerprint (threed.data.sidecar), else its `.bin`'s
    size; neither reads the data."""
    try:
        record = read_sidecar(prefix)
        if record is not None and isinstance(record["bin"].get("fingerprint"), str):
            return record["bin"]["fingerprint"]
    except (ConfigError, OSError, KeyError, TypeError, AttributeError):
        pass  # a damaged sidecar is the preflight's to refuse; the size still tells a rewritten file apart
    try:
        return f"bytes:{os.path.getsize(prefix + '.bin')}"
    except OSError:
        return "unknown"


def run_identity(cfg: RunConfig, splits: DataSplits) -> dict:
    """What the run's losses depend on besides the weights, kept in each checkpoint beside the guard's history and
    compared on resume (`identity_changes`): the training blend (weights, absolute paths, content), --split, the
    learning-rate schedule and --init-from."""
    t, blend = cfg.train, splits.blends[0]
    weights = blend.weights or (None,) * len(blend.prefixes)
    init = cfg.checkpoint.init_from
    return {
        "data": {
            "split": splits.split,
            "blend": [[w, os.path.abspath(p), _content(p)] for w, p in zip(weights, blend.prefixes)],
        },
        "schedule": {
            "kind": "cosine",
            "lr": t.lr,
            "min_lr": t.min_lr,
            "warmup_steps": t.warmup_steps,
            "decay_end": t.steps,
        },
        "init": os.path.abspath(init) if init else None,
    }


def _data_change(old: dict, new: dict) -> str:
    """How the training data changed, in a few words: the paths, the blend weights, --split, or a dataset's content."""
    ob, nb = old.get("blend", []), new.get("blend", [])
    paths = [[b[1] for b in ob], [b[1] for b in nb]]
    if paths[0] != paths[1]:
        return " -> ".join(" ".join(p[:3]) + (" ..." if len(p) > 3 else "") for p in paths)
    if [b[0] for b in ob] != [b[0] for b in nb]:
        return "blend weights " + " -> ".join(
            " ".join("-" if b[0] is None else f"{b[0]:g}" for b in x) for x in (ob, nb)
        )
    if old.get("split") != new.get("split"):
        return f"--split {old.get('split')} -> {new.get('split')}"
    changed = [n[1] for o, n in zip(ob, nb) if o[2] != n[2]]
    more = f" and {len(changed) - 1} more" if len(changed) > 1 else ""
    return f"the content of {changed[0] if changed else 'a dataset'}{more} changed (its fingerprint)"


def _g(value) -> str:
    """A schedule value as a flag takes it: 0.003, 1000, cosine."""
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


def identity_changes(old: dict, new: dict) -> dict[str, str]:
    """What a resume changed of `run_identity` (the checkpoint's `old`, this run's `new`): kind (data, schedule,
    init) -> the change in words. A part the checkpoint did not record counts as unchanged."""
    changes = {}
    if old.get("data") is not None and old["data"] != new.get("data"):
        changes["data"] = f"the training data ({_data_change(old['data'], new['data'])})"
    was, now = old.get("schedule"), new.get("schedule") or {}
    if was is not None and was != now:
        parts = [f"{SCHEDULE_FLAGS.get(k, k)} {_g(was.get(k))} -> {_g(v)}" for k, v in now.items() if was.get(k) != v]
        changes["schedule"] = f"the learning-rate schedule ({', '.join(parts)})"
    if "init" in old and old["init"] != new.get("init"):
        changes["init"] = f"the model's init (--init-from {old['init'] or 'none'} -> {new.get('init') or 'none'})"
    return changes


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
                    os.write(
                        2,
                        b"threed: Ctrl-C: saving a checkpoint at the end of this step, then exiting; "
                        b"press Ctrl-C again to exit at once without saving\n",
                    )
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
                print(
                    f"threed: watchdog: rank {self.rank}: {what} has run for {waited:.0f} s (median "
                    f"{statistics.median(self.durations[kind]):.2f} s, limit {limit:.0f} s = max("
                    f"--watchdog-min-seconds, --watchdog-factor x median)); Python stacks of every thread follow, "
                    f"then exit {EXIT_HUNG}",
                    file=sys.stderr,
                    flush=True,
                )
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                os._exit(EXIT_HUNG)


class RunGuard:
    """The run's control point, once per step on every rank: divergence (exit 3), the time budget and the stop
    request (save and exit 0), and the watchdog (exit 4) it owns."""

    def __init__(
        self,
        ctl: RunControlConfig,
        save: Optional[str],
        rank: int,
        engine,
        stop: Optional[StopRequest] = None,
        device: Optional[torch.device] = None,
        identity: Optional[dict] = None,
    ):
        """`ctl`: the run-control fields (thresholds, time budget, watchdog); `save`: --save, named in messages;
        `identity`: the run's `run_identity`, kept in its checkpoints and compared on resume (None: not compared)."""
        self.save_dir, self.rank, self.engine, self.stop = save, rank, engine, stop
        self.identity = identity
        self.changes: dict[str, str] = {}  # what the resume changed (`identity_changes`), named when a check stops
        self.changed_at = 0  # the step the run resumed at, when it changed something
        self.skip_nonfinite = ctl.skip_nonfinite
        self.exit_duration_in_mins = ctl.exit_duration_in_mins
        self.device = device or torch.device("cpu")
        self.skipped = 0
        self.last_step_time = time.monotonic()
        self.step_seconds = 0.0
        self.save_seconds = 0.0  # the last checkpoint save's duration on this rank (told through `saved`)
        # --async-save: publishes a save still being written (every rank; threed.train.loop sets it), so that a
        # stop for divergence keeps it and names it as the last good checkpoint
        self.settle_saves: Optional[Callable[[], None]] = None
        self.out_of_time = False
        self.spike_factor, self.dead_grad_norm = ctl.spike_factor, ctl.dead_grad_norm
        self.weight_jump_factor = ctl.weight_jump_factor
        self.losses: list[float] = []  # recent finite losses of healthy steps (the spike check's history)
        self.confirm_steps = ctl.spike_confirm_steps
        self.spike: Optional[Spike] = None  # a loss spike not yet confirmed nor over
        self.norm_missing_said = False
        report_grad_norm(engine)  # fp32 without ZeRO: DeepSpeed reports none, so the guard's own is reported
        # The weights' norm before the first step of this process (after a load): the jump check's reference.
        self.weight_norm = weight_norm(engine) if self.weight_jump_factor else 0.0
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
        """The checkpoint a stop for divergence names (every rank asks, at the same step): a background save still
        pending is published first, since its weights were checked when it began."""
        if self.settle_saves is not None:
            self.settle_saves()
        save = self.save_dir
        if not save:
            return "none (the run has no --save)"
        latest = read_latest(save)
        return f"{save}/{latest}" if latest is not None else f"none yet in {save}"

    @staticmethod
    def restart(last: str) -> str:
        """How to go on from `last_checkpoint()`'s answer."""
        return "Start again" if last.startswith("none") else "Resume from it"

    def state(self) -> dict:
        """What a checkpoint keeps of the guard, so that a resume judges against the run's own history."""
        return {
            "losses": list(self.losses),
            "spike": self.spike.to_dict() if self.spike else None,
            "skipped": self.skipped,
            "identity": self.identity,
        }

    def load_state(self, state: Optional[dict]) -> None:
        """The history a checkpoint kept (`state`); None (a checkpoint from before it was saved): a fresh one. A
        resume that changed the data, the schedule or the init (`identity_changes`) keeps the skipped-batch count
        only: the spike window starts afresh, said in one line."""
        if not state:
            return
        self.skipped = int(state.get("skipped", 0))
        old = state.get("identity")
        self.changes = identity_changes(old, self.identity) if old and self.identity else {}
        if self.changes:
            self.changed_at = int(getattr(self.engine, "global_steps", 0))
            self._log(
                f"threed: the resume at step {self.changed_at} changed {'; '.join(self.changes.values())}: the "
                f"loss-spike check starts a new window (the first {SPIKE_WARMUP} steps' losses) instead of judging "
                f"the new losses against the old; the weight-jump, dead-gradient and non-finite checks stay on"
            )
            return
        self.losses = [float(x) for x in state.get("losses", [])][-SPIKE_WINDOW:]
        self.spike = Spike(**state["spike"]) if state.get("spike") else None

    def holding(self) -> bool:
        """A loss spike is unconfirmed: interval saves wait, so that `latest` never names weights it may have
        ruined (a stop request or the last step still saves, with the spike in the guard's state)."""
        return self.spike is not None

    def saved(self, seconds: float) -> None:
        """A checkpoint save took `seconds`: the time budget keeps room for one more."""
        self.save_seconds = seconds

    def _agree(self, *values: float) -> list[float]:
        """The step's one control all-reduce: each value is its MAX over the ranks (a flag is true on every rank
        if it is true on any)."""
        if not is_multi_rank():
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def _weight_jump(self) -> float:
        """This rank's weight norm after the step / before it (inf when the weights became non-finite); 0 when the
        check is off. Becomes the next step's reference."""
        if not self.weight_jump_factor:
            return 0.0
        before, after = self.weight_norm, weight_norm(self.engine)
        self.weight_norm = after
        if not math.isfinite(after):
            return math.inf
        return after / before if before > 0 else 0.0

    def _diverged(
        self, step: int, loss: float, norm: float, dead: bool, jump: float, sources: Sources
    ) -> Optional[tuple[str, str]]:
        """What makes this finite step untrustworthy and the check's HINTS key, from values every rank agrees on
        (`dead` and `jump` went through the all-reduce; loss and gradient norm are global), or None. A healthy
        step's loss joins the spike check's history. `sources`: what the batch was made of, for the spike warning."""
        if self.weight_jump_factor and jump > self.weight_jump_factor:
            return (
                "the step made the weights non-finite"
                if math.isinf(jump)
                else f"the step multiplied the weight norm by {jump:.3g} (--weight-jump-factor "
                f"{self.weight_jump_factor:g})"
            ), "jump"
        if dead:
            return (
                f"gradient norm {norm:.3g} on a step with loss tokens (loss {loss:.4f}): the model is dead, its "
                f"weights saturated (--dead-grad-norm {self.dead_grad_norm:g})"
            ), "dead"
        spiked = self._spiked(step, loss, sources)
        return (spiked, "spike") if spiked else None

    def _spiked(self, step: int, loss: float, sources: Sources) -> Optional[str]:
        """The loss spike check: None while the run is healthy or a spike is unconfirmed (said once, with the
        batch's sources), the reason once the loss has stayed above the bound for --spike-confirm-steps steps."""
        spike = self.spike
        if spike is None and self.spike_factor and len(self.losses) >= SPIKE_WARMUP:
            median = statistics.median(self.losses)
            bound = max(self.spike_factor * median, median + SPIKE_MIN_NATS)
            if loss > bound:
                spike = self.spike = Spike(step, median, len(self.losses), bound, [])
        if spike is None:
            self.losses = (self.losses + [loss])[-SPIKE_WINDOW:]
            return None
        ratio = loss / spike.median if spike.median > 0 else math.inf  # a memorised set's median can be 0
        what = (
            f"loss {loss:.4f} is {ratio:.1f}x the median {spike.median:.4f} of the last "
            f"{spike.window} steps (--spike-factor {self.spike_factor:g})"
        )
        if loss <= spike.bound:  # over: it was a batch, not the model (its losses join the history)
            self._log(
                f"threed: loss back to {loss:.4f} at step {step}, below {spike.bound:.4f}: the spike of step "
                f"{spike.start} lasted {len(spike.losses)} step(s); not a divergence, training goes on"
            )
            self.losses = (self.losses + spike.losses + [loss])[-SPIKE_WINDOW:]
            self.spike = None
            return None
        spike.losses.append(loss)
        if len(spike.losses) >= self.confirm_steps:
            return what + (
                f", above {spike.bound:.4f} for {len(spike.losses)} steps in a row since step {spike.start} "
                f"(--spike-confirm-steps {self.confirm_steps})"
                if self.confirm_steps > 1
                else ""
            )
        if len(spike.losses) == 1 and self.rank == 0:
            sources = sources() if callable(sources) else sources  # a look-up: made only when it is said
            self._log(
                f"threed: warning: loss spike at step {step}: {what}{sources}; the run goes on, saves wait, and it "
                f"stops only if the loss stays above {spike.bound:.4f} for {self.confirm_steps} steps "
                f"(--spike-confirm-steps)"
            )
        return None

    def after_step(
        self,
        step: int,
        loss: float,
        grad_norm: Optional[float],
        has_loss_tokens: bool = True,
        sources: Sources = "",
    ) -> bool:
        """Call on every rank after each step, before any save of it. Raises RunAborted on a non-finite step beyond
        the allowance, or on a finite divergence (a loss spike, a dead model, a weight jump); returns True when
        every rank should save and exit now (a stop request on any rank, or the time budget, which also raises
        the stop request). `has_loss_tokens`: this rank knows the step's loss counted tokens (pretraining: always;
        SFT: the last stage, where the count is; False elsewhere, so that rank does not judge a dead model).
        `grad_norm` None: not reported (never read as non-finite; the dead-model check is off, said once).
        `sources`: the batch's make-up (`; batch sources: ...`, or a function that returns it), named when its loss
        spikes."""
        self._tick(step)
        absent = grad_norm is None
        norm = self._norm(grad_norm)
        applied = getattr(self.engine, "was_step_applied", lambda: True)()
        bad = not (math.isfinite(loss) and (absent or math.isfinite(norm)) and applied)
        late = self._near_budget()
        stop = self.stop is not None and self.stop.requested()
        jump = self._weight_jump()
        dead = bool(self.dead_grad_norm) and has_loss_tokens and not bad and not absent and norm <= self.dead_grad_norm
        stop, bad, late, jump, dead = self._agree(stop, bad, late, jump, dead)
        stop, bad, late = bool(stop), bool(bad), bool(late)
        if bad:
            self._skip_nonfinite(step, loss, norm)
        else:
            self._stop_if_diverged(step, loss, norm, bool(dead), jump, sources)
        if late and not self.out_of_time:
            self._out_of_time()
        return stop or late

    def _tick(self, step: int) -> None:
        """The step's duration (the time budget keeps room for one more), and the watchdog's step number."""
        now = time.monotonic()
        self.step_seconds, self.last_step_time = now - self.last_step_time, now
        if self.watchdog is not None:
            self.watchdog.step = step

    def _norm(self, grad_norm: Optional[float]) -> float:
        """The gradient norm as a float, NaN when the engine reports none (said once: the checks on it are off)."""
        absent = grad_norm is None
        if absent and not self.norm_missing_said:
            self.norm_missing_said = True
            self._log(
                "threed: the engine reports no gradient norm: the guard's non-finite and dead-model checks on it "
                "are off (the loss, the weights and DeepSpeed's skipped steps are still checked)"
            )
        return math.nan if absent else float(grad_norm)

    def _near_budget(self) -> bool:
        """One more step and one more save would pass --exit-duration-in-mins (False without a budget)."""
        budget = self.exit_duration_in_mins * 60
        return bool(budget) and (time.time() - _STARTED) + self.step_seconds + self.save_seconds >= budget

    def _skip_nonfinite(self, step: int, loss: float, norm: float) -> None:
        """A non-finite step (DeepSpeed skipped its optimizer step): a warning within --skip-nonfinite, else the
        run stops without saving (RunAborted, exit 3)."""
        self.skipped += 1
        what = f"loss {loss} / grad norm {norm} at step {step}"
        allowed = self.skip_nonfinite
        if self.skipped > allowed:
            last = self.last_checkpoint()
            self._log(
                f"threed: error: non-finite {what}: stopping without saving (the run diverged; "
                f"{self.skipped} non-finite step(s), --skip-nonfinite {allowed}). Last good checkpoint: "
                f"{last}. {self._advice(last)}, or allow skipping such batches with --skip-nonfinite N"
            )
            raise RunAborted(EXIT_DIVERGED)
        self._log(
            f"threed: warning: non-finite {what}: the optimizer step was skipped (weights unchanged); "
            f"{self.skipped} of --skip-nonfinite {allowed}"
        )

    def _stop_if_diverged(self, step: int, loss: float, norm: float, dead: bool, jump: float, sources: Sources) -> None:
        """A finite step that diverged (`_diverged`) stops the run without saving (RunAborted, exit 3), naming the
        last good checkpoint, and whether its weights already gave the loss that stopped it."""
        found = self._diverged(step, loss, norm, dead, jump, sources)
        if found is None:
            return
        seen, check = found
        last = self.last_checkpoint()
        began = self.spike.start if self.spike is not None else step
        # After a resume that changed the data or the schedule, the change gave this loss, not the checkpoint.
        if not self.changes and check != "jump" and last.endswith(f"/global_step{began - 1}"):
            when = "this step" if began == step else f"step {began}, where the spike began"
            last += f" (saved just before {when}: its weights gave this loss; an earlier one may be safer)"
        self._log(
            f"threed: error: the run diverged at step {step}: {seen}; stopping without saving. Last "
            f"good checkpoint: {last}. {self._advice(last)}; if the run was healthy, {HINTS[check]}"
        )
        raise RunAborted(EXIT_DIVERGED)

    def _advice(self, last: str) -> str:
        """How to go on from `last` (`last_checkpoint()`'s answer): with the previous data / schedule / init when
        the resume changed them (the cause the guard can see), else with a gentler learning rate."""
        if not self.changes:
            return f"{self.restart(last)} with a lower --lr or more --warmup-steps"
        fixes = "; or with ".join(CHANGE_FIXES[k] for k in self.changes)
        return (
            f"The resume at step {self.changed_at} changed {'; '.join(self.changes.values())}, the likely cause: "
            f"{self.restart(last)} with {fixes}"
        )

    def _out_of_time(self) -> None:
        """The time budget is near: said once, and the run's stop request raised, so it saves and exits 0."""
        self.out_of_time = True
        self._log(
            f"threed: --exit-duration-in-mins {self.exit_duration_in_mins:g} is near "
            f"({(time.time() - _STARTED) / 60:.1f} min elapsed): saving and exiting"
        )
        if self.stop is not None:
            self.stop.flag = True
