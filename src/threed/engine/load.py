"""What a built engine starts from, as `threed.checkpoint.start` decided: a full resume through DeepSpeed's loader
(optimizer state placed where torch would put it), weights at the same layout through DeepSpeed's
`load_module_only`, or weights written at another tp / pp read slice by slice into this rank's stage."""

from __future__ import annotations

from threed.checkpoint.format import open_checkpoint
from threed.checkpoint.start import StartDecision
from threed.config import ModelConfig
from threed.convert.into_stage import load_into_stage
from threed.engine.optimizer import place_optimizer_state
from threed.parallel.distributed import library_prints
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


def load_start(engine, model: ModelConfig, tp: int, decision: StartDecision) -> dict:
    """Loads what `decision` names into `engine` (nothing for a fresh start); returns the caller's client state of
    a full resume (what it passed to threed.checkpoint.save.save, e.g. {"consumed_samples": n}), else {}."""
    client_state: dict = {}
    if decision.mode == "resume":
        with library_prints():  # BF16_Optimizer prints a line per rank on load
            path, client_state = engine.load_checkpoint(decision.load_dir, tag=decision.tag)
        if path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint {decision.load_dir}/{decision.tag}")
        place_optimizer_state(engine.optimizer)
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
    # DeepSpeed returns every key of the mp_rank file it does not use itself; the caller's are kept apart.
    return dict((client_state or {}).get("threed_client", {}))
