"""The ranks of `threed generate`: build the engine from a checkpoint at --tp / --pp (the path `threed train
--init-from` takes: DeepSpeed's own `load_checkpoint(load_module_only=True)`), split the prompts over the
data-parallel replicas, generate in batches (`threed.generate.decode`), and write the continuations from rank 0.

    threed generate --load CKPT --prompts prompts.jsonl --max-new-tokens 32 --output out.jsonl \
        --nproc-per-node 4 --tp 2 --pp 2
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Optional

import torch
import torch.distributed as dist

from threed.checkpoint.start import start
from threed.config import CheckpointConfig, LoraConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.errors import ThreedError
from threed.parallel.distributed import Runtime  # before megatron-core (decode's): the device policy's setup
from threed.generate.decode import generate_all
from threed.generate.prompts import GenerateRequest, Tokenizer, keep_output
from threed.engine.build import build_engine
from threed.engine.resolved import resolve


def engine_config(
    load: str, model: ModelConfig, tp: int, pp: int, dtype: str = "fp32", lora: Optional[LoraConfig] = None
) -> RunConfig:
    """The RunConfig whose engine holds the checkpoint's weights at tp x pp (no data, no optimizer steps), with
    `lora`'s adapters on them (--lora: read from its lora_init_from at this layout, threed.engine.lora)."""
    return RunConfig(
        model=model,
        parallel=ParallelConfig(tp=tp, pp=pp),
        train=TrainConfig(dtype=dtype, seq_length=min(64, model.max_position_embeddings), micro_batch_size=1, steps=1),
        checkpoint=CheckpointConfig(init_from=load),
        lora=lora or LoraConfig(),
    )


def pinned_engine(request: Any, rt: Runtime) -> Any:
    """The engine holding the weights of `request.tag`, the tag the command read when it started: a training run
    that saves meanwhile moves `latest`, not what this command loads (every rank loads that one tag)."""
    cfg = engine_config(request.load, request.model, request.tp, request.pp, request.dtype, request.lora)
    run = resolve(cfg, rt.world_size)
    decision = start(run.cfg, run.dims, rt.rank)
    if request.tag:
        decision.tag = request.tag
    return build_engine(run, rt, decision, train=False).engine  # the weights alone: no optimizer state


def end_on_rank0(rt: Runtime, problem: Optional[str]) -> int:
    """Every rank meets at the barrier, then rank 0 says a late failure (`problem`) in one line, exit 2."""
    dist.barrier()
    if problem and rt.rank == 0:
        raise ThreedError(problem)
    return 0


def output_lines(request: GenerateRequest, tokenizer: Tokenizer, results: list) -> list[str]:
    return [
        json.dumps({"prompt": request.texts[r.index], "text": tokenizer.decode(r.tokens), "tokens": r.tokens})
        for r in results
    ]


def run_generate(request: GenerateRequest, tokenizer: Tokenizer, rt: Runtime) -> int:
    """One rank of `threed generate` (every rank of the world calls it, under torchrun or alone)."""
    engine = pinned_engine(request, rt)
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    results = generate_all(
        engine,
        request.model,
        request.prompt_ids,
        request.max_new_tokens,
        request.sampling,
        tokenizer.stop_ids,
        use_cache=not request.no_kv_cache,
        batch_size=request.batch_size,
    )
    seconds = time.perf_counter() - t0
    problem = None
    if rt.rank == 0:
        lines = output_lines(request, tokenizer, results)
        new = sum(len(r.tokens) for r in results)
        summary = (
            f"threed generate: {len(results)} prompt(s), {new} new tokens in {seconds:.2f} s: "
            f"{new / max(seconds, 1e-9):.1f} tokens/s (tp={request.tp} pp={request.pp} "
            f"dp={engine.grid.get_data_parallel_world_size()}, {'no ' if request.no_kv_cache else ''}KV cache)"
        )
        if request.output:
            problem = keep_output(request.output, "".join(line + "\n" for line in lines), "continuations")
            print(summary if problem else f"{summary}; wrote {request.output}", flush=True)
        else:
            print("\n".join(lines), flush=True)
            print(summary, file=sys.stderr, flush=True)
    return end_on_rank0(rt, problem)
