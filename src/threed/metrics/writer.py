"""The one metrics writer of a run.

Every rank builds a `RunMetrics` and calls `step` once per training step (the per-stage numbers need one
all-gather every log interval); only the writer rank, the last pipeline stage at TP rank 0 and DP rank 0
(threed.parallel.distributed.loss_rank), builds records and feeds the sinks. That rank holds the loss itself: DeepSpeed
averages it over DP on the last stage and broadcasts it back up the pipe only for the other stages' return value.

The run directory (where `metrics.jsonl` and `run_config.json` go, always) is `--save` when given, else the parent
of `--tensorboard-dir`; with neither the run logs to stdout only. TensorBoard writes to `--tensorboard-dir`,
by default `<run dir>/tensorboard`; `--tensorboard false` turns it off. `--wandb-project` adds Weights & Biases.

Per-step records carry the writer rank's scalars; every `log_interval` steps the record also carries the
per-stage numbers (means over the interval) and the stdout line is printed.
"""

from __future__ import annotations

import atexit
import json
import math
import platform
import time
from typing import Any, Optional

import deepspeed
import torch

from threed.config import RunConfig
from threed.parallel.dims import RunDims
from threed.parallel.distributed import loss_rank
from threed.metrics.flops import flops_per_token, peak_tflops_per_device
from threed.metrics.sinks import (
    CONFIG_FILE,
    METRICS_FILE,
    JsonlSink,
    TensorBoardSink,
    WandbSink,
    check_metrics_config,
    run_directory,
    stdout_line,
    tensorboard_directory,
)
from threed.metrics.stages import StageTimer, gather_rows, ideal_bubble, memory_bytes, per_stage


def run_summary(cfg: RunConfig, dims: RunDims, start_iteration: int, ds_config: dict[str, Any]) -> dict[str, Any]:
    """Everything that defines the run, written once beside the metrics (and as TensorBoard text); `ds_config` is
    the DeepSpeed config the engine was built with (after a universal resume it differs from a fresh start's)."""
    return {
        "config": cfg.to_dict(),
        "world_size": dims.world,
        "tp": dims.tp,
        "pp": dims.pp,
        "cp": dims.cp,
        "dp": dims.dp,
        "micro_batch_size": dims.micro,
        "grad_accum_steps": dims.gas,
        "global_batch_size": dims.global_batch,
        "start_iteration": start_iteration,
        "flops_per_token": flops_per_token(cfg.model, dims.seq_length, dims.tp),
        "flops_per_token_causal": flops_per_token(cfg.model, dims.seq_length, dims.tp, attention="causal"),
        "peak_tflops_per_device": peak_tflops_per_device(),
        "deepspeed_config": ds_config,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "deepspeed": deepspeed.__version__,
        },
    }


