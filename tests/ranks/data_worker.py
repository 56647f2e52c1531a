"""8-rank runs of `threed.train.loop.train` on megatron-core datasets, for tests/ranks/test_data_dist.py.

python -m torch.distributed.run --nproc-per-node 8 tests/ranks/data_worker.py --out DIR --a PREFIX_A --b PREFIX_B
"""

from __future__ import annotations

import argparse
import dataclasses

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import rank_json, run_worker, stopped_then_resumed
from helpers import model_config
from threed.config import CheckpointConfig, DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
from worker_setup import train


def base_config(a: str, b: str) -> RunConfig:
    return RunConfig(
        model=model_config("gqa31"),
        parallel=ParallelConfig(tp=2, pp=2),
        train=TrainConfig(
            dtype="fp32",
            micro_batch_size=2,
            grad_accum_steps=2,
            seq_length=32,
            steps=4,
            lr=1e-3,
            min_lr=1e-4,
            eval_interval=2,
            eval_iters=2,
            log_interval=10,
        ),
        data=DataConfig(data_path=("0.4", a, "0.6", b), split="90,10,0"),
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--a", required=True)
    p.add_argument("--b", required=True)


def main(args: argparse.Namespace, rt: Runtime) -> None:
    out = args.out
    base = base_config(args.a, args.b)
    results = {}

    # Uninterrupted, with validation every 2 steps, checkpoints at 2 and 4.
    cfg = dataclasses.replace(base, checkpoint=CheckpointConfig(save=str(out / "full"), save_interval=2))
    r = train(cfg)
    results["full"] = {
        "losses": r.losses,
        "evals": r.evals,
        "samples_read": r.samples_read,
        "consumed": r.consumed_samples,
    }

    # The same without validation: training must not notice evaluation.
    r = train(dataclasses.replace(base, train=dataclasses.replace(base.train, eval_interval=0)))
    results["no_eval"] = {"losses": r.losses}

    # Interrupted after step 1 (a STOP file), then the same command resumes from the checkpoint.
    resumed_dir = out / "resumed"
    cfg = dataclasses.replace(base, checkpoint=CheckpointConfig(save=str(resumed_dir), save_interval=2))
    first, second = stopped_then_resumed(train, resumed_dir, cfg, cfg)
    results["resumed"] = {
        "first": first.losses,
        "preempted": first.preempted,
        "second": second.losses,
        "start": second.start_step,
        "evals": second.evals,
    }

    # tp2 x pp4: the two middle stages must read no data.
    r = train(
        dataclasses.replace(
            base,
            parallel=ParallelConfig(tp=2, pp=4),
            train=dataclasses.replace(base.train, steps=1, eval_interval=1, eval_iters=1),
        )
    )
    results["pp4_samples_read"] = r.samples_read
    rank_json(out, "", results)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
