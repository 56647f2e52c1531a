"""One-GPU scenarios for tests/gpu/test_one_gpu.py: threed at tp1 pp1 dp1 in one process (a world of one, no
torchrun: one GPU cannot hold two NCCL ranks), every engine built one after another from HF's gqa31 weights, on
fixed micro-batches of learnable tokens. One process for all of them, because each launch costs imports and a
torch.compile of megatron's SwiGLU, and the device time is short. The pytest side computes the HF references.

    parity     fp32 and bf16 training, 5 steps (losses, gradient norms, the optimizer and whether AdamW is fused)
    resume     fp32 and bf16: 2 steps, threed's save, 2 more; a new engine resumes natively and runs the same 2
    recompute  fp32 and bf16: none, selective, full (every block) and block-1, 3 steps each, forward counts
    zb         fp32 and bf16, gas 4: DeepSpeed's 1F1B against the ZB-H1 engine forced at pp 1 (the weight-gradient
               split of threed.model.wgrad, which the config refuses at pp 1: nothing to fill there)
    packed     bf16 packed rows: logits of HF's weights, then 3 steps through varlen attention (on CUDA) and 3 with
               the block-causal SDPA mask forced, and how often varlen_attn ran

Each scenario's result (or its error, so that one failure does not hide the others) goes to OUT/one_gpu.json.

    THREED_DEVICE=cuda python tests/gpu/one_gpu_worker.py --out /tmp/g
    THREED_DEVICE=cpu python tests/gpu/one_gpu_worker.py --out /tmp/g --only parity,zb    (a CPU sanity check)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

TESTS = Path(__file__).resolve().parents[1]
for _path in (TESTS, TESTS / "ranks"):  # the shared helpers and the rank workers, wherever the tree keeps them
    if _path.is_dir() and str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import torch  # noqa: E402

import threed.checkpoint.save as ckpt  # noqa: E402
from helpers import hf_model, learnable_tokens, model_config  # noqa: E402
from recompute_worker import ForwardCounts  # noqa: E402
from threed.config import CheckpointConfig, DataConfig, RunConfig, TrainConfig  # noqa: E402
from threed.model.wgrad import DEFERRED  # noqa: E402
from threed.parallel.distributed import Runtime  # noqa: E402
from threed.parallel.zero_bubble import use_schedule  # noqa: E402
from worker_setup import build_engine  # noqa: E402
from threed.verify.logits import pipeline_logits  # noqa: E402
from worker_setup import load_hf_weights, run_worker  # noqa: E402

MODEL = "gqa31"  # tests/helpers.py: GQA 4/2, Llama 3.1 rope scaling, vocab 200, 4 blocks
SEQ, MICRO, GAS, STEPS = 128, 2, 2, 5
PACKED_ROWS = [[40, 17, 71], [128]]  # document lengths of the two rows of a packed micro-batch
RECOMPUTE: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": dict(recompute_granularity="selective"),
    "full": dict(activation_checkpointing=True),
    "block1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
}
DTYPES = ("fp32", "bf16")


def config(dtype: str, gas: int = GAS, steps: int = STEPS, pack: bool = False, **train: Any) -> RunConfig:
    """tp1 pp1; the learning-rate schedule and clipping (0.5: active in the first steps) of the CPU suite."""
    return RunConfig(
        model=model_config(MODEL),
        train=TrainConfig(
            dtype=dtype,
            micro_batch_size=MICRO,
            grad_accum_steps=gas,
            seq_length=SEQ,
            steps=steps,
            lr=1e-3,
            min_lr=1e-4,
            warmup_steps=2,
            grad_clip=0.5,
            **train,
        ),
        data=DataConfig(pack=pack),
    )


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` micro-batches (inputs, labels) `[MICRO, SEQ]` of learnable tokens: the loss falls from the first step."""
    rows = torch.from_numpy(learnable_tokens(n * MICRO * (SEQ + 1), seed=seed)).view(n * MICRO, SEQ + 1)
    return [(r[:, :-1].contiguous(), r[:, 1:].contiguous()) for r in rows.split(MICRO)]


