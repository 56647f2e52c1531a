"""`threed plan`: the (tp, cp, pp, micro, gas, sequence parallelism, schedule, recompute) layouts of a model on a
cluster, whether each fits in GPU memory (`threed.memory`), ranked by a predicted step time (`threed.plan.steptime`);
then the recipe lines of the best one.

    threed plan --model llama3.1-70b --nodes 4 --gpus-per-node 8 --gpu-memory 80 --seq-length 8192 \
        --global-batch-size 512

Candidates: tp divides the heads and the KV heads and at most fills a node (TP collectives stay on NVLink);
context parallelism cp (`threed.model.context`) divides world / tp, is at most MAX_CP (so tp x cp is at most
16 nodes) and cuts the sequence into 2 cp chunks (2 cp tp under sequence parallelism), each rank keeping at least
MIN_CP_TOKENS of a row unless --cp names the degree; pp <= layers; dp = world / (tp cp pp); micro x dp divides the
global batch and gas = global / (micro dp); Megatron's sequence parallelism on and off (tp > 1); the pipeline
schedule (`threed.parallel.schedule.SCHEDULES`, pp > 1: ZB-H1 idles less and holds more), 1F1B also interleaved
over VPP_CHOICES chunks per rank where Megatron's rules allow (a bubble / v, v x the sends, rank 0 holding up to
pp + (pp - 1) / v micro-batches); and recompute: none,
every block, and the fewest recomputed blocks per stage that fit (Megatron's full recompute, method block: the
first N blocks of every stage), found by bisection over N = 0..the largest stage's blocks (memory falls and step
time grows with N, so no other N can win).
Under LoRA (--lora-rank: the base frozen, `threed.memory.lora`) the layouts training takes with it
(`threed.config.LoraConfig.validate`, the same rules): a rank tp divides, cp 1, 1F1B (ZB-H1 has no weight gradient to
defer), no recompute with --lora-dropout > 0.
Selective recompute is not searched: threed's SDPA keeps no s x s scores, so it saves next to nothing
(`threed.memory.recompute`). A layout fits when its heaviest stage's peak (threed.memory, CUDA kernels) is at most
--gpu-memory - --reserve.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Optional

from threed.config import (
    SECTIONS,
    ConfigError,
    LoraConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    check_sequence_parallel,
    check_virtual_stages,
    flag_name,
)
from threed.memory.lora import active
from threed.memory.model import GB, estimate, heaviest, stages
from threed.memory.recompute import Recompute

# Layout, full_recompute_verdict: also names of threed.plan.planner, where callers import them from.
from threed.plan.layout import Layout, full_recompute_verdict, schedule_verdict, table  # noqa: F401
from threed.parallel.schedule import SCHEDULES
from threed.plan.steptime import Hardware, pass_times, step_time, tied_allreduce_s  # noqa: F401 (re-exported)

# plan()'s filters: keyword -> the config field (section, name) whose training flag names it. threed.cli.plan takes
# each under that flag; the messages below name it the same way.
FILTER_FIELDS = {
    "tp": ("parallel", "tp"),
    "pp": ("parallel", "pp"),
    "micro": ("train", "micro_batch_size"),
    "act_ckpt": ("train", "activation_checkpointing"),
    "sequence_parallel": ("parallel", "sequence_parallel"),
    "schedule": ("parallel", "pipeline_schedule"),
    "cp": ("parallel", "cp"),
    "vpp": ("parallel", "vpp"),
}
# The largest CP degree searched: Meta trained Llama 3 405B at 131K tokens with cp 16 (beside tp 8); past that the
# K/V all-gather of every block crosses too many ranks to pay.
MAX_CP = 16
# The fewest tokens of a row a CP rank keeps in the search (unless --cp names the degree): the step-time model's
# constant TFLOP/s holds for large GEMMs only, and below this it would credit CP with the smaller bubble of ever
# thinner micro-batches (at 8K it ranked cp 8 first). NeMo's Llama 3 recipes keep 8K-16K per rank (8B 16K cp 2 ...
# 128K cp 8).
MIN_CP_TOKENS = 8192
# The interleaved chunks per rank searched (--vpp; Megatron-LM's Llama recipes use 2 to 8): the bubble falls with v,
# the sends between stages grow with it, and so do rank 0's activations, towards pp + 1 micro-batches' worth.
VPP_CHOICES = (1, 2, 4)
FILTER_FLAGS = {
    key: flag_name(next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name))
    for key, (section, name) in FILTER_FIELDS.items()
}


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(
    model: ModelConfig,
    hw: Hardware,
    seq: int,
    global_batch: int,
    tp: Optional[int] = None,
    pp: Optional[int] = None,
    micro: Optional[int] = None,
    act_ckpt: Optional[bool] = None,
    sequence_parallel: Optional[bool] = None,
    schedule: Optional[str] = None,
    cp: Optional[int] = None,
    vpp: Optional[int] = None,
    lora: Optional[LoraConfig] = None,
) -> list[Layout]:
    """Every valid layout (optionally restricted), fitting or not, fastest first. `act_ckpt`: only every block
    recomputed (True) or none (False); None: none, every block and the fewest that fit. Each schedule is searched
    on its own (ZB-H1 may need more recompute to fit), 1F1B also interleaved (`VPP_CHOICES`, where the blocks and the
    micro-batches divide as Megatron asks); at pp 1 they are one. `lora`: --lora-rank's, only what training takes
    with it (`lora_allows`)."""
    out: list[Layout] = []
    if not lora_allows(lora, 1, 1, "1f1b", True):  # --lora-dropout: no recompute
        act_ckpt = False
    only = dict(micro=micro, act_ckpt=act_ckpt, sequence_parallel=sequence_parallel, schedule=schedule, vpp=vpp)
    for t in _divisors(hw.gpus_per_node):
        if model.num_heads % t or model.num_kv_heads % t or (tp and t != tp):
            continue
        for c in _divisors(hw.world // t):
            if c > MAX_CP or (cp and c != cp) or (not cp and c > 1 and seq // c < MIN_CP_TOKENS):
                continue
            if not lora_allows(lora, t, c):  # a rank tp does not divide, cp > 1
                continue
            for p in _divisors(hw.world // (t * c)):
                if p > model.num_layers or (pp and p != pp):
                    continue
                out += _shapes(model, hw, seq, global_batch, t, p, c, **only, lora=lora)
    return sorted(out, key=lambda la: la.step_s)


def lora_allows(
    lora: Optional[LoraConfig], tp: int, cp: int = 1, schedule: str = "1f1b", recompute: bool = False
) -> bool:
    """Whether training takes `lora` at this tp, cp, schedule and recompute (its own check,
    `threed.config.LoraConfig.validate`); always without LoRA."""
    if not active(lora):
        return True
    assert lora is not None
    try:
        lora.validate(
            ParallelConfig(tp=tp, cp=cp, pipeline_schedule=schedule),
            TrainConfig(seq_length=1, activation_checkpointing=recompute),
        )
    except ConfigError:
        return False
    return True


def _shapes(
    model: ModelConfig,
    hw: Hardware,
    seq: int,
    global_batch: int,
    t: int,
    p: int,
    c: int,
    micro: Optional[int],
    act_ckpt: Optional[bool],
    sequence_parallel: Optional[bool],
    schedule: Optional[str],
    vpp: Optional[int] = None,
    lora: Optional[LoraConfig] = None,
) -> list[Layout]:
    """The layouts of one (tp, pp, cp): every micro-batch size, sequence parallelism, schedule (interleaved or
    not) and recompute; `lora`: --lora-rank's."""
    out = []
    dp = hw.world // (t * p * c)
    for m in [micro] if micro else [1, 2, 4, 8, 16]:
        if global_batch % (m * dp):
            continue
        gas = global_batch // (m * dp)
        for sp in (False, True):  # Megatron's SP splits the sequence over TP: tp > 1, seq a multiple
            if (sp and (t == 1 or seq % t)) or sequence_parallel not in (None, sp) or not cp_divides(seq, c, t, sp):
                continue
            for sched in SCHEDULES:
                if (p == 1 and sched != "1f1b") or schedule not in (None, sched) or not lora_allows(lora, t, c, sched):
                    continue
                for v in vpp_choices(model, p, gas, sched, vpp):
                    most = largest_chunk(model, p, t, seq, v)
                    layout = partial(_recomputing, (model, hw, seq, t, p, dp, m, gas, sp, sched, c), most, v, lora)
                    none, every = layout(0), layout(most)
                    out += {False: [none], True: [every]}.get(act_ckpt, [none, every])  # type: ignore[arg-type]
                    if act_ckpt is None and every.fits and not none.fits and most > 1:
                        fewest = _fewest_fitting(layout, most)
                        out += [fewest] if fewest.recomputed < most else []
    return out


