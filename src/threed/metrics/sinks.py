"""Where a metrics record goes. A record is a flat dict: `iteration`, `samples`, `tokens`, `time` (unix seconds)
and scalars under Megatron-LM's names (`lm loss`, `learning-rate`, ...). Every sink receives the same dict.

Where the sinks write and the rules of their settings live here too, without torch or DeepSpeed: `threed
check-config --paths` (every launch, on every node) checks them without importing the writer's stack.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any, Optional

from threed.atomic import write_atomic
from threed.config import ConfigError, MetricsConfig

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "run_config.json"
META = ("iteration", "samples", "tokens", "time")
# Megatron-LM also logs these against consumed samples ("X vs samples"); we add tokens, the axis that compares
# runs of different sequence lengths and batch sizes.
VS_SAMPLES_AND_TOKENS = ("lm loss", "learning-rate", "grad-norm", "batch-size")
WANDB_MODES = ("online", "offline", "disabled")


def run_directory(m: MetricsConfig, save: Optional[str]) -> Optional[Path]:
    """Where metrics.jsonl and run_config.json go: --save, else the parent of --tensorboard-dir, else nowhere."""
    if save:
        return Path(save)
    if m.tensorboard_dir:
        return Path(m.tensorboard_dir).resolve().parent
    return None


def tensorboard_directory(m: MetricsConfig, save: Optional[str]) -> Optional[Path]:
    if not m.tensorboard:
        return None
    if m.tensorboard_dir:
        return Path(m.tensorboard_dir)
    run_dir = run_directory(m, save)
    return run_dir / "tensorboard" if run_dir else None


def check_metrics_config(m: MetricsConfig) -> None:
    """Run on every rank before anything is logged, so a bad setting stops all ranks alike (never one rank
    failing while the others wait in a collective)."""
    if m.tensorboard_dir and not m.tensorboard:
        raise ConfigError(f"tensorboard_dir={m.tensorboard_dir} is given but tensorboard is false; drop one")
    if m.wandb_mode is not None and m.wandb_mode not in WANDB_MODES:
        raise ConfigError(f"wandb_mode must be one of {', '.join(WANDB_MODES)}, got {m.wandb_mode!r}")
    if m.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError(
            f"wandb_project={m.wandb_project} needs the wandb package, which is not installed. "
            f"Install it (`pip install wandb`; use --wandb-mode offline without network), or drop "
            f"--wandb-project: metrics.jsonl and TensorBoard need nothing extra"
        )


def scalars(record: dict[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if k not in META and isinstance(v, (int, float))}


class JsonlSink:
    """metrics.jsonl: one JSON object per line, flushed per record so a killed run keeps what it logged.

    A resumed run first drops records past the step it resumes from (they belong to the lost steps after the
    last checkpoint), so every iteration appears once."""

    def __init__(self, path: Path, start_iteration: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if path.exists() and start_iteration > 0:
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("iteration", 0) <= start_iteration:
                        kept.append(line)
                except json.JSONDecodeError:  # a line cut off by a crash
                    continue
        write_atomic(path, "".join(line + "\n" for line in kept))
        self.file = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        # NaN/inf are not JSON; null keeps the line parseable by any reader.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    def __init__(self, log_dir: Path, start_iteration: int, config_text: str):
        from torch.utils.tensorboard import SummaryWriter  # tensorboard: heavy, and off with --tensorboard false

        # purge_step makes TensorBoard hide the events an earlier run in this directory wrote past our start (the
        # steps a resumed run repeats; all steps of a run started afresh in the same place).
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=start_iteration + 1, flush_secs=30)
        if start_iteration == 0:
            self.writer.add_text("config", "```\n" + config_text + "\n```", 0)

    def write(self, record: dict[str, Any]) -> None:
        it, samples, tokens = record["iteration"], record["samples"], record["tokens"]
        for name, value in record.items():  # text (generations during training: threed.train.samples)
            if isinstance(value, str) and name not in META:
                self.writer.add_text(name, value, it)
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, it)
            base = name.split("/")[0]
            if base in VS_SAMPLES_AND_TOKENS or name.startswith("lm loss validation"):
                self.writer.add_scalar(name + " vs samples", value, samples)
                self.writer.add_scalar(name + " vs tokens", value, tokens)
        if "lm loss" in record:
            self.writer.add_scalar("samples vs steps", samples, it)
            self.writer.add_scalar("tokens vs steps", tokens, it)

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbSink:
    """Weights & Biases, imported only when asked for. mode "offline" writes under the run directory with no
    network (`wandb sync` uploads it later); None leaves the choice to wandb (WANDB_MODE, else online)."""

    def __init__(
        self, project: str, name: Optional[str], mode: Optional[str], run_dir: Optional[Path], config: dict[str, Any]
    ):
        import wandb  # optional: only with --wandb-project (pip install wandb)

        self.run = wandb.init(
            project=project, name=name, mode=mode, config=config, dir=str(run_dir) if run_dir else None
        )

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        values["samples"], values["tokens"] = record["samples"], record["tokens"]
        self.run.log(values, step=record["iteration"])

    def close(self) -> None:
        self.run.finish()


def _mb(v: float) -> str:
    return f"{v / 2**20:.0f}"


def chunk_idle(r: dict[str, Any], stages: list[int]) -> str:
    """'12+3/4+9': each stage's chunks' idle percentages (threed.metrics.stages.per_chunk), stage by stage."""
    out = []
    for s in stages:
        chunks: list[str] = []
        while f"stage{s}/chunk{len(chunks)}/idle-fraction" in r:
            chunks.append(f"{r[f'stage{s}/chunk{len(chunks)}/idle-fraction'] * 100:.0f}")
        out.append("+".join(chunks))
    return "/".join(out)


def stdout_line(record: dict[str, Any], total_steps: int, eta_s: Optional[float], pp: int) -> str:
    """Today's readable line, plus the per-stage part in compact form (stage values joined by '/')."""
    r = record
    mfu = f"{r['mfu'] * 100:.1f}%" if r.get("mfu") is not None else "n/a"
    if r.get("mfu-causal") is not None:  # the same step counted with causal attention's half square
        mfu += f" (causal {r['mfu-causal'] * 100:.1f}%)"
    parts = [
        f"step {r['iteration']}/{total_steps}",
        f"loss {r['lm loss']:.4f}",
        f"lr {r['learning-rate']:.3e}",
        f"grad norm {r['grad-norm']:.3f}",
        f"{r['iteration-time'] * 1000:.0f} ms",
        f"{r['tokens-per-sec']:.0f} tokens/s",
        f"{r['throughput']:.3g} TFLOP/s/GPU",
        f"MFU {mfu}",
        f"mem {_mb(r['mem-allocated-bytes'])}/{_mb(r['mem-max-allocated-bytes'])} MB",
    ]
    if "loss-tokens" in r:  # SFT: the response tokens the loss counted, of all the positions above
        parts.insert(6, f"{r['loss-tokens']} loss tokens ({r['loss-tokens-per-sec']:.0f}/s)")
    stages = [s for s in range(pp) if f"stage{s}/mem-max-allocated-bytes" in r]

    def join(key: str, fmt) -> str:
        return "/".join(fmt(r[f"stage{s}/{key}"]) for s in stages)

    if stages and f"stage{stages[0]}/idle-fraction" in r:
        parts.append(
            f"stages idle {join('idle-fraction', lambda v: f'{v * 100:.0f}')}% "
            f"(ideal {r['pipeline/ideal-bubble'] * 100:.0f}%) "
            f"compute {join('compute-time', lambda v: f'{v * 1000:.0f}')} ms "
            f"wait {join('p2p-wait-time', lambda v: f'{v * 1000:.0f}')} ms "
            f"peak {join('mem-max-allocated-bytes', _mb)} MB"
        )
        if f"stage{stages[0]}/chunk0/idle-fraction" in r:  # --vpp > 1: each stage's chunks, joined by '+'
            parts[-1] += f" chunks idle {chunk_idle(r, stages)}%"
    elif stages:
        parts.append(f"stages peak {join('mem-max-allocated-bytes', _mb)} MB")
    if eta_s is not None:
        parts.append(f"ETA {eta_s:.0f} s")
    return " | ".join(parts)
