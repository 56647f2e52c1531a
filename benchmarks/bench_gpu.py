"""threed on one GPU against what a user would otherwise run there: HF `LlamaForCausalLM` with bf16 autocast and
torch's fused AdamW. Why: the CPU benchmarks say the code paths run; this says what the single-GPU path costs
(kernels, memory, step time) before anyone trusts a multi-GPU number built on it.

Each run in a process of its own, one after the other, on the same random tokens (why: the first GPU call,
2026-11-26, found 24 GB still allocated after each threed run in a shared process, so HF at seq 8192 ran out of
memory): threed at tp1 pp1 dp1 (bf16, fp32
master weights and gradient accumulation, ZeRO-1, fused AdamW; `threed.engine.build.build_engine`, a world of one
without torchrun) and HF of the same shape (built from the config, random init, fp32 weights under bf16 autocast,
loss on fp32 logits, gradient clipping, fused AdamW). Llama-3.2-1B's shape (preset `llama3.2-1b`, random init,
nothing downloaded), seq 4096 and 8192, 32K tokens per step (micro 1, gas = 32K / seq), with and without
activation checkpointing (threed: every block recomputed; HF: gradient_checkpointing_enable, non-reentrant).

Reported per run: tokens/s, TFLOP/s and MFU in threed's one FLOP convention
(`threed.model.spec.training_flops_per_token`: model FLOPs, recompute not credited, as Megatron-LM's MFU) against
the GPU's dense bf16 peak (`threed.metrics.flops`' table, or --peak-tflops); the peak of
`torch.cuda.max_memory_allocated` over the timed steps above what was allocated before the run, next to the
memory model's estimate for the same layout (`threed.memory.model.estimate`, what `threed memory` prints); and
which kernels ran (the SDPA ops of a profiled step, megatron's fused SwiGLU compiled or not). Ratios come from one
run; nothing is asserted.

    python benchmarks/bench_gpu.py [--json out.json] [--budget-s 180] [--peak-tflops 989] [--runs hf:8192:off,...]
    python benchmarks/bench_gpu.py --tiny           (CPU, the `tiny` preset at seq 64 / 128; also with DRY=1)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

# First: it quiets the libraries' start-up noise before deepspeed and megatron-core are imported.
from threed.parallel.distributed import Runtime, init_distributed
from threed.config import ModelConfig, RunConfig, TrainConfig
from threed.memory.model import estimate
from threed.memory.recompute import Recompute
from threed.metrics.flops import peak_tflops_per_device
from threed.convert.resolve import model_config
from threed.model.spec import training_flops_per_token

FULL = dict(model="llama3.2-1b", seqs=(4096, 8192), tokens=32768, steps=3, warmup=2)
TINY = dict(model="tiny", seqs=(64, 128), tokens=512, steps=2, warmup=1)
SDPA_OPS = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|varlen", re.I)
COMPILED = re.compile(r"Torch-Compiled Region|CompiledFunction")


def plan(seqs: tuple[int, ...], only: str = "") -> list[tuple[str, int, bool]]:
    """(impl, seq, activation checkpointing), the most telling first: a budget cuts the tail. `only` keeps the runs
    it names, `impl:seq:on|off` comma-separated (a rerun of what a first call missed)."""
    runs = [(impl, seq, ac) for ac in (False, True) for seq in seqs for impl in ("threed", "hf")]
    if not only:
        return runs
    keep = {run_key(*run) for run in runs} & set(only.split(","))
    return [run for run in runs if run_key(*run) in keep]


def run_key(impl: str, seq: int, ac: bool) -> str:
    return f"{impl}:{seq}:{'on' if ac else 'off'}"


def global_batch(vocab: int, rows: int, seq: int) -> torch.Tensor:
    """The same random tokens for both sides: [rows, seq + 1] (inputs and shifted labels)."""
    return torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(0))


def micro_batches(tokens: torch.Tensor, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens.split(micro)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def kernels_of(step: Callable[[], float]) -> dict[str, Any]:
    """One profiled step (CPU activity: the aten ops dispatched): which SDPA ops ran, and compiled regions."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = [e.key for e in prof.key_averages()]
    return {
        "sdpa_ops": sorted(n for n in names if SDPA_OPS.search(n)),
        "compiled_regions": sorted(n for n in names if COMPILED.search(n)),
    }


