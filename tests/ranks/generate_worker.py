"""`threed generate`'s decode loop at three layouts in one 4-rank launch (tp1 pp1 dp4, tp2 pp2, tp1 pp2 dp2), each
greedy and sampled, with and without the KV cache, plus a stop token; the pytest side (test_generate.py) compares
the tokens with HF's `generate` on the same weights.

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/generate_worker.py --out /tmp/gen
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, convert_fixtures)
from worker_setup import load_hf_weights, write_json, run_worker
from convert_fixtures import hf_model
from threed.config import ParallelConfig, RunConfig, TrainConfig
from threed.generate.prompts import Sampling
from threed.generate.decode import generate_all
from threed.hf.config import from_hf_config
from threed.parallel.distributed import Runtime
from worker_setup import build_engine

LAYOUTS = [(1, 1), (2, 2), (1, 2)]
SAMPLING = Sampling(temperature=0.8, top_p=0.9, seed=7)


def cases() -> dict[str, tuple[Sampling, bool]]:
    """name -> (sampling, use the KV cache)."""
    return {
        "greedy_cache": (Sampling(), True),
        "greedy_nocache": (Sampling(), False),
        "sample_cache": (SAMPLING, True),
        "sample_nocache": (SAMPLING, False),
    }


def generate(args: argparse.Namespace, rt: Runtime) -> None:
    spec = json_spec(args)
    results: dict = {}
    run_layouts(spec, rt, results, LAYOUTS, tied=False)
    run_layouts(spec, rt, results, [(2, 2)], tied=True)  # Llama 3.2's tied head: the last stage's embedding copy
    if rt.rank == 0:
        write_json(args.out / "generated.json", results)


def run_layouts(spec: dict, rt: Runtime, results: dict, layouts: list, tied: bool) -> None:
    hf = hf_model(spec["config"], seed=spec["seed"], tied=tied)
    model = dataclasses.replace(from_hf_config(hf.config.to_dict(), name="gen"), make_vocab_size_divisible_by=16)
    for tp, pp in layouts:
        cfg = RunConfig(
            model=model,
            parallel=ParallelConfig(tp=tp, pp=pp),
            train=TrainConfig(dtype="fp32", seq_length=32, micro_batch_size=1, steps=1),
        )
        engine = build_engine(cfg, rt).engine
        load_hf_weights(engine, cfg, hf.state_dict())
        for name, (sampling, cache) in cases().items():
            if tied and name != "greedy_cache":
                continue
            out = generate_all(engine, model, spec["prompts"], spec["max_new"], sampling, use_cache=cache, batch_size=3)
            results[f"{'tied_' if tied else ''}tp{tp}_pp{pp}_{name}"] = [
                {"tokens": r.tokens, "margins": r.margins} for r in out
            ]
        if (tp, pp) == (2, 2) and not tied:  # stop ids end each row at its first one (included), batch of 2 and 3 rows
            out = generate_all(engine, model, spec["prompts"], spec["max_new"], Sampling(), spec["stop"], batch_size=2)
            results["tp2_pp2_stop"] = [{"tokens": r.tokens, "margins": r.margins} for r in out]
        dist.barrier()


def json_spec(args: argparse.Namespace) -> dict:
    return json.loads(args.spec.read_text())


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", type=Path, required=True, help="JSON: config, seed, prompts, max_new, stop")


if __name__ == "__main__":
    raise SystemExit(run_worker({"generate": generate}, add_arguments))
