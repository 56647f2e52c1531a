"""`threed memory` (also `python -m threed.memory`): the memory model's estimate per GPU (`threed.memory.model`, whose
docstring lists every term), one line for the heaviest stage or one per stage; then the step time `threed plan`
predicts for this one layout (`threed.plan.planner.build_layout`, the planner's own path) with its tokens/s, and the
line saying which compute rates it rests on (`threed.plan.calibration`).

    threed memory --model llama3.1-70b --tp 8 --pp 4 --dp 16 --micro-batch-size 1 --grad-accum-steps 32 \
        --seq-length 8192 --sequence-parallel [--pipeline-schedule zb-h1 | --vpp 2] [--cp 2] [--lm-head-chunks 8] \
        [--all-stages] [--calibrate benchmarks/measured/2026-11-28-h200.json | gpu_check.json | --tflops 400] \
        [--gpus-per-node 8] [--async-save] [--lora-rank 16 [--lora-targets q k v o gate up down]]

The flags are training's (`threed.cli.flags`: the same names, Megatron aliases and checks as `threed train`); the
earlier short names (--micro, --gas, --seq, --act-ckpt) stay as aliases. `--dp` is the one flag training does not
have: a training run derives it from its world size. The step-time flags (--calibrate, --tflops, --gpus-per-node,
--nvlink-gbps, --network-gbps, --hbm-gbps) are `threed plan`'s, with its defaults and refusals: by default the rates
fitted to the committed H200 runs (the line says so). `threed check-config` prints the same memory estimate for a run.
`--async-save` adds a line: the host memory its checkpoint copies take per node of --gpus-per-node ranks.
The --lora-* flags (training's): a LoRA fine-tune, the base frozen (`threed.memory.lora`), checked as training checks
them against the layout.
"""

from __future__ import annotations

import argparse
import sys

from threed.cli.flags import add_command, add_field_flag, add_model_flag, field_value, standalone
from threed.config import (
    ConfigError,
    ParallelConfig,
    TrainConfig,
    check_lm_head_chunks,
    check_sequence_parallel,
    check_virtual_stages,
)
from threed.errors import guarded
from threed.memory import model as memory_model
from threed.memory.model import estimate, heaviest, host_copy_line
from threed.memory.recompute import Recompute
from threed.convert.resolve import model_config
from threed.plan.planner import build_layout, check_cp
from threed.cli.plan import add_lora_flags, add_step_time_flags, lora_config, step_hardware

