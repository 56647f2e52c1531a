"""`threed plan`: the command line of the layout planner (`threed.plan.planner`: the search, whose docstring says
what it searches and how).

    threed plan --model llama3.1-70b --nodes 4 --gpus-per-node 8 --gpu-memory 80 --seq-length 8192 \
        --global-batch-size 512 [--tp 8] [--pp 4] [--cp 2] [--micro-batch-size 1] [--sequence-parallel true] \
        [--vpp 2] [--calibrate benchmarks/measured/2026-11-28-h200.json | gpu_check.json] \
        [--lora-rank 16 [--lora-targets q k v o gate up down] [--lora-dropout 0.05]]

The step time's compute rates are fitted to measured GPU runs (`threed.plan.calibration`): by default to the
committed H200 runs (the first line printed says so), with --calibrate FILE to the runs of FILE.

Training's flag names (`threed.cli.flags`), with the earlier short ones (--seq, --global-batch, --micro,
--act-ckpt) kept as aliases; the hardware flags (--nodes, --gpu-memory, ...) are the planner's own. The --lora-*
flags are training's too: a LoRA fine-tune's memory and step (`threed.memory.lora`), and only the layouts training
takes with it.
"""

from __future__ import annotations

import argparse
import math
import sys
from functools import partial
from pathlib import Path
from typing import Optional

from threed.cli.flags import add_command, add_field_flag, add_model_flag, field_value, standalone
from threed.config import ConfigError, LoraConfig, check_ranges
from threed.errors import guarded
from threed.convert.resolve import model_config
from threed.plan.layout import (
    context_parallel_verdict,
    full_recompute_verdict,
    interleave_verdict,
    schedule_verdict,
    table,
)
from threed.plan import planner
from threed.plan.planner import FILTER_FIELDS, FILTER_FLAGS, candidates, check_positive, plan, recipe_lines
from threed.plan.planner import step_numbers
from threed.plan.calibration import calibrated
from threed.plan.steptime import DEFAULT_RATES, Hardware, Rates

# The search's filters (threed.plan.planner.FILTER_FIELDS: keyword -> config field): earlier names, what each keeps.
FILTERS = {
    "tp": ((), "this tp"),
    "pp": ((), "this pp"),
    "micro": (("--micro",), "this micro-batch size"),
    "act_ckpt": (("--act-ckpt",), "every block recomputed (true) / none (false)"),
    "sequence_parallel": ((), "with (true) / without (false) sequence parallelism"),
    "schedule": ((), "this pipeline schedule"),
    "cp": ((), "this context-parallel size"),
    "vpp": ((), "this many interleaved chunks per rank (1: no interleaving)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpu-memory", type=float, required=True, help="GB per GPU, e.g. 80")
    add_field_flag(p, "train", "seq_length", required=True, old=("--seq",))
    add_field_flag(
        p, "train", "global_batch_size", required=True, old=("--global-batch",), help="sequences per optimizer step"
    )
    p.add_argument("--reserve", type=float, default=Hardware.reserve_gb, help="GB kept free per GPU (CUDA, NCCL)")
    add_step_time_flags(p)
    add_lora_flags(p)
    # The search's filters: training's flags, each restricting the search to one value (none given: all searched).
    for key, (old, what) in FILTERS.items():
        add_field_flag(p, *FILTER_FIELDS[key], default=None, old=old, help=f"only {what}")
    p.add_argument("--top", type=int, default=15, help="rows to list")


def add_step_time_flags(p: argparse.ArgumentParser) -> None:
    """The step-time model's flags (`threed.plan.steptime`): `threed plan`'s, and `threed memory`'s for the step of
    its one layout."""
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--calibrate",
        type=Path,
        metavar="FILE",
        help="fit the compute rates to these measured runs (benchmarks/measured/*.json or gpu_check.json); "
        f"default: {DEFAULT_RATES.fitted_to}",
    )
    p.add_argument(
        "--tflops", type=float, help="one sustained bf16 TFLOP/s over the full attention square instead (no fit)"
    )
    p.add_argument("--nvlink-gbps", type=float, default=Hardware.nvlink_gbps, help="intra-node GB/s")
    p.add_argument("--network-gbps", type=float, default=Hardware.network_gbps, help="inter-node GB/s per GPU")
    p.add_argument("--hbm-gbps", type=float, default=Hardware.hbm_gbps, help="GPU memory bandwidth, GB/s")


