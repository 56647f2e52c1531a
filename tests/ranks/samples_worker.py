"""`threed train` twice in one 2-rank launch (tp1 pp2: the metrics writer is rank 1, not rank 0): first with
--generate-interval 2 and --harness-interval 2 (local lm-eval tasks), then the same run without them; then both
again at --vpp 2 (interleaved: two chunks per rank). The pytest side (test_samples.py) checks the losses are
bit-identical, the scores and generations were logged, and vpp 2's equal vpp 1's.

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/samples_worker.py --out /tmp/s --spec spec.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, harness_fixtures)
from worker_setup import run_worker, write_json
from harness_fixtures import TASKS
from threed.config import CheckpointConfig, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
from worker_setup import train

STEPS, INTERVAL = 4, 2


def run_config(spec: dict, save: Path, with_samples: bool, vpp: int = 1) -> RunConfig:
    model = dataclasses.replace(ModelConfig(**spec["model"]), make_vocab_size_divisible_by=16)
    samples = dict(
        generate_interval=INTERVAL,
        generate_prompts=spec["prompts"],
        generate_max_new_tokens=4,
        harness_interval=INTERVAL,
        harness_tasks=",".join(TASKS),
        harness_limit=5,
        harness_include_path=spec["include_path"],
    )
    return RunConfig(
        model=model,
        parallel=ParallelConfig(tp=1, pp=2, vpp=vpp),
        train=TrainConfig(
            dtype="fp32",
            seq_length=32,
            micro_batch_size=2,
            grad_accum_steps=2,
            steps=STEPS,
            lr=1e-3,
            warmup_steps=1,
            seed=3,
            **(samples if with_samples else {}),
        ),  # fmt: skip
        data=DataConfig(data_path=(spec["data"],), split="100,0,0", tokenizer=spec["tokenizer"]),
        checkpoint=CheckpointConfig(save=str(save)),
    )


def samples(args: argparse.Namespace, rt: Runtime) -> None:
    spec = json.loads(args.spec.read_text())
    results: dict[str, list] = {}
    for vpp, suffix in ((1, ""), (2, "_vpp2")):
        for name, with_samples in (("with", True), ("without", False)):
            dist.barrier()
            seed_all()
            results[name + suffix] = train(run_config(spec, args.out / (name + suffix), with_samples, vpp)).losses
            results["draws" + suffix] = results.get("draws" + suffix, []) + [next_draws()]
    if rt.rank == 1:  # the last stage holds the losses
        write_json(args.out / "losses.json", results)


def seed_all() -> None:
    """Both runs start from the same generator states (training seeds torch's itself, not Python's or NumPy's)."""
    random.seed(5)
    np.random.seed(5)


def next_draws() -> list[float]:
    """The next numbers of torch's, Python's and NumPy's generators: lm-eval seeds all three, and dropout, data
    shuffles or a later phase would draw from them (with dropout 0 the losses alone would not show it)."""
    return [*torch.rand(2).tolist(), random.random(), float(np.random.rand())]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", type=Path, required=True, help="JSON: model, data, tokenizer, prompts, include_path")


if __name__ == "__main__":
    raise SystemExit(run_worker({"samples": samples}, add_arguments))
