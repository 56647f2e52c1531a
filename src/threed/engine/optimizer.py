"""The optimizer of a run: AdamW (no weight decay on norm weights, as Megatron-LM) with linear warmup and cosine
decay, handed to DeepSpeed as client objects; and where optimizer state tensors belong after a checkpoint load.

Each takes the `TrainConfig` section it reads, not the whole run.
"""

from __future__ import annotations

import math

import torch

from threed.config import TrainConfig


def lr_lambda(t: TrainConfig):
    """Linear warmup to lr, then cosine decay to min_lr at the last step (as a multiplier of lr)."""
    floor = t.min_lr / t.lr if t.lr > 0 else 0.0

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def make_optimizer(
    model: torch.nn.Module, t: TrainConfig, fused: bool = False
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    # Norm weights (1-D) get no weight decay, as in Megatron-LM.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [
        g
        for g in ({"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    # fused (CUDA only, see threed.parallel.distributed.cuda_only); elsewhere torch's default (foreach) implementation.
    optimizer = torch.optim.AdamW(
        groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps, fused=True if fused else None
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t))
    return optimizer, scheduler


def apply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, t: TrainConfig) -> None:
    """After a full resume, this command's --lr at the step the checkpoint reached. DeepSpeed's load restores the
    scheduler's base_lrs and each group's lr from the checkpoint, so a resume with a lower --lr (what the divergence
    guard's line asks for) trained on at the old one. The schedule's shape (warm-up, --min-lr, --steps) is already
    this command's (`lr_lambda(t)`). Megatron-LM refuses such a change unless told (--override-opt_param-scheduler);
    here the command line wins, as the guard's line "the resume changed the learning-rate schedule (--lr A -> B)"
    says. The same command gives the same floats (base x factor, as LambdaLR computes them): an exact resume stays
    bit for bit."""
    scheduler.base_lrs = [t.lr for _ in scheduler.base_lrs]
    for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = t.lr
        group["lr"] = t.lr * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's wrappers (BF16_Optimizer, ZeRO's stage-1/2 optimizer keep it as
    `.optimizer`); the optimizer itself when it is not wrapped."""
    while not isinstance(optimizer, torch.optim.Optimizer) and hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def place_optimizer_state(optimizer) -> int:
    """After a checkpoint load, put every optimizer state tensor where torch's own `Optimizer.load_state_dict`
    would: on its parameter's device, and AdamW's `step` on that device too (as float32) in a fused or capturable
    group, on the CPU otherwise. DeepSpeed's universal load restores the state from CPU files and leaves `step` a
    CPU tensor, which the fused CUDA kernel cannot take (it is handed a host pointer). Returns how many tensors
    moved (0 on a CPU run, or when the load placed them already)."""
    opt = _torch_optimizer(optimizer)
    if not isinstance(opt, torch.optim.Optimizer):
        return 0
    moved = 0
    for group in opt.param_groups:
        on_device_step = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            state = opt.state.get(p)
            if not state:
                continue
            for key, value in list(state.items()):
                if not isinstance(value, torch.Tensor):
                    continue
                if key == "step":
                    device = p.device if on_device_step else torch.device("cpu")
                    want = value.to(device=device, dtype=torch.float32)
                else:
                    want = value.to(device=p.device)
                if want is not value:
                    state[key] = want
                    moved += 1
    return moved
