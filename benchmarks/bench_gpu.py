"""threed on one GPU against what a user would otherwise run there: HF `LlamaForCausalLM` with bf16 autocast and
torch's fused AdamW. Why: the CPU benchmarks say the code paths run; this says what the single-GPU path costs
(kernels, memory, step time) before anyone trusts a multi-GPU number built on it.

Each run in a process of its own, one after the other, on the same random tokens (why: the first GPU call,
2026-11-26, found 24 GB still allocated after each threed run in a shared process, so HF at seq 8192 ran out of
memory): threed at tp1 pp1 dp1 (bf16, fp32
master weights and gradient accumulation, ZeRO-1, fused AdamW; `threed.engine.build.build_engine`, a world of one
without torchrun) and HF of the same shape (built from the config, random init, fp32 weights under bf16 autocast,
loss on fp32 logits, gradient clipping, fused AdamW). Llama-3.2-1B's shape (preset `llama3.2-1b`, random init,
nothing downloaded), seq 4096 and 8192, 32K tokens per step (micro 1, gas = 32K / seq), and micro-batch 2 at seq
4096 (gas 4: the same tokens and FLOPs per step as micro 1's gas 8, half the micro-batches, so the two differ only
by the per-micro-batch cost, which the planner's step-time model fits beside its FLOP rates), with and without
activation checkpointing (threed: every block recomputed; HF: gradient_checkpointing_enable, non-reentrant).
Then threed's opt-in speed flags at the shortest length, each alone against the same run without it (`VARIANTS`:
`--lm-head-chunks 8`, `--torch-compile rope-norm`; `--torch-compile block` only when named): they are measured
here and kept out of the step-time fit, whose rates describe the default path that `threed plan` assumes.

Reported per run: tokens/s, TFLOP/s and MFU in both of threed's FLOP conventions
(`threed.model.spec.training_flops_per_token`: model FLOPs, recompute not credited; attention over the full square
as torchtitan, and `_causal` over its half as Megatron-LM today) against the GPU's dense bf16 peak
(`threed.metrics.flops`' table, or --peak-tflops); the peak of `torch.cuda.max_memory_allocated` over the timed
steps above what was allocated before the run, next to the memory model's estimate for the same layout
(`threed.memory.model.estimate`, what `threed memory` prints); and which kernels ran (the SDPA ops of a profiled
step, megatron's fused SwiGLU compiled or not). Ratios come from one run; nothing is asserted. After every run,
the planner's step-time model fitted to threed's runs so far (`fit`: `threed.plan.calibration`, matmul and
attention rates and the per-micro-batch cost, as `threed plan --calibrate` fits them).

`--profile` (the profile phase of `tools/gpu_check.sh`) instead builds threed at the shortest length, micro 1, and
runs `torch.profiler` (CPU, and CUDA on a GPU) over `--profile-steps` steps after the warm-up: the top kernels by
device time and the device's idle holes within a step (`threed.metrics.trace`), written to --json.

    python benchmarks/bench_gpu.py [--json out.json] [--budget-s 180] [--peak-tflops 989] [--runs hf:8192:off,...]
    python benchmarks/bench_gpu.py --runs threed:4096:off,threed:4096:off:chunks8   (one flag against its base)
    python benchmarks/bench_gpu.py --tiny           (CPU, the `tiny` preset at seq 64 / 128; also with DRY=1)
    python benchmarks/bench_gpu.py --profile [--tiny] [--profile-steps 2] --json profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
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
from threed.config import ConfigError, ModelConfig, RunConfig, TrainConfig
from threed.memory.model import estimate
from threed.memory.recompute import Recompute
from threed.metrics.flops import peak_tflops_per_device
from threed.convert.resolve import model_config
from threed.data.loader import on_device
from threed.train.host_gc import StepCollector
from threed.metrics.trace import Span, idle_gaps, top_kernels
from threed.model.spec import ATTENTION, training_flops_per_token
from threed.plan import calibration
from threed.plan.steptime import Hardware

FULL = dict(model="llama3.2-1b", seqs=(4096, 8192), tokens=32768, steps=3, warmup=2)
TINY = dict(model="tiny", seqs=(64, 128), tokens=512, steps=2, warmup=1)
SDPA_OPS = re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|varlen", re.I)
COMPILED = re.compile(r"Torch-Compiled Region|CompiledFunction")
STEP_MARK = "threed_profile_step"  # the record_function around each profiled step: the step windows
WORK = {"cpu_op", "kernel", "gpu_memcpy", "gpu_memset"}  # the profiler's activity types that are device work
# The hardware the fit subtracts the once-per-step terms with: one GPU (dp 1: no DP all-reduce, no tied-weight
# one) at the planner's default bandwidths, not the measured device's. Only the optimizer's pass over the weights
# depends on it: 17.7 ms of the H200's ~780 ms 1B step at the default 3,350 GB/s, 12.4 ms at an H200's 4,800, and
# the 2026-11-28 runs fitted at 4,800 give R_mm 619 TFLOP/s and c 36.4 ms against 623 and 36.1: under 1%. It is the
# hardware the default rates were fitted with, so the benchmark's fit of those runs is `DEFAULT_RATES`.
FIT_HARDWARE = Hardware(nodes=1, gpus_per_node=1, gpu_memory_gb=80)
# threed's opt-in speed flags (issue 35's "behind a flag and measured"): a run key's last part names one, and the
# run sets these TrainConfig fields. chunks8: the LM head and cross-entropy over 8 chunks of tokens, so the logits
# are never whole (8 divides every length the bench runs, 64 to 8192); rope-norm / block: `--torch-compile`.
VARIANTS: dict[str, dict[str, Any]] = {
    "chunks8": {"lm_head_chunks": 8},
    "rope-norm": {"torch_compile": "rope-norm"},
    "block": {"torch_compile": "block"},
}
DEFAULT_VARIANTS = ("chunks8", "rope-norm")  # "block" compiles for ~1 min per run on a GPU: only when named
Run = tuple[str, int, bool, int, str]  # impl, seq, activation checkpointing, micro, variant ("": the default path)


def plan(seqs: tuple[int, ...], only: str = "") -> list[Run]:
    """(impl, seq, activation checkpointing, micro, variant), the most telling first: a budget cuts the tail.
    threed's micro-batch 2 at the shortest length (what parts the fit's per-micro-batch cost from its rates) comes
    before HF's longest run; then the opt-in flags at the shortest length (DEFAULT_VARIANTS: each against the
    default path's run of the same shape, measured first), then the recompute runs. `only` keeps the runs it
    names, `impl:seq:on|off[:mb2][:VARIANT]` comma-separated (a rerun of what a first call missed), from
    `nameable`."""
    off: list[Run] = [(impl, seq, False, 1, "") for seq in seqs for impl in ("threed", "hf")]
    off.insert(len(off) - 1 if len(seqs) > 1 else len(off), ("threed", min(seqs), False, 2, ""))
    flags: list[Run] = [("threed", min(seqs), False, 1, v) for v in DEFAULT_VARIANTS]
    runs = off + flags + [(impl, seq, True, 1, "") for seq in seqs for impl in ("threed", "hf")]
    if not only:
        return runs
    keep = set(only.split(","))
    return [run for run in nameable(runs, seqs) if run_key(*run) in keep]


def nameable(runs: list[Run], seqs: tuple[int, ...]) -> list[Run]:
    """The default plan, then what runs only when named: HF's micro 2, every flag at every length, with and
    without recompute (the block compile among them)."""
    extra = [("hf", min(seqs), False, 2, "")] + [
        ("threed", seq, ac, 1, v) for seq in seqs for ac in (False, True) for v in VARIANTS
    ]
    return runs + [run for run in extra if run not in runs]


def run_key(impl: str, seq: int, ac: bool, micro: int = 1, variant: str = "") -> str:
    return (
        f"{impl}:{seq}:{'on' if ac else 'off'}"
        + (f":mb{micro}" if micro != 1 else "")
        + (f":{variant}" * bool(variant))
    )


def parse_key(key: str) -> Run:
    impl, seq, ac, *rest = key.split(":")
    micro = int(rest.pop(0).removeprefix("mb")) if rest and rest[0].startswith("mb") else 1
    return impl, int(seq), ac == "on", micro, rest[0] if rest else ""


def global_batch(vocab: int, rows: int, seq: int) -> torch.Tensor:
    """The same random tokens for both sides: [rows, seq + 1] (inputs and shifted labels)."""
    return torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(0))


def micro_batches(tokens: torch.Tensor, micro: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens.split(micro)]


class NoMetrics:
    """Where the bench's StepCollector sends its per-step figures: nowhere (the bench writes its own JSON)."""

    def log(self, *args: Any, **kwargs: Any) -> None:
        pass


