"""Fewer bytes per micro-batch, over a real pipeline (tests/ranks/test_bytes.py): 2 ranks, tp 1 pp 2, bf16 with fp32
accumulation (BF16_Optimizer), micro 2 x gas 3, the tiny preset, 3 steps. Run twice in one launch:

- "before": DeepSpeed's own `_update_hp_grad` (an fp32 copy of each bf16 gradient) and DeepSpeed's own
  PipelineEngine (the last stage keeps its logits and the loss's graph);
- "after": what threed.engine.build installs (threed.engine.fp32_accumulate, threed.parallel.lean_engine).

Each run reports its losses, gradient norms and the fp32 master weights' sums (the same bits in both runs), what the
last stage holds after each step, and whether the engine, a parameter and an AdamW state tensor are still alive after
`destroy()`, `del` and garbage collection (`collect_all`).

"head_chunks" (`--lm-head-chunks`, threed.model.layers.chunked_token_losses): first real engines (ENGINE_CASES) trained
STEPS steps with the whole logits and with HEAD_CHUNKS chunks (losses, gradient norms); then one tp 2 stage
(HEAD_CASES, fp32, no engine), the loss and every parameter's gradient of one micro-batch both ways, on each TP rank.

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/bytes_worker.py compare --out /tmp/b
    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/bytes_worker.py head_chunks --out /tmp/h
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import weakref
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import build_engine, rank_json, reads_data, run_worker, synthetic_batches
from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
from helpers import gradients_against, pipeline_module
from threed.config import ParallelConfig, RunConfig, TrainConfig
from threed.convert.resolve import model_config
from threed.engine import build as engine_build, fp32_accumulate
from threed.parallel.distributed import Runtime, init_megatron_parallel_state

MICRO, GAS, SEQ, STEPS = 2, 3, 32, 3
HEAD_CHUNKS = 4
# name -> (preset, tp, pp, dtype): 2-rank engines with and without --lm-head-chunks. pp 2 bf16 is BF16_Optimizer, whose
# gradient hooks must fire after the engine's backward prologue (the DeferredLogits view); tied, the head's weight is
# the embedding's, its gradient summed over the two stages' copies; tp 2 fp32, ZeRO-1's fp32 optimizer and TP.
ENGINE_CASES = {
    "pp2_bf16": ("tiny", 1, 2, "bf16"),
    "pp2_bf16_tied": ("tiny-tied", 1, 2, "bf16"),
    "tp2_fp32": ("tiny", 2, 1, "fp32"),
}
# name -> (preset, sequence parallel, packed rows with a loss mask): one tp 2 stage, fp32.
HEAD_CASES = {
    "tp2": ("tiny", False, False),
    "tp2_sp": ("tiny", True, False),
    "tp2_sp_tied": ("tiny-tied", True, False),
    "tp2_packed_masked": ("tiny", False, True),
}


@contextlib.contextmanager
def deepspeeds_own() -> Iterator[None]:
    """DeepSpeed's `_update_hp_grad` and its PipelineEngine class, as before threed installed its own."""
    current = BF16_Optimizer._update_hp_grad
    with (
        mock.patch.object(BF16_Optimizer, "_update_hp_grad", getattr(current, "deepspeed", current)),
        mock.patch.object(fp32_accumulate, "install", lambda: False),
        mock.patch.object(engine_build, "use_schedule", lambda engine, *schedule: engine),
    ):
        yield


def last_stage_holds(engine) -> dict:
    outputs = [t for t in engine.pipe_buffers["outputs"] if t is not None]
    return {
        "outputs": len(outputs),
        "output_bytes": sum(t.untyped_storage().nbytes() for t in outputs if torch.is_tensor(t)),
        "loss_graph": torch.is_tensor(engine.loss) and engine.loss.grad_fn is not None,
    }


def one_run(rt: Runtime, variant: str) -> dict:
    cfg = RunConfig(
        model=model_config("tiny"),
        parallel=ParallelConfig(tp=1, pp=2),
        train=TrainConfig(dtype="bf16", micro_batch_size=MICRO, grad_accum_steps=GAS, seq_length=SEQ, steps=STEPS),
    )
    # the whole run, not only the build: a worker that ran earlier in this process may have installed threed's
    # accumulation already (it is process-wide), and "before" must train with DeepSpeed's own
    with deepspeeds_own() if variant == "before" else contextlib.nullcontext():
        return measured_run(build_engine(cfg, rt).engine, cfg, variant)


