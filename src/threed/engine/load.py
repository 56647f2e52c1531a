"""What a built engine starts from, as `threed.checkpoint.start` decided: a full resume through DeepSpeed's loader
(optimizer state placed where torch would put it), weights at the same layout through DeepSpeed's
`load_module_only`, or weights written at another tp / pp read slice by slice into this rank's stage.

Whatever was loaded is checked finite before anything runs on it (`check_finite`): a NaN or inf in a checkpoint
(a diverged run saved by another tool, a converted model with a broken tensor, a damaged file) would otherwise
surface as a non-finite loss at step 1, told to lower the learning rate. The check reads the weights in memory,
as loaded (one isfinite per parameter and one host sync per rank), never the files again."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from threed.checkpoint.format import CheckpointError, layer_file, open_checkpoint
from threed.checkpoint.start import StartDecision
from threed.config import ModelConfig, TrainConfig
from threed.convert.into_stage import load_into_stage
from threed.engine.optimizer import apply_schedule, place_optimizer_state
from threed.parallel.distributed import is_multi_rank, library_prints
from threed.parallel.pipeline import local_modules


def load_weights_sliced(engine, model: ModelConfig, tp: int, decision: StartDecision) -> None:
    """Weights written at another tp / pp (decision.other_layout): each rank reads its shards' slices of them
    (threed.convert.into_stage), then, as DeepSpeed's `load_checkpoint(load_module_only=True)` does after its own
    load, the optimizer's fp32 master weights are refreshed from the loaded parameters."""
    ck = open_checkpoint(decision.load_dir, model=model, tag=decision.tag)  # the model decide_start checked
    tp_rank = engine.grid.get_slice_parallel_rank()
    load_into_stage(ck, local_modules(engine.module, model), tp, tp_rank)
    if engine.optimizer is not None and hasattr(engine.optimizer, "refresh_fp32_params"):
        engine.optimizer.refresh_fp32_params()


def load_start(
    engine, model: ModelConfig, tp: int, decision: StartDecision, schedule: Optional[TrainConfig] = None
) -> dict:
    """Loads what `decision` names into `engine` (nothing for a fresh start); returns the caller's client state of
    a full resume (what it passed to threed.checkpoint.save.save, e.g. {"consumed_samples": n}), else {}. A resume
    of a training engine (`schedule`: this command's) trains at this command's --lr (`apply_schedule`)."""
    client_state: dict = {}
    if decision.mode == "resume":
        with library_prints():  # BF16_Optimizer prints a line per rank on load
            # An adapter-only LoRA checkpoint's layer files lack the frozen base (threed.engine.lora loaded it from
            # the base it names): not strictly, or DeepSpeed refuses every absent base key.
            path, client_state = engine.load_checkpoint(
                decision.load_dir, tag=decision.tag, load_module_strict=not decision.adapters_only
            )
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {decision.load_dir}/{decision.tag}")
        place_optimizer_state(engine.optimizer)
        if schedule is not None:
            apply_schedule(engine.lr_scheduler, schedule)
    elif decision.mode == "weights" and decision.other_layout:
        load_weights_sliced(engine, model, tp, decision)
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
    if decision.mode in ("resume", "weights"):
        check_finite(engine, model, decision)
    # DeepSpeed returns every key of the mp_rank file it does not use itself; the caller's are kept apart.
    return dict((client_state or {}).get("threed_client", {}))


def first_non_finite(engine, model: ModelConfig, decision: StartDecision) -> Optional[str]:
    """The first of this rank's loaded layers holding a NaN or inf, as `<what> in <parameter> of <layer file>`, or
    None. One isfinite pass over the weights in memory and one host sync (a flag per layer)."""
    modules = local_modules(engine.module, model)
    flags = [
        torch.stack([torch.isfinite(p).all() for p in module.parameters()]).all()
        for _, module in modules
        if any(True for _ in module.parameters())
    ]
    if not flags or bool(torch.stack(flags).all()):
        return None
    for layer, module in modules:
        for name, p in module.named_parameters():
            if not bool(torch.isfinite(p).all()):
                what = "nan" if bool(torch.isnan(p).any()) else "inf"
                tp_rank = engine.grid.get_slice_parallel_rank() if hasattr(engine, "grid") else 0
                native = not (decision.other_layout or decision.universal)
                where = (
                    layer_file(layer.index, tp_rank) if native else f"layer {layer.index} (layer_{layer.index:02d}-*)"
                )
                return f"{what} in {name} of {where}"
    return None


def check_finite(engine, model: ModelConfig, decision: StartDecision) -> None:
    """Refuse (CheckpointError, exit 2 on every rank, said once by rank 0) loaded weights that hold a NaN or inf,
    naming the tensor, the layer file and the checkpoint: training from them gives a non-finite loss at step 1."""
    bad = first_non_finite(engine, model, decision)
    if is_multi_rank():  # every rank refuses alike, with the first bad tensor of any rank
        views: list = [None] * dist.get_world_size()
        dist.all_gather_object(views, bad)
        bad = next((v for v in views if v), None)
    if bad:
        source = f"{decision.load_dir}/{decision.tag}"
        raise CheckpointError(
            f"checkpoint {source} holds non-finite weights ({bad}): it was saved from a diverged run or damaged "
            f"on disk, and training from it would give a non-finite loss at step 1 whatever the learning rate. "
            f"Start from an earlier checkpoint (move {source} out of {decision.load_dir}: the newest complete one "
            f"left is used) or convert the weights again"
        )
