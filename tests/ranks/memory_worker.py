"""What a rank really allocates, for tests/ranks/test_memory.py: run under torchrun (or as one plain process).

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/memory_worker.py --out /tmp/m --layouts 2x2
    python tests/ranks/memory_worker.py --out /tmp/m --layouts 1x1 --activations
    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/memory_worker.py --out /tmp/t --layouts 1x2 \
        --model tiny-tied

--layouts: for each TPxPP layout (dp = world / (tp pp)) build the engine, run one bf16 train step on synthetic
tokens, then add up the storages of the module's parameters and grads and of BF16_Optimizer's tensors (flat
groups, fp32 master partitions, fp32 gradient buffers, AdamW state), and separately the RoPE caches and the
pipeline's receive/gradient buffers. Also every tensor the garbage collector can see, as a cross-check that
nothing else (e.g. the fp32 parameters DeepSpeed cast to bf16) stays alive: every tensor but those that were alive
before the engine was built (what earlier requests of the launch left, tests/ranks/dispatch_worker.py, and the engines
before it). One JSON per rank and layout.
--lora-layouts: the same for TPxPP engines with --lora-rank LORA_RANK on every target (after --layouts' engines).

--activations (one process): the CPU allocator's peak during the forward and backward of one micro-batch through
a whole one-stage model (the profiler's memory events), with and without activation checkpointing, next to
`threed.memory`'s estimate with CPU kernels.

--stage-activations (tests/ranks/test_memory_sp.py; tp = the world, one stage): the same peak on every TP rank for each
of SP_CASES (sequence parallelism on/off, recompute none / first N blocks / all), next to the estimate.
--cp-activations (tests/ranks/test_memory_cp.py; 2 ranks, tp 1 pp 1): the same peak at cp 1 and then cp 2 on the same
rows, every rank its share at cp 2.
--head-chunks (tests/ranks/test_memory_head.py; one process): the same peak through a one-stage model whose LM head sets
it (HEAD_MODEL), with the whole logits and with --lm-head-chunks HEAD_CHUNKS.
--sequence-parallel: the --layouts engines run with Megatron's sequence parallelism. --pipeline-schedule: the
--layouts engines run that schedule (tests/ranks/test_memory_zb.py: zb-h1, whose static terms are 1F1B's).

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/memory_worker.py --out /tmp/sp --stage-activations
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import warnings
import weakref
from pathlib import Path

import torch
import torch.distributed as dist

from threed.config import LoraConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.model.spec import is_adapter_key
from threed.model import context
from threed.parallel.distributed import Runtime, context_rank, init_megatron_parallel_state
from worker_setup import build_engine
from threed.convert.resolve import model_config
from threed.memory.model import Stage, stage_activations, stage_bounds, stage_memory, stages
from threed.memory.recompute import Recompute
from worker_setup import rank_json, reads_data, run_worker, synthetic_batches, write_json
from helpers import pipeline_module

STATIC = dict(model="tiny", micro=2, gas=2, seq=32)
LORA_RANK = 4  # --lora-layouts: a multiple of tp 2 (the column targets' A shard their rank over TP)
# Wide enough that activations dwarf everything else allocated during a step.
ACT_MODEL = ModelConfig(
    name="act",
    vocab_size=1000,
    hidden_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    ffn_hidden_size=704,
    max_position_embeddings=1024,
    make_vocab_size_divisible_by=32,
)
ACT = dict(micro=2, seq=512)
# --stage-activations: four blocks, so that partial recompute has an N strictly between 0 and all of them.
SP_MODEL = dataclasses.replace(ACT_MODEL, name="act-sp", num_layers=4)
# --head-chunks: one block and a vocabulary whose logits outweigh it (no padding: 16384 is a multiple of 32), so that
# the loss's share of the peak is what the measurement sees.
HEAD_MODEL = dataclasses.replace(ACT_MODEL, name="act-head", vocab_size=16384, num_layers=1)
HEAD = dict(micro=2, seq=256, chunks=8)
SP_CASES = {  # name -> (sequence parallel, recompute)
    "tp": (False, Recompute()),
    "sp": (True, Recompute()),
    "tp_full": (False, Recompute.of(True)),
    "sp_full": (True, Recompute.of(True)),
    "sp_block2": (True, Recompute.first_blocks(2)),
}


class StorageCounter:
    """Bytes per category of distinct storages: a tensor whose storage was already counted adds nothing."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.bytes: dict[str, int] = {}

    def add(self, category: str, t) -> None:
        if not isinstance(t, torch.Tensor):
            return
        st = t.untyped_storage()
        if st.data_ptr() in self.seen or st.nbytes() == 0:
            return
        self.seen.add(st.data_ptr())
        self.bytes[category] = self.bytes.get(category, 0) + st.nbytes()