def measure(step: Callable[[], float], steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """Warm-up steps (the first compiles megatron's SwiGLU), then `steps` timed ones; CUDA peak over those."""
    t0 = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    sync(device)
    warm_s = time.perf_counter() - t0
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if cuda else None
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        losses.append(step())
        sync(device)
        times.append(time.perf_counter() - t)
    return {
        "warmup_s": round(warm_s, 3),
        "step_s": [round(t, 4) for t in times],
        "median_step_s": statistics.median(times),
        "losses": [round(x, 4) for x in losses],
        "held_after_warmup_bytes": held,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }


def threed_run(m: ModelConfig, seq: int, micro: int, gas: int, ac: bool, rt: Runtime, tokens) -> dict[str, Any]:
    from threed.engine.build import build_engine
    from threed.engine.resolved import resolve

    cfg = RunConfig(
        model=m,
        train=TrainConfig(
            dtype="bf16",
            micro_batch_size=micro,
            grad_accum_steps=gas,
            seq_length=seq,
            steps=10**6,
            lr=1e-4,
            min_lr=1e-5,
            activation_checkpointing=ac,
        ),
    )
    t0 = time.perf_counter()
    engine = build_engine(resolve(cfg, rt.world_size), rt).engine
    build_s = time.perf_counter() - t0
    batches = micro_batches(tokens, micro)

    def step() -> float:
        return float(engine.train_batch(data_iter=iter(batches)))

    blocks = [f for f in engine.module.forward_funcs if type(f).__name__ == "LlamaBlock"]
    from megatron.core.fusions import fused_bias_swiglu  # heavy: megatron, already imported by the engine

    info = {
        "build_s": round(build_s, 2),
        "fused_swiglu": bool(blocks and blocks[0].mlp.config.bias_activation_fusion),
        "swiglu_torch_compiled": hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"),
        "optimizer": type(engine.optimizer).__name__,
    }
    mem = estimate(m, 1, 1, 1, micro, gas, seq, Recompute.from_train(cfg.train), device=rt.device.type)[0]
    info["estimate"] = {
        "peak_bytes": mem.peak,
        "static_bytes": mem.static,
        "phase": mem.phase[0],
        "phase_bytes": mem.phase[1],
        "line": mem.line(1),
    }
    return {**info, "step": step, "engine": engine}


def hf_run(m: ModelConfig, seq: int, micro: int, gas: int, ac: bool, device: torch.device, tokens) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from threed.hf.config import to_hf_config

    t0 = time.perf_counter()
    with torch.device(device):  # built and initialised on the GPU itself
        model = LlamaForCausalLM(LlamaConfig(**to_hf_config(m), attn_implementation="sdpa")).train()
    if ac:  # transformers 5.23 renamed gradient_checkpointing_enable; the image's 5.17 may not have the new name
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True if device.type == "cuda" else None)
    build_s = time.perf_counter() - t0
    batches = micro_batches(tokens, micro)

    def step() -> float:
        total = torch.zeros((), device=device)
        for x, y in batches:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(input_ids=x.to(device, non_blocking=True)).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.to(device).view(-1)) / len(batches)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    info = {"build_s": round(build_s, 2), "attn_implementation": model.config._attn_implementation}
    return {**info, "step": step, "engine": (model, opt)}