def vpp_choices(model: ModelConfig, pp: int, gas: int, schedule: str, only: Optional[int]) -> list[int]:
    """The chunks per rank searched for this pipeline: `VPP_CHOICES` (or --vpp's one value) that training takes
    (`threed.config.check_virtual_stages`: pp > 1, 1f1b, blocks divisible by pp x vpp, gas by pp)."""
    out = []
    for v in [only] if only else VPP_CHOICES:
        try:
            check_virtual_stages(pp, v, model.num_layers, schedule, gas)
        except ConfigError:
            continue
        out.append(v)
    return out


def largest_chunk(model: ModelConfig, pp: int, tp: int, seq: int, vpp: int = 1) -> int:
    """The most blocks a stage holds (at vpp > 1 a chunk: Megatron's recompute counts its blocks per chunk)."""
    return max(c.blocks for st in stages(model, pp, tp, seq, None, vpp) for c in st.parts)


def cp_divides(seq: int, cp: int, tp: int, sp: bool) -> bool:
    """Whether context parallelism can cut `seq` (2 cp chunks, each split over tp under SP): the rule and its
    message live in `threed.model.context.check_divisible`."""
    try:
        check_cp(seq, cp, tp, sp)
    except ConfigError:
        return False
    return True


def check_cp(seq: int, cp: int, tp: int, sp: bool) -> None:
    """`threed.model.context.check_divisible`: ConfigError, one line, when `seq` cannot be cut for `cp`."""
    # torch, through the CP attention module: the caller has DeepSpeed (threed.parallel.partition) loaded already.
    from threed.model.context import check_divisible

    check_divisible(seq, cp, tp, sp)


