"""Build the DeepSpeed pipeline engine for a RunConfig: process groups, the PipelineModule, AdamW + schedule,
the group-agreement check, and loading weights or a full checkpoint."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from threed.checkpoint import check_layout, has_checkpoint
from threed.config import ConfigError, RunConfig, deepspeed_config
from threed.distributed import Runtime, check_groups_agree, init_megatron_parallel_state
from threed.pipeline import build_pipeline_module


def lr_lambda(cfg: RunConfig):
    """Linear warmup to lr, then cosine decay to min_lr at the last step (as a multiplier of lr)."""
    t = cfg.train
    floor = t.min_lr / t.lr if t.lr > 0 else 0.0

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_optimizer(model: torch.nn.Module, cfg: RunConfig,
                   fused: bool = False) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    # Norm weights (1-D) get no weight decay, as in Megatron-LM.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    t = cfg.train
    groups = [g for g in ({"params": decay, "weight_decay": t.weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
    # fused (CUDA only, see threed.distributed.cuda_only); elsewhere torch's default (foreach) implementation.
    optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps,
                                  fused=True if fused else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    return optimizer, scheduler


@dataclass
class Built:
    engine: "deepspeed.runtime.pipe.engine.PipelineEngine"  # noqa: F821
    resumed_from: Optional[str]


def build_engine(cfg: RunConfig, rt: Runtime) -> Built:
    import deepspeed

    cfg.validate(rt.world_size)
    ck = cfg.checkpoint
    for what, path in (("load", ck.load), ("init_from", ck.init_from)):
        # Checked before building anything: asking for a checkpoint and silently training from random is the
        # classic Megatron-DeepSpeed failure.
        if path and not has_checkpoint(path):
            raise ConfigError(f"{what}={path} holds no DeepSpeed checkpoint (no 'latest' file); pass the "
                              f"directory that `threed train --save` or `threed convert --out` wrote")
    resume_from = ck.load or (ck.save if ck.auto_resume and has_checkpoint(ck.save) else None)
    weights_from = None if resume_from else ck.init_from
    if resume_from or weights_from:
        source = resume_from or weights_from
        check_layout(source, cfg, rt.world_size, full_resume=bool(resume_from))
        if (Path(source) / "threed_run.json").is_file():
            # Also compare the recorded model (e.g. another vocab padding) before DeepSpeed's deep size errors.
            from threed.convert.ds_checkpoint import check_loadable

            check_loadable(source, cfg.model, cfg.parallel.tp, cfg.parallel.pp, weights_only=not resume_from)

    torch.manual_seed(cfg.train.seed)
    init_megatron_parallel_state(cfg.parallel.tp, cfg.parallel.pp, rt.cuda_only.gloo_process_groups)
    module = build_pipeline_module(cfg, rt.world_size, initialize=not (resume_from or weights_from),
                                   fused_swiglu=rt.cuda_only.fused_swiglu)
    check_groups_agree(module._grid)
    optimizer, scheduler = make_optimizer(module, cfg, fused=rt.cuda_only.fused_adamw)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, rt.world_size))
    if resume_from:
        path, _ = engine.load_checkpoint(resume_from)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {resume_from}")
    elif weights_from:
        path, _ = engine.load_checkpoint(weights_from, load_module_only=True, load_optimizer_states=False,
                                         load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load weights from {weights_from}")
        # DeepSpeed 0.19 refreshes the optimizer's fp32 master weights after load_module_only (the fix for the
        # "loss jumps after step 1" bug, DS PR #4141); tests/test_convert checks the loss does not jump.
    return Built(engine=engine, resumed_from=resume_from)