# LoRA's fields that change memory or the step (and alpha, so that a training command line's flags paste as they are);
# --lora-init-from names a file and changes neither.
LORA_FIELDS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """Training's --lora-* flags (`threed plan`'s and `threed memory`'s): the run is a LoRA fine-tune."""
    for name in LORA_FIELDS:
        add_field_flag(p, "lora", name)


def lora_config(ns: argparse.Namespace) -> LoraConfig:
    """The --lora-* flags as training reads them, each field's range checked (rank 0: off, a full fine-tune)."""
    values = {name: field_value(ns, "lora", name) for name in LORA_FIELDS}
    lora = LoraConfig(**{**values, "lora_targets": tuple(values["lora_targets"])})
    check_ranges("lora", lora)
    return lora


def check_finite(ns: argparse.Namespace, *flags: str) -> None:
    for flag in flags:
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None and not math.isfinite(value):  # nan passes every comparison, inf every lower bound
            raise ConfigError(f"{flag} must be a finite number, got {value:g}; e.g. {flag} 80")


def step_hardware(ns: argparse.Namespace, nodes: int, gpu_memory: float, reserve: float) -> tuple[Hardware, list[str]]:
    """The cluster of `add_step_time_flags`' flags, with the rates fitted to --calibrate FILE's runs, --tflops' flat
    rate or the default fit; and the lines that say which. ConfigError, one line, on a bad flag or file."""
    check_finite(ns, "--tflops", "--nvlink-gbps", "--network-gbps", "--hbm-gbps")
    if ns.tflops is not None and ns.calibrate:
        raise ConfigError("--tflops and --calibrate both set the compute rates; give one")
    rates = Rates.flat(ns.tflops) if ns.tflops is not None else DEFAULT_RATES
    hw = Hardware(nodes, ns.gpus_per_node, gpu_memory, reserve, rates, ns.nvlink_gbps, ns.network_gbps, ns.hbm_gbps)
    check_positive(*step_numbers(hw))  # before the fit divides by them
    return calibrated(hw, ns.calibrate) if ns.calibrate else (hw, [hw.rates.line()])