def _recomputing(shape: tuple, most: int, vpp: int, lora: Optional[LoraConfig], n: int) -> Layout:
    """The layout of `shape` (`build_layout`'s arguments before and after its recompute: model, hw, seq, tp, pp, dp,
    micro, gas; sp, schedule, cp) at `vpp` (and `lora`) recomputing the first N blocks of each stage, or chunk
    (N = `most`: every block)."""
    rc = Recompute.of(True) if n >= most else Recompute.first_blocks(n)
    return build_layout(*shape[:8], rc, *shape[8:], most, vpp, lora)


def build_layout(
    model: ModelConfig,
    hw: Hardware,
    seq: int,
    tp: int,
    pp: int,
    dp: int,
    micro: int,
    gas: int,
    rc: Recompute,
    sp: bool = False,
    schedule: str = "1f1b",
    cp: int = 1,
    most: Optional[int] = None,
    vpp: int = 1,
    lora: Optional[LoraConfig] = None,
) -> Layout:
    """One layout, its memory and its predicted step (`threed.plan.steptime`): what the search ranks, and what
    `threed memory` prints for the one layout it is given. `most`: the largest stage's (chunk's) blocks, when known;
    `vpp`: interleaved chunks per rank; `lora`: --lora-rank's (the base frozen)."""
    most = most if most is not None else largest_chunk(model, pp, tp, seq, vpp)
    mems = estimate(
        model, tp, pp, dp, micro, gas, seq, rc, sequence_parallel=sp, schedule=schedule, cp=cp, vpp=vpp, lora=lora
    )
    passes = pass_times(model, hw, tp, pp, dp, micro, seq, rc, sp, schedule, cp, vpp, lora)
    trainable = max(x.trainable for x in mems)  # what the DP all-reduce and AdamW touch
    seconds = step_time(model, hw, tp, pp, dp, micro, gas, seq, rc, trainable, sp, schedule, passes, cp, vpp, lora)
    fits = heaviest(mems).peak <= hw.budget
    return Layout(tp, pp, dp, micro, gas, rc, heaviest(mems), seconds, fits, sp, most, schedule, passes, cp, vpp)


