"""Pipeline-schedule scenarios for tests/ranks/test_pipeline_schedule.py: the same run under 1f1b and zb-h1 (fp32, HF's
gqa31 weights, 6 steps, several gas), its final weights, a checkpoint written under one schedule resumed under
the other, evaluation, and zb-h1 with bf16, sequence parallelism, recompute, packed rows and a tied model.

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/schedule_worker.py --out /tmp/x --data PREFIX \
        --tp 2 --pp 2 --gas 4,8
    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/schedule_worker.py --out /tmp/y --data PREFIX \
        --tp 1 --pp 4 --gas 8,3 --variants ""
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import load_hf_weights, rank_json, reads_data, run_worker
from dist_worker import run_steps, train_dataset
from helpers import hf_model, model_config
from reference import PARITY
from recompute_worker import packed_batches
from tied_worker import tied_hf_model, tied_model_config
from threed.config import CheckpointConfig, DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
from worker_setup import build_engine
from threed.model.wgrad import DEFERRED

STEPS = 6
# zb-h1 variants checked against 1f1b with the same switches (tp2 pp2 launch): name -> (config changes, model)
VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "bf16": (dict(dtype="bf16"), "gqa31"),
    "sp_block1": (
        dict(sequence_parallel=True, recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        "gqa31",
    ),
    "uniform1": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), "gqa31"),
    "selective": (dict(recompute_granularity="selective"), "gqa31"),
    "packed": (dict(pack=True), "gqa31"),
    "tied": ({}, "tied"),
}


def model(name: str):
    return tied_model_config() if name == "tied" else model_config(name)


def config(
    args: argparse.Namespace,
    schedule: str,
    gas: int,
    name: str = "gqa31",
    pack: bool = False,
    sequence_parallel: bool = False,
    **train: Any,
) -> RunConfig:
    blocks = model(name).num_layers
    per_stage = ",".join([str(blocks // args.pp)] * args.pp)
    return RunConfig(
        model=model(name),
        parallel=ParallelConfig(
            tp=args.tp,
            pp=args.pp,
            partition_method=f"layers:{per_stage}",
            sequence_parallel=sequence_parallel,
            pipeline_schedule=schedule,
        ),
        train=TrainConfig(
            **{**PARITY, **dict(micro_batch_size=1, grad_accum_steps=gas, seq_length=32, steps=STEPS), **train}
        ),
        data=DataConfig(data_path=(args.data,), pack=pack),
    )


def run(cfg: RunConfig, engine, ds, start: int, stop: int) -> tuple[list[float], list[float]]:
    if not cfg.data.pack:
        return run_steps(engine, cfg, ds, start, stop)
    batches = packed_batches(cfg) if reads_data(engine) else None
    losses, norms = [], []
    for _ in range(start, stop):
        losses.append(engine.train_batch(data_iter=batches).item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def trained(cfg: RunConfig, rt: Runtime, ds, hf_state: dict, save_after: int = 0) -> dict:
    """STEPS steps from HF's weights: losses, gradient norms, an evaluation loss and the final weights' checksum;
    with `save_after`, a checkpoint at that step (in cfg.checkpoint.save)."""
    engine = build_engine(cfg, rt).engine
    load_hf_weights(engine, cfg, hf_state)
    # How many weight gradients each backward deferred in the first step (every split linear of the stage, once).
    deferred: list[int] = []
    put = DEFERRED.put
    DEFERRED.put = lambda fn: (deferred.append(1), put(fn))  # type: ignore[method-assign]
    try:
        losses, norms = run(cfg, engine, ds, 0, 1)
    finally:
        del DEFERRED.put
    more = run(cfg, engine, ds, 1, save_after or STEPS)
    losses, norms = losses + more[0], norms + more[1]
    if save_after:
        engine.save_checkpoint(cfg.checkpoint.save)
        more = run(cfg, engine, ds, save_after, STEPS)
        losses, norms = losses + more[0], norms + more[1]
    weights = dict(engine.module.named_parameters())  # the same module under either schedule
    gen = torch.Generator().manual_seed(3)
    vocab, micro, seq = cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.train.seq_length
    evals = [
        (t[:, :-1].contiguous(), t[:, 1:].contiguous())
        for t in (torch.randint(0, vocab, (micro, seq + 1), generator=gen) for _ in range(cfg.train.grad_accum_steps))
    ]
    eval_loss = (
        float(engine.eval_batch(iter(evals) if reads_data(engine) and not cfg.data.pack else None))
        if not cfg.data.pack
        else None
    )
    linears = [
        type(m).__name__
        for m in engine.module.modules()
        if type(m).__name__ in ("SplitColumnParallelLinear", "SplitRowParallelLinear")
    ]
    return {
        "losses": losses,
        "grad_norms": norms,
        "eval": eval_loss,
        "stage": engine.stage_id,
        "class": type(engine).__name__,
        "deferred_per_micro_batch": len(deferred) / cfg.train.grad_accum_steps,
        "split_linears": len(linears) + int(engine.is_last_stage() and cfg.model.tie_word_embeddings),
        "weights": {
            k: [float(v.detach().double().sum()), float(v.detach().double().abs().sum())] for k, v in weights.items()
        },
    }


def resumed(cfg: RunConfig, rt: Runtime, ds, load: str, start: int) -> dict:
    built = build_engine(dataclasses.replace(cfg, checkpoint=CheckpointConfig(load=load)), rt)
    assert built.engine.global_steps == start, built.engine.global_steps
    losses, norms = run(cfg, built.engine, ds, start, STEPS)
    return {"losses": losses, "grad_norms": norms}


def main(args: argparse.Namespace, rt: Runtime) -> None:
    hf = {"gqa31": hf_model("gqa31").state_dict(), "tied": tied_hf_model().state_dict()}
    results: dict[str, Any] = {}
    for gas in (int(g) for g in args.gas.split(",") if g):
        ds = train_dataset(config(args, "1f1b", gas), rt.world_size)
        for schedule in ("1f1b", "zb-h1"):
            cfg = config(args, schedule, gas)
            if gas == int(args.gas.split(",")[0]):  # the first gas also saves at step 3, for the cross resume
                cfg = dataclasses.replace(
                    cfg, checkpoint=CheckpointConfig(save=f"{args.out}/ckpt_{schedule}", auto_resume=False)
                )
                results[f"{schedule}_gas{gas}"] = trained(cfg, rt, ds, hf["gqa31"], save_after=3)
            else:
                results[f"{schedule}_gas{gas}"] = trained(cfg, rt, ds, hf["gqa31"])
        if gas == int(args.gas.split(",")[0]):
            for saved, now in (("1f1b", "zb-h1"), ("zb-h1", "1f1b")):
                results[f"{saved}_then_{now}"] = resumed(config(args, now, gas), rt, ds, f"{args.out}/ckpt_{saved}", 3)
    gas = args.variant_gas
    for name in [v for v in args.variants.split(",") if v]:
        changes, which = VARIANTS[name]
        train = {k: v for k, v in changes.items() if k not in ("pack", "sequence_parallel")}
        extra = {k: v for k, v in changes.items() if k in ("pack", "sequence_parallel")}
        # packed rows are synthetic (recompute_worker.packed_batches): no dataset
        ds = (
            None
            if extra.get("pack")
            else train_dataset(config(args, "1f1b", gas, which, **extra, **train), rt.world_size)
        )
        for schedule in ("1f1b", "zb-h1"):
            results[f"{name}_{schedule}"] = trained(
                config(args, schedule, gas, which, **extra, **train), rt, ds, hf[which]
            )
    rank_json(args.out, "schedule", results)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--gas", default="4,8", help="comma-separated; the first also checks the cross-schedule resume")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--variant-gas", type=int, default=4)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
