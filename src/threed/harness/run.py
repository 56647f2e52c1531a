"""The ranks of `threed eval-harness`: build the engine from a checkpoint at --tp / --pp (as `threed generate`
does), wrap it in `ThreedLM`, run lm-eval's `simple_evaluate` on every rank alike (the requests are split over
the data-parallel replicas inside the model) and write lm-eval's results dict as JSON from rank 0, beside the
checkpoint unless --output says where.

    threed eval-harness --load CKPT --tasks arc_easy,piqa --limit 100 --nproc-per-node 4 --tp 2 --pp 2
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from lm_eval import evaluator
from lm_eval.utils import handle_non_serializable

from threed.atomic import write_atomic
from threed.checkpoint.format import read_latest
from threed.config import ModelConfig
from threed.generate.run import engine_config
from threed.harness.lm import ThreedLM
from threed.harness.tasks import quiet_lm_eval, task_manager
from threed.parallel.distributed import Runtime
from threed.engine.build import build_engine
from threed.engine.resolved import resolve


@dataclass
class HarnessRequest:
    load: str
    model: ModelConfig
    tp: int
    pp: int
    tasks: list[str]
    tokenizer: str
    include_path: Optional[str] = None
    limit: Optional[float] = None
    num_fewshot: Optional[int] = None
    output: Optional[str] = None
    batch_size: int = 16
    log_samples: bool = False
    dtype: str = "fp32"


def evaluate(lm: ThreedLM, request: HarnessRequest, manager: Any) -> dict:
    """lm-eval's results dict for the request's tasks scored by `lm`; the same on every rank."""
    with quiet_lm_eval():
        results = evaluator.simple_evaluate(
            model=lm,
            tasks=request.tasks,
            num_fewshot=request.num_fewshot,
            limit=request.limit,
            log_samples=request.log_samples,
            task_manager=manager,
            bootstrap_iters=0,
        )
    return results


def scores_line(results: dict) -> str:
    """`task metric value` for each task's metrics, for the log."""
    parts = []
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            if isinstance(value, float) and "stderr" not in key:
                parts.append(f"{task} {key.split(',')[0]} {value:.4f}")
    return "; ".join(parts)


def default_output(load: str) -> Path:
    """CKPT/harness/<tag>_<time>.json: the scores of the checkpoint `latest` names, beside it."""
    tag = read_latest(load) or "checkpoint"
    return Path(load) / "harness" / f"{tag}_{time.strftime('%Y%m%d-%H%M%S')}.json"


def run_harness(request: HarnessRequest, tokenizer: Any, rt: Runtime) -> int:
    """One rank of `threed eval-harness` (every rank of the world calls it, under torchrun or alone)."""
    manager = task_manager(request.tasks, request.include_path)  # the command checked the tasks and their data
    cfg = engine_config(request.load, request.model, request.tp, request.pp, request.dtype)
    engine = build_engine(resolve(cfg, rt.world_size), rt, train=False).engine  # the weights alone: no optimizer state
    lm = ThreedLM(engine, request.model, tokenizer, batch_size=request.batch_size)
    t0 = time.perf_counter()
    results = evaluate(lm, request, manager)
    if rt.rank == 0:
        out = Path(request.output) if request.output else default_output(request.load)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, json.dumps(results, indent=2, default=handle_non_serializable))
        print(
            f"threed eval-harness: {scores_line(results)} ({time.perf_counter() - t0:.1f} s, tp={request.tp} "
            f"pp={request.pp} dp={engine.grid.get_data_parallel_world_size()}); wrote {out}",
            flush=True,
        )
    dist.barrier()
    return 0
