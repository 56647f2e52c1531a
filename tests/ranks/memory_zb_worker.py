"""What ZB-H1 (`--pipeline-schedule zb-h1`) makes a rank hold, for tests/ranks/test_memory_zb.py: run under torchrun.

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/memory_zb_worker.py --out /tmp/zb --layouts 1x2 \
        --pipeline-schedule zb-h1 --deferred --schedule-peaks

--layouts, --pipeline-schedule: tests/ranks/memory_worker.py's static terms of those engines.
--deferred (tp = the world, one stage): for sequence parallelism off and on, the bytes one micro-batch's queued
weight-gradient passes hold after its input-gradient backward (`threed.model.wgrad`'s queue: each linear's saved
input and output gradient), next to `threed.memory.deferred`'s count.
--schedule-peaks (tp 1, pp = the world): the CPU allocator's peak during a whole train step of a 1F1B and of a ZB-H1
engine (after a first step), on every stage, next to the estimate's activation phase.
"""

from __future__ import annotations

import argparse
import gc

import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import rank_json, reads_data, run_worker, synthetic_batches
from memory_worker import ACT, SP_MODEL, StorageCounter, add_arguments as memory_arguments, cpu_peak, cuda_peak, static
from threed.config import ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime, init_megatron_parallel_state
from worker_setup import build_engine
from helpers import pipeline_module
from threed.memory.deferred import awaiting_w_bytes
from threed.memory.model import Stage, stage_kinds, stage_memory, stages
from threed.model.wgrad import DEFERRED


def deferred_cases(args: argparse.Namespace, rt: Runtime) -> None:
    """One micro-batch's backward through a whole one-stage model (tp = world) with the weight gradients deferred:
    the distinct storages its queued W passes hold (inputs, output gradients), and threed.memory's count."""
    tp, (micro, seq) = rt.world_size, (ACT["micro"], ACT["seq"])
    init_megatron_parallel_state(tp, 1)
    results = {}
    for sp in (False, True):
        cfg = RunConfig(
            model=SP_MODEL,
            parallel=ParallelConfig(tp=tp, sequence_parallel=sp),
            train=TrainConfig(seq_length=seq, micro_batch_size=micro),
        )
        module = pipeline_module(cfg, tp).bfloat16()
        module._precompute_checkpointable_values()
        tokens, labels = next(synthetic_batches(SP_MODEL.vocab_size, micro, seq, n=1))
        DEFERRED.clear()
        loss = module.loss_fn(module(tokens), labels)
        with DEFERRED.deferring():  # what the ZB-H1 engine's B does
            loss.backward()
        (group,) = DEFERRED._groups  # one backward: one group of W passes
        held, tensor_bytes = StorageCounter(), 0
        for _weight, fn in group:  # fn: functools.partial(_weight_grad, input_, grad_output, ...)
            for t in (fn.args[0], fn.args[1]):
                held.add("deferred", t)
                tensor_bytes += t.numel() * t.element_size()
        DEFERRED.run_oldest()
        stage = Stage(index=0, blocks=SP_MODEL.num_layers, first=True, last=True)
        results["sp" if sp else "tp"] = {
            "linears": len(group),
            "storage_bytes": held.bytes["deferred"],
            "tensor_bytes": tensor_bytes,
            "estimate": awaiting_w_bytes(SP_MODEL, tp, stage_kinds(stage), sp) * micro * seq,
        }
        del module, loss, group
        gc.collect()
    rank_json(args.out, "deferred", results)


PEAKS = dict(micro=2, gas=4, seq=512)
SCHEDULES = {"1f1b": ("1f1b", 1), "zb-h1": ("zb-h1", 1), "1f1b-vpp2": ("1f1b", 2)}  # name -> (schedule, vpp)


def schedule_peaks(args: argparse.Namespace, rt: Runtime) -> None:
    """Each schedule's engine (tp 1, pp = world, SP_MODEL in bf16): the CPU peak of its second train step above
    what it held before, and the estimate's largest phase (activations here) with CPU kernels."""
    pp, (micro, gas, seq) = rt.world_size, (PEAKS["micro"], PEAKS["gas"], PEAKS["seq"])
    results = {}
    for name in args.schedules.split(","):
        schedule, vpp = SCHEDULES[name]
        cfg = RunConfig(
            model=SP_MODEL,
            parallel=ParallelConfig(tp=1, pp=pp, vpp=vpp, pipeline_schedule=schedule),
            train=TrainConfig(dtype="bf16", micro_batch_size=micro, grad_accum_steps=gas, seq_length=seq),
        )
        engine = build_engine(cfg, rt).engine

        def step() -> None:
            data = synthetic_batches(SP_MODEL.vocab_size, micro, seq, n=gas)
            engine.train_batch(data_iter=data if reads_data(engine) else None)  # noqa: F821 (bound in the loop; ruff sees its `del` below)

        step()  # grads, optimizer state and pipe buffers exist from here on
        gc.collect()
        dist.barrier()
        # tests/gpu/test_gpu.py runs this on CUDA: torch.cuda's peak and the estimate with CUDA kernels
        measured = cuda_peak(step) if rt.device.type == "cuda" else cpu_peak(step)
        stage = stages(SP_MODEL, pp, 1, seq, vpp=vpp)[engine.stage_id]
        mem = stage_memory(SP_MODEL, 1, pp, 1, micro, gas, seq, False, stage, rt.device.type, schedule=schedule)
        results[name] = {
            "stage": engine.stage_id,
            "measured": measured,
            "activations": mem.activations,
            "phase": mem.phase[1],
        }
        del engine
        gc.collect()
        dist.barrier()
    rank_json(args.out, "schedule_peaks", results)


def add_arguments(p: argparse.ArgumentParser) -> None:
    memory_arguments(p)
    p.add_argument(
        "--deferred",
        action="store_true",
        help="the bytes queued for the deferred weight gradients (zb-h1), tp = the world",
    )
    p.add_argument(
        "--schedule-peaks",
        action="store_true",
        help="the CPU peak of a train step under each of --schedules, pp = the world",
    )
    p.add_argument("--schedules", default="1f1b,zb-h1", help=f"for --schedule-peaks, of {', '.join(SCHEDULES)}")


def main(args: argparse.Namespace, rt: Runtime) -> None:
    static(args, rt)
    if args.deferred:
        deferred_cases(args, rt)
    if args.schedule_peaks:
        schedule_peaks(args, rt)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
