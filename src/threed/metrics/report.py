"""`threed report RUN_DIR [RUN_DIR2]`: plots and a one-screen summary from a run's metrics.jsonl, for a cluster
login node without a browser. Two run directories are overlaid on the same plots.

    threed report runs/llama3-8b/ckpt                       # PNGs into runs/llama3-8b/ckpt/report/
    threed report runs/a runs/b --out cmp/                  # a vs b

Plots (always all five; a panel without data says so): loss.png (training and validation loss vs tokens),
learning_rate.png, throughput.png (tokens/s and TFLOP/s per GPU), memory.png (peak memory per stage),
idle.png (idle fraction per pipeline stage, with the ideal bubble dashed). A run that scored lm-evaluation-harness
tasks during training (--harness-interval: `harness/<task>/<metric>` records) also gets harness.png, a panel per task
and metric vs tokens, and a summary line for each.

A run that went wrong must not read like a healthy short one: the summary marks the steps whose loss or gradient
norm was not finite (metrics.jsonl holds null there; DeepSpeed skipped their optimizer step) and a stop by the
divergence guard (the loop's `exit-status` record, exit 3), with the steps the run was meant to reach.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from threed.errors import ThreedError
from threed.metrics.sinks import CONFIG_FILE, METRICS_FILE

PLOTS = ("loss.png", "learning_rate.png", "throughput.png", "memory.png", "idle.png")
HARNESS_PLOT = "harness.png"  # only for runs that hold harness scores
HARNESS_PREFIX = "harness/"  # metrics.jsonl keys of the scores (threed.train.samples.harness_scores)


class ReportError(ThreedError):
    """Input that cannot be reported on; the message is the one line shown to the user."""


@dataclass
class Run:
    label: str
    train: list[dict[str, Any]]  # records with `lm loss`, in iteration order, one per iteration
    validation: list[dict[str, Any]]
    summary: dict[str, Any]  # run_config.json, {} when absent
    stopped: Optional[tuple[int, int]] = None  # (step, exit status) of a stop by the guard, from `exit-status`
    scores: list[dict[str, Any]] = field(default_factory=list)  # harness records, one per scored step, in order

    def score_keys(self) -> list[str]:
        """`harness/<task>/<metric>` keys the run scored, sorted (task, then metric)."""
        return sorted({k for r in self.scores for k in r if k.startswith(HARNESS_PREFIX)})

    def series(self, key: str, x: str = "iteration", records: Optional[list] = None) -> tuple[list, list]:
        pts = [(r[x], r[key]) for r in (self.train if records is None else records) if r.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    def stages(self) -> list[int]:
        keys = {k for r in self.train for k in r}
        return sorted(
            int(k[5:].split("/")[0]) for k in keys if k.startswith("stage") and k.endswith("/mem-max-allocated-bytes")
        )


def load_run(run_dir: str) -> Run:
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"{run_dir}: no such directory")
    metrics = path / METRICS_FILE
    if not metrics.is_file():
        raise ReportError(
            f"{run_dir}: no {METRICS_FILE} (the training run writes it into --save, or the parent of --tensorboard-dir)"
        )
    lines = metrics.read_text().splitlines()
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if n == len(lines):  # the last line of a killed run may be cut off
                continue
            raise ReportError(f"{metrics}:{n}: not a JSON record") from None
    by_iteration: dict[int, dict] = {}
    stops: dict[int, int] = {}
    scores: dict[int, dict] = {}
    for r in records:
        if not isinstance(r, dict) or not {"iteration", "samples", "tokens"} <= r.keys():
            raise ReportError(f"{metrics}: a record without iteration/samples/tokens: not a threed metrics file")
        if "lm loss" in r:
            by_iteration[r["iteration"]] = r  # a resumed run re-logs steps after its checkpoint: the last wins
        if r.get("exit-status") is not None:
            stops[r["iteration"]] = int(r["exit-status"])
        if any(k.startswith(HARNESS_PREFIX) for k in r):  # a resumed run scoring a step again: the last wins
            scores.setdefault(r["iteration"], {}).update(r)
    if not by_iteration:
        raise ReportError(f"{metrics}: no training records (empty, or the run stopped before its first step)")
    summary = {}
    if (path / CONFIG_FILE).is_file():
        summary = json.loads((path / CONFIG_FILE).read_text())
    last = max(by_iteration)
    # A stop recorded before the run's last step was resumed past: only one at or after the last step stands.
    stopped = max(((i, c) for i, c in stops.items() if i >= last), default=None)
    return Run(
        label=path.name if path.name not in ("", ".") else str(path.resolve().name),
        train=[by_iteration[i] for i in sorted(by_iteration)],
        validation=[r for r in records if "lm loss validation" in r],
        summary=summary,
        stopped=stopped,
        scores=[scores[i] for i in sorted(scores)],
    )


def non_finite_steps(run: Run) -> list[int]:
    """Steps whose loss, or gradient norm, was not finite (null in metrics.jsonl). A norm that is null on every step
    was never reported (not a non-finite one), so then only the loss counts."""
    norms_reported = any(r.get("grad-norm") is not None for r in run.train)
    return [
        r["iteration"]
        for r in run.train
        if r.get("lm loss") is None or (norms_reported and "grad-norm" in r and r["grad-norm"] is None)
    ]


def warning_lines(run: Run) -> list[str]:
    """What went wrong in the run, each marked `!`: non-finite (skipped) steps, a stop by the guard."""
    lines = []
    bad = non_finite_steps(run)
    if bad:
        shown = ", ".join(str(i) for i in bad[:10]) + (", ..." if len(bad) > 10 else "")
        lines.append(
            f"   ! {len(bad)} step(s) with a non-finite loss or gradient norm (optimizer step skipped): {shown}"
        )
    if run.stopped is not None:
        step, status = run.stopped
        planned = run.summary.get("config", {}).get("train", {}).get("steps")
        meant = f" of the {planned} it was to run" if planned else ""
        lines.append(
            f"   ! the run stopped at step {step}{meant} with exit {status}"
            + (" (diverged: the divergence guard's line in the run's log says why)" if status == 3 else "")
        )
    return lines


def harness_lines(run: Run) -> list[str]:
    """Each harness task and metric: its latest score and step, and the first one (how it moved in training)."""
    lines = []
    for key in run.score_keys():
        task, metric = key[len(HARNESS_PREFIX) :].rsplit("/", 1)
        x, y = run.series(key, records=run.scores)
        if not x:  # a key only null values carry
            continue
        trend = f" (first {y[0]:.4f} at step {x[0]}; {len(x)} scores)" if len(x) > 1 else ""
        lines.append(f"   harness {task} {metric}: {y[-1]:.4f} at step {x[-1]}{trend}")
    return lines


def _median(values: list) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary_lines(run: Run) -> list[str]:
    s, last = run.summary, run.train[-1]
    lines = [f"== {run.label}"]
    if s:
        c = s["config"]
        cp = s.get("cp", c.get("parallel", {}).get("cp", 1))  # runs summarised before "cp" was written: the config's
        lines.append(
            f"   {c['model']['name']}: tp {s['tp']} x pp {s['pp']} x {f'cp {cp} x ' if cp > 1 else ''}dp {s['dp']} = "
            f"{s['world_size']} "
            f"rank(s); global batch {s['global_batch_size']} = micro {s['micro_batch_size']} x gas "
            f"{s['grad_accum_steps']} x dp {s['dp']}; seq {c['train']['seq_length']}; {c['train']['dtype']}"
        )
    losses = [r["lm loss"] for r in run.train if r.get("lm loss") is not None]
    lines.append(
        f"   steps {run.train[0]['iteration']}-{last['iteration']}, {last['tokens']:,} tokens; lm loss "
        + (f"{losses[0]:.4f} -> {losses[-1]:.4f} (min {min(losses):.4f})" if losses else "never finite")
    )
    lines += warning_lines(run)
    if run.validation:
        v = run.validation[-1]
        lines.append(
            f"   validation at step {v['iteration']}: lm loss {v['lm loss validation']:.4f}, ppl "
            f"{v.get('lm loss validation ppl', float('nan')):.2f}"
        )
    it, tok, tfl = (_median([r.get(k) for r in run.train]) for k in ("iteration-time", "tokens-per-sec", "throughput"))
    mfu, causal = (_median([r.get(k) for r in run.train]) for k in ("mfu", "mfu-causal"))
    lines.append(
        f"   median: {it * 1000:.0f} ms/step, {tok:,.0f} tokens/s, {tfl:.3g} TFLOP/s/GPU, MFU "
        + (f"{mfu * 100:.1f}%" if mfu is not None else "n/a (peak unknown)")
        + (f" (causal {causal * 100:.1f}%)" if causal is not None else "")
    )
    for st in run.stages():
        idle = _median([r.get(f"stage{st}/idle-fraction") for r in run.train])
        comp = _median([r.get(f"stage{st}/compute-time") for r in run.train])
        mem = max((r.get(f"stage{st}/mem-max-allocated-bytes") or 0) for r in run.train)
        timing = (
            "no timing (stage_timing off)"
            if idle is None
            else f"idle {idle * 100:.1f}% (ideal {last.get('pipeline/ideal-bubble', 0) * 100:.1f}%), compute "
            f"{comp * 1000:.0f} ms/step"
        )
        lines.append(f"   stage {st}: {timing}, peak memory {mem / 2**30:.2f} GiB")
    return lines + harness_lines(run)


def _no_data(ax) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def harness_figure(runs: list[Run], plt) -> Any:
    """harness.png's figure: one panel per task and metric any run scored, score vs tokens, a line per run."""
    keys = sorted({k for run in runs for k in run.score_keys()})
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for run in runs:
            x, y = run.series(key, "tokens", run.scores)
            if x:
                ax.plot(x, y, "o-", label=run.label)
        task, metric = key[len(HARNESS_PREFIX) :].rsplit("/", 1)
        ax.set(xlabel="tokens", ylabel=metric, title=f"{task} {metric}")
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(keys) :]:  # the grid's unused cells
        ax.axis("off")
    return fig


