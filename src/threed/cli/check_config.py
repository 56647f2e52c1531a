"""`threed check-config`: the checks `threed train` runs before it builds anything, in one process, in a few seconds:
numeric ranges, the model, tp / pp against heads and layers, seq against positions, the batch arithmetic at a given
world size (DP, GAS and train_batch_size = micro x gas x DP), which stage holds which layers (--partition-method;
at --vpp > 1 each rank's chunks; DeepSpeed's own methods import DeepSpeed for its split functions), and the memory
model's estimate per GPU for the heaviest stage (`threed.memory`: the same line as `threed memory` with these
flags); with `--paths`, also every check `threed train` runs on what is on disk before it builds
(`threed.train.preflight.check_run`, the same function: the data paths, duplicate prefixes, validation splits,
each dataset's .bin/.idx and sidecar, the --tensorboard-dir, wandb for --wandb-project), and what the run would do
with its checkpoint directories (resume, refuse to overwrite a run, room for a checkpoint), without creating
anything. A dataset that cannot be checked (no sidecar) is said on stderr.

    threed check-config --world 8 --model tiny --tp 2 --pp 2 --micro-batch-size 4 --grad-accum-steps 4 ...

recipes/launch.sh runs it before torchrun (and in its dry run), so a bad recipe fails once, with one line.
Exit status (with --paths) 0 when the run would start, 2 (and one `threed: configuration error: ...` line) when
not; without --paths, when its flags would (the dry run: data and checkpoints need not exist yet). Output: the
summary line, then `memory: ~N GB/GPU = ...`; with --async-save also `memory: host ~N per node of R rank(s) ...`
(--ranks-per-node R, default 8: the host memory of its checkpoint copies, the figure the run refuses a node by).
"""

from __future__ import annotations

import argparse
import sys

from threed.checkpoint.format import adapter_only_lora, checkpoint_bytes
from threed.config import ConfigError, RunConfig
from threed.errors import guarded
from threed.memory.model import estimate, heaviest, host_copy_line
from threed.memory.recompute import Recompute
from threed.cli.flags import add_run_flags, run_config_from_args
from threed.model.spec import parameter_count
from threed.train.preflight import check_config, check_run
from threed.parallel.dims import RunDims
from threed.units import human_bytes


def check(ns: argparse.Namespace) -> str:
    """Raise ConfigError, or return the summary of the run and its memory line."""
    if ns.world < 1:
        raise ConfigError(f"--world must be >= 1 (the number of ranks), got {ns.world}")
    cfg = run_config_from_args(ns)
    run = check_config(cfg, ns.world)  # what train checks before building, the same functions (threed.train.preflight)
    if ns.paths:
        for note in check_run(run).notes:
            print(f"threed: {note}", file=sys.stderr, flush=True)
    d = run.dims
    dp, micro, gas, glob = d.dp, d.micro, d.gas, d.global_batch
    recompute = d.recompute_phrase
    chunks = f" (interleaved: {d.vpp} chunks per rank, virtual stage c x pp + r on rank r)" if d.vpp > 1 else ""
    stages = f"stages{chunks}: {d.stages(cfg.model)}; " if d.pp > 1 else ""
    start = check_paths(cfg, d) if ns.paths else unchecked_start(cfg)
    summary = (
        f"config ok: {cfg.model.name} ({parameter_count(cfg.model) / 1e6:.1f}M params), world {ns.world} = "
        f"{d.layout}, global batch {glob} = micro {micro} x gas "
        f"{gas} x dp {dp}, seq {cfg.train.seq_length}, {cfg.train.steps} steps; {stages}recompute: {recompute}; "
        f"start: {start}; {checkpoints(cfg)}"
    )
    host = ""
    if cfg.checkpoint.async_save:  # the host memory of its checkpoint copies (what the run refuses a node by)
        p = cfg.parallel
        host = "\n" + host_copy_line(
            cfg.model, p.tp, p.pp, dp, cfg.train.seq_length, ns.ranks_per_node, p.cp, vpp=p.vpp,
            partition_method=p.partition_method, dtype=cfg.train.dtype, lora=adapter_only_lora(cfg),
        )  # fmt: skip
    return f"{summary}\nmemory: {memory(cfg, dp, micro, gas)}{host}"


def memory(cfg: RunConfig, dp: int, micro: int, gas: int) -> str:
    """The memory model's line for the run's heaviest stage (bf16 on CUDA: what the model describes)."""
    p, t = cfg.parallel, cfg.train
    mems = estimate(
        cfg.model,
        p.tp,
        p.pp,
        dp,
        micro,
        gas,
        t.seq_length,
        Recompute.from_train(t),
        partition_method=p.partition_method,
        sequence_parallel=p.sequence_parallel,
        schedule=p.pipeline_schedule,
        cp=p.cp,
        head_chunks=t.lm_head_chunks,
        vpp=p.vpp,
        lora=cfg.lora,
    )
    line = heaviest(mems).line(p.pp)
    return line if t.dtype == "bf16" else f"{line} (the model is of a bf16 run; this one is {t.dtype})"


def checkpoints(cfg: RunConfig) -> str:
    """What the run's checkpoints take on disk: one's size, and how many --keep-last leaves in --save."""
    ck = cfg.checkpoint
    if not ck.save:
        return "no --save: no checkpoints"
    one = checkpoint_bytes(cfg)
    if ck.keep_last:
        return (
            f"checkpoints ~{human_bytes(one)} each, the newest {ck.keep_last} kept (--keep-last): "
            f"~{human_bytes(one * ck.keep_last)} in {ck.save}"
        )
    return f"checkpoints ~{human_bytes(one)} each, all kept (--keep-last 0)"


def unchecked_start(cfg: RunConfig) -> str:
    """Where the run would start, from the flags alone (the dry run: the directories are not read)."""
    ck = cfg.checkpoint
    if ck.load:
        return f"resume from --load {ck.load} (not read: --paths checks it)"
    if ck.init_from:
        return f"weights from --init-from {ck.init_from} (not read: --paths checks it)"
    if ck.save and ck.auto_resume:
        return f"random init, or resume from --save {ck.save} if it holds a run (not read: --paths checks it)"
    return "random init"


def check_paths(cfg: RunConfig, dims: RunDims) -> str:
    """What `threed.checkpoint.start.start` decides, without its side effects (nothing is created or converted)."""
    # torch: threed.checkpoint.start pulls it in; check-config without --paths runs without it
    from threed.checkpoint.start import check_save_dir, decide_start

    decision = decide_start(cfg, dims)
    check_save_dir(cfg, decision, create=False)
    return decision.describe() + (" (converted once)" if decision.universal else "")


def _run(ns: argparse.Namespace) -> int:
    if ns.paths:
        # torch: the data checks need it anyway; megatron-core's import-time warnings off, as in `threed train`
        from threed.parallel.distributed import quiet_libraries

        quiet_libraries()
    return guarded("threed", lambda: print(check(ns)), prefix="configuration error: ")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check-config", help="run training's config checks at a world size, build nothing")
    add_run_flags(p)
    p.add_argument("--world", type=int, required=True, help="number of ranks (nodes x ranks per node)")
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=8,
        metavar="N",
        help="ranks per node (GPUS_PER_NODE), for --async-save's host memory per node (default 8)",
    )
    p.add_argument(
        "--paths",
        action="store_true",
        help="also run train's checks of what is on disk (data and sidecars, checkpoint directories, "
        "--tensorboard-dir, wandb); creates nothing",
    )
    p.set_defaults(run=_run)