def live_tensors() -> list[torch.Tensor]:
    """Every strided, non-meta tensor the garbage collector can see."""
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        return [
            o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.layout == torch.strided and not o.is_meta
        ]


def measure_static(engine, before: list[weakref.ref]) -> dict[str, int]:
    c = StorageCounter()
    opt = engine.optimizer
    for p in engine.module.parameters():
        c.add("weights", p)
        c.add("bf16 grads", p.grad)
    for b in engine.module.buffers():
        c.add("module buffers", b)
    for t in opt.bf16_groups_flat:
        c.add("weights", t)
    for t in opt.fp32_groups_gradients_flat:
        c.add("grads", t)
    for t in opt.fp32_groups_flat_partition:
        c.add("master", t)
        c.add("master grad", t.grad)  # a view of the fp32 gradient buffer: adds nothing if so
    for state in opt.optimizer.state.values():
        for v in state.values():
            c.add("adam", v)
    model_states = sum(c.bytes.values())
    for layer in engine.module.forward_funcs:
        for t in getattr(getattr(layer, "rotary", None), "_cache", {}).values():
            c.add("buffers", t)
    for t in [engine.pipe_recv_buf, engine.grad_layer, *engine._grad_layer_buf]:
        c.add("buffers", t)
    from megatron.core import parallel_state  # heavy: only here (sequence parallelism's all-gather buffer)

    memory_buffer = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    for t in memory_buffer.buffer.values() if memory_buffer is not None else []:
        c.add("buffers", t)
    for key in ("outputs", "output_tensors"):  # DeepSpeed's last stage kept its logits here (lean_engine: none)
        for t in engine.pipe_buffers[key]:
            c.add("buffers", t)
    out: dict = dict(c.bytes, model_states=model_states)
    # Cross-check: every other tensor the garbage collector knows about (none should be large), but those alive
    # before the engine was built. Those still alive hold their storages, so no new tensor can share their address.
    counted = sum(c.bytes.values())
    earlier = {t.untyped_storage().data_ptr() for ref in before if (t := ref()) is not None}
    largest = []
    for t in live_tensors():
        ptr = t.untyped_storage().data_ptr()
        if ptr not in c.seen and ptr not in earlier:
            c.add("unaccounted", t)
            largest.append((t.untyped_storage().nbytes(), list(t.shape), str(t.dtype)))
    out["unaccounted"] = sum(c.bytes.values()) - counted
    out["largest_unaccounted"] = sorted(largest, reverse=True)[:4]
    return out


def static(args: argparse.Namespace, rt: Runtime) -> None:
    for layout in args.layouts:
        static_layout(args, rt, layout)
    for layout in args.lora_layouts:
        static_layout(args, rt, layout, LoraConfig(lora_rank=LORA_RANK))


def trainable_counts(engine) -> dict[str, int]:
    """Elements by who holds them, to show that under LoRA only the adapters have a gradient and optimizer state:
    the adapters, the other parameters with requires_grad or a .grad, BF16_Optimizer's fp32 gradient buffers, its
    fp32 master partitions and AdamW's state."""
    opt = engine.optimizer
    named = list(engine.module.named_parameters())
    return {
        "adapters": sum(p.numel() for n, p in named if is_adapter_key(n)),
        "base_trainable": sum(p.numel() for n, p in named if not is_adapter_key(n) and p.requires_grad),
        "base_grads": sum(p.grad.numel() for n, p in named if not is_adapter_key(n) and p.grad is not None),
        "fp32_grads": sum(t.numel() for t in opt.fp32_groups_gradients_flat),
        "master": sum(t.numel() for t in opt.fp32_groups_flat_partition),
        "adam": sum(v.numel() for st in opt.optimizer.state.values() for k, v in st.items() if k != "step"),
    }