def doc_ids() -> torch.Tensor:
    """`[MICRO, SEQ]` int32 document ids of a packed micro-batch (PACKED_ROWS)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in PACKED_ROWS]).to(
        torch.int32
    )


def packed_batches(n: int) -> list:
    ids = doc_ids()
    return [((x, ids), y) for x, y in batches(n, seed=1)]


def fresh(cfg: RunConfig, rt: Runtime, hf_state: dict):
    engine = build_engine(cfg, rt).engine
    load_hf_weights(engine, cfg, hf_state)
    return engine


def train(engine, data: list, start: int, stop: int, gas: int) -> dict[str, list[float]]:
    """Steps [start, stop): step k takes micro-batches [k gas, (k + 1) gas) of `data`."""
    losses, norms = [], []
    for step in range(start, stop):
        losses.append(engine.train_batch(data_iter=iter(data[step * gas : (step + 1) * gas])).item())
        norms.append(float(engine.get_global_grad_norm()))
    return {"losses": losses, "grad_norms": norms}


def torch_optimizer(engine) -> torch.optim.Optimizer:
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer  # inside DeepSpeed's BF16_Optimizer / ZeRO-1 wrapper
    return opt


def optimizer_facts(engine) -> dict[str, Any]:
    """The wrapper's name, whether AdamW is fused, and the device types its state tensors are on, per key."""
    opt = torch_optimizer(engine)
    places: dict[str, set] = {}
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                places.setdefault(key, set()).add(value.device.type)
    return {
        "optimizer": type(engine.optimizer).__name__,
        "fused": bool(opt.param_groups[0].get("fused")),
        "state_devices": {k: sorted(v) for k, v in places.items()},
    }


def done(engine) -> None:
    """Let an engine go before the next one is built (DeepSpeed's gradient hooks hold the parameters)."""
    engine.destroy()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parity(out: Path, rt: Runtime, hf_state: dict) -> dict:
    data = batches(STEPS * GAS)
    results = {}
    for dtype in DTYPES:
        engine = fresh(config(dtype), rt, hf_state)
        results[dtype] = {**train(engine, data, 0, STEPS, GAS), **optimizer_facts(engine)}
        done(engine)
    return results


def resume(out: Path, rt: Runtime, hf_state: dict) -> dict:
    """A native resume on the device: AdamW's state (fused on CUDA) must come back where the fused kernel wants it."""
    data = batches(4 * GAS)
    results = {}
    for dtype in DTYPES:
        save = out / f"ckpt_{dtype}"
        cfg = dataclasses.replace(config(dtype), checkpoint=CheckpointConfig(save=str(save), auto_resume=False))
        engine = fresh(cfg, rt, hf_state)
        train(engine, data, 0, 2, GAS)
        ckpt.save(engine, cfg, rt.rank, {"consumed_samples": 2 * GAS * MICRO})
        uninterrupted = train(engine, data, 2, 4, GAS)
        done(engine)
        built = build_engine(dataclasses.replace(config(dtype), checkpoint=CheckpointConfig(load=str(save))), rt)
        facts = {"start": built.engine.global_steps, "universal": bool(built.decision and built.decision.universal)}
        facts.update(optimizer_facts(built.engine))  # right after the load, before a step could move anything
        results[dtype] = {"uninterrupted": uninterrupted, "resumed": train(built.engine, data, 2, 4, GAS), **facts}
        done(built.engine)
    return results


def recompute(out: Path, rt: Runtime, hf_state: dict) -> dict:
    data = batches(3 * GAS)
    results: dict[str, dict] = {}
    for dtype in DTYPES:
        for name, flags in RECOMPUTE.items():
            engine = fresh(config(dtype, steps=3, **flags), rt, hf_state)
            counts = ForwardCounts(engine)
            r = train(engine, data, 0, 3, GAS)
            results[f"{dtype}_{name}"] = {**r, **counts.per_micro_batch(3 * GAS)}
            done(engine)
    return results