def loss_figure(runs: list[Run], plt) -> Any:
    """loss.png's figure: training loss vs tokens, a line per run, its validation points dashed in the same colour."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in runs:
        (line,) = ax.plot(*run.series("lm loss", "tokens"), label=f"{run.label} train")
        if run.validation:
            ax.plot(
                *run.series("lm loss validation", "tokens", run.validation),
                "o--",
                color=line.get_color(),
                label=f"{run.label} validation",
            )
    ax.set(xlabel="tokens", ylabel="lm loss", title="loss vs tokens")
    ax.legend()
    return fig


def learning_rate_figure(runs: list[Run], plt) -> Any:
    """learning_rate.png's figure: the schedule vs tokens, so runs of other batch sizes line up."""
    fig, ax = plt.subplots(figsize=(8, 4))
    for run in runs:
        ax.plot(*run.series("learning-rate", "tokens"), label=run.label)
    ax.set(xlabel="tokens", ylabel="learning-rate", title="learning rate")
    ax.legend()
    return fig


def throughput_figure(runs: list[Run], plt) -> Any:
    """throughput.png's figure: tokens/s of the whole job beside model TFLOP/s per GPU, vs iteration."""
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        a1.plot(*run.series("tokens-per-sec"), label=run.label)
        a2.plot(*run.series("throughput"), label=run.label)
    a1.set(xlabel="iteration", ylabel="tokens/s", title="tokens per second (whole job)")
    a2.set(xlabel="iteration", ylabel="TFLOP/s per GPU", title="model TFLOP/s per GPU")
    a1.legend()
    return fig