def static_layout(args: argparse.Namespace, rt: Runtime, layout: str, lora: LoraConfig | None = None) -> None:
    """One TPxPP layout's engine (`lora`: with --lora-rank's adapters), one bf16 step, its tensors and the model's."""
    gc.collect()
    # what the launch's earlier requests and engines left (DeepSpeed's caches of the one before): not this engine's
    before = [weakref.ref(t) for t in live_tensors()]
    mc = model_config(args.model)
    tp, pp = (int(x) for x in layout.split("x"))
    dp = rt.world_size // (tp * pp)
    cfg = RunConfig(
        model=mc,
        parallel=ParallelConfig(
            tp=tp, pp=pp, sequence_parallel=args.sequence_parallel, pipeline_schedule=args.pipeline_schedule
        ),
        train=TrainConfig(
            dtype="bf16", micro_batch_size=STATIC["micro"], grad_accum_steps=STATIC["gas"], seq_length=STATIC["seq"]
        ),
        lora=lora or LoraConfig(),
    )
    engine = build_engine(cfg, rt).engine
    data = synthetic_batches(
        mc.vocab_size, STATIC["micro"], STATIC["seq"], seed=engine.grid.get_data_parallel_rank(), n=STATIC["gas"]
    )
    loss = engine.train_batch(data_iter=data if reads_data(engine) else None).item()
    gc.collect()
    stage = stages(mc, pp, tp, STATIC["seq"])[engine.stage_id]
    micro, gas, seq, sp, schedule = (
        STATIC["micro"],
        STATIC["gas"],
        STATIC["seq"],
        args.sequence_parallel,
        args.pipeline_schedule,
    )
    mem = stage_memory(mc, tp, pp, dp, micro, gas, seq, False, stage, "cpu", sp, schedule, lora=lora)
    result = {
        "model": mc.name,
        "layout": [tp, pp, dp],
        "rank": rt.rank,
        "stage": engine.stage_id,
        "loss": loss,
        "parts": [int(b) for b in engine.module.parts],
        "predicted_parts": list(stage_bounds(mc, pp, tp, STATIC["seq"])),
        "optimizer": type(engine.optimizer).__name__,
        "engine": type(engine).__name__,
        "measured": measure_static(engine, before),
        "predicted": {
            "weights": mem.weights,
            "grads": mem.grads,
            "optimizer": mem.optimizer,
            "model_states": mem.model_states,
            "buffers": mem.buffers,
            "static": mem.static,
            "params": mem.params,
            "adapters": mem.adapters,
        },
        "counts": trainable_counts(engine),
    }
    rank_json(args.out, f"static_{'lora_' if lora else ''}{tp}x{pp}x{dp}", result)
    del engine
    gc.collect()
    dist.barrier()


