"""Build the DeepSpeed pipeline engine for a RunConfig: the DeepSpeed config (engine policy: batch, ZeRO, bf16 with
fp32 accumulation and reduction), process groups, the PipelineModule, AdamW + schedule, the group-agreement
check, and loading weights or a full checkpoint."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from threed.checkpoint.format import open_checkpoint
from threed.checkpoint.start import StartDecision, start
from threed.config import RunConfig
from threed.convert.into_stage import load_into_stage
from threed.metrics.stages import reset_peak_memory
from threed.parallel.distributed import Runtime, check_groups_agree, init_megatron_parallel_state, library_prints
from threed.parallel.pipeline import build_pipeline_module, local_modules
from threed.parallel.zero_bubble import use_schedule


def deepspeed_config(
    cfg: RunConfig, world_size: int, load_universal: bool = False, train: bool = True
) -> dict[str, Any]:
    """The one place that writes DeepSpeed's config. The optimizer and LR schedule are client objects
    (`make_optimizer` below), so they are not in here. `train=False`: an engine that only runs its stages
    (`build_engine(train=False)`), ZeRO off."""
    micro, gas, glob = cfg.train.resolve_batch(cfg.parallel.dp(world_size))
    ds: dict[str, Any] = {
        # DeepSpeed's data axis holds dp x cp ranks (threed.parallel.pipeline.make_topology) and it checks
        # train_batch_size = micro x gas x its data size; the CP ranks of a data-parallel rank read the same rows,
        # so the rows per step stay micro x gas x dp (`glob`).
        "train_batch_size": glob * cfg.parallel.cp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {"stage": cfg.train.zero_stage if train else 0},
        # A torch AdamW under ZeRO-1 is exact (elementwise on flat partitions) and matches a plain torch run.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # we log ourselves, with tokens/s and MFU
        "wall_clock_breakdown": False,
    }
    if cfg.train.dtype == "bf16":
        ds["bf16"] = {
            "enabled": True,
            # Each micro-batch's bf16 gradient is added into the fp32 accumulator by a hook as soon as it is
            # produced and the bf16 .grad is freed (DeepSpeed 0.19's default, stated so it cannot change under
            # us): 2 B/param less at the peak, and the same sums in the same order as the deferred copy.
            "immediate_grad_update": True,
        }
        # fp32 gradient accumulation selects DeepSpeed's BF16_Optimizer (fp32 master weights and grads).
        ds["data_types"] = {"grad_accum_dtype": cfg.train.grad_accum_dtype}
    # The data-parallel all-reduce runs on the fp32 accumulated gradients. DeepSpeed's default is the compute
    # dtype (bf16 when bf16 is on), which rounds the fp32 sums to bf16 before reducing and allocates a 2 B/param
    # temporary every step; fp32 keeps dp2 x gas1 equal to dp1 x gas2 (tests/ranks/test_training.py).
    ds["communication_data_type"] = "fp32"
    if cfg.data.pack:
        # Packed rows send (hidden, doc_ids) between stages: DeepSpeed's reentrant activation checkpointing needs
        # every input of a checkpointed block to require grad, which the integer ids cannot (the first stage fails
        # with "element 0 of tensors does not require grad"); the non-reentrant variant takes them as they are.
        ds["pipeline"] = {"use_reentrant": False}
    if cfg.parallel.sequence_parallel:
        # DeepSpeed's pipe_partitioned / grad_partitioned (on by default under TP) assume every TP rank holds the
        # same activation, send 1/tp of it and all-gather it over TP after the receive. Under sequence parallelism
        # each rank's [s/tp, b, h] is already its own part: it goes as it is, with no gather (1/tp per rank still).
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    if load_universal:  # resuming at another layout: threed.checkpoint.universal
        ds["checkpoint"] = {"load_universal": True}
    return ds


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


def make_optimizer(
    model: torch.nn.Module, cfg: RunConfig, fused: bool = False
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    # Norm weights (1-D) get no weight decay, as in Megatron-LM.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    t = cfg.train
    groups = [
        g
        for g in ({"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0})
        if g["params"]
    ]
    # fused (CUDA only, see threed.parallel.distributed.cuda_only); elsewhere torch's default (foreach) implementation.
    optimizer = torch.optim.AdamW(
        groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps, fused=True if fused else None
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    return optimizer, scheduler


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


@dataclass
class Built:
    engine: "deepspeed.runtime.pipe.engine.PipelineEngine"  # noqa: F821
    resumed_from: Optional[str]  # the checkpoint directory of a full resume, else None
    # What the caller passed to threed.checkpoint.save.save (e.g. {"consumed_samples": n}) when this run resumed;
    # empty otherwise.
    client_state: dict = field(default_factory=dict)
    decision: Optional[StartDecision] = None  # where the run started, and the log lines about it
    ds_config: dict = field(default_factory=dict)  # the DeepSpeed config the engine was built with


def load_weights_sliced(engine, cfg: RunConfig, decision: StartDecision) -> None:
    """Weights written at another tp / pp (decision.other_layout): each rank reads its shards' slices of them
    (threed.convert.into_stage), then, as DeepSpeed's `load_checkpoint(load_module_only=True)` does after its own
    load, the optimizer's fp32 master weights are refreshed from the loaded parameters."""
    ck = open_checkpoint(decision.load_dir, model=cfg.model, tag=decision.tag)  # the model decide_start checked
    tp_rank = engine.grid.get_slice_parallel_rank()
    load_into_stage(ck, local_modules(engine.module, cfg.model), cfg.parallel.tp, tp_rank)
    if engine.optimizer is not None and hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()


