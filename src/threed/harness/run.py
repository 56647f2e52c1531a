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

from lm_eval import evaluator
from lm_eval.utils import handle_non_serializable

from threed.checkpoint.format import read_latest, step_of
from threed.config import LoraConfig, ModelConfig
from threed.generate.prompts import keep_output
from threed.generate.run import end_on_rank0, pinned_engine
from threed.harness.lm import ThreedLM
from threed.harness.tasks import default_output, quiet_lm_eval, task_manager
from threed.parallel.distributed import Runtime


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
    tag: Optional[str] = None  # the checkpoint's tag, pinned when the command started
    lora: Optional[LoraConfig] = None  # --lora: the adapters put on the base (threed.generate.prompts.lora_request)


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


def scored(request: HarnessRequest) -> dict:
    """What the scores are of, kept in the results: the checkpoint's path, its tag and step (pinned at the start),
    and --lora's adapters."""
    tag = request.tag or read_latest(request.load)
    what = {"checkpoint": str(Path(request.load).resolve()), "tag": tag, "step": step_of(tag) if tag else None}
    lora = request.lora.lora_init_from if request.lora else None
    return {**what, "lora": str(Path(lora).resolve())} if lora else what


def run_harness(request: HarnessRequest, tokenizer: Any, rt: Runtime) -> int:
    """One rank of `threed eval-harness` (every rank of the world calls it, under torchrun or alone)."""
    manager = task_manager(request.tasks, request.include_path)  # the command checked the tasks and their data
    engine = pinned_engine(request, rt)  # the tag read at the start, whatever `latest` names by now
    lm = ThreedLM(engine, request.model, tokenizer, batch_size=request.batch_size)
    t0 = time.perf_counter()
    results = evaluate(lm, request, manager)
    problem = None
    if rt.rank == 0:
        what = scored(request)
        results["threed"] = what
        out = request.output or str(default_output(request.load, request.tag))  # the command resolved it
        problem = keep_output(out, json.dumps(results, indent=2, default=handle_non_serializable), "scores")
        print(
            f"threed eval-harness: {scores_line(results)} ({time.perf_counter() - t0:.1f} s, tp={request.tp} "
            f"pp={request.pp} dp={engine.grid.get_data_parallel_world_size()}); scored {what['checkpoint']}/"
            f"{what['tag']} (step {what['step']})" + ("" if problem else f"; wrote {out}"),
            flush=True,
        )
    return end_on_rank0(rt, problem)