def cpu_peak(fn) -> int:
    """Peak bytes the CPU allocator holds during `fn()` above what it held before (profiler memory events)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The trace keeps every allocation and free in order (FunctionEvent lists drop many of them).
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    events = sorted((e for e in trace if e.get("name") == "[memory]"), key=lambda e: float(e["ts"]))
    current = peak = 0
    for e in events:
        current += e["args"]["Bytes"]
        peak = max(peak, current)
    return peak


def activations(args: argparse.Namespace) -> None:
    init_megatron_parallel_state(1, 1)
    micro, seq = ACT["micro"], ACT["seq"]
    results = {}
    for ckpt in (False, True):
        cfg = RunConfig(
            model=ACT_MODEL, train=TrainConfig(seq_length=seq, micro_batch_size=micro, activation_checkpointing=ckpt)
        )
        module = pipeline_module(cfg, 1).bfloat16()
        module._precompute_checkpointable_values()  # what the engine does before the first forward
        tokens, labels = next(synthetic_batches(ACT_MODEL.vocab_size, micro, seq, n=1))
        module.loss_fn(module(tokens), labels).backward()  # grads now exist: backward adds into them

        def step() -> None:
            logits = module(tokens)  # kept until backward ends, as the pipeline engine keeps its outputs
            module.loss_fn(logits, labels).backward()
            del logits

        measured = cpu_peak(step)
        stage = Stage(index=0, blocks=ACT_MODEL.num_layers, first=True, last=True)
        max_param = max(p.numel() for p in module.parameters())
        kw = dict(stage=stage, micro=micro, gas=1, seq=seq, act_ckpt=ckpt, max_param=max_param)
        # The engine keeps the logits in its pipe buffers (threed.memory counts them under `buffers`); here
        # `step` keeps them alive through backward the same way, so they are added to the estimate.
        logits = 2 * micro * seq * ACT_MODEL.padded_vocab_size(1)
        cpu = stage_activations(ACT_MODEL, 1, 1, device="cpu", **kw) + logits
        cuda = stage_activations(ACT_MODEL, 1, 1, device="cuda", **kw) + logits
        results["ckpt" if ckpt else "no_ckpt"] = {
            "measured": measured,
            "estimate_cpu_kernels": cpu,
            "estimate_cuda_kernels": cuda,
        }
    write_json(args.out / "activations.json", results)


def recompute_config(rc: Recompute) -> dict:
    """TrainConfig's fields for `rc` (Megatron's flags; all blocks is --activation-checkpointing)."""
    if rc == Recompute.of(True):
        return {"activation_checkpointing": True}
    return {
        "recompute_granularity": rc.granularity,
        "recompute_method": rc.method,
        "recompute_num_layers": rc.num_layers or None,
    }


def cuda_peak(fn) -> int:
    """Peak bytes torch's CUDA allocator holds during `fn()` above what it held before."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def stage_activation_cases(args: argparse.Namespace, rt: Runtime) -> None:
    """Each SP_CASES case on one stage of tp = world ranks: the CPU peak of one micro-batch's forward and backward
    on this rank (after a first step, so that grads and megatron's all-gather buffer exist), and the estimate."""
    tp, (micro, seq) = rt.world_size, (ACT["micro"], ACT["seq"])
    cuda = rt.device.type == "cuda"  # tests/gpu/test_gpu.py: torch.cuda's peak, CUDA kernels, fp32 model moved over
    init_megatron_parallel_state(tp, 1)
    results = {}
    for case, (sp, rc) in SP_CASES.items():
        cfg = RunConfig(
            model=SP_MODEL,
            parallel=ParallelConfig(tp=tp, sequence_parallel=sp),
            train=TrainConfig(seq_length=seq, micro_batch_size=micro, **recompute_config(rc)),
        )
        module = pipeline_module(cfg, tp, fused_swiglu=rt.cuda_only.fused_swiglu).bfloat16().to(rt.device)
        module._precompute_checkpointable_values()
        tokens, labels = (t.to(rt.device) for t in next(synthetic_batches(SP_MODEL.vocab_size, micro, seq, n=1)))
        module.loss_fn(module(tokens), labels).backward()

        def step() -> None:
            logits = module(tokens)  # kept until backward ends, as the pipeline engine keeps its outputs  # noqa: F821 (bound in the loop; ruff sees its `del` below)
            module.loss_fn(logits, labels).backward()  # noqa: F821
            del logits

        # The least of three peaks: a collective's buffers are freed a little earlier or later depending on when
        # the other rank arrives, which moves single peaks by up to a block's activations (upwards only).
        measured = min(cuda_peak(step) if cuda else cpu_peak(step) for _ in range(3))
        stage = Stage(index=0, blocks=SP_MODEL.num_layers, first=True, last=True)
        max_param = max(p.numel() for p in module.parameters())
        estimate = stage_activations(SP_MODEL, tp, 1, stage, micro, 1, seq, rc, rt.device.type, max_param, sp)
        logits = 2 * micro * seq * SP_MODEL.padded_vocab_size(tp) // tp  # kept by `step`, as in `activations`
        results[case] = {"measured": measured, "estimate_cpu_kernels": estimate + logits}
        del module
        gc.collect()
    rank_json(args.out, "stage_activations", results)


def context_parallel_cases(args: argparse.Namespace, rt: Runtime) -> None:
    """One stage (tp 1, pp 1) at the same rows first at cp 1 (each rank the whole rows; dp = the world), then at cp 2
    (each rank its share: 2 of 4 chunks of every row): the CPU peak of one micro-batch's forward and backward on this
    rank, as `stage_activation_cases` measures it, next to the estimate (tests/ranks/test_memory_cp.py)."""
    micro, seq = ACT["micro"], ACT["seq"]
    tokens_full, labels_full = next(synthetic_batches(SP_MODEL.vocab_size, micro, seq, n=1))
    results = {}
    for cp in (1, 2):
        init_megatron_parallel_state(1, 1, cp=cp)
        cfg = RunConfig(
            model=SP_MODEL, parallel=ParallelConfig(cp=cp), train=TrainConfig(seq_length=seq, micro_batch_size=micro)
        )
        module = pipeline_module(cfg, rt.world_size).bfloat16()
        module._precompute_checkpointable_values()
        rank = context_rank(rt.rank, 1, cp)
        tokens, labels = (context.split(t, cp, rank) for t in (tokens_full, labels_full))
        module.loss_fn(module(tokens), labels).backward()

        def step() -> None:
            logits = module(tokens)  # kept until backward ends, as the pipeline engine keeps its outputs  # noqa: F821 (bound in the loop; ruff sees its `del` below)
            module.loss_fn(logits, labels).backward()  # noqa: F821
            del logits

        # One step: `stage_activation_cases` takes the least of three for its collectives' temporaries, and this one
        # process has none, so its allocations repeat exactly (2026-11-29: three peaks of 28037128 B at 8 chunks)
        measured = cpu_peak(step)
        max_param = max(p.numel() for p in module.parameters())
        results[f"cp{cp}"] = {"measured": measured, "max_param": max_param}
        del module
        gc.collect()
        dist.barrier()
    rank_json(args.out, "cp_activations", results)


