"""Interleaved-stage scenarios for tests/ranks/test_interleaved.py: the same fp32 run (HF's gqa31 weights, 4 blocks, 5
steps) at --vpp 1 and --vpp 2 on this launch's tp x pp (and at one rank, pp 1, for the single-process reference):
losses, gradient norms, an evaluation loss and every parameter's final checksum; a checkpoint written at step 3
under one vpp, resumed under the same and the other; the engine `threed generate` / `eval-harness` build from such
a checkpoint, its weights and a greedy generation (`inference`); greedy generation and the harness's log-probabilities
on the live engine itself, before step 1 (HF's weights) and after the last (`decoded`: at vpp 2 over the chunks).

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/interleaved_worker.py main --out /tmp/x \
        --data PREFIX --tp 1 --pp 2 --gas 4 --vpps 1,2 --resume
    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/interleaved_worker.py resume --out /tmp/y \
        --data PREFIX --tp 1 --pp 4 --gas 4 --vpps 1 --load /tmp/x/ckpt_vpp2     (a universal resume)
    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/interleaved_worker.py inference --out /tmp/z \
        --data PREFIX --tp 1 --pp 2 --load /tmp/x/ckpt_vpp2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from types import SimpleNamespace
from typing import Any, Iterator

import torch
import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import build_engine, load_hf_weights, rank_json, reads_data, run_worker
from dist_worker import train_dataset
from helpers import hf_model, model_config
from reference import PARITY
from schedule_worker import VARIANTS, run
from tied_worker import tied_hf_model, tied_model_config
import threed.checkpoint.save as ckpt
from threed.config import CheckpointConfig, DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.generate import decode
from threed.generate.decode import generate_all
from threed.generate.prompts import Sampling
from threed.generate.run import pinned_engine
from threed.metrics.stages import StageTimer, gather_rows, per_stage
from threed.parallel.distributed import Runtime

STEPS = 5
SAVE_AT = 3
PROMPTS = [[5, 17, 9, 1, 32], [20, 3], [7, 7, 150, 61, 12, 99, 4]]  # token ids (gqa31's vocabulary of 200)
NEW_TOKENS = 6
SAMPLED = Sampling(temperature=0.8, top_p=0.9, seed=4)  # `decoded`'s sampled generation (noise keyed by prompt, step)


def config(args: argparse.Namespace, vpp: int, gas: int, variant: str = "") -> RunConfig:
    """The run at `vpp`; `variant`: one of schedule_worker's VARIANTS (bf16, recompute, packed rows, ...)."""
    model = tied_model_config() if args.tied else model_config("gqa31")
    if args.layers:  # more blocks than HF's gqa31 (pp 4 vpp 2: 8 virtual stages), from threed's own init
        model = dataclasses.replace(model, num_layers=args.layers)
    changes = VARIANTS[variant][0] if variant else {}
    train = {k: v for k, v in changes.items() if k not in ("pack", "sequence_parallel")}
    stages = args.pp * vpp
    return RunConfig(
        model=model,
        parallel=ParallelConfig(
            tp=args.tp,
            pp=args.pp,
            cp=args.cp,
            vpp=vpp,
            # one block per virtual stage at pp 2 vpp 2: the same blocks per rank as pp 2's layers:2,2
            partition_method="layers:" + ",".join([str(model.num_layers // stages)] * stages),
            sequence_parallel=args.sp or changes.get("sequence_parallel", False),
        ),
        train=TrainConfig(
            **{**PARITY, **dict(micro_batch_size=1, grad_accum_steps=gas, seq_length=32, steps=STEPS), **train}
        ),
        data=DataConfig(data_path=(args.data,), pack=changes.get("pack", False)),
    )


def checksums(engine, rt: Runtime) -> dict[str, list[float]]:
    """Every parameter this rank holds, `tp<rank>/<name>` -> [sum, sum of |x|] (float64): names are global layer
    indices, the same at any pp and vpp."""
    tp_rank = engine.grid.get_slice_parallel_rank()
    return {
        f"tp{tp_rank}/{k}": [float(v.detach().double().sum()), float(v.detach().double().abs().sum())]
        for k, v in engine.module.named_parameters()
    }


def evaluation(engine, cfg: RunConfig) -> float:
    gen = torch.Generator().manual_seed(3)
    vocab, micro, seq = cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.train.seq_length
    batches = [
        (t[:, :-1].contiguous(), t[:, 1:].contiguous())
        for t in (torch.randint(0, vocab, (micro, seq + 1), generator=gen) for _ in range(cfg.train.grad_accum_steps))
    ]
    return float(engine.eval_batch(iter(batches) if reads_data(engine) else None))


@contextlib.contextmanager
def pipe_group_calls(engine) -> Iterator[list[str]]:
    """The collectives of this rank on its pipeline group, in order, while in the block ("all_reduce", or "p2p" for
    a batch_isend_irecv whose every op is on the group; "p2p-other-group" for one that is not)."""
    group, calls = engine.grid.get_pipe_parallel_group(), []
    batch, all_reduce = dist.batch_isend_irecv, dist.all_reduce

    def logged_batch(ops):
        calls.append("p2p" if all(op.group is group for op in ops) else "p2p-other-group")
        return batch(ops)

    def logged_all_reduce(tensor, *args, **kwargs):
        if kwargs.get("group") is group:
            calls.append("all_reduce")
        return all_reduce(tensor, *args, **kwargs)

    dist.batch_isend_irecv, dist.all_reduce = logged_batch, logged_all_reduce
    try:
        yield calls
    finally:
        dist.batch_isend_irecv, dist.all_reduce = batch, all_reduce


def decoded(engine, cfg: RunConfig) -> dict | None:
    """On the live engine, as --generate-interval / --harness-interval run it: greedy and sampled (SAMPLED)
    generation (KV cache) of PROMPTS with each step's top-1 / top-2 margin, and each prompt's (sum of
    log-probabilities of its tokens after the first, all greedy) as the harness's loglikelihood requests ask
    (`score_batch`: on the last stage, None elsewhere). None with packed rows (the run's activations carry document
    ids)."""
    if cfg.data.pack:
        return None
    out = generate_all(engine, cfg.model, PROMPTS, NEW_TOKENS, Sampling(), batch_size=len(PROMPTS))
    sampled = generate_all(engine, cfg.model, PROMPTS, NEW_TOKENS, SAMPLED, batch_size=len(PROMPTS))
    stage = decode.stage_of(engine, cfg.model)
    with decode.evaluation(engine, stage):
        scores = decode.score_batch(stage, PROMPTS, [len(p) - 1 for p in PROMPTS])
    return {
        "tokens": [r.tokens for r in out],
        "margins": [r.margins for r in out],
        "sampled": [r.tokens for r in sampled],
        "sampled_margins": [r.margins for r in sampled],
        "scores": scores,
    }


def trained(cfg: RunConfig, rt: Runtime, ds, hf_state: dict, save: str = "") -> dict:
    """STEPS steps from HF's weights; with `save`, a checkpoint there at step SAVE_AT."""
    if save:
        cfg = dataclasses.replace(cfg, checkpoint=CheckpointConfig(save=save, auto_resume=False))
    engine = build_engine(cfg, rt).engine
    if cfg.model.num_layers == hf_model_layers():
        load_hf_weights(engine, cfg, hf_state)
    at_start = decoded(engine, cfg)
    timer = StageTimer(engine, rt.device)  # the per-stage idle metric's timers (threed.metrics.stages)
    timer.install()
    with pipe_group_calls(engine) as calls:
        losses, norms = run(cfg, engine, ds, 0, SAVE_AT if save else STEPS)
    if save:
        # threed's save: its manifest records the (virtual) stage boundaries, by which a resume at another vpp
        # knows to go through a universal checkpoint (DeepSpeed's optimizer shards hold other layers per rank)
        ckpt.save(engine, cfg, rt.rank, {"consumed_samples": SAVE_AT * cfg.train.grad_accum_steps})
        saved = checksums(engine, rt)
        more = run(cfg, engine, ds, SAVE_AT, STEPS)
        losses, norms = losses + more[0], norms + more[1]
    timer.uninstall()
    at_end = decoded(engine, cfg)  # (and the evaluation loss below, on the engine after it)
    # the metrics writer's numbers of this run: every rank's row, gathered, per stage (and per chunk at vpp > 1)
    stages = per_stage(gather_rows(timer, rt.device), cfg.parallel.pp)
    return {
        "timing": {bucket: timer.totals[bucket] for bucket in ("compute", "p2p", "dp-reduce", "optimizer")},
        "chunk_timing": timer.chunk_totals,
        "per_stage": {k: v for k, v in stages.items() if "idle" in k or "time" in k},
        # the first 3 collectives on the pipeline group, and whether every batch of sends and receives was on it
        "pipe_group": {"first": calls[:3], "p2p_elsewhere": "p2p-other-group" in calls, "p2p": calls.count("p2p")},
        "losses": losses,
        "grad_norms": norms,
        # (no evaluation with packed rows or under CP: `evaluation`'s rows are whole, not split as run_steps splits)
        "eval": None if cfg.data.pack or cfg.parallel.cp > 1 else evaluation(engine, cfg),
        "class": type(engine).__name__,
        "stage": engine.stage_id,
        "dp_rank": engine.grid.get_data_parallel_rank(),
        "weights": checksums(engine, rt),
        "saved_weights": saved if save else None,  # at step SAVE_AT, what the checkpoint holds
        "decoded": {"start": at_start, "end": at_end},
    }


def hf_model_layers() -> int:
    return model_config("gqa31").num_layers


def resumed(cfg: RunConfig, rt: Runtime, ds, load: str) -> dict:
    built = build_engine(dataclasses.replace(cfg, checkpoint=CheckpointConfig(load=load)), rt)
    assert built.engine.global_steps == SAVE_AT, built.engine.global_steps
    losses, norms = run(cfg, built.engine, ds, SAVE_AT, STEPS)
    return {"losses": losses, "grad_norms": norms, "universal": bool(built.decision.universal)}


def main(args: argparse.Namespace, rt: Runtime) -> None:
    hf = (tied_hf_model() if args.tied else hf_model("gqa31")).state_dict()
    vpps = [int(v) for v in args.vpps.split(",")]
    results: dict[str, Any] = {}
    for n, gas in enumerate(int(g) for g in args.gas.split(",") if g):
        ds = train_dataset(config(args, 1, gas), rt.world_size)
        for vpp in vpps:
            save = f"{args.out}/ckpt_vpp{vpp}" if args.resume and n == 0 else ""
            results[f"vpp{vpp}_gas{gas}"] = trained(config(args, vpp, gas), rt, ds, hf, save)
        if args.resume and n == 0:
            for saved in vpps:
                for now in vpps:
                    results[f"vpp{saved}_then_vpp{now}"] = resumed(
                        config(args, now, gas), rt, ds, f"{args.out}/ckpt_vpp{saved}"
                    )
    for variant in [v for v in args.variants.split(",") if v]:
        ds = None if VARIANTS[variant][0].get("pack") else train_dataset(config(args, 1, 4, variant), rt.world_size)
        for vpp in vpps:
            results[f"{variant}_vpp{vpp}"] = trained(config(args, vpp, 4, variant), rt, ds, hf)
    dist.barrier()
    rank_json(args.out, "interleaved", results)


def resume(args: argparse.Namespace, rt: Runtime) -> None:
    """Steps SAVE_AT + 1 .. STEPS from the checkpoint in --load, at this launch's layout and the one vpp of --vpps."""
    gas, vpp = int(args.gas), int(args.vpps)
    ds = train_dataset(config(args, 1, gas), rt.world_size)
    result = resumed(config(args, vpp, gas), rt, ds, args.load)
    dist.barrier()
    rank_json(args.out, "resumed", result)


def inference(args: argparse.Namespace, rt: Runtime) -> None:
    """The engine `threed generate` and `eval-harness` build from the checkpoint in --load (`pinned_engine`: no
    optimizer, vpp 1, this launch's tp x pp), its weights' checksums, and greedy generation on PROMPTS with each
    step's top-1 / top-2 margin."""
    model = model_config("gqa31")
    request = SimpleNamespace(load=args.load, model=model, tp=args.tp, pp=args.pp, dtype="fp32", tag=None, lora=None)
    engine = pinned_engine(request, rt)
    out = generate_all(engine, model, PROMPTS, NEW_TOKENS, Sampling(), batch_size=len(PROMPTS))
    result = {
        "weights": checksums(engine, rt),
        "tokens": [r.tokens for r in out],
        "margins": [r.margins for r in out],
        "vpp": engine.module.vpp,
    }
    dist.barrier()
    rank_json(args.out, "inference", result)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--gas", default="4")
    p.add_argument("--vpps", default="1,2")
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.add_argument("--tied", action="store_true", help="the tied-embedding model (Llama 3.2's tie)")
    p.add_argument("--resume", action="store_true", help="save at step 3 under each vpp, resume under each")
    p.add_argument("--load", help="(resume) the checkpoint directory to resume from")
    p.add_argument("--layers", type=int, default=0, help="blocks (0: gqa31's, with its HF weights)")
    p.add_argument("--variants", default="", help="schedule_worker's VARIANTS, each at gas 4 under every vpp")


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main, "resume": resume, "inference": inference}, add_arguments))
