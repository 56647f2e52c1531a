"""Multi-rank SFT scenarios (issue 11), run under torchrun by tests/ranks/test_sft_train.py; results go to --out as
JSON and `.pt`, and the pytest side compares them with HuggingFace references computed in its own process.

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/sft_worker.py --out /tmp/x \
        --data PREFIX_text_document
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import keeps_logits, load_hf_weights, rank_json, run_worker, stopped_then_resumed
from helpers import hf_model, model_config
from reference import PARITY
from threed.config import CheckpointConfig, DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
from worker_setup import build_engine
from threed.verify.logits import pipeline_logits
from worker_setup import train

MODEL = "gqa31"
SEQ = 64
ROWS = [[5, 17, 9, 1, 32], [20, 20, 24]]  # example lengths (positions) of two packed rows


def sft_config(data: str, pack: bool, steps: int, **train_kw) -> RunConfig:
    """The run both sides train: tp2 pp2 (dp2 on 8 ranks), micro 2 x gas 2 x dp 2 = 8 rows of 64 per step, fp32,
    validation on the held-out 10% after the last step."""
    return RunConfig(
        model=model_config(MODEL),
        parallel=ParallelConfig(tp=2, pp=2),
        train=TrainConfig(
            **PARITY,
            micro_batch_size=2,
            grad_accum_steps=2,
            seq_length=SEQ,
            steps=steps,
            eval_interval=steps,
            eval_iters=1,
            **train_kw,
        ),
        data=DataConfig(data_path=(data,), split="90,10,0", pack=pack),
    )


def packed_rows() -> tuple[torch.Tensor, torch.Tensor]:
    vocab = model_config(MODEL).vocab_size
    tokens = torch.randint(0, vocab, (len(ROWS), SEQ), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in ROWS])
    return tokens, doc_ids.to(torch.int32)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)


def main(args: argparse.Namespace, rt: Runtime) -> None:
    out = args.out

    # 1. Packed rows through the tp2 pp2 pipeline with HF's weights: logits per example (compared with HF alone).
    cfg = sft_config(args.data, pack=True, steps=1)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=1))
    engine = build_engine(cfg, rt, token_weighted=True).engine
    load_hf_weights(engine, cfg, hf_model(MODEL).state_dict())
    tokens, doc_ids = packed_rows()
    logits = pipeline_logits(engine, (tokens, doc_ids), cfg.model.vocab_size)
    if logits is not None and keeps_logits(engine):
        torch.save({"tokens": tokens, "rows": ROWS, "logits": logits}, out / "packed_logits.pt")
    dist.barrier()

    # 2. Training through threed.train (the real loop): packed, packed with activation checkpointing, unpacked.
    results = {}
    for name, c in (
        ("packed", sft_config(args.data, True, 5)),
        ("packed_act_ckpt", sft_config(args.data, True, 2, activation_checkpointing=True)),
        ("unpacked", sft_config(args.data, False, 3)),
    ):
        r = train(c)
        results[name] = {"losses": r.losses, "grad_norms": r.grad_norms, "evals": r.evals, "loss_tokens": r.loss_tokens}

    # 3. Preempted after step 1 (a STOP file) at tp2 pp2 dp2, resumed at tp1 pp2 dp4 (DeepSpeed's universal
    # checkpoint): the packed rows' order depends only on the global batch, so steps 2-5 are the uninterrupted ones.
    save = out / "resumed"
    cfg = sft_config(args.data, True, 5)
    cfg = dataclasses.replace(cfg, checkpoint=CheckpointConfig(save=str(save)))
    # The same global batch of 8 rows: micro 2 x gas 1 x dp 4.
    first, second = stopped_then_resumed(
        train,
        save,
        cfg,
        dataclasses.replace(
            cfg, parallel=ParallelConfig(tp=1, pp=2), train=dataclasses.replace(cfg.train, grad_accum_steps=1)
        ),
    )
    results["resumed"] = {
        "first": first.losses,
        "preempted": first.preempted,
        "second": second.losses,
        "start": second.start_step,
    }
    rank_json(out, "sft", results)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