def head_chunk_cases(args: argparse.Namespace) -> None:
    """HEAD_MODEL's one stage (tp 1, bf16) with the whole logits and with HEAD["chunks"] chunks: the CPU peak of one
    micro-batch's forward and backward, the output let go once the loss is made (threed.parallel.lean_engine), next to
    `stage_activations` with CPU kernels (`head_chunks`)."""
    init_megatron_parallel_state(1, 1)
    micro, seq = HEAD["micro"], HEAD["seq"]
    tokens, labels = next(synthetic_batches(HEAD_MODEL.vocab_size, micro, seq, n=1))
    results = {}
    for chunks in (1, HEAD["chunks"]):
        cfg = RunConfig(
            model=HEAD_MODEL, train=TrainConfig(seq_length=seq, micro_batch_size=micro, lm_head_chunks=chunks)
        )
        module = pipeline_module(cfg, 1).bfloat16()
        module._precompute_checkpointable_values()
        module.loss_fn(module(tokens), labels).backward()  # grads now exist: backward adds into them

        def step() -> None:
            # the output goes once the loss is made, as the engine lets it go
            module.loss_fn(module(tokens), labels).backward()  # noqa: F821 (bound in the loop; ruff sees its `del`)

        # One step: `stage_activation_cases` takes the least of three for its collectives' temporaries, and this one
        # process has none, so its allocations repeat exactly (2026-11-29: three peaks of 28037128 B at 8 chunks)
        measured = cpu_peak(step)
        stage = Stage(index=0, blocks=HEAD_MODEL.num_layers, first=True, last=True)
        max_param = max(p.numel() for p in module.parameters())
        estimate = stage_activations(
            HEAD_MODEL, 1, 1, stage, micro, 1, seq, False, "cpu", max_param, head_chunks=chunks
        )
        results[str(chunks)] = {"measured": measured, "estimate_cpu_kernels": estimate}
        del module
        gc.collect()
    write_json(args.out / "head_chunks.json", results)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", nargs="*", default=[], help="TPxPP, e.g. 2x2")
    p.add_argument("--activations", action="store_true", help="also the CPU activation peak (one process)")
    p.add_argument(
        "--stage-activations", action="store_true", help="the CPU activation peak of each SP_CASES case, tp = the world"
    )
    p.add_argument(
        "--cp-activations", action="store_true", help="the CPU activation peak at cp 1 and cp 2 (tp 1 pp 1, 2 ranks)"
    )
    p.add_argument(
        "--head-chunks", action="store_true", help="the CPU activation peak with and without --lm-head-chunks"
    )
    p.add_argument(
        "--lora-layouts", nargs="*", default=[], help=f"TPxPP engines with --lora-rank {LORA_RANK} (static terms)"
    )
    p.add_argument("--sequence-parallel", action="store_true", help="the --layouts engines with SP")
    p.add_argument("--pipeline-schedule", default="1f1b", help="the --layouts engines' schedule")
    p.add_argument(
        "--model",
        default=STATIC["model"],
        help="preset of the --layouts engines (tests/ranks/test_memory_tied.py: tiny-tied)",
    )


def main(args: argparse.Namespace, rt: Runtime) -> None:
    static(args, rt)
    if args.activations:
        activations(args)
    if args.stage_activations:
        stage_activation_cases(args, rt)
    if args.cp_activations:
        context_parallel_cases(args, rt)
    if args.head_chunks:
        head_chunk_cases(args)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