def _fewest_fitting(layout, most: int) -> Layout:
    """Bisection between N = 0 (does not fit) and N = most (fits): memory only falls as N grows."""
    lo, hi = 0, most
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if layout(mid).fits else (mid, hi)
    return layout(hi)


def _nodes_needed(model: ModelConfig, hw: Hardware, seq: int, lora: Optional[LoraConfig] = None) -> Optional[int]:
    """The fewest nodes (doubling) on which the leanest layout fits: largest tp, all GPUs in the pipeline."""
    tp = max(
        t
        for t in _divisors(hw.gpus_per_node)
        if model.num_heads % t == 0 and model.num_kv_heads % t == 0 and lora_allows(lora, t)
    )
    nodes = hw.nodes
    while nodes < 4096:
        nodes *= 2
        pp = min(nodes * hw.gpus_per_node // tp, model.num_layers)
        while (nodes * hw.gpus_per_node) % (tp * pp):
            pp -= 1
        dp = nodes * hw.gpus_per_node // (tp * pp)
        recompute = lora_allows(lora, tp, recompute=True)  # not with --lora-dropout
        mems = estimate(model, tp, pp, dp, 1, pp, seq, recompute, sequence_parallel=tp > 1, lora=lora)
        if heaviest(mems).peak <= hw.budget:
            return nodes
    return None


def step_numbers(hw: Hardware) -> tuple[tuple[str, float], ...]:
    """The figures of `hw` the step-time model divides by, each under the flag that sets it (`threed plan`'s and
    `threed memory`'s)."""
    return (
        ("--gpus-per-node", hw.gpus_per_node),
        ("--tflops", hw.rates.mm_tflops),
        ("--nvlink-gbps", hw.nvlink_gbps),
        ("--network-gbps", hw.network_gbps),
        ("--hbm-gbps", hw.hbm_gbps),
    )


def check_positive(*numbers: tuple[str, float]) -> None:
    """ConfigError, one line, naming the first (flag, value) that is not positive."""
    for what, value in numbers:
        if value <= 0:
            raise ConfigError(f"{what} must be a positive number, got {value:g}")


def plan(
    model: ModelConfig, hw: Hardware, seq: int, global_batch: int, lora: Optional[LoraConfig] = None, **only
) -> tuple[Layout, list[Layout]]:
    """(best, every candidate fastest first); ConfigError when nothing is valid or nothing fits. `lora`:
    --lora-rank's (a filter given that training refuses with it: its one line)."""
    restricted = {k: v for k, v in only.items() if v is not None}
    if active(lora):
        assert lora is not None
        parallel = dict(tp="tp", cp="cp", pipeline_schedule="schedule")
        lora.validate(
            ParallelConfig(**{f: restricted[k] for f, k in parallel.items() if k in restricted}),
            TrainConfig(seq_length=1, activation_checkpointing=bool(restricted.get("act_ckpt"))),
        )
    check_positive(
        ("--nodes", hw.nodes),
        ("--seq-length", seq),
        ("--global-batch-size", global_batch),
        ("--gpu-memory", hw.gpu_memory_gb),
        *step_numbers(hw),
        *((FILTER_FLAGS[k], v) for k, v in restricted.items() if not isinstance(v, (bool, str))),
    )
    if not 0 <= hw.reserve_gb < hw.gpu_memory_gb:
        raise ConfigError(f"--reserve {hw.reserve_gb:g} GB must be >= 0 and below --gpu-memory {hw.gpu_memory_gb:g} GB")
    if seq > model.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {seq} exceeds {model.name}'s max_position_embeddings "
            f"{model.max_position_embeddings}; use --seq-length <= {model.max_position_embeddings}"
        )
    # a rule the filters break by themselves: named, not "no valid layout" (tp 1 has no sequence to split)
    check_sequence_parallel(restricted.get("tp"), restricted.get("sequence_parallel"))
    if restricted.get("cp", 1) > 1:  # a degree the world or the sequence cannot take: one line, before the search
        cp = restricted["cp"]
        if hw.world % cp:
            raise ConfigError(
                f"{FILTER_FLAGS['cp']} {cp} does not divide the world of {hw.world} GPUs ({hw.nodes} node(s) x "
                f"{hw.gpus_per_node}; world = tp x pp x cp x dp): use a cp that divides {hw.world}"
            )
        check_cp(seq, cp, restricted.get("tp", 1), bool(restricted.get("sequence_parallel")))
    every = candidates(model, hw, seq, global_batch, **only, lora=lora)
    where = f"{hw.nodes} node(s) x {hw.gpus_per_node} GPUs"
    given = "".join(f" {FILTER_FLAGS[k]} {str(v).lower()}" for k, v in restricted.items())
    if not every:
        raise ConfigError(
            f"no valid layout of {model.name} on {where} with --global-batch-size {global_batch}{given}: "
            f"tp must divide {model.num_heads} heads, {model.num_kv_heads} KV heads and "
            f"{hw.gpus_per_node} GPUs per node, pp <= {model.num_layers} layers, cp <= {MAX_CP} must cut "
            f"the sequence into 2 x cp chunks (x tp under sequence parallelism), and micro x dp must "
            f"divide the global batch; use a global batch that is a multiple of {hw.world}"
            f"{' or drop' + given if given else ''}"
        )
    fitting = [la for la in every if la.fits]
    if not fitting:
        leanest = min(every, key=lambda la: la.memory.peak)
        more = "" if restricted else _more_nodes(model, hw, seq, lora)
        raise ConfigError(
            f"nothing fits: {model.name} at seq {seq} on {where} with {hw.gpu_memory_gb:g} GB needs "
            f"at least {leanest.memory.peak / GB:.0f} GB per GPU ({leanest.name()}; "
            f"{hw.reserve_gb:g} GB reserved); {more}use more nodes, a shorter --seq-length or larger GPUs"
        )
    return fitting[0], every


