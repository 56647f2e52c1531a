"""Multi-rank scenario for tests/ranks/test_tied_training.py: a tied-embedding Llama (Llama 3.2's layout) trained at tp2
pp2 dp2 from HF weights, its two copies of the tied weight compared after every step, then resumed at tp1 pp2 dp4
through DeepSpeed's universal checkpoint; bf16, activation checkpointing, and packed SFT through threed.train.
Runs under torchrun (8 ranks):

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/tied_worker.py --out /tmp/t --data PREFIX \
        --sft-data CHAT_text_document

Rank 0 writes OUT/tied.json (losses, grad norms, per-step copy checks); TP rank 0 of data-parallel replica 0 of each
stage writes OUT/final_stage<S>.pt, the HF-named tensors its stage holds after the last step (the last stage's
copy of the tied weight as `lm_head.weight`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch
import torch.distributed as dist

import threed.checkpoint.save as ckpt

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import load_hf_weights, run_worker
from dist_worker import run_steps, train_dataset
from reference import PARITY
from sft_worker import sft_config
from threed.config import CheckpointConfig, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.convert.mapping import layer_to_hf
from threed.parallel.distributed import Runtime
from worker_setup import build_engine
from threed.hf.config import from_hf_config
from threed.parallel.pipeline import local_modules
from worker_setup import train

STEPS, SAVED_AT, BF16_STEPS, SFT_STEPS = 10, 5, 4, 3


def tied_hf_model():
    """The `gqa31` test Llama (GQA 4/2, vocab 200 padded to 208/224: padding is real) with its LM head tied."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import HF_CONFIGS

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_CONFIGS["gqa31"], tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model


def tied_model_config() -> ModelConfig:
    return dataclasses.replace(
        from_hf_config(tied_hf_model().config.to_dict(), name="gqa31-tied"), make_vocab_size_divisible_by=16
    )


def tied_weight(engine) -> torch.Tensor:
    return engine.module.tied_modules["embedding"].word_embeddings.weight


def copies_equal(engine) -> bool:
    """Whether this rank's copy of the tied weight is bit-identical to the other stage's (the first stage's copy is
    sent over DeepSpeed's own tie group; every rank of a pp=2 layout is in one)."""
    comm = engine.module.tied_comms["embedding"]
    mine = tied_weight(engine).detach().clone()
    first = mine.clone()
    dist.broadcast(first, src=min(comm["ranks"]), group=comm["group"])
    same = torch.tensor([int(torch.equal(mine, first))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)  # every rank answers for all
    return bool(same.item())


def save_final(engine, cfg: RunConfig, out, prefix: str = "final_") -> None:
    """HF-named tensors of this stage, TP shards gathered, as OUT/<prefix>stage<S>.pt (see the module docstring)."""
    group = engine.grid.get_slice_parallel_group()
    tensors: dict[str, torch.Tensor] = {}
    for layer, module in local_modules(engine.module, cfg.model):
        mine = {k: v.detach().float() for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)}
        shards: list = [None] * cfg.parallel.tp
        dist.all_gather_object(shards, mine, group=group)
        hf = layer_to_hf(cfg.model, layer, shards)
        if layer.kind == "embedding" and not engine.is_first_stage():
            hf = {"lm_head.weight": hf["model.embed_tokens.weight"]}  # the last stage's copy
        tensors.update(hf)
    if engine.grid.get_slice_parallel_rank() == 0 and engine.grid.get_data_parallel_rank() == 0:
        torch.save(tensors, out / f"{prefix}stage{engine.grid.get_stage_id()}.pt")


def steps_checked(engine, cfg: RunConfig, ds, start: int, stop: int) -> dict:
    """Train [start, stop) one step at a time; after each, whether the two copies are equal and have moved."""
    losses, norms, equal, moved = [], [], [], []
    before = tied_weight(engine).detach().clone()
    for step in range(start, stop):
        loss, norm = run_steps(engine, cfg, ds, step, step + 1)
        losses += loss
        norms += norm
        equal.append(copies_equal(engine))
        now = tied_weight(engine).detach()
        moved.append(not torch.equal(now, before))
        before = now.clone()
    return {"losses": losses, "grad_norms": norms, "copies_equal": equal, "moved": moved}