# The per-stage panels: (file, the stage{N}/ metric, y label, title).
STAGE_PLOTS = (
    ("memory.png", "mem-max-allocated-bytes", "GiB", "peak memory per stage (max over the stage's ranks)"),
    ("idle.png", "idle-fraction", "idle fraction", "pipeline idle per stage (dashed: ideal bubble)"),
)


def stage_figure(runs: list[Run], plt, key: str, ylabel: str, title: str) -> Any:
    """A per-stage panel: a line per run and stage (memory in GiB); the idle panel adds each run's ideal bubble,
    dashed. Without any stage data the panel says so."""
    fig, ax = plt.subplots(figsize=(8, 4))
    plotted = False
    for run in runs:
        for st in run.stages():
            x, y = run.series(f"stage{st}/{key}")
            if not x:
                continue
            if key.startswith("mem"):
                y = [v / 2**30 for v in y]
            ax.plot(x, y, marker=".", label=f"{run.label} stage {st}")
            plotted = True
        if key == "idle-fraction" and run.series("pipeline/ideal-bubble")[0]:
            ax.plot(*run.series("pipeline/ideal-bubble"), "k--", linewidth=1, label=f"{run.label} ideal")
    if plotted:
        ax.legend()
    else:
        _no_data(ax)
    ax.set(xlabel="iteration", ylabel=ylabel, title=title)
    return fig


def write_plots(runs: list[Run], out: Path) -> list[Path]:
    import matplotlib  # heavy and optional for everything but the plots: imported only to draw them

    matplotlib.use("Agg")  # files only: no display on a login node
    import matplotlib.pyplot as plt  # matplotlib: heavy, only when plots are drawn

    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        paths.append(out / name)

    save(loss_figure(runs, plt), "loss.png")
    save(learning_rate_figure(runs, plt), "learning_rate.png")
    save(throughput_figure(runs, plt), "throughput.png")
    for name, key, ylabel, title in STAGE_PLOTS:
        save(stage_figure(runs, plt, key, ylabel, title), name)
    if any(run.scores for run in runs):
        save(harness_figure(runs, plt), HARNESS_PLOT)
    return paths


def report(run_dirs: list[str], out: Optional[str]) -> list[Path]:
    runs = [load_run(d) for d in run_dirs]
    if len(runs) == 2 and runs[0].label == runs[1].label:
        runs[0].label, runs[1].label = run_dirs[0], run_dirs[1]
    for run in runs:
        print("\n".join(summary_lines(run)))
    paths = write_plots(runs, Path(out) if out else Path(run_dirs[0]) / "report")
    print(f"plots: {', '.join(str(p) for p in paths)}")
    return paths
