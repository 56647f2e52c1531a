"""Build the DeepSpeed pipeline engine of a resolved run: the one page that says in which order parallelism is
applied (`build_engine`). Training, generation, lm-eval scoring and verification all build theirs here.

    run = threed.engine.resolved.resolve(cfg, world)
    built = build_engine(run, rt)            # built.engine: DeepSpeed's PipelineEngine over this rank's stage
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from threed.checkpoint.start import StartDecision, start
from threed.engine.ds_config import engine_config
from threed.engine import fp32_accumulate
from threed.engine.load import load_start
from threed.engine.lora import attach_lora
from threed.engine.optimizer import make_optimizer
from threed.engine.resolved import ResolvedRun
from threed.metrics.stages import reset_peak_memory
from threed.parallel.distributed import Runtime, check_groups_agree, init_megatron_parallel_state, library_prints
from threed.parallel.pipeline import build_pipeline_module
from threed.model import compiled
from threed.parallel.zero_bubble import use_schedule


@dataclass
class Built:
    engine: "deepspeed.runtime.pipe.engine.PipelineEngine"  # noqa: F821
    resumed_from: Optional[str]  # the checkpoint directory of a full resume, else None
    # What the caller passed to threed.checkpoint.save.save (e.g. {"consumed_samples": n}) when this run resumed;
    # empty otherwise.
    client_state: dict = field(default_factory=dict)
    decision: Optional[StartDecision] = None  # where the run started, and the log lines about it
    ds_config: dict = field(default_factory=dict)  # the DeepSpeed config the engine was built with


def build_engine(
    run: ResolvedRun,
    rt: Runtime,
    decision: Optional[StartDecision] = None,
    token_weighted: bool = False,
    train: bool = True,
) -> Built:
    """This rank's engine. Where the run starts (and whether --save can take a checkpoint) is decided on rank 0 and
    shared before the model is built (`threed.checkpoint.start.start`; threed.train calls it even before the
    datasets and passes its `decision`), so a bad checkpoint directory costs seconds. `token_weighted`: SFT data
    (per-token loss weights). `train=False` (threed generate, eval-harness): the weights alone, with no optimizer,
    so no fp32 master weights, gradient buffers or Adam state (under bf16 DeepSpeed wraps a placeholder optimizer
    that allocates nothing): 2 B/param in bf16 where training holds ~16."""
    import deepspeed  # heavy: only where a model is built

    cfg, dims = run.cfg, run.dims
    if decision is None:
        decision = start(cfg, dims, rt.rank)
    torch.manual_seed(cfg.train.seed)
    # --torch-compile refused in one line where this device or torch cannot compile, before anything is built.
    compiled.check(cfg.train.torch_compile, rt.device)
    # 1. Process groups: megatron-core's tp-cp-dp-pp groups, which its layers use for TP, SP and CP collectives.
    init_megatron_parallel_state(dims.tp, dims.pp, cp=dims.cp)
    with library_prints():  # DeepSpeed's PipelineModule and engine print() their start-up lines on rank 0
        # 2-4. Layers with TP / SP / CP (megatron-core's block, our attention), cut into the stages of dims.bounds
        # (each rank builds only its own), compiled as --torch-compile says, with full recompute's chunks: one
        # PipelineModule.
        module = build_pipeline_module(
            cfg.model,
            dims,
            cfg.train,
            sequence_parallel=cfg.parallel.sequence_parallel,
            initialize=decision.mode == "fresh",
            fused_swiglu=rt.cuda_only.fused_swiglu,
            token_weighted=token_weighted,
        )
        check_groups_agree(module._grid)  # DeepSpeed's (pipe, data, model) grid == megatron's groups, rank by rank
        attach_lora(module, cfg, decision)  # --lora-rank: adapters on, the base frozen, before the optimizer is made
        # 5. ZeRO-1 over dp x cp, bf16 with fp32 accumulation and reduction: DeepSpeed's engine around the module.
        fused = rt.cuda_only.fused_adamw
        optimizer, scheduler = make_optimizer(module, cfg.train, fused=fused) if train else (None, None)
        ds_config = engine_config(run.ds_config, load_universal=decision.universal, train=train)
        fp32_accumulate.install()  # BF16_Optimizer adds each bf16 grad into fp32 without an fp32 copy of it
        engine, _, _, _ = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
        )
        # 6. The schedule (1F1B, ZB-H1, interleaved at --vpp > 1) on the engine DeepSpeed returned, which runs it
        # (every engine's last stage lets go of its logits after the loss: threed.parallel.lean_engine).
        use_schedule(engine, dims.schedule, dims.vpp)
    # 7. What the run starts from: a full resume, weights (at this layout or sliced from another), or nothing.
    client_state = load_start(engine, cfg.model, dims.tp, decision, schedule=cfg.train if train else None)
    # Every rank's peak memory from here on: the training steps' (BF16_Optimizer reset rank 0's alone at its init).
    reset_peak_memory(rt.device)
    return Built(
        engine=engine,
        resumed_from=decision.source.path if decision.mode == "resume" else None,
        client_state=client_state,
        decision=decision,
        ds_config=ds_config,
    )
