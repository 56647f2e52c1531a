"""Multi-rank scenarios for tests/ranks/test_context_parallel.py (8 gloo ranks, fp32, the `gqa31` HF test model):
context parallelism wired into training. One launch runs them all, since a launch costs ~15 s of start-up:

- the same 10 steps from HF's weights at tp2 pp2 dp2 (cp1), tp2 pp2 cp2 under 1F1B and under ZB-H1, and tp2 cp2
  dp2 with --sequence-parallel (pp1): losses, gradient norms and final weights;
- a converted HF checkpoint (tp2 pp2) starts a cp2 run through threed.train;
- a 2-source blend validated at cp1 and cp2 (validation loss and per-source losses);
- resumes across cp: the cp2 run's step-5 checkpoint at cp1 tp2 pp1 dp4 (the ZeRO shards go from 2 to 4: universal),
  the cp1 run's at cp2 tp2 pp2 dp1 (2 shards both: native);
- packed SFT rows through threed.train at tp2 pp2 cp2 and at cp1 (loss masks differ chunk by chunk), and one step of
  the cp2 run with the per-rank-mean mistake put in (each CP rank normalising by its own loss tokens).

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/cp_worker.py --out /tmp/cp --data PREFIX \\
        --sft-data CHAT_text_document --converted CONVERTED_DIR --data-b PREFIX_B

Rank 0 writes OUT/cp.json; OUT/final_<run>_stage<S>.pt hold the HF-named weights of each stage after the last step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil

import torch.distributed as dist

import threed.checkpoint.save as ckpt
import threed.train.loop as loop

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import load_hf_weights, run_worker
from dist_worker import run_steps, train_dataset
from helpers import hf_model, model_config
from reference import PARITY
from sft_worker import sft_config
from sp_worker import StageTraffic
from threed.config import CheckpointConfig, DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.data.loader import token_weighted
from threed.parallel.distributed import Runtime, loss_rank
from worker_setup import build_engine
from worker_setup import train
from tied_worker import save_final

STEPS, SAVED_AT, SFT_STEPS, INIT_STEPS, BLEND_STEPS = 10, 5, 3, 2, 2
SEQ, MICRO, GLOBAL = 32, 2, 8

# name -> (tp, pp, cp, sequence parallel, pipeline schedule); 8 ranks each, dp = 8 / (tp pp cp)
RUNS = {
    "cp1": (2, 2, 1, False, "1f1b"),
    "cp2": (2, 2, 2, False, "1f1b"),
    "cp2_zb": (2, 2, 2, False, "zb-h1"),
    "cp2_sp": (2, 1, 2, True, "1f1b"),
}


def base_config(data: str, tp: int, pp: int, cp: int, sp: bool = False, schedule: str = "1f1b", save=None):
    """reference.gqa31_reference's model, batch (8 sequences of 32 per step) and optimizer over STEPS steps."""
    return RunConfig(
        model=model_config("gqa31"),
        parallel=ParallelConfig(tp=tp, pp=pp, cp=cp, sequence_parallel=sp, pipeline_schedule=schedule),
        train=TrainConfig(**PARITY, micro_batch_size=MICRO, global_batch_size=GLOBAL, seq_length=SEQ, steps=STEPS),
        data=DataConfig(data_path=(data,)),
        checkpoint=CheckpointConfig(save=None if save is None else str(save), auto_resume=save is not None),
    )


def trained(cfg: RunConfig, rt: Runtime, hf_state: dict, out, name: str, save_at: int = 0) -> dict:
    """cfg trained from HF's weights for STEPS steps (a checkpoint after `save_at`); the final weights go to
    OUT/final_<name>_stage<S>.pt."""
    ds = train_dataset(cfg, rt.world_size)
    engine = build_engine(cfg, rt).engine
    load_hf_weights(engine, cfg, hf_state)
    traffic = StageTraffic()  # what crosses a stage boundary: this rank's [s/cp, b, h] (1/tp of it)
    losses, norms = [], []
    for step in range(STEPS):
        loss, norm = run_steps(engine, cfg, ds, step, step + 1)
        losses += loss
        norms += norm
        if step + 1 == save_at:
            ckpt.save(engine, cfg, rt.rank, {"consumed_samples": save_at * GLOBAL})
    sent: list = [None] * rt.world_size
    dist.all_gather_object(sent, traffic.close()["sent"])
    save_final(engine, cfg, out, prefix=f"final_{name}_")
    dist.barrier()
    return {"losses": losses, "grad_norms": norms, "sent": sent}


def resumed(cfg: RunConfig, rt: Runtime) -> dict:
    """cfg resumed from its --save (the checkpoint after step SAVED_AT) and trained to STEPS."""
    built = build_engine(cfg, rt)
    start = built.engine.global_steps
    losses, norms = run_steps(built.engine, cfg, train_dataset(cfg, rt.world_size), start, STEPS)
    universal = bool(built.decision and built.decision.universal)
    return {"start": start, "universal": universal, "losses": losses, "grad_norms": norms}


