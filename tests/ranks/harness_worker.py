"""`ThreedLM` under lm-eval at three layouts in one 4-rank launch (tp1 pp1 dp4, tp2 pp2, tp1 pp2 dp2), on the local
tasks of harness_fixtures.py; then, through `threed eval-harness`'s own rank code (run_harness, loading a checkpoint),
a converted tied model (Llama 3.2's layout) and a checkpoint this launch trains with packed SFT, both at tp2 pp2
(eval-harness loads a checkpoint at its own layout). The pytest side (test_harness.py) compares every request with
lm-eval's HF backend.

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/harness_worker.py --out /tmp/h --spec spec.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, convert_fixtures, harness_fixtures)
from worker_setup import load_hf_weights, run_worker, write_json
from convert_fixtures import hf_model
from harness_fixtures import GEN_TASK, TASKS, request_results
from lm_eval import evaluator
from sft_worker import sft_config
from threed.config import CheckpointConfig, ParallelConfig, RunConfig, TrainConfig
from threed.generate.prompts import check_checkpoint
from threed.generate.prompts import hf_tokenizer
from threed.harness.lm import ThreedLM
from threed.harness.run import HarnessRequest, run_harness
from threed.harness.tasks import task_manager
from threed.hf.config import from_hf_config
from threed.parallel.distributed import Runtime
from worker_setup import build_engine
from worker_setup import train

LAYOUTS = [(1, 1), (2, 2), (1, 2)]


def harness(args: argparse.Namespace, rt: Runtime) -> None:
    spec = json.loads(args.spec.read_text())
    hf = hf_model(spec["config"])
    model = dataclasses.replace(from_hf_config(hf.config.to_dict(), name="h"), make_vocab_size_divisible_by=16)
    manager = task_manager([*TASKS, GEN_TASK], spec["include_path"])
    tokenizer = hf_tokenizer(spec["model_dir"])
    results: dict = {}
    for tp, pp in LAYOUTS:
        cfg = RunConfig(
            model=model,
            parallel=ParallelConfig(tp=tp, pp=pp),
            train=TrainConfig(dtype="fp32", seq_length=32, micro_batch_size=1, steps=1),
        )
        engine = build_engine(cfg, rt).engine
        load_hf_weights(engine, cfg, hf.state_dict())
        lm = ThreedLM(engine, model, tokenizer, batch_size=5)
        out = evaluator.simple_evaluate(
            model=lm, tasks=[*TASKS, GEN_TASK], log_samples=True, task_manager=manager, bootstrap_iters=0
        )
        if out is not None:  # lm-eval returns the results where LOCAL_RANK is 0 (every rank scored)
            results[f"tp{tp}_pp{pp}"] = {"requests": request_results(out), "results": out["results"]}
        dist.barrier()
    if rt.rank == 0:
        write_json(args.out / "harness.json", results)
    sft_trained(spec, model, rt)
    for name, load, tp, pp in (("tied", spec["tied_ckpt"], 2, 2), ("sft", spec["sft_ckpt"], 2, 2)):
        score_checkpoint(spec, load, args.out / f"{name}_harness.json", tp, pp, rt)


def sft_trained(spec: dict, model, rt: Runtime) -> None:
    """A few packed-SFT steps from random init at tp2 pp2 (dp1), saved to spec["sft_ckpt"] with the run's files."""
    cfg = sft_config(spec["sft_data"], pack=True, steps=3)
    cfg = dataclasses.replace(cfg, model=model, checkpoint=CheckpointConfig(save=spec["sft_ckpt"]))
    train(cfg)
    dist.barrier()


def score_checkpoint(spec: dict, load: str, out: Path, tp: int, pp: int, rt: Runtime) -> None:
    """`threed eval-harness --load LOAD --tp TP --pp PP --log-samples` on the local multiple-choice and rolling tasks,
    as the command's ranks run it."""
    model, tp, pp = check_checkpoint(load, tp, pp)
    request = HarnessRequest(
        load=load, model=model, tp=tp, pp=pp, tasks=list(TASKS), tokenizer=spec["model_dir"],
        include_path=spec["include_path"], output=str(out), batch_size=5, log_samples=True,
    )  # fmt: skip
    run_harness(request, hf_tokenizer(spec["model_dir"]), rt)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", type=Path, required=True, help="JSON: config, model_dir, include_path")


if __name__ == "__main__":
    raise SystemExit(run_worker({"harness": harness}, add_arguments))
