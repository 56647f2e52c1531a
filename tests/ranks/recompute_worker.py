"""8-rank recompute scenarios for tests/ranks/test_recompute.py (one launch, tp2 pp2 dp2, fp32, the gqa31 HF weights):
3 steps each without recompute, with full recompute (uniform / block, Megatron's flags) and with selective
recompute, with and without sequence parallelism, and packed rows (non-reentrant checkpointing); every run records
its losses, gradient norms, how often each of its stage's blocks and core attentions ran forward, and the runs of
layers the stage recomputes together (`StagedPipelineModule.recompute_runs`).

    python -m torch.distributed.run --nproc-per-node 8 tests/ranks/recompute_worker.py --out /tmp/x --data PREFIX
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any, Iterator

import torch

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import load_hf_weights, rank_json, reads_data, run_worker
from dist_worker import run_steps, train_dataset
from helpers import hf_model, model_config
from reference import PARITY
from threed.config import DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
from worker_setup import build_engine

STEPS = 3
FULL = {"uniform1": ("uniform", 1), "block1": ("block", 1), "uniform2": ("uniform", 2)}
# (name, --recompute-granularity / method / num layers, --sequence-parallel)
RUNS = [
    ("none", {}, False),
    *[
        (k, dict(recompute_granularity="full", recompute_method=m, recompute_num_layers=n), False)
        for k, (m, n) in FULL.items()
    ],
    ("selective", dict(recompute_granularity="selective"), False),
    ("sp_none", {}, True),
    ("sp_block1", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1), True),
    ("sp_selective", dict(recompute_granularity="selective"), True),
]
PACKED_RUNS = [
    ("packed_none", {}),
    ("packed_block1", dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)),
    ("packed_selective", dict(recompute_granularity="selective")),
]


def base_config(data: str, pack: bool = False, sequence_parallel: bool = False, **recompute: Any) -> RunConfig:
    # layers:2,2: two blocks per stage (block / 1 recomputes one of them), whatever the balanced split would pick.
    return RunConfig(
        model=model_config("gqa31"),
        parallel=ParallelConfig(tp=2, pp=2, partition_method="layers:2,2", sequence_parallel=sequence_parallel),
        train=TrainConfig(
            **PARITY,
            micro_batch_size=2,
            grad_accum_steps=2,
            seq_length=32,
            steps=STEPS,
            **recompute,
        ),
        data=DataConfig(data_path=(data,), pack=pack),
    )


class ForwardCounts:
    """Forward calls of each block of this stage and of each block's core attention (hooks on their modules)."""

    def __init__(self, engine):
        blocks = [f for f in engine.module.forward_funcs if type(f).__name__ == "LlamaBlock"]
        self.blocks, self.core = Counter(), Counter()
        self.handles = [m.register_forward_hook(self._counter(self.blocks, i)) for i, m in enumerate(blocks)]
        self.handles += [
            b.self_attention.core_attention.register_forward_hook(self._counter(self.core, i))
            for i, b in enumerate(blocks)
        ]
        self.n = len(blocks)

    @staticmethod
    def _counter(counts: Counter, index: int):
        def hook(*_: Any) -> None:
            counts[index] += 1

        return hook

    def per_micro_batch(self, micro_batches: int) -> dict:
        for h in self.handles:
            h.remove()
        return {
            "blocks": [self.blocks[i] / micro_batches for i in range(self.n)],
            "core_attn": [self.core[i] / micro_batches for i in range(self.n)],
        }


def packed_batches(cfg: RunConfig) -> Iterator:
    """Packed rows `((tokens, doc_ids), labels)`: two documents per row, the same on every data-parallel rank."""
    gen = torch.Generator().manual_seed(7)
    vocab, b, s = cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.train.seq_length
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(2), torch.tensor([s // 4, s - s // 4]))] * b)
    while True:
        tokens = torch.randint(0, vocab, (b, s + 1), generator=gen)
        yield (tokens[:, :-1].contiguous(), doc_ids.to(torch.int32)), tokens[:, 1:].contiguous()


def run_packed(cfg: RunConfig, engine) -> tuple[list[float], list[float]]:
    batches = packed_batches(cfg) if reads_data(engine) else None
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(engine.train_batch(data_iter=batches).item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def trained(cfg: RunConfig, rt: Runtime, hf_state: dict, ds=None) -> dict:
    """STEPS steps from HF's weights: losses, gradient norms, forward counts, the stage's recompute runs. `ds` None:
    packed synthetic rows."""
    engine = build_engine(cfg, rt).engine
    load_hf_weights(engine, cfg, hf_state)
    counts = ForwardCounts(engine)
    losses, norms = run_packed(cfg, engine) if ds is None else run_steps(engine, cfg, ds, 0, STEPS)
    return {
        "losses": losses,
        "grad_norms": norms,
        "stage": engine.stage_id,
        "runs": engine.module.recompute_runs,
        **counts.per_micro_batch(STEPS * cfg.train.grad_accum_steps),
    }


def main(args: argparse.Namespace, rt: Runtime) -> None:
    hf_state = hf_model("gqa31").state_dict()
    ds = train_dataset(base_config(args.data), rt.world_size)
    results = {
        name: trained(base_config(args.data, sequence_parallel=sp, **recompute), rt, hf_state, ds)
        for name, recompute, sp in RUNS
    }
    results.update(
        {name: trained(base_config(args.data, pack=True, **recompute), rt, hf_state) for name, recompute in PACKED_RUNS}
    )
    rank_json(args.out, "recompute", results)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
