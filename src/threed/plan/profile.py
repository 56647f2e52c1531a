"""What `threed profile-layers` does (its command line: `threed.cli.profile_layers`): measure what each layer kind costs
in training, and print the `--partition-method costs:...` that balances the pipeline stages on those measurements.

    threed profile-layers --model tiny --pp 2 --micro-batch-size 1 --seq-length 128 [--threads 1]

Why: 1F1B runs at the pace of its slowest stage, and `balanced` splits by a FLOP formula that misprices what is
not a matmul (the embedding's backward, the loss's softmax, norms; on CPU the formula's 1.3 blocks for the
benchmark's LM head measured 0.98-1.0 on a quiet machine, `benchmarks/bench_pipeline.py --partition measured`). This
builds one of each kind (embedding, one transformer block, final norm, LM head + loss) exactly as the pipeline does
(`threed.parallel.pipeline.layer_spec`, `run_megatron_config` with training's CUDA-only kernels, `threed.model.init`),
runs forward + backward on random micro-batches of the run's size, sequence length and dtype (each repeat with fresh
weight gradients, as training's hooks leave them), interleaving the kinds so background load hits all alike, and
takes each kind's median after a warm-up. The costs are relative to a block; the split is
`threed.parallel.partition`'s own (`costs:` = `balanced` over these numbers), so the achievable spread printed here is
what training would get.

It measures at tp=1, in one process: a tp>1 run splits each matmul over its TP group and adds TP collectives
(all-reduce or, with sequence parallelism, all-gather / reduce-scatter) to the blocks, the embedding and the loss,
whose share differs by kind, so its true ratios can differ; the output says so. Full recompute is not measured
(a recomputed block costs one more forward). Threads: `--threads` (default torch's current setting); the
benchmarks run one thread per rank, so profile with `--threads 1` for them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from typing import Any, Callable, Iterator, Optional

from threed.parallel.device_policy import cuda_only
from threed.config import ConfigError, ModelConfig, RunConfig
from threed.parallel.layer_costs import COSTS_PREFIX, format_costs, parse_costs
from threed.model.spec import LAYER_KINDS, LayerKind, PipelineLayer, pipeline_layers
from threed.parallel.partition import describe, resolve_partition


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    seconds: dict[LayerKind, float]  # median forward + backward of one micro-batch, per layer kind
    threads: int
    device: str

    @property
    def method(self) -> str:
        """The `--partition-method` value: costs relative to a block."""
        return format_costs(self.seconds)


def stage_costs(method: str, model: ModelConfig, pp: int, seq_length: int) -> tuple[list[int], list[float]]:
    """The stage boundaries a `costs:` method gives (threed.parallel.partition's split) and each stage's summed cost."""
    costs = parse_costs(method[len(COSTS_PREFIX) :])
    bounds = resolve_partition(method, model, pp, seq_length)
    per_layer = [costs[la.kind] for la in pipeline_layers(model)]
    return bounds, [sum(per_layer[a:b]) for a, b in zip(bounds, bounds[1:])]


def balance(stages: list[float]) -> tuple[float, float]:
    """(spread = slowest / fastest stage, fraction of the ideal pipeline speed-up left by the imbalance alone =
    mean / slowest: 1F1B runs every stage at the slowest one's pace)."""
    return max(stages) / min(stages), sum(stages) / len(stages) / max(stages)


@contextlib.contextmanager
def _world_of_one() -> Iterator[None]:
    """megatron's layers need its tp=1 process groups: a gloo world of one, torn down again (and the environment
    it set restored), so a caller can go on to launch ranks of its own (benchmarks/bench_pipeline.py)."""
    # torch, megatron: heavy; only the profile itself needs them. threed.parallel.distributed first: it quiets the
    # libraries' import-time warnings before megatron is imported.
    from threed.parallel.distributed import init_distributed, init_megatron_parallel_state, shutdown_distributed

    import torch.distributed as dist
    from megatron.core import parallel_state

    if dist.is_initialized():
        raise ConfigError(
            "threed profile-layers runs in a process of its own (tp=1, one rank); torch.distributed "
            "is already initialised here"
        )
    env = dict(os.environ)
    init_distributed()
    try:
        init_megatron_parallel_state(1, 1)
        yield
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        shutdown_distributed()
        os.environ.clear()
        os.environ.update(env)


@contextlib.contextmanager
def _threads(n: Optional[int]) -> Iterator[int]:
    import torch  # heavy: as above

    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def profile_layers(cfg: RunConfig, threads: Optional[int] = None, warmup: int = 3, repeats: int = 10) -> LayerProfile:
    """Median forward + backward seconds per micro-batch of one layer of each kind, at tp=1 (see the docstring)."""
    with _world_of_one(), _threads(threads) as n:
        return LayerProfile(seconds=_measure(cfg, warmup, repeats), threads=n, device=_device())


def _device() -> str:
    from threed.parallel.distributed import device_and_backend  # heavy: torch

    return str(device_and_backend()[0])


def _measure(cfg: RunConfig, warmup: int, repeats: int) -> dict[LayerKind, float]:
    import torch  # heavy: as above

    device = torch.device(_device())
    modules, steps = _layer_steps(cfg, device)
    times = _median_times(
        [steps[k] for k in LAYER_KINDS], device, warmup, repeats, before=lambda: _drop_grads(modules.values())
    )
    return dict(zip(LAYER_KINDS, times))


def megatron_config_as_trained(cfg: RunConfig, device) -> Any:
    """megatron's config for the profiled layers, at tp=1, with the CUDA-only kernels training uses on `device`
    (`threed.parallel.device_policy.cuda_only`: on CUDA the fused SwiGLU, which is not the unfused one's cost)."""
    # torch, megatron: heavy, only here
    from threed.parallel.pipeline import run_megatron_config

    return run_megatron_config(
        cfg.model, 1, cfg.train, sequence_parallel=False, fused_swiglu=cuda_only(device).fused_swiglu
    )


def _layer_steps(cfg: RunConfig, device) -> tuple[dict[LayerKind, Any], dict[LayerKind, Callable[[], None]]]:
    """One module of each layer kind, built and initialised as the pipeline does, and each kind's forward + backward
    of one micro-batch."""
    # torch and the layers (megatron): heavy, only here
    import torch

    from threed.convert.io_utils import DTYPES
    from threed.model.init import init_pipeline_layers_
    from threed.model.layers import causal_lm_loss
    from threed.parallel.pipeline import layer_spec

    dtype = DTYPES[cfg.train.dtype]
    mcore = megatron_config_as_trained(cfg, device)
    layers = pipeline_layers(cfg.model)
    first: dict[LayerKind, PipelineLayer] = {}
    for layer in layers:
        first.setdefault(layer.kind, layer)
    specs = {kind: layer_spec(layer, cfg.model, mcore) for kind, layer in first.items()}
    modules = {kind: spec.build() for kind, spec in specs.items()}
    # Weights as training starts them (an uninitialised tensor may hold denormals, which are slow on CPU); a tied
    # head's module is an embedding copy, drawn as its owner (threed.parallel.pipeline.local_modules).
    owners = [(layers[la.tied_to] if la.tied_to is not None else la, modules[k]) for k, la in first.items()]
    init_pipeline_layers_(owners, cfg.model, 1, 0, cfg.train.seed)
    for m in modules.values():
        m.to(device=device, dtype=dtype).train()
    head = modules["lm_head"]
    forward_fn = getattr(specs["lm_head"], "forward_fn", None)  # a tied head runs with the embedding's weight
    run_head = (lambda h: forward_fn(head, h)) if forward_fn is not None else head

    b, s, h = cfg.train.micro_batch_size, cfg.train.seq_length, cfg.model.hidden_size
    gen = torch.Generator().manual_seed(cfg.train.seed)
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=gen).to(device)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    hidden = torch.randn(s, b, h, generator=gen).to(device=device, dtype=dtype)
    grad = torch.randn(s, b, h, generator=gen).to(device=device, dtype=dtype)

    def hidden_in() -> torch.Tensor:
        # A received activation: backward computes its gradient, as on every stage but the first's embedding.
        return hidden.detach().requires_grad_()

    steps: dict[LayerKind, Callable[[], None]] = {
        "embedding": lambda: modules["embedding"](inputs).backward(grad),
        "block": lambda: modules["block"](hidden_in()).backward(grad),
        "final_norm": lambda: modules["final_norm"](hidden_in()).backward(grad),
        "lm_head": lambda: causal_lm_loss(run_head(hidden_in()), labels).backward(),
    }
    return modules, steps


def _drop_grads(modules) -> None:
    """Each repeat's backward writes fresh weight gradients, as in training (DeepSpeed's hooks move each bf16 .grad
    into the fp32 accumulator and free it), instead of adding into the last repeat's .grad: that add is a kernel
    training does not run, and in bf16 it rounds."""
    for m in modules:
        for p in m.parameters():
            p.grad = None


def _median_times(
    fns: list[Callable[[], None]], device, warmup: int, repeats: int, before: Callable[[], None] = lambda: None
) -> list[float]:
    """Median seconds of each fn, the calls interleaved so that load from elsewhere hits every fn alike; `before`
    runs ahead of every call, untimed."""
    import torch  # heavy: as above

    def sync() -> None:
        if device.type == "cuda":  # kernels are asynchronous: time them to completion
            torch.cuda.synchronize()

    times: list[list[float]] = [[] for _ in fns]
    for r in range(warmup + repeats):
        for fn, ts in zip(fns, times):
            before()
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r >= warmup:
                ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def report(profile: LayerProfile, cfg: RunConfig) -> list[str]:
    """The table, the flag, and what it gives at the run's pp."""
    t, pp, block = cfg.train, cfg.parallel.pp, profile.seconds["block"]
    lines = [
        f"layer costs: {cfg.model.name}, micro {t.micro_batch_size} x seq {t.seq_length}, {t.dtype}, tp=1, "
        f"{profile.threads} thread{'s' * (profile.threads != 1)}, {profile.device}; forward + backward of one "
        f"micro-batch, median"
    ]
    lines += [
        f"  {kind:<11} {profile.seconds[kind] * 1000:9.3f} ms  {profile.seconds[kind] / block:7.3f} blocks"
        for kind in LAYER_KINDS
    ]
    method = profile.method
    lines.append(f"--partition-method {method}")
    bounds, stages = stage_costs(method, cfg.model, pp, t.seq_length)
    if pp > 1:
        spread, fraction = balance(stages)
        lines.append(
            f"pp {pp}: {describe(bounds, cfg.model)}; stage costs "
            + ", ".join(f"{c:.3f}" for c in stages)
            + f" blocks; spread (slowest / fastest) {spread:.3f}, "
            f"at best {fraction * 100:.1f}% of the ideal pipeline speed-up (whole blocks per stage)"
        )
    if cfg.parallel.tp > 1:
        lines.append(
            f"measured at tp=1: at tp={cfg.parallel.tp} the TP collectives change the ratios (see "
            f"`threed profile-layers --help`)"
        )
    return lines