def _more_nodes(model: ModelConfig, hw: Hardware, seq: int, lora: Optional[LoraConfig] = None) -> str:
    nodes = _nodes_needed(model, hw, seq, lora)
    return f"by this model it needs >= {nodes} nodes; " if nodes else ""


def recipe_lines(model: str, best: Layout, global_batch: int, seq: int, lora: Optional[LoraConfig] = None) -> list[str]:
    """What to paste into a recipe (recipes/launch.sh's variables; GAS empty so GLOBAL decides it). Partial
    recompute goes as Megatron's flags (RECOMPUTE_*), every block as ACT_CKPT; a schedule other than 1f1b as
    PIPELINE_SCHEDULE, interleaving as VPP; LoRA as LORA_RANK (and LORA_TARGETS when not every target)."""
    values = {
        "MODEL": model,
        "TP": best.tp,
        "PP": best.pp,
        "CP": best.cp,
        "MICRO": best.micro,
        "GAS": "",
        "GLOBAL": global_batch,
        "SEQ": seq,
        "SEQUENCE_PARALLEL": str(best.sp).lower(),
        "ACT_CKPT": str(best.act_ckpt).lower(),
    }
    if best.recomputed and not best.act_ckpt:
        values.update(RECOMPUTE_GRANULARITY="full", RECOMPUTE_METHOD="block", RECOMPUTE_NUM_LAYERS=best.recomputed)
    if best.schedule != "1f1b":  # --pipeline-schedule
        values.update(PIPELINE_SCHEDULE=best.schedule)
    if best.vpp > 1:  # --vpp
        values.update(VPP=best.vpp)
    if active(lora):  # --lora-rank (its alpha and dropout change no memory: the recipe's own)
        assert lora is not None
        values.update(LORA_RANK=lora.lora_rank)
        if set(lora.lora_targets) != set(LoraConfig().lora_targets):
            values.update(LORA_TARGETS=" ".join(lora.lora_targets))
    return [f"{k}=${{{k}-{v}}}" for k, v in values.items()]
