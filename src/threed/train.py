"""Train a Llama with megatron-core TP x DeepSpeed PP x ZeRO-1 DP.

    torchrun --nproc-per-node 8 -m threed.train --model tiny --tp 2 --pp 2 --data runs/demo/tokens.bin ...
    threed train ...            # the same, as a console script

One step: the first stage reads micro-batches and embeds them; hidden states flow stage to stage (1F1B); the
last stage computes the vocab-parallel loss; DeepSpeed runs backward, all-reduces gradients over DP, clips,
and steps AdamW on fp32 master weights (ZeRO-1 shards optimizer state over DP).

Preemption: SIGUSR1 / SIGTERM (Slurm's --signal, scancel, torchrun's forwarded SIGTERM) or a file named
`STOP` in the save directory make every rank save a checkpoint at the next step boundary and exit 0; the next
run resumes from it.
"""
from __future__ import annotations

import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from threed.checkpoint import save
from threed.config import RunConfig
from threed.data.flat import TokenDataset, micro_batches
from threed.distributed import init_distributed
from threed.engine import build_engine
from threed.metrics import throughput

@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    start_step: int = 0
    end_step: int = 0
    saved_to: Optional[str] = None
    preempted: bool = False


class StopRequest:
    """Set by a signal on any rank; agreed on by all ranks with one tiny all-reduce per step."""

    def __init__(self, save_dir: Optional[str]):
        self.flag = False
        self.stop_file = Path(save_dir) / "STOP" if save_dir else None
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.flag = True

    def agreed(self, device: torch.device) -> bool:
        local = self.flag or bool(self.stop_file and self.stop_file.exists())
        t = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def train(cfg: RunConfig) -> TrainResult:
    rt = init_distributed()
    cfg.validate(rt.world_size)
    if cfg.data.path is None:
        raise ValueError("no training data: pass --data TOKENS.bin (made by `threed tokenize`)")
    dataset = TokenDataset(cfg.data.path, cfg.train.seq_length, cfg.model.vocab_size)  # fail before building
    stop = StopRequest(cfg.checkpoint.save)
    built = build_engine(cfg, rt)
    engine = built.engine
    dp, dp_rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
    micro, gas, glob = cfg.train.resolve_batch(dp)
    start = engine.global_steps
    result = TrainResult(start_step=start, end_step=start)
    log(rt.rank, f"threed: world {rt.world_size} = tp {cfg.parallel.tp} x pp {cfg.parallel.pp} x dp {dp} on "
                 f"{rt.device.type}/{rt.backend}; global batch {glob} = micro {micro} x gas {gas} x dp {dp}; "
                 f"{cfg.model.name} {cfg.model.num_params() / 1e6:.1f}M params; dtype {cfg.train.dtype}; "
                 + (f"resumed from {built.resumed_from} at step {start}" if built.resumed_from else
                    f"weights from {cfg.checkpoint.init_from}" if cfg.checkpoint.init_from else "random init"))
    reads_data = engine.is_first_stage() or engine.is_last_stage()
    batches = micro_batches(dataset, micro, gas, dp, dp_rank, start, cfg.train.seed) if reads_data else None
    t_start = time.time()
    for step in range(start, cfg.train.steps):
        t0 = time.time()
        loss = engine.train_batch(data_iter=batches).item()
        dt = time.time() - t0
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        result.losses.append(loss)
        result.grad_norms.append(norm)
        result.end_step = step + 1
        if (step + 1) % cfg.train.log_interval == 0 or step + 1 == cfg.train.steps:
            tp = throughput(cfg.model, cfg.train.seq_length, glob, dt, rt.world_size)
            done = step + 1 - start
            eta = (time.time() - t_start) / done * (cfg.train.steps - step - 1)
            mfu = f"{tp['mfu'] * 100:.1f}%" if tp["mfu"] is not None else "n/a"
            log(rt.rank, f"step {step + 1}/{cfg.train.steps} | loss {loss:.4f} | lr {engine.get_lr()[0]:.3e} | "
                         f"grad norm {norm:.3f} | {dt * 1000:.0f} ms | {tp['tokens_per_s']:.0f} tokens/s | "
                         f"{tp['tflops_per_device']:.3f} TFLOPs/device | MFU {mfu} | ETA {eta:.0f} s")
        last = step + 1 == cfg.train.steps
        interval = cfg.checkpoint.save_interval
        if stop.agreed(rt.device):
            result.preempted = True
            if cfg.checkpoint.save:
                result.saved_to = save(engine, cfg, rt.rank)
            log(rt.rank, f"stop requested: saved step {step + 1} to {result.saved_to}; exiting for a restart")
            break
        if cfg.checkpoint.save and (last or (interval and (step + 1) % interval == 0)):
            result.saved_to = save(engine, cfg, rt.rank)
            log(rt.rank, f"saved checkpoint step {step + 1} to {cfg.checkpoint.save}")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    from threed.cli import parse_run_config

    cfg = parse_run_config(sys.argv[1:] if argv is None else argv)
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
