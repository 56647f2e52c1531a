"""4-rank scenarios for tests/ranks/test_init.py: random init at several layouts, and the bf16 gradient reduction.

python -m torch.distributed.run --nproc-per-node 4 tests/ranks/init_worker.py --out /tmp/x
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist

import threed.engine.build

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import local_layers, run_worker, write_json
from helpers import model_config
from threed.config import ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
from threed.engine.ds_config import engine_config
from worker_setup import build_engine

LAYOUTS = ((1, 1), (2, 1), (1, 2), (1, 4), (2, 2))


def save_init_weights(rt, out: Path) -> None:
    """Each (tp rank, stage) of data-parallel replica 0 saves its local layers as built (no step taken)."""
    mc = model_config("gqa31")
    for tp, pp in LAYOUTS:
        cfg = RunConfig(
            model=mc, parallel=ParallelConfig(tp=tp, pp=pp), train=TrainConfig(dtype="fp32", seq_length=16, seed=4321)
        )
        engine = build_engine(cfg, rt).engine
        mod = engine.module
        if (tp, pp) == (2, 2) and rt.rank == 0:
            from megatron.core import parallel_state as ps

            mlp = next(m for m in mod.modules() if type(m).__name__ == "MLP")
            write_json(
                out / "cpu_switches.json",
                {
                    "fused_adamw": bool(engine.optimizer.optimizer.defaults.get("fused")),
                    "fused_swiglu": mlp.config.bias_activation_fusion,
                    "device": str(next(mod.parameters()).device),
                    "megatron_gloo_groups": ps._DATA_PARALLEL_GROUP_GLOO is not None,  # its getter asserts it exists
                },
            )
        if engine.grid.get_data_parallel_rank() == 0:
            layers = {
                idx: {k: v.detach().cpu() for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)}
                for idx, m in local_layers(engine)
            }
            torch.save(
                layers,
                out / f"init_tp{tp}_pp{pp}_t{engine.grid.get_slice_parallel_rank()}_s{engine.grid.get_stage_id()}.pt",
            )
        dist.barrier()


def grad_norms(rt, out: Path) -> None:
    """One bf16 step of the same global batch (4 sequences) at dp2 x gas1 and at dp1 x gas2, with the DP
    all-reduce in fp32 (ours) and in bf16 (DeepSpeed's default): the first global grad norm of each."""
    mc = model_config("gqa31")
    tokens = torch.randint(0, mc.vocab_size, (4, 17), generator=torch.Generator().manual_seed(7))
    results = {}
    for comm in ("fp32", "bf16"):

        def config(base, comm=comm, **kw):
            ds = engine_config(base, **kw)
            ds["communication_data_type"] = comm
            return ds

        threed.engine.build.engine_config = config  # the bf16 variant exists only to show what fp32 fixes
        for name, (tp, pp, gas) in {"dp2_gas1": (2, 1, 1), "dp1_gas2": (2, 2, 2)}.items():
            cfg = RunConfig(
                model=mc,
                parallel=ParallelConfig(tp=tp, pp=pp),
                train=TrainConfig(
                    dtype="bf16", seq_length=16, micro_batch_size=2, grad_accum_steps=gas, lr=1e-3, seed=99
                ),
            )
            engine = build_engine(cfg, rt).engine
            dp, dp_rank = engine.grid.get_data_parallel_world_size(), engine.grid.get_data_parallel_rank()
            share = tokens.shape[0] // dp
            mine = tokens[dp_rank * share : (dp_rank + 1) * share]
            micro = [(mine[i : i + 2, :-1], mine[i : i + 2, 1:]) for i in range(0, share, 2)]
            engine.train_batch(data_iter=iter(micro))
            results[f"{comm}_{name}"] = float(engine.get_global_grad_norm())
    threed.engine.build.engine_config = engine_config
    if rt.rank == 0:
        write_json(out / "grad_norms.json", results)


def main(args: argparse.Namespace, rt: Runtime) -> None:
    save_init_weights(rt, args.out)
    grad_norms(rt, args.out)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}))
