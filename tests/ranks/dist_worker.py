"""Multi-rank test scenarios, run under torchrun by the tests (one launch does several checks, since a launch
costs ~15 s of start-up on 2 cores). Each writes its results under --out; the pytest side compares them with
HuggingFace references computed in its own process.

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/dist_worker.py parity --out /tmp/x
    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/dist_worker.py train --out /tmp/x --data tokens.bin
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import keeps_logits, load_hf_weights, local_weights, rank_json, reads_data, run_worker
from helpers import hf_model, model_config
from reference import PARITY
from megatron.core import parallel_state as ps
from threed.config import CheckpointConfig, DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.data.datasets import build_datasets
from threed.data.loader import micro_batches
from threed.data.splits import read_data_flags
from threed.model.context import share_batches
from threed.parallel.distributed import GroupMismatch, Runtime, check_groups_agree
from worker_setup import build_engine
from threed.verify.logits import pipeline_logits

PARITY_TOKENS = dict(batch=2, seq=32, seed=1)


def parity(args: argparse.Namespace, rt: Runtime) -> None:
    gen = torch.Generator().manual_seed(PARITY_TOKENS["seed"])
    for name in ("gqa31", "mha2"):
        hf_state = hf_model(name).state_dict()
        mc = model_config(name)
        tokens = torch.randint(0, mc.vocab_size, (PARITY_TOKENS["batch"], PARITY_TOKENS["seq"]), generator=gen)
        for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            if rt.world_size % (tp * pp):
                continue  # fewer ranks than the layout needs (make test-gpu on a machine with few GPUs)
            cfg = RunConfig(
                model=mc,
                parallel=ParallelConfig(tp=tp, pp=pp),
                train=TrainConfig(
                    dtype="fp32",
                    seq_length=PARITY_TOKENS["seq"],
                    micro_batch_size=PARITY_TOKENS["batch"],
                    grad_accum_steps=1,
                ),
            )
            engine = build_engine(cfg, rt).engine
            load_hf_weights(engine, cfg, hf_state)
            logits = pipeline_logits(engine, tokens, mc.vocab_size)
            if logits is not None and keeps_logits(engine):
                torch.save({"tokens": tokens, "logits": logits}, args.out / f"{name}_tp{tp}_pp{pp}.pt")
            dist.barrier()


def train_dataset(cfg: RunConfig, world_size: int):
    """The train split `threed train` reads for cfg (built on every rank here; only stages 0 and -1 read it)."""
    return build_datasets(
        cfg, read_data_flags(cfg), cfg.train.resolve_batch(cfg.parallel.dp(world_size))[2], True
    ).train


def run_steps(engine, cfg: RunConfig, ds, start: int, stop: int) -> tuple[list[float], list[float]]:
    """Train steps [start, stop) reading what threed.train reads: rows dealt over dp (megatron's data-parallel group
    without CP; DeepSpeed's data axis holds dp x cp), each CP rank keeping its share of them."""
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    micro, gas, glob = cfg.train.resolve_batch(dp)
    it = None
    if reads_data(engine):
        rows = micro_batches(ds, glob, micro, dp, dp_rank, start * glob, cfg.model.vocab_size)
        it = share_batches(rows, ps.get_context_parallel_world_size(), ps.get_context_parallel_rank())
    losses, norms = [], []
    for _ in range(start, stop):
        losses.append(engine.train_batch(data_iter=it).item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def train(args: argparse.Namespace, rt: Runtime) -> None:
    out = args.out
    mc = model_config("gqa31")
    hf_state = hf_model("gqa31").state_dict()
    base = RunConfig(
        model=mc,
        parallel=ParallelConfig(tp=2, pp=2),
        train=TrainConfig(
            **PARITY,
            micro_batch_size=2,
            grad_accum_steps=2,
            seq_length=32,
            steps=5,
        ),
        data=DataConfig(data_path=(args.data,)),
    )
    results: dict = {}

    # 1. fp32 parity run, with a checkpoint after step 3.
    ckpt = str(out / "ckpt")
    cfg = dataclasses.replace(base, checkpoint=CheckpointConfig(save=ckpt, auto_resume=False))
    ds = train_dataset(cfg, rt.world_size)
    engine = build_engine(cfg, rt).engine
    results["groups"] = check_groups_agree(engine.grid)
    load_hf_weights(engine, cfg, hf_state)
    l1, n1 = run_steps(engine, cfg, ds, 0, 3)
    engine.save_checkpoint(ckpt)
    saved = local_weights(engine, cfg.model)
    l2, n2 = run_steps(engine, cfg, ds, 3, 5)
    results["fp32"] = {"losses": l1 + l2, "grad_norms": n1 + n2}

    # 2. Resume from the checkpoint: bit-identical weights, the same next losses.
    cfg_resume = dataclasses.replace(base, checkpoint=CheckpointConfig(load=ckpt))
    built = build_engine(cfg_resume, rt)
    loaded = local_weights(built.engine, cfg.model)
    results["resume"] = {
        "step": built.engine.global_steps,
        "weights_equal": all(torch.equal(saved[k], loaded[k]) for k in saved) and saved.keys() == loaded.keys(),
    }
    results["resume"]["losses"], results["resume"]["grad_norms"] = run_steps(built.engine, cfg_resume, ds, 3, 5)

    # 3. bf16 (micro 2 x gas 2, fp32 grad accumulation) against fp32 on learnable data.
    for dtype in ("bf16", "fp32"):
        cfg_d = dataclasses.replace(
            base,
            train=dataclasses.replace(
                base.train, dtype=dtype, steps=args.bf16_steps, lr=3e-3, min_lr=3e-4, warmup_steps=3, grad_clip=1.0
            ),
            data=DataConfig(data_path=(args.learnable,)),
        )
        learn = train_dataset(cfg_d, rt.world_size)
        eng = build_engine(cfg_d, rt).engine
        load_hf_weights(eng, cfg_d, hf_state)
        results[f"learn_{dtype}"] = {
            "losses": run_steps(eng, cfg_d, learn, 0, args.bf16_steps)[0],
            "optimizer": type(eng.optimizer).__name__,
        }

    # 4. Activation checkpointing (recompute each block in backward) changes memory, not numbers.
    cfg_ac = dataclasses.replace(base, train=dataclasses.replace(base.train, activation_checkpointing=True))
    eng = build_engine(cfg_ac, rt).engine
    load_hf_weights(eng, cfg_ac, hf_state)
    results["activation_checkpointing"] = dict(zip(("losses", "grad_norms"), run_steps(eng, cfg_ac, ds, 0, 2)))

    # 5. From random init (no HF weights): the same numbers as HF's model holding `random_hf_state(seed)`.
    eng = build_engine(base, rt).engine
    results["fp32_random"] = dict(zip(("losses", "grad_norms"), run_steps(eng, base, ds, 0, 5)))

    # 6. The start-up check must catch a grid whose rank order differs from megatron-core's.
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology

    wrong = PipelineParallelGrid(topology=ProcessTopology(axes=["data", "pipe", "model"], dims=[2, 2, 2]))
    try:
        check_groups_agree(wrong)
        results["mismatch_detected"] = False
    except GroupMismatch:
        results["mismatch_detected"] = True

    rank_json(out, "train", results)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data")
    p.add_argument("--learnable")
    p.add_argument("--bf16-steps", type=int, default=20)


if __name__ == "__main__":
    raise SystemExit(run_worker({"parity": parity, "train": train}, add_arguments))
