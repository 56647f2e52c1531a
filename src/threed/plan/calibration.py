"""The step-time model's compute rates fitted to measured GPU runs (`threed plan --calibrate FILE`): a matmul rate
R_mm, an attention rate R_attn on causal attention FLOPs, and a cost c per micro-batch (`threed.plan.steptime.Rates`).
Why: a single assumed TFLOP/s over the full attention square matched the 2026-11-28 H200 run at seq 4096 by
coincidence and predicted 8192 16-19% too slow (issue 35); every layout `threed plan` ranks rests on it.

A measured run at tp 1, pp 1, cp 1 (any dp) takes, by the step-time model,

    step = gas x (M / R_mm + A / R_attn + c) + once_per_step_s

M and A: one micro-batch's matmul and causal attention FLOPs (`threed.plan.steptime.stage_flops`, the very FLOPs
the predictions divide), once_per_step_s the optimizer, the DP all-reduce and the tied-weight terms of the model
(not fitted: they stay as they are). So each run is one linear equation in (1/R_mm, 1/R_attn, c); `fit` solves them
by least squares on relative errors. With 3 parameters and 2-3 runs it is constrained, and says how:
  - the three free when at least 3 runs give all three positive (c may be 0) and pin each rate down
    (`RATE_SPREAD`);
  - else R_attn = R_mm / 2 (one rate over the full attention square, Megatron's MFU convention and the earlier
    model) with (R_mm, c) fitted; c = 0 when that alone makes it negative or one run is all there is.
The 2026-11-28 H200 runs (seq 4096, 8192, 8192 recomputed) take the second: their free solution has a negative
attention rate, as the matmul FLOPs are the same in two of them and the recompute run moves both (docs/performance.md).

What a calibration file is: the JSON `read_measured` reads, either the project's measured form
(benchmarks/measured/*.json: device, date, torch, runs with their shape, tokens/s and step time; `from_bench_log`
builds it from bench_gpu.py's log) or the `gpu_check.json` that tools/gpu_check.sh writes (its `bench` part:
bench_gpu.py's JSON). Unknown keys are ignored; HF runs are not threed's and are left out.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from threed.config import ConfigError
from threed.convert.resolve import model_config
from threed.memory.model import estimate, stages
from threed.memory.recompute import Recompute
from threed.plan.steptime import Hardware, Rates, once_per_step_s, stage_flops, step_time

# R_attn / R_mm when the runs cannot tell them apart: the full square at one rate is the causal half at half of it.
TIED_ATTENTION = 0.5
# The free fit is taken only when the runs pin each rate down: a 1% error in every measured step (the spread of
# repeated steps) moves neither rate by more than 20% (one standard deviation, from the fit's covariance). The three
# H200 runs do not: 1% moves R_attn from 155 to 4,600 TFLOP/s.
TIMING_NOISE, RATE_SPREAD = 0.01, 0.2


@dataclass(frozen=True)
class Run:
    """One measured threed run: its shape and its median step."""

    model: str
    seq: int
    micro: int
    gas: int
    recompute: bool  # every block recomputed (bench_gpu.py's `ac on`) or none
    tokens_per_s: float
    step_s: float
    tp: int = 1
    pp: int = 1
    dp: int = 1

    def name(self) -> str:
        return f"seq {self.seq} micro {self.micro} gas {self.gas}{' recompute' if self.recompute else ''}"


@dataclass(frozen=True)
class Measured:
    device: str
    date: str
    torch: str
    source: str  # what produced the figures
    runs: tuple[Run, ...]

    def as_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "date": self.date,
            "torch": self.torch,
            "source": self.source,
            "runs": [r.__dict__ for r in self.runs],
        }


@dataclass(frozen=True)
class Fit:
    mm_tflops: float
    attn_tflops: float
    micro_s: float
    how: str  # which constraint the fit took


def fit(points: Sequence[tuple[float, float, float, float]]) -> Fit:
    """Least squares on relative errors of `seconds = M / R_mm + A / R_attn + n c` over points (M matmul FLOPs,
    A causal attention FLOPs, n micro-batches, seconds), constrained as the module docstring says. Pure."""
    x = np.array([p[:3] for p in points], dtype=float)
    y = np.array([p[3] for p in points], dtype=float)
    if len(points) == 0 or (x[:, :2] <= 0).any() or (y <= 0).any():
        raise ConfigError("calibration needs runs with positive FLOPs and step times; the file has none usable")
    scaled = x / y[:, None]  # relative errors: each row divided by its measured seconds
    if len(points) >= 3 and np.linalg.matrix_rank(scaled) == 3:
        (u, v, c), *_ = np.linalg.lstsq(scaled, np.ones(len(y)), rcond=None)
        spread = TIMING_NOISE * np.sqrt(np.diag(np.linalg.inv(scaled.T @ scaled))[:2]) / np.abs([u, v])
        if u > 0 and v > 0 and c >= 0 and (spread <= RATE_SPREAD).all():
            return Fit(1e-12 / float(u), 1e-12 / float(v), float(c), "R_mm, R_attn and c free")
    tied = np.stack([scaled[:, 0] + scaled[:, 1] / TIED_ATTENTION, scaled[:, 2]], axis=1)
    if len(points) >= 2:
        (u, c), *_ = np.linalg.lstsq(tied, np.ones(len(y)), rcond=None)
        if u > 0 and c >= 0:
            return Fit(1e-12 / float(u), TIED_ATTENTION * 1e-12 / float(u), float(c), "R_attn tied to R_mm / 2, c free")
    u = float(tied[:, 0] @ np.ones(len(y)) / (tied[:, 0] @ tied[:, 0]))
    return Fit(1e-12 / u, TIED_ATTENTION * 1e-12 / u, 0.0, "R_attn tied to R_mm / 2, c = 0")


def run_point(run: Run, hw: Hardware) -> tuple[float, float, float, float]:
    """(M, A, n, seconds of the micro-batches) of a run on one stage: its measured step less `once_per_step_s`."""
    if (run.tp, run.pp) != (1, 1):
        raise ConfigError(
            f"calibration reads runs at tp 1, pp 1 (one stage, where the model is linear in the rates); run "
            f"{run.name()} has tp {run.tp}, pp {run.pp}: leave it out of the file"
        )
    model = model_config(run.model)
    (stage,) = stages(model, 1, 1, run.seq)
    recomputed = Recompute.of(run.recompute).recomputed(stage.blocks)
    flops = stage_flops(model, 1, run.seq, run.seq * run.micro, stage.blocks, stage.last, recomputed)
    mm, attn = (run.gas * sum(p[i] for p in flops) for i in (0, 1))
    return mm, attn, float(run.gas), run.step_s - once_per_step_s(model, hw, 1, 1, run.dp, params(run))


def params(run: Run) -> int:
    """The largest stage's parameters per GPU, as the planner passes them to `step_time`."""
    mems = estimate(model_config(run.model), run.tp, run.pp, run.dp, run.micro, run.gas, run.seq, run.recompute)
    return max(m.params for m in mems)