def one_run(impl: str, seq: int, ac: bool, a: argparse.Namespace, m: ModelConfig, rt: Runtime) -> dict[str, Any]:
    micro = a.micro
    gas = max(1, a.tokens // (seq * micro))
    tokens = global_batch(m.vocab_size, micro * gas, seq)
    cuda = rt.device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else None
    built = (
        threed_run(m, seq, micro, gas, ac, rt, tokens)
        if impl == "threed"
        else hf_run(m, seq, micro, gas, ac, rt.device, tokens)
    )
    step, owner = built.pop("step"), built.pop("engine")
    r = {"impl": impl, "seq": seq, "micro": micro, "gas": gas, "activation_checkpointing": ac, **built}
    r.update(measure(step, a.steps, a.warmup, rt.device))
    r["kernels"] = kernels_of(step)
    tokens_per_s = micro * gas * seq / r["median_step_s"]
    tflops = training_flops_per_token(m, seq, 1) * tokens_per_s / 1e12
    r.update(tokens_per_s=round(tokens_per_s, 1), tflops=float(f"{tflops:.4g}"))
    r["mfu"] = round(tflops / a.peak, 4) if a.peak else None
    if cuda:
        r["peak_above_start_bytes"] = r["peak_bytes"] - before
    if hasattr(owner, "destroy"):
        owner.destroy()  # DeepSpeed: its gradient hooks hold the parameters otherwise
    del owner, step
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        r["left_allocated_bytes"] = torch.cuda.memory_allocated() - before
    return r


def line(r: dict[str, Any]) -> str:
    if "error" in r or "skipped" in r:
        return f"{r['impl']:>6} seq {r['seq']} ac {'on ' if r['activation_checkpointing'] else 'off'}: " + str(
            r.get("error") or r.get("skipped")
        )
    gb = r.get("peak_above_start_bytes")
    mem = f", peak {gb / 2**30:.1f} GiB" if gb is not None else ""
    if "estimate" in r:
        mem += f" (estimate {r['estimate']['peak_bytes'] / 2**30:.1f} GiB)"
    mfu = f", MFU {r['mfu']:.3f}" if r.get("mfu") is not None else ""
    return (
        f"{r['impl']:>6} seq {r['seq']} ac {'on ' if r['activation_checkpointing'] else 'off'}: "
        f"{r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.3g} TFLOP/s{mfu}{mem}; sdpa {r['kernels']['sdpa_ops']}"
    )


def ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """threed / HF per (seq, activation checkpointing): tokens/s and peak memory; threed's peak / its estimate."""
    done = {(r["impl"], r["seq"], r["activation_checkpointing"]): r for r in runs if "tokens_per_s" in r}
    out: dict[str, Any] = {}
    for (impl, seq, ac), r in done.items():
        key = f"seq{seq}_ac{'on' if ac else 'off'}"
        hf = done.get(("hf", seq, ac))
        if impl == "threed" and hf:
            out[f"{key}_threed_over_hf_tokens_per_s"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 3)
            if r.get("peak_above_start_bytes") and hf.get("peak_above_start_bytes"):
                out[f"{key}_threed_over_hf_peak_memory"] = round(
                    r["peak_above_start_bytes"] / hf["peak_above_start_bytes"], 3
                )
        if impl == "threed" and r.get("peak_above_start_bytes"):
            out[f"{key}_threed_measured_over_estimate"] = round(
                r["peak_above_start_bytes"] / r["estimate"]["peak_bytes"], 3
            )
    return out


def arguments(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized: the tiny preset at seq 64/128 (also DRY=1)")
    p.add_argument("--json", type=Path, help="write the results here (after every run)")
    p.add_argument("--budget-s", type=float, default=0, help="skip the runs that would end past this (0: none)")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: threed.metrics.flops)")
    p.add_argument("--micro", type=int, default=1, help="sequences per micro-batch (gas = tokens / (seq x micro))")
    p.add_argument("--seqs", help="comma-separated sequence lengths (default 4096,8192; tiny 64,128)")
    p.add_argument("--runs", default="", help="only these runs, impl:seq:on|off comma-separated (default all)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # impl:seq:on|off: one run in this process, its JSON to --json
    a = p.parse_args(argv)
    shape = TINY if a.tiny or os.environ.get("DRY") == "1" else FULL
    a.tiny = shape is TINY
    a.model, a.tokens, a.steps, a.warmup = shape["model"], shape["tokens"], shape["steps"], shape["warmup"]
    a.seqs = tuple(int(s) for s in a.seqs.split(",")) if a.seqs else shape["seqs"]
    if not a.tiny and not torch.cuda.is_available():
        p.error("no CUDA GPU visible: the 1B shape is for a GPU; use --tiny (or DRY=1) on CPU")
    if min(a.seqs) < 1 or a.micro < 1:
        p.error("--seqs and --micro must be positive integers")
    return a


def child(a: argparse.Namespace) -> int:
    """One run in this process (`--child impl:seq:on|off`); its result, or its error, to --json."""
    impl, seq, ac = a.child.split(":")
    stub = {"impl": impl, "seq": int(seq), "activation_checkpointing": ac == "on"}
    rt = init_distributed()
    a.peak = a.peak_tflops or peak_tflops_per_device()
    try:
        r = one_run(impl, int(seq), ac == "on", a, model_config(a.model), rt)
    except Exception as e:  # an OOM or a kernel missing on this GPU: say which; the parent goes on with the next run
        r = {**stub, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    a.json.write_text(json.dumps(r) + "\n")
    return 0


def spawn(impl: str, seq: int, ac: bool, a: argparse.Namespace, argv: list[str], limit: Optional[float]) -> dict:
    """One run in a fresh process: nothing a previous run left allocated (DeepSpeed's engine, compiled graphs)
    weighs on its memory or speed."""
    stub = {"impl": impl, "seq": seq, "activation_checkpointing": ac}
    out = Path(a.json or "bench_gpu.json").with_suffix(f".{impl}-{seq}-{'on' if ac else 'off'}.json")
    cmd = [sys.executable, __file__, *argv, "--child", run_key(impl, seq, ac), "--json", str(out)]
    try:
        proc = subprocess.run(cmd, timeout=limit, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired:
        return {**stub, "error": f"timed out after {limit:.0f} s"}
    if not out.exists():
        tail = proc.stdout.strip().splitlines()[-3:]
        return {**stub, "error": f"the run's process exited {proc.returncode} with no result: {' | '.join(tail)}"}
    r = json.loads(out.read_text())
    out.unlink()
    return r


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = arguments(argv)
    if a.child:
        return child(a)
    a.peak = a.peak_tflops or peak_tflops_per_device()
    m = model_config(a.model)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not a.tiny else "cpu"
    result: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "model": a.model,
        "tokens_per_step": a.tokens,
        "peak_tflops": a.peak,
        "flops_per_token": {str(s): training_flops_per_token(m, s, 1) for s in a.seqs},
        "flops_convention": "threed.model.spec.training_flops_per_token (model FLOPs; recompute not credited)",
        "isolation": "each run in its own process",
        "runs": [],
    }
    print(f"bench_gpu: {a.model} on {device} (peak {a.peak} TFLOP/s), {a.tokens} tokens per step", flush=True)
    start, took = time.perf_counter(), {}  # impl -> seconds of its last run: what the next one is expected to take
    for impl, seq, ac in plan(a.seqs, a.runs):
        expect = took.get(impl, max(took.values(), default=0.0))
        left = a.budget_s - (time.perf_counter() - start) if a.budget_s else None
        if left is not None and left < expect:
            r = {"impl": impl, "seq": seq, "activation_checkpointing": ac}
            r["skipped"] = f"the {a.budget_s:.0f} s budget would run out (a run takes ~{expect:.0f} s)"
        else:
            t0 = time.perf_counter()
            r = spawn(impl, seq, ac, a, argv, left)
            took[impl] = r["seconds"] = round(time.perf_counter() - t0, 1)
        result["runs"].append(r)
        result["ratios"] = ratios(result["runs"])
        print(line(r), flush=True)
        if a.json:
            a.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result.get("ratios", {}), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