# (section, field, earlier names): the training fields the memory model reads.
REQUIRED = (
    ("parallel", "tp", ()),
    ("parallel", "pp", ()),
    ("train", "micro_batch_size", ("--micro",)),
    ("train", "grad_accum_steps", ("--gas",)),
    ("train", "seq_length", ("--seq",)),
)
OPTIONAL = (
    ("train", "activation_checkpointing", ("--act-ckpt",)),
    ("parallel", "sequence_parallel", ()),
    ("train", "recompute_granularity", ()),
    ("train", "recompute_method", ()),
    ("train", "recompute_num_layers", ()),
    ("parallel", "pipeline_schedule", ()),
    ("parallel", "vpp", ()),
    ("parallel", "cp", ()),
    ("train", "lm_head_chunks", ()),
    ("checkpoint", "async_save", ()),  # a line for the host memory of its checkpoint copies, per --gpus-per-node
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    for section, name, old in REQUIRED:
        add_field_flag(p, section, name, required=True, old=old)
    p.add_argument(
        "--dp",
        type=int,
        required=True,
        metavar="N",
        help="data-parallel size, excluding cp (training derives it: world / (tp x pp x cp))",
    )
    for section, name, old in OPTIONAL:
        add_field_flag(p, section, name, old=old)
    p.add_argument("--all-stages", action="store_true", help="one line per pipeline stage")
    add_step_time_flags(p)  # threed plan's: the step's cluster and compute rates
    add_lora_flags(p)


def lines(ns: argparse.Namespace) -> list[str]:
    """The estimate's line(s), then the predicted step and the rates it rests on; ConfigError on a bad layout or a
    bad step-time flag (--calibrate FILE read and fitted here), before anything is computed."""
    tp, pp, micro, gas, seq = (field_value(ns, s, n) for s, n, _ in REQUIRED)
    cp, sp = field_value(ns, "parallel", "cp"), field_value(ns, "parallel", "sequence_parallel")
    schedule, vpp = field_value(ns, "parallel", "pipeline_schedule"), field_value(ns, "parallel", "vpp")
    if min(tp, pp, ns.dp, micro, gas, seq, cp, vpp) < 1:
        raise ConfigError(
            "--tp, --pp, --dp, --cp, --vpp, --micro-batch-size, --grad-accum-steps and --seq-length must all be "
            "positive integers"
        )
    check_sequence_parallel(tp, sp)
    if cp > 1:  # the CP layout's own rule and message (2 x cp chunks, x tp under sequence parallelism)
        check_cp(seq, cp, tp, sp)
    chunks = field_value(ns, "train", "lm_head_chunks")
    check_lm_head_chunks(chunks, seq, tp, cp, sp, schedule)
    model = model_config(ns.model)
    check_virtual_stages(pp, vpp, model.num_layers, schedule, gas)  # training's rules for --vpp, in its words
    train = recompute_flags(ns, model)
    rc = Recompute.from_train(train)
    lora = lora_config(ns)
    lora.validate(ParallelConfig(tp=tp, cp=cp, pipeline_schedule=schedule), train)  # training's rules, its words
    world = tp * pp * cp * ns.dp
    # the step's cluster: just the layout's GPUs (memory is not weighed against a GPU's size here: no fit verdict)
    hw, rates = step_hardware(ns, -(-world // max(ns.gpus_per_node, 1)), gpu_memory=0.0, reserve=0.0)
    mems = estimate(
        model, tp, pp, ns.dp, micro, gas, seq, rc, sequence_parallel=sp, schedule=schedule, cp=cp, head_chunks=chunks,
        vpp=vpp, lora=lora,
    )  # fmt: skip
    out = [m.line(pp) for m in (mems if ns.all_stages else [heaviest(mems)])]
    if field_value(ns, "checkpoint", "async_save"):
        # under --lora-rank: the adapter-only checkpoint of a LoRA run from a base
        out.append(host_copy_line(model, tp, pp, ns.dp, seq, ns.gpus_per_node, cp, vpp=vpp, lora=lora))
    step = build_layout(model, hw, seq, tp, pp, ns.dp, micro, gas, rc, sp, schedule, cp, vpp=vpp, lora=lora)
    tokens = seq * micro * gas * ns.dp
    out.append(
        f"predicted: {step.step_s:.2f} s/step ({tokens / step.step_s:,.0f} tokens/s, {tokens:,} tokens per step), "
        f"bubble {step.bubble:.1%}, {hw.gpus_per_node} GPUs per node"
    )
    return out + rates


def recompute_flags(ns: argparse.Namespace, model) -> TrainConfig:
    """The recompute flags as training reads them, with training's checks."""
    train = TrainConfig(
        seq_length=1,
        activation_checkpointing=field_value(ns, "train", "activation_checkpointing"),
        recompute_granularity=field_value(ns, "train", "recompute_granularity"),
        recompute_method=field_value(ns, "train", "recompute_method"),
        recompute_num_layers=field_value(ns, "train", "recompute_num_layers"),
    )
    train.validate(model)  # the recompute flags' checks (seq_length 1 passes the others), as training's
    return train


def run(ns: argparse.Namespace) -> int:
    return guarded("threed memory", lambda: print("\n".join(lines(ns))), prefix="")


def register(sub: argparse._SubParsersAction) -> None:
    add_command(
        sub, "memory", "the memory model's estimate per GPU for a layout", memory_model.__doc__, add_arguments, run
    )


def main(argv: list[str] | None = None) -> int:
    return run(standalone("threed memory", memory_model.__doc__, add_arguments).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