def predict(run: Run, hw: Hardware) -> float:
    """The step-time model's seconds per step for a measured run's layout."""
    model = model_config(run.model)
    return step_time(model, hw, run.tp, run.pp, run.dp, run.micro, run.gas, run.seq, run.recompute, params(run))


def calibrate(measured: Measured, hw: Hardware) -> tuple[Rates, str]:
    """The rates `fit` finds for the measured runs, named after the device, the date and the source; and how the
    fit was constrained."""
    if not measured.runs:
        raise ConfigError(f"no threed run in the calibration file ({measured.source}); it needs at least one")
    f = fit([run_point(r, hw) for r in measured.runs])
    return Rates(f.mm_tflops, f.attn_tflops, f.micro_s, f"{measured.device}, {measured.date}, {measured.source}"), f.how


def calibrated(hw: Hardware, path: Path) -> tuple[Hardware, list[str]]:
    """`hw` with the rates fitted to the runs in `path`, and the lines that say so: the rates, how the fit was
    constrained, and each run's measured step beside what the fitted model predicts for it."""
    measured = read_measured(path)
    rates, how = calibrate(measured, hw)
    hw = dataclasses.replace(hw, rates=rates)
    lines = [f"{rates.line()} ({how}; torch {measured.torch})"]
    for run in measured.runs:
        predicted = predict(run, hw)
        lines.append(
            f"  {run.model} {run.name()}: measured {run.step_s:.3f} s/step, fitted model {predicted:.3f} s/step "
            f"({predicted / run.step_s - 1:+.1%})"
        )
    return hw, lines