def per_rank_mean(step, dp_group=None, device=None):
    """The mistake: every CP rank weighs its tokens by its own loss-token count (no all-reduce), so the step
    minimises the mean of per-rank means instead of the global batch's token mean."""
    return token_weighted(step, None, device)


def sft_runs(chat: str) -> dict:
    """Packed SFT through threed.train at cp2 and cp1 (random init, SFT_STEPS steps, validation after the last),
    and one step at cp2 with `per_rank_mean` in place of the loop's token weighting."""
    out = {}
    for name, cp in (("sft_cp2", 2), ("sft_cp1", 1)):
        cfg = sft_config(chat, pack=True, steps=SFT_STEPS)
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(tp=2, pp=2, cp=cp))
        if cp == 2:  # dp 1: the same 8 rows per step as micro 2 x gas 4
            cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=4))
        r = train(cfg)
        counted: list = [None] * dist.get_world_size()  # the loss rank's (last stage) loss-token counts
        dist.all_gather_object(counted, r.loss_tokens)
        tokens = counted[loss_rank(2, 2, dist.get_world_size() // (4 * cp), cp=cp)]
        out[name] = {"losses": r.losses, "grad_norms": r.grad_norms, "evals": r.evals, "loss_tokens": tokens}
    cfg = sft_config(chat, pack=True, steps=1)
    cfg = dataclasses.replace(
        cfg, parallel=ParallelConfig(tp=2, pp=2, cp=2), train=dataclasses.replace(cfg.train, grad_accum_steps=4)
    )
    keep, loop.token_weighted = loop.token_weighted, per_rank_mean
    try:
        out["sft_cp2_per_rank_mean"] = {"losses": train(cfg).losses}
    finally:
        loop.token_weighted = keep
    return out


def blend_runs(a: str, b: str) -> dict:
    """A 2-source blend through threed.train at cp1 and cp2 (random init), validated after BLEND_STEPS steps: the
    validation loss and the per-source losses, each CP rank summing its share of the tokens."""
    out = {}
    for name, cp, gas in (("blend_cp1", 1, 2), ("blend_cp2", 2, 4)):
        cfg = RunConfig(
            model=model_config("gqa31"),
            parallel=ParallelConfig(tp=2, pp=2, cp=cp),
            train=TrainConfig(
                **PARITY,
                micro_batch_size=MICRO,
                grad_accum_steps=gas,
                seq_length=SEQ,
                steps=BLEND_STEPS,
                eval_interval=BLEND_STEPS,
                eval_iters=2,
            ),
            data=DataConfig(data_path=("0.4", a, "0.6", b), split="90,10,0"),
        )
        r = train(cfg)
        out[name] = {"losses": r.losses, "evals": r.evals}
    return out


def main(args: argparse.Namespace, rt: Runtime) -> None:
    hf_state = hf_model("gqa31").state_dict()
    out = args.out
    results: dict = {}
    for name, (tp, pp, cp, sp, schedule) in RUNS.items():
        save = out / f"save_{name}" if name in ("cp1", "cp2") else None
        cfg = base_config(args.data, tp, pp, cp, sp, schedule, save=save)
        results[name] = trained(cfg, rt, hf_state, out, name, save_at=SAVED_AT if save else 0)

    # Across cp: cp2 -> cp1 at 4 ZeRO shards instead of 2 (universal), cp1 -> cp2 at 2 shards both (native).
    for name, src, (tp, pp, cp) in (("cp2_to_cp1", "cp2", (2, 1, 1)), ("cp1_to_cp2", "cp1", (2, 2, 2))):
        save = out / f"save_{name}"
        if rt.rank == 0:
            shutil.copytree(out / f"save_{src}", save)
        dist.barrier()
        results[name] = resumed(base_config(args.data, tp, pp, cp, save=save), rt)

    # A converted HF checkpoint (written at tp2 pp2 by `threed convert`, which knows no cp) through threed.train at cp2.
    cfg = base_config(args.data, 2, 2, 2)
    cfg = dataclasses.replace(
        cfg,
        # One validation batch: the run validates after its last step, and the default 100 batches at 8 ranks were
        # a third of this launch's time; the test reads the losses only.
        train=dataclasses.replace(cfg.train, steps=INIT_STEPS, eval_iters=1),
        checkpoint=CheckpointConfig(init_from=args.converted),
    )
    results["converted_cp2"] = {"losses": train(cfg).losses}

    results.update(blend_runs(args.data, args.data_b))
    results.update(sft_runs(args.sft_data))
    if rt.rank == 0:
        (out / "cp.json").write_text(json.dumps(results))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)
    p.add_argument("--sft-data", required=True)
    p.add_argument("--converted", required=True)
    p.add_argument("--data-b", required=True)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
