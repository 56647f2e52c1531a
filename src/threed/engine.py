"""Build the DeepSpeed pipeline engine for a RunConfig: process groups, the PipelineModule, AdamW + schedule,
the group-agreement check, and loading weights or a full checkpoint."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from threed.checkpoint.start import StartDecision, start
from threed.config import RunConfig, deepspeed_config
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
    resumed_from: Optional[str]  # the checkpoint directory of a full resume, else None
    # What the caller passed to threed.checkpoint.save.save (e.g. {"consumed_samples": n}) when this run resumed;
    # empty otherwise.
    client_state: dict = field(default_factory=dict)
    plan: Optional[StartDecision] = None  # where the run started, and the log lines about it


def build_engine(cfg: RunConfig, rt: Runtime, plan: Optional[StartDecision] = None, token_weighted: bool = False) -> Built:
    """Checks, then builds. Where the run starts (and whether --save can take a checkpoint) is decided on rank 0
    and shared before the model is built (`threed.checkpoint.start.start`; threed.train calls it even before the
    datasets and passes its `plan`), so a bad checkpoint directory costs seconds."""
    import deepspeed

    cfg.validate(rt.world_size)
    if plan is None:
        plan = start(cfg, rt.rank, rt.world_size)
    resume = plan.mode == "resume"

    torch.manual_seed(cfg.train.seed)
    init_megatron_parallel_state(cfg.parallel.tp, cfg.parallel.pp, rt.cuda_only.gloo_process_groups)
    module = build_pipeline_module(cfg, rt.world_size, initialize=plan.mode == "fresh",
                                   fused_swiglu=rt.cuda_only.fused_swiglu, token_weighted=token_weighted)
    check_groups_agree(module._grid)
    optimizer, scheduler = make_optimizer(module, cfg, fused=rt.cuda_only.fused_adamw)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=deepspeed_config(cfg, rt.world_size, load_universal=plan.universal))
    client_state: dict = {}
    if resume:
        path, client_state = engine.load_checkpoint(plan.load_dir, tag=plan.tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {plan.load_dir}/{plan.tag}")
    elif plan.mode == "weights":
        path, _ = engine.load_checkpoint(plan.load_dir, tag=plan.tag, load_module_only=True,
                                         load_optimizer_states=False, load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load weights from {plan.load_dir}/{plan.tag}")
        # DeepSpeed 0.19 refreshes the optimizer's fp32 master weights after load_module_only (the fix for the
        # "loss jumps after step 1" bug, DS PR #4141); tests/test_convert checks the loss does not jump.
    # DeepSpeed returns every key of the mp_rank file it does not use itself; the caller's are kept apart.
    client_state = dict((client_state or {}).get("threed_client", {}))
    resumed_from = plan.source.path if resume else None  # the tag: plan.source.tag
    return Built(engine=engine, resumed_from=resumed_from, client_state=client_state, plan=plan)