def zb(out: Path, rt: Runtime, hf_state: dict) -> dict:
    gas = 4
    data = batches(3 * gas)
    results: dict[str, dict] = {}
    for dtype in DTYPES:
        for schedule in ("1f1b", "zb-h1"):
            engine = fresh(config(dtype, gas=gas, steps=3), rt, hf_state)
            use_schedule(engine, schedule)  # past the config's pp > 1 check: the split itself, at pp 1
            deferred: list[int] = []
            put = DEFERRED.put
            DEFERRED.put = lambda fn: (deferred.append(1), put(fn))  # type: ignore[method-assign]
            try:
                r = train(engine, data, 0, 3, gas)
            finally:
                del DEFERRED.put
            linears = [m for m in engine.module.modules() if type(m).__name__.startswith("Split")]
            results[f"{dtype}_{schedule}"] = {
                **r,
                "class": type(engine).__name__,
                "deferred_per_micro_batch": len(deferred) / (3 * gas),
                "split_linears": len(linears),
            }
            done(engine)
    return results


def packed(out: Path, rt: Runtime, hf_state: dict) -> dict:
    """bf16 packed rows: logits before any step (HF's weights), then training through varlen attention (CUDA) and
    through the block-causal mask SDPA path, counting varlen_attn's calls."""
    import threed.model.attention as attention

    calls = count_varlen_calls()
    data = packed_batches(3 * GAS)
    engine = fresh(config("bf16", steps=3, pack=True), rt, hf_state)
    tokens = data[0][0][0]
    logits = pipeline_logits(engine, (tokens, doc_ids()), model_config(MODEL).vocab_size)
    torch.save({"tokens": tokens, "rows": PACKED_ROWS, "logits": logits}, out / "packed_logits.pt")
    results: dict[str, Any] = {"logits_varlen_calls": len(calls)}
    calls.clear()
    results["varlen"] = {**train(engine, data, 0, 3, GAS), "varlen_calls": len(calls)}
    done(engine)
    usable = attention._varlen_usable
    attention._varlen_usable = lambda query: False  # the masked SDPA path, on the same rows
    try:
        calls.clear()
        engine = fresh(config("bf16", steps=3, pack=True), rt, hf_state)
        results["mask"] = {**train(engine, data, 0, 3, GAS), "varlen_calls": len(calls)}
        done(engine)
    finally:
        attention._varlen_usable = usable
    return results


def count_varlen_calls() -> list[int]:
    """A list that grows by one per call of torch's varlen_attn (threed imports it where it calls it)."""
    calls: list[int] = []
    try:
        import torch.nn.attention.varlen as varlen
    except ImportError:  # torch < 2.9: no varlen kernel, the mask path only
        return calls
    kernel = varlen.varlen_attn

    @functools.wraps(kernel)  # keeps the kernel's signature: threed asks it which keywords this torch takes
    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    varlen.varlen_attn = counted
    return calls


SCENARIOS: dict[str, Callable[[Path, Runtime, dict], dict]] = {
    "parity": parity,
    "resume": resume,
    "recompute": recompute,
    "zb": zb,
    "packed": packed,
}


def main(args: argparse.Namespace, rt: Runtime) -> None:
    hf_state = hf_model(MODEL).state_dict()
    wanted = [s for s in args.only.split(",") if s] if args.only else list(SCENARIOS)
    results: dict[str, Any] = {"device": str(rt.device)}
    for name in wanted:
        try:
            results[name] = SCENARIOS[name](args.out, rt, hf_state)
        except Exception as e:  # the others still run; the test names this one's error
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        (args.out / "one_gpu.json").write_text(json.dumps(results, indent=1))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default="", help=f"comma-separated scenarios (default all: {','.join(SCENARIOS)})")


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