def measured_run(engine, cfg: RunConfig, variant: str) -> dict:
    """Train `engine` STEPS steps; its numbers, what its last stage holds, and what is alive after destroy()."""
    data = synthetic_batches(cfg.model.vocab_size, MICRO, SEQ, seed=0, n=GAS * STEPS)
    losses, norms, held = [], [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data_iter=data if reads_data(engine) else None).item())
        norms.append(float(engine.get_global_grad_norm()))
        held.append(last_stage_holds(engine))
    opt = engine.optimizer
    result = {
        "variant": variant,
        "stage": engine.stage_id,
        "last": engine.is_last_stage(),
        "optimizer": type(opt).__name__,
        "update_hp_grad": BF16_Optimizer._update_hp_grad.__name__,
        "class": type(engine).__name__,
        "losses": losses,
        "grad_norms": norms,
        "master": [float(t.double().sum()) for t in opt.fp32_groups_flat_partition],
        "held": held,
    }
    state = next(iter(opt.optimizer.state.values()))["exp_avg"]
    refs = {"engine": weakref.ref(engine), "parameter": weakref.ref(next(engine.module.parameters()))}
    refs["adamw state"] = weakref.ref(state)
    del opt, state, data
    engine.destroy()
    del engine
    result["gc_passes"] = collect_all()
    result["alive_after_destroy"] = {name: ref() is not None for name, ref in refs.items()}
    return result


def collect_all(most: int = 10) -> int:
    """gc.collect() until a pass finds nothing: its number of passes. One is not enough for the parameters: torch
    skips a tensor that C++ still holds (it could be resurrected) during a pass, and each of DeepSpeed's bf16
    parameters is in a cycle with its own bound methods (`get_full_hp_param`, ...), so it goes a pass after what held
    it (measured: freed on the second pass, not the first)."""
    for passes in range(1, most + 1):
        if gc.collect() == 0:
            return passes
    return most


def compare(args: argparse.Namespace, rt: Runtime) -> None:
    results = {}
    for variant in ("before", "after"):
        results[variant] = one_run(rt, variant)
        dist.barrier()
    rank_json(args.out, "", results)


def engine_run(rt: Runtime, case: str, chunks: int) -> dict:
    """ENGINE_CASES[case] trained STEPS steps (micro 2 x gas 3) on synthetic tokens: its losses and gradient norms."""
    name, tp, pp, dtype = ENGINE_CASES[case]
    cfg = RunConfig(
        model=model_config(name),
        parallel=ParallelConfig(tp=tp, pp=pp),
        train=TrainConfig(
            dtype=dtype,
            micro_batch_size=MICRO,
            grad_accum_steps=GAS,
            seq_length=SEQ,
            steps=STEPS,
            lm_head_chunks=chunks,
        ),
    )
    engine = build_engine(cfg, rt).engine
    data = synthetic_batches(cfg.model.vocab_size, MICRO, SEQ, seed=0, n=GAS * STEPS)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data_iter=data if reads_data(engine) else None).item())
        norms.append(float(engine.get_global_grad_norm()))
    engine.destroy()
    return {"losses": losses, "grad_norms": norms}


def stage_grads(name: str, sp: bool, packed: bool, chunks: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One tp 2 stage (the world) of `name`, fp32: the loss of one micro-batch and this TP rank's gradients."""
    cfg = RunConfig(
        model=model_config(name),
        parallel=ParallelConfig(tp=2, sequence_parallel=sp),
        train=TrainConfig(dtype="fp32", micro_batch_size=MICRO, seq_length=SEQ, lm_head_chunks=chunks),
    )
    module = pipeline_module(cfg, 2)
    tokens, labels = next(synthetic_batches(cfg.model.vocab_size, MICRO, SEQ, seed=1, n=1))
    inputs, targets = tokens, labels
    if packed:  # two documents per row, and a loss mask (SFT's)
        doc_ids = (torch.arange(SEQ) >= 13).to(torch.int32).expand(MICRO, SEQ).contiguous()
        inputs, targets = (tokens, doc_ids), (labels, (torch.arange(SEQ) % 3 > 0).float().expand(MICRO, SEQ))
    loss = module.loss_fn(module(inputs), targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


def head_chunks(args: argparse.Namespace, rt: Runtime) -> None:
    """One micro-batch of each HEAD_CASES stage at tp 2, whole and chunked (make test)."""
    results: dict = {}
    init_megatron_parallel_state(2, 1)
    for case, (name, sp, packed) in HEAD_CASES.items():
        whole_loss, whole = stage_grads(name, sp, packed, 1)
        results[case] = gradients_against(*stage_grads(name, sp, packed, HEAD_CHUNKS), whole_loss, whole)
    rank_json(args.out, "head_chunks", results)


def head_chunks_engines(args: argparse.Namespace, rt: Runtime) -> None:
    """Each ENGINE_CASES engine trained 3 steps, whole and chunked (make test-slow: six engines, ~40 s)."""
    results: dict = {}
    for case in ENGINE_CASES:
        results[case] = {str(c): engine_run(rt, case, c) for c in (1, HEAD_CHUNKS)}
        dist.barrier()
    rank_json(args.out, "head_chunks_engines", results)


if __name__ == "__main__":
    raise SystemExit(
        run_worker({"compare": compare, "head_chunks": head_chunks, "head_chunks_engines": head_chunks_engines})
    )