# ------------------------------------------------------------------------------------------------ reading


def read_measured(path: Path) -> Measured:
    """The project's measured JSON, or tools/gpu_check.sh's gpu_check.json (or bench_gpu.py's own JSON)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--calibrate {path}: cannot read it as JSON ({e}); give a measured JSON or gpu_check.json")
    if not isinstance(data, dict):
        raise ConfigError(f"--calibrate {path}: not a JSON object; give a measured JSON or gpu_check.json")
    if isinstance(data.get("bench"), dict):  # gpu_check.json: the benchmark's JSON under `bench`
        return from_bench_json(data["bench"], data, path)
    if data.get("runs") and all("impl" in r for r in data["runs"]):
        return from_bench_json(data, {}, path)
    try:
        runs = tuple(Run(**{k: r[k] for k in Run.__dataclass_fields__ if k in r}) for r in data["runs"])
        return Measured(data["device"], data["date"], data["torch"], data.get("source", path.name), runs)
    except (KeyError, TypeError) as e:
        raise ConfigError(
            f"--calibrate {path}: not a measured JSON (missing {e}) nor a gpu_check.json with a `bench` part"
        )


def from_bench_json(bench: dict[str, Any], outer: dict[str, Any], path: Path) -> Measured:
    """bench_gpu.py's JSON (threed runs that finished; the HF baseline is not threed's model, and a run with an
    opt-in speed flag, `variant`, is not the default path whose rates the planner assumes)."""
    runs = []
    for r in bench.get("runs") or []:
        if r.get("impl") == "threed" and r.get("median_step_s") and not r.get("variant"):
            step = float(r["median_step_s"])
            tokens = r["micro"] * r["gas"] * r["seq"]
            runs.append(
                Run(
                    bench["model"],
                    r["seq"],
                    r["micro"],
                    r["gas"],
                    bool(r["activation_checkpointing"]),
                    tokens / step,
                    step,
                )
            )
    env = outer.get("env") or {}
    device = bench.get("device") or (env.get("gpu") or {}).get("name") or "unknown device"
    torch = bench.get("torch") or (env.get("versions") or {}).get("torch") or "unknown"
    date = outer.get("date") or bench.get("date") or "undated"
    return Measured(device, date, torch, f"{path.name} (bench_gpu.py)", tuple(runs))


# bench_gpu.py's header and one line per run (benchmarks/bench_gpu.py `line`).
_HEADER = re.compile(r"^bench_gpu: (\S+) on (.+) \(peak .*\), (\d+) tokens per step$", re.M)
_RUN = re.compile(r"^threed seq (\d+) ac (on|off) ?: ([\d.]+) tokens/s", re.M)


def from_bench_log(text: str, date: str, torch: str, micro: int = 1) -> Measured:
    """The threed runs of a bench_gpu.py log: its lines give the model, the device, tokens per step and each run's
    tokens/s; micro is the run's --micro (the log does not print it), gas = tokens per step / (seq x micro), and
    the step time tokens per step / tokens/s (bench_gpu.py's tokens/s is that of the median step)."""
    head = _HEADER.search(text)
    if not head:
        raise ConfigError("not a bench_gpu.py log: no 'bench_gpu: MODEL on DEVICE (peak ...), N tokens per step' line")
    model, device, tokens = head[1], head[2], int(head[3])
    runs = []
    for seq, ac, tps in _RUN.findall(text):
        seq, tps = int(seq), float(tps)
        runs.append(Run(model, seq, micro, tokens // (seq * micro), ac == "on", tps, round(tokens / tps, 5)))
    return Measured(device, date, torch, "bench_gpu.py", tuple(runs))