def run(ns: argparse.Namespace) -> int:
    model = model_config(ns.model)
    if ns.top < 1:
        raise ConfigError(f"--top must be a positive number, got {ns.top}")
    check_finite(ns, "--gpu-memory", "--reserve")
    hw, fitted = step_hardware(ns, ns.nodes, ns.gpu_memory, ns.reserve)
    seq, global_batch = field_value(ns, "train", "seq_length"), field_value(ns, "train", "global_batch_size")
    only = {key: field_value(ns, *FILTER_FIELDS[key]) for key in FILTERS}
    lora = lora_config(ns)
    try:
        best, every = plan(model, hw, seq, global_batch, lora, **only)
    except ConfigError as e:
        if str(e).startswith("no valid layout"):  # the planner's numbers checks come first and stand as they are
            refuse_empty_filters(model, hw, seq, global_batch, only, lora)
        raise
    tokens = seq * global_batch
    fitting = [la for la in every if la.fits]
    lora_words = f", LoRA rank {lora.lora_rank} on {' '.join(lora.lora_targets)}" if lora.lora_rank else ""
    print(
        f"{model.name}{lora_words} on {hw.nodes} x {hw.gpus_per_node} GPUs ({hw.gpu_memory_gb:g} GB, {hw.reserve_gb:g} "
        f"reserved), seq {seq}, global batch {global_batch} ({tokens / 1e6:.2f}M tokens): "
        f"{len(fitting)} of {len(every)} layouts fit. Fastest first, with up to 5 faster ones that do not fit:"
    )
    shown = fitting[: ns.top] + [la for la in every if not la.fits and la.step_s < best.step_s][:5]
    print("\n".join(table(sorted(shown, key=lambda la: la.step_s), hw.budget)))
    if len(fitting) > ns.top:
        print(f"({len(fitting) - ns.top} slower layouts that fit not shown; --top N lists more)")
    print(full_recompute_verdict(every))
    schedule = schedule_verdict(best, every)
    if lora.lora_rank and best.pp > 1:  # zb-h1 is not searched under LoRA: say why, not "the only one searched"
        schedule = "1f1b: LoRA's frozen base has no weight gradient for zb-h1 to defer"
    print(f"pipeline schedule: {schedule}")
    print(f"interleaving: {interleave_verdict(best, every)}")
    print(context_parallel_verdict(best, every))
    print("\n".join(fitted))
    print(
        f"\nbest: {best.name()}: {best.step_s:.1f} s/step predicted ({tokens / best.step_s:,.0f} tokens/s), "
        f"bubble {best.bubble:.1%}, {best.memory.line(best.pp)}"
    )
    print("recipe lines (recipes/<model>.sh):")
    print("\n".join(recipe_lines(ns.model, best, global_batch, seq, lora)))
    print(
        f"launch: NNODES={hw.nodes} GPUS_PER_NODE={hw.gpus_per_node} recipes/launch.sh RECIPE "
        f"(or sbatch --nodes={hw.nodes} slurm/train.sh RECIPE)"
    )
    return 0


def refuse_empty_filters(
    model, hw: Hardware, seq: int, global_batch: int, only: dict, lora: Optional[LoraConfig] = None
) -> None:
    """Filters that leave no valid layout, when the search without them finds some: name the filters to drop or
    change (by their flags), not the global batch, which is not the cause."""
    given = {k: v for k, v in only.items() if v is not None}
    if not given:
        return
    search = partial(candidates, model, hw, seq, global_batch, lora=lora)
    if search(**only) or not search():
        return
    alone = [k for k in given if not search(**{k: given[k]})]

    def shown(keys: list[str]) -> str:
        return " ".join(f"{FILTER_FLAGS[k]} {str(given[k]).lower()}" for k in keys)

    why = f"{shown(alone)} alone leave{'s' if len(alone) == 1 else ''} none" if alone else "none together"
    raise ConfigError(
        f"no valid layout of {model.name} on {hw.nodes} node(s) x {hw.gpus_per_node} GPUs with "
        f"{shown(list(given))} (--global-batch-size {global_batch} is fine without them): {why}. A layout needs "
        f"tp dividing {model.num_heads} heads, {model.num_kv_heads} KV heads and {hw.gpus_per_node} GPUs per node, "
        f"pp <= {model.num_layers} layers and dividing the GPUs, micro x dp dividing the global batch, a "
        f"zero-bubble schedule pp > 1, and vpp > 1 1f1b with pp x vpp dividing the blocks and pp the micro-batches; "
        f"drop or change {shown(alone or list(given))}"
    )


def register(sub: argparse._SubParsersAction) -> None:
    add_command(
        sub,
        "plan",
        "rank (tp, cp, pp, micro, gas, sequence parallel, schedule, vpp, recompute) layouts for a cluster",
        planner.__doc__,
        add_arguments,
        run,
    )


def main(argv: Optional[list[str]] = None) -> int:
    ns = standalone("threed plan", planner.__doc__, add_arguments).parse_args(argv)
    return guarded("threed plan", lambda: run(ns), prefix="")


if __name__ == "__main__":
    sys.exit(main())
