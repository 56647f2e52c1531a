"""Multi-rank scenarios for tests/ranks/test_sequence_parallel.py (8 ranks, tp2 pp2 dp2, fp32, the `gqa31` HF test
model): the same run with and without `--sequence-parallel`, the replicated norm weights compared over each TP group
after every step, what crosses a stage boundary counted on DeepSpeed's send and gather paths, packed SFT through
threed.train, and resumes that switch sequence parallelism on or off (natively and through the universal
checkpoint).

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/sp_worker.py --out /tmp/sp --data PREFIX \\
        --sft-data CHAT_text_document

Rank 0 writes OUT/sp.json; OUT/final_<run>_stage<S>.pt hold the HF-named weights of each stage after the last step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
from collections import Counter

import torch
import torch.distributed as dist

import threed.checkpoint.save as ckpt

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import load_hf_weights, run_worker
from dist_worker import run_steps, train_dataset
from helpers import hf_model, model_config
from reference import PARITY
from sft_worker import sft_config
from threed.config import CheckpointConfig, DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
from worker_setup import build_engine
from worker_setup import train
from tied_worker import save_final

STEPS, SAVED_AT, SFT_STEPS = 10, 5, 3
SEQ, MICRO = 32, 2


def base_config(data: str, sp: bool, save: str | None = None, tp: int = 2, pp: int = 2) -> RunConfig:
    """reference.gqa31_reference's model, batch (8 sequences of 32) and optimizer, over STEPS steps."""
    return RunConfig(
        model=model_config("gqa31"),
        parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=sp),
        train=TrainConfig(
            **PARITY,
            micro_batch_size=MICRO,
            global_batch_size=8,
            seq_length=SEQ,
            steps=STEPS,
        ),
        data=DataConfig(data_path=(data,)),
        checkpoint=CheckpointConfig(save=save, auto_resume=save is not None),
    )


def norms_equal_over_tp(engine) -> bool:
    """Whether every replicated (norm) weight of this stage is bit-identical on all TP ranks of the group; every
    rank answers for all."""
    group = engine.grid.get_slice_parallel_group()
    same = True
    for name, p in engine.module.named_parameters():
        if p.dim() == 1:
            first = p.detach().clone()
            dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
            same &= torch.equal(first, p.detach())
    flag = torch.tensor([int(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class StageTraffic:
    """Counts what DeepSpeed's pipeline engine sends between stages (elements per p2p.send of a float tensor) and
    how often it all-gathers a received activation over TP (`PartitionedTensor.full`)."""

    def __init__(self):
        from deepspeed.runtime.pipe import engine as pipe_engine, p2p
        from deepspeed.runtime.utils import PartitionedTensor

        self.sent: Counter = Counter()
        self.gathers = 0
        self._p2p, self._pt, self._engine_mod = p2p, PartitionedTensor, pipe_engine
        self._send, self._full = p2p.send, PartitionedTensor.full

        def send(tensor, dest_stage, async_op=False):
            if tensor.is_floating_point():
                self.sent[tensor.numel()] += 1
            return self._send(tensor, dest_stage, async_op=async_op)

        def full(pt, *a, **k):
            self.gathers += 1
            return self._full(pt, *a, **k)

        p2p.send = send
        PartitionedTensor.full = full

    def close(self) -> dict:
        self._p2p.send, self._pt.full = self._send, self._full
        return {"sent": {str(k): v for k, v in self.sent.items()}, "gathers": self.gathers}


def trained(cfg: RunConfig, rt: Runtime, hf_state: dict, out, name: str, save_at: int = 0) -> dict:
    """Train cfg from the HF weights for STEPS steps (a checkpoint after `save_at`), checking the norms after
    every step and counting the stage traffic; the final weights go to OUT/final_<name>_stage<S>.pt."""
    ds = train_dataset(cfg, rt.world_size)
    engine = build_engine(cfg, rt).engine
    load_hf_weights(engine, cfg, hf_state)
    traffic = StageTraffic()
    losses, norms, equal = [], [], []
    for step in range(STEPS):
        loss, norm = run_steps(engine, cfg, ds, step, step + 1)
        losses += loss
        norms += norm
        equal.append(norms_equal_over_tp(engine))
        if step + 1 == save_at:
            ckpt.save(engine, cfg, rt.rank, {"consumed_samples": save_at * 8})
    counted: list = [None] * rt.world_size
    dist.all_gather_object(counted, {**traffic.close(), "stage": engine.grid.get_stage_id()})
    save_final(engine, cfg, out, prefix=f"final_{name}_")
    dist.barrier()
    return {"losses": losses, "grad_norms": norms, "norms_equal_over_tp": equal, "traffic": counted}


def resumed(cfg: RunConfig, rt: Runtime) -> dict:
    """Resume cfg from its --save (the checkpoint after step SAVED_AT) and train to STEPS."""
    built = build_engine(cfg, rt)
    start = built.engine.global_steps
    losses, norms = run_steps(built.engine, cfg, train_dataset(cfg, rt.world_size), start, STEPS)
    return {
        "start": start,
        "universal": bool(built.decision and built.decision.universal),
        "losses": losses,
        "grad_norms": norms,
    }


def main(args: argparse.Namespace, rt: Runtime) -> None:
    hf_state = hf_model("gqa31").state_dict()
    out = args.out
    results: dict = {}
    # Each run saves after step 5 into its own directory; the resumes below start from copies of those.
    for name, sp in (("plain", False), ("sp", True)):
        results[name] = trained(
            base_config(args.data, sp, save=str(out / f"save_{name}")), rt, hf_state, out, name, save_at=SAVED_AT
        )

    # A checkpoint written with sequence parallelism resumes without it, and the reverse: at the same layout
    # (natively), and at another layout through the universal checkpoint.
    for name, src, sp, tp, pp in (
        ("sp_to_plain", "sp", False, 2, 2),
        ("plain_to_sp", "plain", True, 2, 2),
        ("sp_to_tp1pp2", "sp", False, 1, 2),
        ("plain_to_sp_tp2pp1", "plain", True, 2, 1),
    ):
        save = out / f"save_{name}"
        if rt.rank == 0:
            shutil.copytree(out / f"save_{src}", save)
        dist.barrier()
        results[name] = resumed(base_config(args.data, sp, save=str(save), tp=tp, pp=pp), rt)

    # Packed SFT rows through the real loop (threed.train), from random init: test_sft_train's reference.
    r = train(
        dataclasses.replace(
            sft_config(args.sft_data, pack=True, steps=SFT_STEPS),
            parallel=ParallelConfig(tp=2, pp=2, sequence_parallel=True),
        )
    )
    results["sft_sp"] = {"losses": r.losses, "grad_norms": r.grad_norms, "evals": r.evals}
    if rt.rank == 0:
        (out / "sp.json").write_text(json.dumps(results))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)
    p.add_argument("--sft-data", required=True)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
