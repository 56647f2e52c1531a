"""Multi-rank scenario for tests/ranks/test_init_any_layout.py: weights written at one tp / pp, started from at
another (`--init-from`, read slice by slice: threed.convert.into_stage), against the same weights resharded on disk
by `threed reshard` and loaded by DeepSpeed's own `load_checkpoint(load_module_only=True)`. 4 ranks:

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/layout_worker.py --out /tmp/l --cases cases.json

cases.json: [{"name", "sliced": DIR, "native": DIR, "tp", "pp", "dtype"}]. For each case and each of the two
sources this rank writes its weights after the load and after STEPS training steps, and the losses, to
OUT/<name>_<source>_rank<R>.pt; and the weights of the engine `threed generate` / `eval-harness` build from the
checkpoint (no optimizer state) to OUT/<name>_inference_rank<R>.pt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, convert_fixtures)
from worker_setup import local_weights, reads_data, run_worker, synthetic_batches
from threed.checkpoint.format import read_model_config
from threed.config import CheckpointConfig, ParallelConfig, RunConfig, TrainConfig
from threed.generate.run import engine_config
from threed.parallel.distributed import Runtime
from worker_setup import build_engine

STEPS, MICRO, SEQ = 2, 2, 16


def one(case: dict, source: str, rt: Runtime) -> dict:
    """Build the engine from `case[source]` at the case's layout, then train STEPS steps on fixed batches."""
    model = read_model_config(case[source])
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(tp=case["tp"], pp=case["pp"]),
        train=TrainConfig(dtype=case["dtype"], seq_length=SEQ, micro_batch_size=MICRO, steps=STEPS, lr=1e-3),
        checkpoint=CheckpointConfig(init_from=case[source]),
    )
    cfg.validate(rt.world_size)
    built = build_engine(cfg, rt)
    engine = built.engine
    loaded = local_weights(engine, model)
    it = synthetic_batches(model.vocab_size, MICRO, SEQ, seed=5) if reads_data(engine) else None
    losses = [engine.train_batch(data_iter=it).item() for _ in range(STEPS)]
    return {
        "loaded": loaded,
        "trained": local_weights(engine, model),
        "losses": losses,
        "start": built.decision.describe(),
    }


def inference(case: dict, rt: Runtime) -> dict:
    """The engine `threed generate` / `eval-harness` build (`build_engine(train=False)`) from the case's checkpoint:
    its weights, and the fp32 tensors its optimizer holds (none: no master weights, gradients or Adam state)."""
    model = read_model_config(case["sliced"])
    cfg = engine_config(case["sliced"], model, case["tp"], case["pp"], case["dtype"])
    cfg.validate(rt.world_size)
    engine = build_engine(cfg, rt, train=False).engine
    held = [t for t in vars(engine.optimizer).values() if isinstance(t, list)] if engine.optimizer is not None else []
    fp32 = sum(1 for group in held for t in group if isinstance(t, torch.Tensor) and t.dtype == torch.float32)
    return {"loaded": local_weights(engine, model), "optimizer_fp32_tensors": fp32}


def compare(args: argparse.Namespace, rt: Runtime) -> None:
    for case in json.loads(args.cases.read_text()):
        for source in ("sliced", "native"):
            result = one(case, source, rt)
            torch.save(result, args.out / f"{case['name']}_{source}_rank{rt.rank}.pt")
            dist.barrier()
        torch.save(inference(case, rt), args.out / f"{case['name']}_inference_rank{rt.rank}.pt")
        dist.barrier()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", type=Path, required=True)


if __name__ == "__main__":
    raise SystemExit(run_worker({"compare": compare}, add_arguments))
