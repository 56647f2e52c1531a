"""A step time split into a fixed cost per micro-batch and a FLOP rate, fitted to measured runs:

    step_s = gas x c + flops_per_step / R

Why: one sustained TFLOP/s with no per-micro-batch cost predicted the H200's seq 8192 step 16-19% too slow
(issue 35), because a micro-batch also costs host work (launches, copies, hooks) that does not grow with its
FLOPs. Runs that differ in gas at the same FLOPs (micro-batch 1 and 2 at one length) pin c; runs that differ in
FLOPs at the same gas (seq 8192 micro 1 against seq 4096 micro 2) pin R. Plain numbers in and out, so the
benchmark's summary (`tools/gpu_check_report.py`) and the planner's calibration can both use it.

The fit is least squares on relative errors (each run counts alike, whatever its step time); with two runs it
is exact. It says what the runs say: a negative c means the runs disagree with the model, and is reported so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Run:
    gas: int  # micro-batches per optimizer step
    flops: float  # training FLOPs of the whole step (one convention: the caller's)
    step_s: float  # measured seconds per step


@dataclass(frozen=True)
class StepFit:
    per_micro_batch_s: float  # c
    flops_per_s: float  # R: the rate the FLOPs run at once the per-micro-batch cost is taken out
    relative_errors: tuple[float, ...]  # (predicted - measured) / measured, per run in the order given

    def predict(self, gas: int, flops: float) -> float:
        return gas * self.per_micro_batch_s + flops / self.flops_per_s


def fit_step_time(runs: Sequence[Run]) -> StepFit:
    """c and R from at least two runs whose (gas, FLOPs) are not proportional (else c and R trade off freely)."""
    if len(runs) < 2:
        raise ValueError(f"a step-time fit needs at least 2 runs, got {len(runs)}")
    if any(r.gas < 1 or r.flops <= 0 or r.step_s <= 0 for r in runs):
        raise ValueError("every run needs gas >= 1, FLOPs > 0 and a step time > 0")
    # rows (gas / t, flops / t) against 1: relative errors; unknowns (c, 1 / R)
    rows = [(r.gas / r.step_s, r.flops / r.step_s) for r in runs]
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if det <= 1e-9 * saa * sbb:
        raise ValueError("the runs' (gas, FLOPs) are proportional: add a run with another gas at the same FLOPs")
    c = (sa * sbb - sb * sab) / det
    inverse_rate = (saa * sb - sab * sa) / det
    if inverse_rate <= 0:
        raise ValueError("the fitted FLOP rate is not positive: the runs do not follow step = gas x c + FLOPs / R")
    fit = StepFit(c, 1.0 / inverse_rate, ())
    errors = tuple(fit.predict(r.gas, r.flops) / r.step_s - 1.0 for r in runs)
    return StepFit(c, 1.0 / inverse_rate, errors)
