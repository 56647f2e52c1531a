"""LoRA at interleaved stages (--vpp 2) for tests/ranks/test_lora_vpp.py: tp1 pp2, fp32, the `gqa31` HF test model with
an HF PEFT adapter brought in with --lora-init-from (A and B random), 5 steps at --vpp 1 and at --vpp 2 (one block
per virtual stage), each saving a checkpoint after step 2; then the vpp-2 checkpoint resumed at vpp 2 (the same
layout: DeepSpeed's own checkpoint, no universal conversion) and trained on to step 5.

Every rank writes OUT/lora_vpp_rank<R>.json: per run its losses, gradient norms, engine class, the elements the
optimizer holds against the adapters' and each adapter's checksum (by global parameter name: the same at any vpp).

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/lora_vpp_worker.py --out /tmp/l --data PREFIX \\
        --peft PEFT_DIR
"""

from __future__ import annotations

import argparse
import dataclasses

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import build_engine, load_hf_weights, rank_json, run_worker
from dist_worker import run_steps, train_dataset
from helpers import hf_model, model_config
from lora_worker import ALPHA, RANK, SAVED, STEPS, optimizer_elements
from reference import PARITY
from threed.checkpoint.save import save
from threed.config import CheckpointConfig, DataConfig, LoraConfig, ParallelConfig, RunConfig, TrainConfig
from threed.model.spec import is_adapter_key
from threed.parallel.distributed import Runtime


def config(args: argparse.Namespace, vpp: int) -> RunConfig:
    """tp1 pp2 at `vpp` (gas 4: micro-batches of 2 rows, 8 a step), the adapter of --peft, saving into OUT/save_vpp<V>
    (resumed from there when it holds a checkpoint)."""
    model = model_config("gqa31")
    stages = 2 * vpp
    return RunConfig(
        model=model,
        parallel=ParallelConfig(
            tp=1, pp=2, vpp=vpp, partition_method="layers:" + ",".join([str(model.num_layers // stages)] * stages)
        ),
        train=TrainConfig(**PARITY, micro_batch_size=2, global_batch_size=8, seq_length=32, steps=STEPS),
        data=DataConfig(data_path=(args.data,)),
        lora=LoraConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_init_from=args.peft),
        checkpoint=CheckpointConfig(save=str(args.out / f"save_vpp{vpp}")),
    )


def adapters(engine) -> dict[str, list[float]]:
    """Each adapter weight this rank holds: name -> [sum, sum of |x|] (float64)."""
    return {
        k: [float(p.detach().double().sum()), float(p.detach().double().abs().sum())]
        for k, p in engine.module.named_parameters()
        if is_adapter_key(k)
    }


def trained(args: argparse.Namespace, rt: Runtime, vpp: int, ds, clip: bool = True) -> dict:
    """STEPS steps from HF's base and the PEFT adapter, a checkpoint after step SAVED; without `clip`, no gradient
    clipping (and no checkpoint)."""
    cfg = config(args, vpp)
    if not clip:
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, grad_clip=0.0), checkpoint=CheckpointConfig()
        )
    engine = build_engine(cfg, rt).engine
    load_hf_weights(engine, cfg, hf_model("gqa31").state_dict())
    losses, norms = run_steps(engine, cfg, ds, 0, SAVED)
    if clip:
        save(engine, cfg, rt.rank, {"consumed_samples": SAVED * cfg.train.global_batch_size})
    more = run_steps(engine, cfg, ds, SAVED, STEPS)
    return {
        "losses": losses + more[0],
        "grad_norms": norms + more[1],
        "class": type(engine).__name__,
        "optimizer_elements": optimizer_elements(engine),
        "adapter_elements": sum(p.numel() for k, p in engine.module.named_parameters() if is_adapter_key(k)),
        "adapters": adapters(engine),
    }


def resumed(args: argparse.Namespace, rt: Runtime, vpp: int, ds) -> dict:
    """The run's checkpoint after step SAVED, picked up by the same command (auto-resume), trained to STEPS."""
    built = build_engine(config(args, vpp), rt)
    start = built.engine.global_steps
    losses, norms = run_steps(built.engine, config(args, vpp), ds, start, STEPS)
    return {
        "start": start,
        "universal": bool(built.decision and built.decision.universal),
        "losses": losses,
        "grad_norms": norms,
        "adapters": adapters(built.engine),
    }


def main(args: argparse.Namespace, rt: Runtime) -> None:
    ds = train_dataset(config(args, 1), rt.world_size)
    out = {f"vpp{vpp}": trained(args, rt, vpp, ds) for vpp in (1, 2)}
    out.update({f"vpp{vpp}_noclip": trained(args, rt, vpp, ds, clip=False) for vpp in (1, 2)})
    out["vpp2_resumed"] = resumed(args, rt, 2, ds)
    rank_json(args.out, "lora_vpp", out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)
    p.add_argument("--peft", required=True)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