def main(args: argparse.Namespace, rt: Runtime) -> None:
    hf_state = tied_hf_model().state_dict()
    assert "lm_head.weight" not in hf_state or torch.equal(
        hf_state["lm_head.weight"], hf_state["model.embed_tokens.weight"]
    )
    base = RunConfig(
        model=tied_model_config(),
        parallel=ParallelConfig(tp=2, pp=2),
        train=TrainConfig(
            **PARITY,
            micro_batch_size=2,
            global_batch_size=8,
            seq_length=32,
            steps=STEPS,
        ),
        data=DataConfig(data_path=(args.data,)),
    )
    results: dict = {}

    # 1. fp32 at tp2 pp2 dp2 from the HF weights, a checkpoint (threed's save) after step SAVED_AT.
    save = args.out / "save"
    cfg = dataclasses.replace(base, checkpoint=CheckpointConfig(save=str(save), auto_resume=False))
    ds = train_dataset(cfg, rt.world_size)
    engine = build_engine(cfg, rt).engine
    load_hf_weights(engine, cfg, hf_state)
    results["initial_copies_equal"] = copies_equal(engine)
    first = steps_checked(engine, cfg, ds, 0, SAVED_AT)
    ckpt.save(engine, cfg, rt.rank, {"consumed_samples": SAVED_AT * 8})
    rest = steps_checked(engine, cfg, ds, SAVED_AT, STEPS)
    results["fp32"] = {k: first[k] + rest[k] for k in first}
    save_final(engine, cfg, args.out)
    dist.barrier()

    # 2. The same run resumed from its step-5 checkpoint at tp1 pp2 dp4: DeepSpeed's universal checkpoint.
    cfg_u = dataclasses.replace(base, parallel=ParallelConfig(tp=1, pp=2), checkpoint=CheckpointConfig(save=str(save)))
    built = build_engine(cfg_u, rt)
    results["universal"] = {
        "start": built.engine.global_steps,
        "via_universal": bool(built.decision and built.decision.universal),
        "copies_equal_after_load": copies_equal(built.engine),
        **steps_checked(built.engine, cfg_u, train_dataset(cfg_u, rt.world_size), SAVED_AT, STEPS),
    }
    ckpt.save(built.engine, cfg_u, rt.rank, {"consumed_samples": STEPS * 8})
    dist.barrier()

    # 3. bf16 with fp32 master weights and fp32 gradient accumulation (BF16_Optimizer, ZeRO-1 over dp2).
    cfg_b = dataclasses.replace(base, train=dataclasses.replace(base.train, dtype="bf16", steps=BF16_STEPS))
    eng = build_engine(cfg_b, rt).engine
    load_hf_weights(eng, cfg_b, hf_state)
    results["bf16"] = {
        "optimizer": type(eng.optimizer).__name__,
        **steps_checked(eng, cfg_b, train_dataset(cfg_b, rt.world_size), 0, BF16_STEPS),
    }

    # 4. Activation checkpointing (the tied head is a function: never recomputed, nothing changes).
    cfg_ac = dataclasses.replace(base, train=dataclasses.replace(base.train, activation_checkpointing=True))
    eng = build_engine(cfg_ac, rt).engine
    load_hf_weights(eng, cfg_ac, hf_state)
    results["activation_checkpointing"] = steps_checked(eng, cfg_ac, ds, 0, 2)

    # 5. Packed SFT through the real loop (threed.train) from random init, validation after the last step.
    sft = dataclasses.replace(sft_config(args.sft_data, pack=True, steps=SFT_STEPS), model=base.model)
    r = train(sft)
    results["sft"] = {"losses": r.losses, "grad_norms": r.grad_norms, "evals": r.evals}
    if rt.rank == 0:
        (args.out / "tied.json").write_text(json.dumps(results))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)
    p.add_argument("--sft-data", required=True)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