NO_METRICS = NoMetrics()


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


def threed_run(
    m: ModelConfig, seq: int, micro: int, gas: int, ac: bool, rt: Runtime, tokens, variant: str = ""
) -> dict[str, Any]:
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
            **VARIANTS.get(variant, {}),
        ),
    )
    t0 = time.perf_counter()
    engine = build_engine(resolve(cfg, rt.world_size), rt).engine
    build_s = time.perf_counter() - t0
    batches = micro_batches(tokens, micro)
    # As the training loop steps (threed.train.loop): the step's micro-batches reach the device in one pinned,
    # non-blocking copy per tensor, and Python's collector runs at step boundaries only (off and frozen between).
    collector = StepCollector(rt.device, log_interval=1).__enter__()

    def step() -> float:
        staged = on_device(batches, rt.device, rt.cuda_only.pinned_batches)
        loss = float(engine.train_batch(data_iter=iter(staged)))
        collector.after_step(1, NO_METRICS)
        return loss

    blocks = [f for f in engine.module.forward_funcs if type(f).__name__ == "LlamaBlock"]
    from megatron.core.fusions import fused_bias_swiglu  # heavy: megatron, already imported by the engine

    info = {
        "build_s": round(build_s, 2),
        "fused_swiglu": bool(blocks and blocks[0].mlp.config.bias_activation_fusion),
        "swiglu_torch_compiled": hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"),
        "optimizer": type(engine.optimizer).__name__,
        # What the engine's head was built with (a tied head is DeepSpeed's partial of TiedLMHead), not the flag
        "lm_head_chunks": getattr(engine.module.forward_funcs[-1], "func", engine.module.forward_funcs[-1]).loss_chunks,
    }
    recompute, chunks = Recompute.from_train(cfg.train), cfg.train.lm_head_chunks
    mem = estimate(m, 1, 1, 1, micro, gas, seq, recompute, device=rt.device.type, head_chunks=chunks)[0]
    info["estimate"] = {
        "peak_bytes": mem.peak,
        "static_bytes": mem.static,
        "phase": mem.phase[0],
        "phase_bytes": mem.phase[1],
        "line": mem.line(1),
    }
    return {**info, "step": step, "engine": engine, "collector": collector}


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


