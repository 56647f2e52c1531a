"""What every tests/ranks/*_worker.py shares: the start (`[SCENARIO] --out DIR [flags]`, the results directory, the
process group), the result files the pytest side reads back, and the small facts about a rank's engine the
scenarios ask (its layers and weights, whether it reads data, whether it keeps the pipeline's logits).

A worker runs as a script under torchrun, so its own folder, tests/ranks/, is on sys.path and it imports this module
as `worker_setup`; importing it puts tests/ there too, for helpers.py and reference.py. A worker therefore imports
worker_setup before any of those (or before another worker that does):

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/metrics_worker.py train --out /tmp/m

and ends with `raise SystemExit(run_worker({"train": train, "bubble": bubble}))`; each scenario is called with the
parsed arguments (`args.out` is a Path that exists) and the rank's threed.parallel.distributed.Runtime.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

import threed.checkpoint.start as start_module
from threed.config import ModelConfig, RunConfig, RunControlConfig
from threed.convert.in_memory import load_hf_state
from threed.engine import build as engine_build
from threed.engine.resolved import resolve
from threed.parallel.distributed import Runtime, init_distributed
from threed.parallel.pipeline import local_modules

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(1, TESTS)  # after the worker's own folder

Scenario = Callable[[argparse.Namespace, Runtime], Optional[int]]
AddArguments = Callable[[argparse.ArgumentParser], None]


def run_worker(scenarios: dict[str, Scenario], add_arguments: Optional[AddArguments] = None) -> int:
    """Parse `[SCENARIO] --out DIR [flags]` (the scenario word only when there is more than one), make DIR, join the
    process group with training's default timeout (what `threed train` does), and run the scenario: its return
    value (None: 0) is the exit status."""
    p = argparse.ArgumentParser()
    if len(scenarios) > 1:
        p.add_argument("scenario", choices=list(scenarios))
    p.add_argument("--out", required=True, type=Path)
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rt = init_distributed(RunControlConfig().dist_timeout_minutes)
    scenario = scenarios[args.scenario] if len(scenarios) > 1 else next(iter(scenarios.values()))
    return scenario(args, rt) or 0


def build_engine(cfg: RunConfig, rt: Runtime, **kw: Any) -> engine_build.Built:
    """threed.engine.build.build_engine of `cfg` resolved at this world, as train, generate and eval-harness resolve
    theirs (threed.engine.resolved.resolve): the scenarios describe their runs as RunConfigs."""
    return engine_build.build_engine(resolve(cfg, rt.world_size), rt, **kw)


def train(cfg: RunConfig):
    """threed.train.loop.train of `cfg` resolved at torchrun's world, as `threed train` does (threed.cli.main)."""
    from threed.train import loop  # the loop's imports (datasets, samples, harness) only for the scenarios that train

    return loop.train(resolve(cfg, int(os.environ.get("WORLD_SIZE", "1"))))


def write_json(path: Path, results: Any) -> None:
    path.write_text(json.dumps(results))


def rank_json(out: Path, stem: str, results: Any) -> None:
    """This rank's results as OUT/<stem>_rank<R>.json (OUT/rank<R>.json for an empty stem): every rank writes
    one, and the pytest side reads them all."""
    rank = dist.get_rank()
    write_json(out / (f"{stem}_rank{rank}.json" if stem else f"rank{rank}.json"), results)


def local_layers(engine) -> Iterator[tuple[int, torch.nn.Module]]:
    """(global layer index, layer) for each pipeline layer this rank's stage holds."""
    return iter(engine.module.indexed_layers())


def local_weights(engine, model: ModelConfig) -> dict[str, torch.Tensor]:
    """Copies of this rank's weights, keyed `<layer index>.<name>` (a tied head's: the embedding copy it runs with,
    under the embedding's index). megatron's linears also hold `_extra_state` (None) entries: tensors only."""
    return {
        f"{layer.index}.{k}": v.detach().clone()
        for layer, m in local_modules(engine.module, model)
        for k, v in m.state_dict().items()
        if isinstance(v, torch.Tensor)
    }


def reads_data(engine) -> bool:
    """Only the first stage (tokens) and the last (labels) read batches; a middle stage passes None."""
    return engine.is_first_stage() or engine.is_last_stage()


def keeps_logits(engine) -> bool:
    """threed.logits.pipeline_logits returns the logits on every rank of the last stage; TP rank 0 of data-parallel
    replica 0 is the one that saves them."""
    return engine.grid.get_slice_parallel_rank() == 0 and engine.grid.get_data_parallel_rank() == 0


def synthetic_batches(
    vocab: int, micro: int, seq: int, seed: int = 0, n: Optional[int] = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, labels) micro-batches of random token ids from a generator seeded with `seed`: `n` of them, or
    without end."""
    gen = torch.Generator().manual_seed(seed)
    made = 0
    while n is None or made < n:
        tokens = torch.randint(0, vocab, (micro, seq + 1), generator=gen)
        yield tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        made += 1


def load_hf_weights(engine, cfg: RunConfig, hf_state: dict) -> None:
    """Each rank copies its own layers' TP shards of the HF weights, then refreshes the optimizer's fp32 masters."""
    load_hf_state(engine.module, cfg.model, hf_state, cfg.parallel.tp, engine.grid.get_slice_parallel_rank())
    engine.optimizer.refresh_fp32_params()


def stopped_then_resumed(
    train: Callable[[RunConfig], Any], save: Path, first: RunConfig, second: RunConfig
) -> tuple[Any, Any]:
    """A run preempted after its first step (a STOP file in `save`, the new directory both configs save to), then
    the resumed run: the two results of `train`."""
    if dist.get_rank() == 0:
        save.mkdir()
        (save / "STOP").write_text("")
    dist.barrier()
    # A STOP present at start is a stopped run's leftover and is removed (threed.checkpoint.start); here it stands
    # for one that arrives during the first step, so that removal is switched off for the first run only.
    keep = start_module.remove_stale_stop
    start_module.remove_stale_stop = lambda save: None
    try:
        stopped = train(first)
    finally:
        start_module.remove_stale_stop = keep
    dist.barrier()
    if dist.get_rank() == 0:
        (save / "STOP").unlink()
    dist.barrier()
    return stopped, train(second)