class RunMetrics:
    def __init__(
        self,
        cfg: RunConfig,
        dims: RunDims,
        engine: Any,
        rt: Any,
        ds_config: dict[str, Any],
        start_iteration: Optional[int] = None,
    ):
        """`dims`: the run's resolved dimensions (threed.parallel.dims); `ds_config`: the DeepSpeed config `engine`
        was built with (threed.engine.build.Built.ds_config), recorded in run_config.json as it was used."""
        check_metrics_config(cfg.metrics)
        self.device = rt.device
        self.dims = dims
        self.pp, self.vpp = dims.pp, dims.vpp
        # dp excludes cp: DeepSpeed's data axis (grid) holds dp x cp ranks, whose CP ranks read the same rows.
        self.gas, self.batch = dims.gas, dims.global_batch
        self.seq = cfg.train.seq_length
        self.total_steps = cfg.train.steps
        self.log_interval = max(1, cfg.train.log_interval)
        self.start = engine.global_steps if start_iteration is None else start_iteration
        self.engine = engine
        self.ds_config = ds_config
        self.is_writer = rt.rank == loss_rank(dims.tp, dims.pp, dims.dp, cp=dims.cp)
        self.flops_per_token = flops_per_token(cfg.model, self.seq, dims.tp)  # the full attention square
        self.flops_per_token_causal = flops_per_token(cfg.model, self.seq, dims.tp, attention="causal")
        self.peak_tflops = peak_tflops_per_device()
        self.timer = StageTimer(engine, rt.device, instructions=cfg.metrics.stage_timing)
        self.timer.install()
        self.overhead_s = 0.0  # time this rank spent in step()/log(): the cost of logging, measured
        self.collective_s = 0.0  # the part of it spent in the all-gather (mostly waiting for the slowest rank)
        self.sinks: list[Any] = []
        self.run_dir = run_directory(cfg.metrics, cfg.checkpoint.save)
        self._t_first: Optional[float] = None
        if self.is_writer:
            self._open_sinks(cfg)
            atexit.register(self.close)

    def _open_sinks(self, cfg: RunConfig) -> None:
        summary = run_summary(cfg, self.dims, self.start, self.ds_config)
        text = json.dumps(summary, indent=1, default=str)
        where = []
        if self.run_dir:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / CONFIG_FILE).write_text(text + "\n")
            self.sinks.append(JsonlSink(self.run_dir / METRICS_FILE, self.start))
            where.append(str(self.run_dir / METRICS_FILE))
        tb_dir = tensorboard_directory(cfg.metrics, cfg.checkpoint.save)
        if tb_dir:
            self.sinks.append(TensorBoardSink(tb_dir, self.start, text))
            where.append(f"TensorBoard {tb_dir}")
        m = cfg.metrics
        if m.wandb_project:
            self.sinks.append(WandbSink(m.wandb_project, m.wandb_name, m.wandb_mode, self.run_dir, summary))
            where.append(f"W&B project {m.wandb_project}")
        print(
            "metrics: "
            + (", ".join(where) if where else "stdout only (give --save or --tensorboard-dir to keep metrics.jsonl)"),
            flush=True,
        )

    def _meta(self, iteration: int, samples: Optional[int]) -> dict[str, Any]:
        if samples is None:
            samples = iteration * self.batch  # a constant global batch since step 0
        return {"iteration": iteration, "samples": samples, "tokens": samples * self.seq, "time": time.time()}

    def step(
        self,
        iteration: int,
        loss: float,
        grad_norm: Optional[float] = None,
        samples: Optional[int] = None,
        loss_tokens: Optional[int] = None,
    ) -> Optional[dict[str, Any]]:
        """Every rank, once per training step, right after `train_batch`. `iteration` counts steps done (1-based),
        `samples` the samples consumed so far (default iteration x global batch). Returns the record on the writer
        rank, None elsewhere. `loss_tokens` (SFT: the tokens the loss counted in this global batch, known on the
        writer rank) adds `loss-tokens` and `loss-tokens-per-sec`: with padding or prompts, tokens/s counts every
        position, this counts what was trained on."""
        t0 = time.perf_counter()
        record: Optional[dict[str, Any]] = None
        if self.is_writer:
            record = self._step_record(iteration, loss, grad_norm, samples)
            if loss_tokens is not None:
                dt = record["iteration-time"]
                record["loss-tokens"] = int(loss_tokens)
                record["loss-tokens-per-sec"] = loss_tokens / dt if dt > 0 else 0.0
        if iteration % self.log_interval == 0 or iteration == self.total_steps:
            t_gather = time.perf_counter()
            rows = gather_rows(self.timer, self.device)
            self.collective_s += time.perf_counter() - t_gather
            self.timer.reset()
            if record is not None:
                record.update(per_stage(rows, self.pp, timed=self.timer.instructions))
                if self.timer.instructions:
                    record["pipeline/ideal-bubble"] = ideal_bubble(self.pp, self.gas, self.vpp)
                if self._t_first is None or iteration <= self.start + 1:
                    eta = None
                else:
                    eta = (t0 - self._t_first) / (iteration - self.start - 1) * (self.total_steps - iteration)
                print(stdout_line(record, self.total_steps, eta, self.pp), flush=True)
        if record is not None:
            for sink in self.sinks:
                sink.write(record)
        if self._t_first is None:
            self._t_first = t0
        self.overhead_s += time.perf_counter() - t0
        return record

    def _step_record(
        self, iteration: int, loss: float, grad_norm: Optional[float], samples: Optional[int]
    ) -> dict[str, Any]:
        if grad_norm is None:
            norm = self.engine.get_global_grad_norm()
            grad_norm = float(norm) if norm is not None else float("nan")
        dt = self.timer.last_iteration
        tokens_per_s = self.batch * self.seq / dt if dt > 0 else 0.0
        tflops = self.flops_per_token * tokens_per_s / self.dims.world / 1e12
        mem_now, mem_peak = memory_bytes(self.device)
        record = {
            **self._meta(iteration, samples),
            "lm loss": float(loss),
            "learning-rate": float(self.engine.get_lr()[0]),
            "grad-norm": float(grad_norm),
            "iteration-time": dt,
            "batch-size": self.batch,
            "tokens-per-sec": tokens_per_s,
            "throughput": tflops,
            "throughput-causal": tflops * self.flops_per_token_causal / self.flops_per_token,
            "mem-allocated-bytes": mem_now,
            "mem-max-allocated-bytes": mem_peak,
        }
        if self.peak_tflops:  # both conventions (threed.model.spec): full attention square, and its causal half
            record["mfu"] = tflops / self.peak_tflops
            record["mfu-causal"] = record["throughput-causal"] / self.peak_tflops
        return record

    def log(self, iteration: int, values: dict[str, Any], samples: Optional[int] = None, line: bool = True) -> None:
        """Extra scalars at `iteration` (e.g. `lm loss validation/<dataset>`) to every sink; `line` also prints them.
        No collective: call it on any ranks; only the writer rank writes."""
        if not self.is_writer:
            return
        t0 = time.perf_counter()
        # text values (generations) stay text: metrics.jsonl keeps them, TensorBoard shows them as text
        record = {
            **self._meta(iteration, samples),
            **{k: v if isinstance(v, str) else float(v) for k, v in values.items()},
        }
        if line:
            shown = {k: v for k, v in values.items() if not isinstance(v, str)}
            print(f"step {iteration} | " + " | ".join(f"{k} {v:.4f}" for k, v in shown.items()), flush=True)
        for sink in self.sinks:
            sink.write(record)
        self.overhead_s += time.perf_counter() - t0

    def validation(
        self,
        iteration: int,
        loss: float,
        per_dataset: Optional[dict[str, float]] = None,
        samples: Optional[int] = None,
        line: bool = False,
    ) -> None:
        """Megatron's `lm loss validation` and `lm loss validation ppl` (exp of the loss, capped at e^20 as
        Megatron does), plus `.../<name>` for each dataset of a blend. No stdout line by default: the training
        loop prints its own validation line."""
        values = {"lm loss validation": loss, "lm loss validation ppl": math.exp(min(20.0, loss))}
        for name, v in (per_dataset or {}).items():
            values[f"lm loss validation/{name}"] = v
            values[f"lm loss validation ppl/{name}"] = math.exp(min(20.0, v))
        self.log(iteration, values, samples, line)

    def close(self) -> None:
        """Idempotent; also run at interpreter exit, so TensorBoard's buffered events survive an early exit."""
        self.timer.uninstall()
        atexit.unregister(self.close)
        for sink in self.sinks:
            sink.close()
        self.sinks = []