def one_run(run: Run, a: argparse.Namespace, m: ModelConfig, rt: Runtime) -> dict[str, Any]:
    impl, seq, ac, micro, variant = run
    gas = max(1, a.tokens // (seq * micro))
    tokens = global_batch(m.vocab_size, micro * gas, seq)
    cuda = rt.device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else None
    built = (
        threed_run(m, seq, micro, gas, ac, rt, tokens, variant)
        if impl == "threed"
        else hf_run(m, seq, micro, gas, ac, rt.device, tokens)
    )
    step, owner, collector = built.pop("step"), built.pop("engine"), built.pop("collector", None)
    r = {**stub_of(run), "gas": gas, **built}
    r.update(measure(step, a.steps, a.warmup, rt.device))
    r["kernels"] = kernels_of(step)
    tokens_per_s = micro * gas * seq / r["median_step_s"]
    r["tokens_per_s"] = round(tokens_per_s, 1)
    for attention in ATTENTION:  # tflops, mfu: the full square; tflops_causal, mfu_causal: its half
        tflops = training_flops_per_token(m, seq, 1, attention) * tokens_per_s / 1e12
        suffix = "" if attention == "full" else f"_{attention}"
        r["tflops" + suffix] = float(f"{tflops:.4g}")
        r["mfu" + suffix] = round(tflops / a.peak, 4) if a.peak else None
    if cuda:
        r["peak_above_start_bytes"] = r["peak_bytes"] - before
    if hasattr(owner, "destroy"):
        owner.destroy()  # DeepSpeed: its gradient hooks hold the parameters otherwise
    del owner, step
    if collector is not None:
        collector.__exit__(None, None, None)  # the collector back on for the next run
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        r["left_allocated_bytes"] = torch.cuda.memory_allocated() - before
    return r


def stub_of(run: Run) -> dict[str, Any]:
    """What names a run in the JSON (a result, an error or a skip): `variant` only for an opt-in flag's run."""
    impl, seq, ac, micro, variant = run
    return {"impl": impl, "seq": seq, "activation_checkpointing": ac, "micro": micro} | (
        {"variant": variant} if variant else {}
    )


def line(r: dict[str, Any]) -> str:
    flag = f" [{r['variant']}]" if r.get("variant") else ""
    head = (
        f"{r['impl']:>6} seq {r['seq']} mb {r.get('micro', 1)} ac {'on ' if r['activation_checkpointing'] else 'off'}"
        f"{flag}: "
    )
    if "error" in r or "skipped" in r:
        return head + str(r.get("error") or r.get("skipped"))
    gb = r.get("peak_above_start_bytes")
    mem = f", peak {gb / 2**30:.1f} GiB" if gb is not None else ""
    if "estimate" in r:
        mem += f" (estimate {r['estimate']['peak_bytes'] / 2**30:.1f} GiB)"
    mfu = f", MFU {r['mfu']:.3f} (causal {r['mfu_causal']:.3f})" if r.get("mfu") is not None else ""
    return (
        f"{head}{r['tokens_per_s']:.0f} tokens/s, {r['tflops']:.3g} TFLOP/s (causal {r['tflops_causal']:.3g})"
        f"{mfu}{mem}; sdpa {r['kernels']['sdpa_ops']}"
    )


def ratios(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """threed / HF per (seq, activation checkpointing, micro): tokens/s and peak memory; threed's peak / its
    estimate; an opt-in flag's run also over the default path's run of the same shape (`_over_default_`)."""
    done = {
        (r["impl"], r["seq"], r["activation_checkpointing"], r.get("micro", 1), r.get("variant", "")): r
        for r in runs
        if "tokens_per_s" in r
    }
    out: dict[str, Any] = {}
    for (impl, seq, ac, micro, variant), r in done.items():
        if impl != "threed":
            continue
        key = (
            f"seq{seq}_ac{'on' if ac else 'off'}"
            + (f"_mb{micro}" if micro != 1 else "")
            + f"_{variant}" * bool(variant)
        )
        against = [("threed_over_hf", done.get(("hf", seq, ac, micro, "")))]
        against += [("over_default", done.get(("threed", seq, ac, micro, "")))] if variant else []
        for name, other in against:
            if other:
                out[f"{key}_{name}_tokens_per_s"] = round(r["tokens_per_s"] / other["tokens_per_s"], 3)
                if r.get("peak_above_start_bytes") and other.get("peak_above_start_bytes"):
                    out[f"{key}_{name}_peak_memory"] = round(
                        r["peak_above_start_bytes"] / other["peak_above_start_bytes"], 3
                    )
        if r.get("peak_above_start_bytes"):
            out[f"{key}_threed_measured_over_estimate"] = round(
                r["peak_above_start_bytes"] / r["estimate"]["peak_bytes"], 3
            )
    return out


def step_fit(result: dict[str, Any]) -> dict[str, Any]:
    """The planner's step-time model fitted to the threed runs measured so far (`threed.plan.calibration`, what
    `threed plan --calibrate gpu_check.json` reads from the same runs): R_mm, R_attn on causal FLOPs, c per
    micro-batch, the constraint the fit took, and each run's predicted / measured - 1; or why there is no fit yet."""
    measured = calibration.from_bench_json(result, {}, Path("bench_gpu.json"))
    try:
        rates, how = calibration.calibrate(measured, FIT_HARDWARE)
    except ConfigError as e:
        return {"error": str(e)}
    fitted = dataclasses.replace(FIT_HARDWARE, rates=rates)
    return {
        "runs": [run_key("threed", r.seq, r.recompute, r.micro) for r in measured.runs],
        "mm_tflops": float(f"{rates.mm_tflops:.4g}"),
        "attn_tflops": float(f"{rates.attn_tflops:.4g}"),  # on causal attention FLOPs
        "per_micro_batch_ms": round(rates.micro_s * 1e3, 3),
        "how": how,
        "relative_errors": [round(calibration.predict(r, fitted) / r.step_s - 1, 4) for r in measured.runs],
    }


def arguments(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized: the tiny preset at seq 64/128 (also DRY=1)")
    p.add_argument("--json", type=Path, help="write the results here (after every run)")
    p.add_argument("--budget-s", type=float, default=0, help="skip the runs that would end past this (0: none)")
    p.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: threed.metrics.flops)")
    p.add_argument("--seqs", help="comma-separated sequence lengths (default 4096,8192; tiny 64,128)")
    p.add_argument("--runs", default="", help="only these runs, impl:seq:on|off[:mb2] comma-separated (default all)")
    p.add_argument("--profile", action="store_true", help="profile threed at the shortest length instead (--json)")
    p.add_argument("--profile-steps", type=int, default=2, help="steps under torch.profiler after the warm-up")
    p.add_argument("--child", help=argparse.SUPPRESS)  # impl:seq:on|off[:mbN]: one run here, its JSON to --json
    a = p.parse_args(argv)
    shape = TINY if a.tiny or os.environ.get("DRY") == "1" else FULL
    a.tiny = shape is TINY
    a.model, a.tokens, a.steps, a.warmup = shape["model"], shape["tokens"], shape["steps"], shape["warmup"]
    a.seqs = tuple(int(s) for s in a.seqs.split(",")) if a.seqs else shape["seqs"]
    if not a.tiny and not torch.cuda.is_available():
        p.error("no CUDA GPU visible: the 1B shape is for a GPU; use --tiny (or DRY=1) on CPU")
    if min(a.seqs) < 1 or a.profile_steps < 1:
        p.error("--seqs and --profile-steps must be positive integers")
    if a.profile and not a.json:
        p.error("--profile writes its result to --json: name the file")
    unknown = sorted(set(a.runs.split(",")) - {"", *(run_key(*r) for r in nameable(plan(a.seqs), a.seqs))})
    if unknown and not a.child:
        p.error(
            f"--runs: no run {','.join(unknown)} at --seqs {','.join(map(str, a.seqs))}: name them as "
            f"impl:seq:on|off[:mb2][:VARIANT], VARIANT one of {', '.join(VARIANTS)}"
        )
    return a


def child(a: argparse.Namespace) -> int:
    """One run in this process (`--child impl:seq:on|off[:mbN]`); its result, or its error, to --json."""
    run = parse_key(a.child)
    rt = init_distributed()
    a.peak = a.peak_tflops or peak_tflops_per_device()
    try:
        r = one_run(run, a, model_config(a.model), rt)
    except Exception as e:  # an OOM or a kernel missing on this GPU: say which; the parent goes on with the next run
        r = {**stub_of(run), "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    a.json.write_text(json.dumps(r) + "\n")
    return 0


def spawn(key: str, a: argparse.Namespace, argv: list[str], limit: Optional[float]) -> dict:
    """One run in a fresh process: nothing a previous run left allocated (DeepSpeed's engine, compiled graphs)
    weighs on its memory or speed."""
    stub = stub_of(parse_key(key))
    out = Path(a.json or "bench_gpu.json").with_suffix("." + key.replace(":", "-") + ".json")
    cmd = [sys.executable, __file__, *argv, "--child", key, "--json", str(out)]
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


def profiled_spans(prof: Any, device_type: str) -> tuple[list[Span], list[tuple[float, float]]]:
    """The device's work (kernels, copies and memsets on a GPU; aten ops on the CPU) as spans in µs, and the
    windows of the steps marked STEP_MARK. Annotations (ours, DeepSpeed's, their GPU-side copies) are left out by
    activity type and by name, so that they neither count as work nor cover the device's idle holes."""
    from torch.autograd import DeviceType  # heavy: torch's profiler enums, imported with torch already

    want = DeviceType.CUDA if device_type == "cuda" else DeviceType.CPU
    events = prof.profiler.kineto_results.events()
    marks = {e.name() for e in events if e.is_user_annotation()}
    windows = [
        (e.start_ns() / 1e3, e.end_ns() / 1e3)
        for e in events
        if e.name() == STEP_MARK and e.device_type() == DeviceType.CPU
    ]
    spans = [
        Span(e.name(), e.start_ns() / 1e3, e.end_ns() / 1e3, (e.device_index(), e.device_resource_id()))
        for e in events
        if e.device_type() == want and e.name() not in marks and getattr(e, "activity_type", lambda: "cpu_op")() in WORK
    ]
    return spans, sorted(windows)


def profile_run(a: argparse.Namespace) -> dict[str, Any]:
    """threed at the shortest length, micro 1, as the bench builds it: warm-up steps, then `profile_steps` steps
    under torch.profiler, each marked and ended by a device sync; the trace read by `threed.metrics.trace`."""
    from torch.profiler import ProfilerActivity, profile, record_function  # heavy: torch's profiler

    rt = init_distributed()
    m, seq = model_config(a.model), min(a.seqs)
    gas = max(1, a.tokens // seq)
    built = threed_run(m, seq, 1, gas, False, rt, global_batch(m.vocab_size, gas, seq))
    step = built["step"]
    warm = [step() for _ in range(a.warmup)]
    sync(rt.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    times = []
    with profile(activities=activities) as prof:
        for _ in range(a.profile_steps):
            t = time.perf_counter()
            with record_function(STEP_MARK):
                step()
                sync(rt.device)
            times.append(round(time.perf_counter() - t, 4))
    t0 = time.perf_counter()
    spans, windows = profiled_spans(prof, rt.device.type)
    gaps = idle_gaps(spans, windows)
    return {
        "model": a.model,
        "seq": seq,
        "micro": 1,
        "gas": gas,
        "device": torch.cuda.get_device_name() if rt.device.type == "cuda" else "cpu",
        "warmup_losses": [round(x, 4) for x in warm],
        "profiled_step_s": times,  # under the profiler: slower than the bench's timed steps
        "device_spans": len(spans),
        "spans_per_micro_batch": round(len(spans) / max(1, len(windows)) / gas, 1),
        "top_kernels": top_kernels(spans),
        "gaps": gaps,
        "analysis_s": round(time.perf_counter() - t0, 2),
    }


def profile_main(a: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    try:
        r = profile_run(a)
    except Exception as e:  # an OOM or a profiler failure: say which in the JSON, the summary shows it
        r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    r["seconds"] = round(time.perf_counter() - t0, 1)
    a.json.write_text(json.dumps(r, indent=1) + "\n")
    for k in r.get("top_kernels", [])[:10]:
        print(f"  {k['share'] * 100:5.1f}%  {k['total_ms']:9.2f} ms  x{k['count']:<6} {k['name'][:100]}")
    print(json.dumps({k: v for k, v in r.items() if k != "top_kernels"}, indent=1), flush=True)
    return 0 if "error" not in r else 1


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = arguments(argv)
    if a.child:
        return child(a)
    if a.profile:
        return profile_main(a)
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
        "flops_per_token_causal": {str(s): training_flops_per_token(m, s, 1, "causal") for s in a.seqs},
        "flops_convention": "threed.model.spec.training_flops_per_token (model FLOPs; recompute not credited): "
        "tflops and mfu over the full attention square, tflops_causal and mfu_causal over its causal half",
        "isolation": "each run in its own process",
        "runs": [],
    }
    print(f"bench_gpu: {a.model} on {device} (peak {a.peak} TFLOP/s), {a.tokens} tokens per step", flush=True)
    start, took = time.perf_counter(), {}  # impl -> seconds of its last run: what the next one is expected to take
    for run in plan(a.seqs, a.runs):
        impl = run[0]
        expect = took.get(impl, max(took.values(), default=0.0))
        left = a.budget_s - (time.perf_counter() - start) if a.budget_s else None
        if left is not None and left < expect:
            r = stub_of(run) | {"skipped": f"the {a.budget_s:.0f} s budget would run out (a run takes ~{expect:.0f} s)"}
        else:
            t0 = time.perf_counter()
            r = spawn(run_key(*run), a, argv, left)
            took[impl] = r["seconds"] = round(time.perf_counter() - t0, 1)
        result["runs"].append(r)
        result["ratios"] = ratios(result["runs"])
        result["fit"] = step_fit(result)
        print(line(r), flush=True)
        if a.json:
            a.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"ratios": result.get("ratios", {}), "fit": result.get("fit", {})}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
