"""What the divergence guard's per-step weight-norm pass costs beside a training step (issue 19): the guard calls
`threed.checkpoint.save.weight_norm` once per step on every rank (the --weight-jump-factor check), so it must be
small beside the step it guards. Measured in one run, calls interleaved: the norm over every weight of the `tiny`
preset model (tp1 pp1, one process: all of its weights, more than any rank of a tp2 pp2 run holds) against one
step's forward + backward of the same model on the demo's per-rank work (--gas micro-batches of --batch x --seq,
fp32; the optimizer step is left out, so the step is underestimated and the ratio overestimated). Prints both
median times and the ratio norm / step.

    .venv/bin/python benchmarks/bench_guard.py [--model tiny --batch 4 --seq 128 --gas 4 --threads 1]
"""

from __future__ import annotations

import argparse
import types

import torch

from bench_model import median_times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--gas", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from threed.checkpoint.save import weight_norm
    from threed.config import ParallelConfig, RunConfig, TrainConfig
    from threed.parallel.distributed import init_distributed, init_megatron_parallel_state
    from threed.parallel.dims import resolve_dims
    from threed.parallel.pipeline import build_pipeline_module
    from threed.model.presets import PRESETS

    model_cfg = PRESETS[a.model]
    cfg = RunConfig(model=model_cfg, parallel=ParallelConfig(1, 1), train=TrainConfig(dtype="fp32", seq_length=a.seq))
    rt = init_distributed()
    init_megatron_parallel_state(1, 1)
    torch.manual_seed(0)
    model = build_pipeline_module(
        cfg.model, resolve_dims(cfg, rt.world_size), cfg.train, sequence_parallel=cfg.parallel.sequence_parallel
    ).train()  # on rt.device
    engine = types.SimpleNamespace(module=model)  # what weight_norm reads of a DeepSpeed engine
    gen = torch.Generator().manual_seed(0)
    micro = [torch.randint(0, model_cfg.vocab_size, (a.batch, a.seq + 1), generator=gen) for _ in range(a.gas)]
    micro = [(t[:, :-1].to(rt.device), t[:, 1:].to(rt.device)) for t in micro]

    def step():
        model.zero_grad(set_to_none=True)
        for inputs, labels in micro:
            (model.loss_fn(model(inputs), labels) / a.gas).backward()

    def norm():
        weight_norm(engine)

    t_step, t_norm = median_times([step, norm], a.warmup, a.iters)
    n = sum(p.numel() for p in model.parameters())
    print(
        f"config: {a.model} ({n / 1e6:.2f}M params, one process), step = {a.gas} x fwd+bwd of batch {a.batch} x "
        f"seq {a.seq}, fp32, {a.threads} thread(s)"
    )
    print(f"step {t_step * 1000:.1f} ms   weight_norm {t_norm * 1000:.3f} ms")
    print(f"ratio weight_norm / step = {t_norm / t_step:.4f}")


if __name__ == "__main__":
    main()