def build_engine(
    cfg: RunConfig,
    rt: Runtime,
    decision: Optional[StartDecision] = None,
    token_weighted: bool = False,
    train: bool = True,
) -> Built:
    """Builds from a validated `cfg` (`RunConfig.validate`: threed.train validates once, before anything else).
    Where the run starts (and whether --save can take a checkpoint) is decided on rank 0 and shared before the
    model is built (`threed.checkpoint.start.start`; threed.train calls it even before the datasets and passes its
    `decision`), so a bad checkpoint directory costs seconds. `train=False` (threed generate, eval-harness): the
    weights alone, with no optimizer, so no fp32 master weights, gradient buffers or Adam state (under bf16
    DeepSpeed wraps a placeholder optimizer that allocates nothing): 2 B/param in bf16 where training holds ~16, so
    a checkpoint trained on several nodes is scored on one."""
    import deepspeed  # heavy: only where a model is built

    if decision is None:
        decision = start(cfg, rt.rank, rt.world_size)
    resume = decision.mode == "resume"

    torch.manual_seed(cfg.train.seed)
    init_megatron_parallel_state(cfg.parallel.tp, cfg.parallel.pp, rt.cuda_only.gloo_process_groups, cp=cfg.parallel.cp)
    with library_prints():  # DeepSpeed's PipelineModule and engine print() their start-up lines on rank 0
        module = build_pipeline_module(
            cfg,
            rt.world_size,
            initialize=decision.mode == "fresh",
            fused_swiglu=rt.cuda_only.fused_swiglu,
            token_weighted=token_weighted,
        )
        check_groups_agree(module._grid)
        optimizer, scheduler = make_optimizer(module, cfg, fused=rt.cuda_only.fused_adamw) if train else (None, None)
        ds_config = deepspeed_config(cfg, rt.world_size, load_universal=decision.universal, train=train)
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        use_schedule(engine, cfg.parallel.pipeline_schedule)  # --pipeline-schedule (threed.parallel.schedule)
    client_state: dict = {}
    if resume:
        with library_prints():  # BF16_Optimizer prints a line per rank on load
            path, client_state = engine.load_checkpoint(decision.load_dir, tag=decision.tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {decision.load_dir}/{decision.tag}")
        place_optimizer_state(engine.optimizer)
    elif decision.mode == "weights" and decision.other_layout:
        load_weights_sliced(engine, cfg, decision)
    elif decision.mode == "weights":
        path, _ = engine.load_checkpoint(
            decision.load_dir,
            tag=decision.tag,
            load_module_only=True,
            load_optimizer_states=False,
            load_lr_scheduler_states=False,
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load weights from {decision.load_dir}/{decision.tag}")
        # DeepSpeed 0.19 refreshes the optimizer's fp32 master weights after load_module_only (the fix for the
        # "loss jumps after step 1" bug, DS PR #4141); tests/test_convert checks the loss does not jump.
    # DeepSpeed returns every key of the mp_rank file it does not use itself; the caller's are kept apart.
    client_state = dict((client_state or {}).get("threed_client", {}))
    # Every rank's peak memory from here on: the training steps' (BF16_Optimizer reset rank 0's alone at its init).
    reset_peak_memory(rt.device)
    resumed_from = decision.source.path if resume else None  # the tag: decision.source.tag
    return Built(
        engine=engine, resumed_from=resumed_from, client_state=client_state, decision=decision, ds_config=ds_config
    )
