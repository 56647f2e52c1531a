"""LoRA (`--lora-rank`) in the memory model, the step-time model, `threed plan` / `threed memory` / `threed
check-config` (issue 38): pure functions, no engine. The adapter counts agree with what threed.convert.lora cuts
rank by rank; a frozen base has weights only; the step has no base weight gradient, so the planner picks 1F1B; and 70B
LoRA on 4 nodes x 8 x 80 GB has a layout that fits. tests/ranks/test_memory.py checks the static terms against a LoRA
engine's tensors."""

from __future__ import annotations

import math

import pytest

from threed.config import ConfigError, LoraConfig
from threed.convert.lora import target_slices
from threed.convert.resolve import model_config
from threed.memory.lora import block_elements
from threed.memory.model import GB, estimate, stage_kinds
from threed.model.spec import largest_parameter, pipeline_layers
from threed.plan.planner import Hardware, plan, recipe_lines
from threed.plan.steptime import Rates, pass_times

M70 = model_config("llama3.1-70b")
R16 = LoraConfig(lora_rank=16)
HW70 = Hardware(nodes=4, gpus_per_node=8, gpu_memory_gb=80)


@pytest.mark.parametrize(
    "name,tp,targets",
    [("tiny", 1, None), ("tiny", 2, None), ("tiny", 2, ("q", "v")), ("llama3.1-70b", 8, None)],
)
def test_adapter_elements_are_what_convert_cuts_per_rank(name: str, tp: int, targets) -> None:
    """The memory model's count (from the base shapes) equals, on every TP rank, the shapes threed.convert.lora gives
    the adapters the engine builds (`target_slices`): one fact, read the same way."""
    model = model_config(name)
    lora = LoraConfig(lora_rank=16, **({"lora_targets": targets} if targets else {}))
    block = next(ly for ly in pipeline_layers(model) if ly.kind == "block")
    for rank in range(tp):
        cut = sum(math.prod(t.a.shape) + math.prod(t.b.shape) for t in target_slices(model, block, lora, tp, rank))
        assert block_elements(model, lora, tp) == cut


def test_70b_lora_terms_frozen_base_and_adapter_states() -> None:
    """tp8 pp4 dp1: the base's bf16 weights only; grads (fp32), master and AdamW (12 B) of the adapters alone; the
    model's states in all about the issue's ~135 GiB (base 2 B/param + adapters 18 B/param)."""
    full = estimate(M70, 8, 4, 1, 1, 64, 8192, True, sequence_parallel=True)
    mems = estimate(M70, 8, 4, 1, 1, 64, 8192, True, sequence_parallel=True, lora=R16)
    per_block = block_elements(M70, R16, 8)
    assert per_block == 16 * (2 * (8192 + 8192) + 2 * (1024 + 8192) + 3 * (28672 + 8192)) // 8
    for f, m in zip(full, mems):
        assert m.params == f.params and m.adapters == per_block * m.stage.blocks
        assert 2 * (m.params + m.adapters) <= m.weights <= 2 * (m.params + m.adapters + 2)  # base unpadded
        assert m.grads == pytest.approx(4 * m.adapters, abs=8) and m.optimizer == pytest.approx(12 * m.adapters, abs=16)
        # the adapters' inputs come on top; the one bf16 .grad transient is an adapter's, not the base's largest
        base_grad = 2 * largest_parameter(M70, 8, stage_kinds(m.stage))
        assert f.activations - base_grad < m.activations < f.activations + 2 * 8192 * 8192 * 2
    states = sum(m.model_states for m in mems) * 8  # every TP rank holds its shard
    print(f"70B LoRA r16 model states: {states / 2**30:.1f} GiB (full fine-tune: "
          f"{sum(f.model_states for f in full) * 8 / 2**30:.0f} GiB)")  # fmt: skip
    assert 130 * 2**30 < states < 140 * 2**30


def test_no_base_weight_gradient_under_lora() -> None:
    """The step-time model's W is the adapters' alone (<1% of a full fine-tune's); at tp 1 F and B grow by the
    adapters' matmuls only (<1% at one flat rate, no per-micro-batch cost): a 70B micro-batch costs ~0.73 of a full
    fine-tune's. At tp 8 the adapters' own TP collectives ([s, b, h] gathered and reduced besides the base's) and the
    collectives megatron hid behind the base's weight-gradient GEMMs take back what W saved."""
    flat = Hardware(nodes=4, gpus_per_node=8, gpu_memory_gb=80, rates=Rates.flat(400))
    full = pass_times(M70, flat, 1, 8, 4, 1, 8192, False)
    lora = pass_times(M70, flat, 1, 8, 4, 1, 8192, False, lora=R16)
    assert lora[2] < 0.01 * full[2]
    assert full[0] < lora[0] < 1.01 * full[0] and full[1] < lora[1] < 1.01 * full[1]
    assert 0.7 < sum(lora) / sum(full) < 0.75
    full, lora = (pass_times(M70, HW70, 8, 4, 1, 1, 8192, False, True, lora=x) for x in (None, R16))
    print(f"tp8 pp4 SP: F B W full {full}, LoRA {lora}: {sum(lora) / sum(full):.3f}")
    assert lora[2] < 0.01 * full[2] and lora[0] > 1.1 * full[0]
    assert 0.95 < sum(lora) / sum(full) < 1.1


# recipes/llama31_70b_lora_sft.sh's plan: --reserve 8 keeps it at <= 72 GB like every recipe, --vpp 1 (LoRA not run
# interleaved yet); tp and micro given in make test (the search over every tp takes ~50 s)
RECIPE_HW = Hardware(nodes=4, gpus_per_node=8, gpu_memory_gb=80, reserve_gb=8)


def check_70b_lora_plan(**only):
    """`threed plan --lora-rank 16` for 70B on 4 x 8 x 80 GB: a layout that fits, only 1F1B searched (ZB-H1 has
    nothing to defer and training refuses it), cp 1, a tp the rank divides, under 1% of the parameters trained; and
    the recipe lines say LORA_RANK. Returns the best layout."""
    best, every = plan(M70, RECIPE_HW, 8192, 64, R16, vpp=1, **only)
    print(f"best: {best.name()} {best.step_s:.1f} s, {best.memory.peak / GB:.1f} GB")
    assert best.fits and best.memory.peak <= RECIPE_HW.budget
    assert {la.schedule for la in every} == {"1f1b"} and {la.cp for la in every} == {1}
    assert any(la.pp > 1 and la.fits for la in every), "pipelined layouts were searched (1F1B only)"
    assert best.memory.adapters > 0 and 16 % best.tp == 0 and best.memory.trainable < best.memory.params / 100
    assert "LORA_RANK=${LORA_RANK-16}" in recipe_lines("llama3.1-70b", best, 64, 8192, R16)
    return best


def test_plan_70b_lora_on_4_nodes_is_the_recipe() -> None:
    best = check_70b_lora_plan(tp=4, micro=1)
    assert (best.tp, best.pp, best.dp, best.gas, best.sp, best.recomputed) == (4, 1, 8, 8, True, 43)


@pytest.mark.slow
def test_plan_70b_lora_on_4_nodes_whole_search() -> None:
    """Every tp, pp, micro and recompute: the recipe's layout, faster than the full fine-tune's best."""
    best = check_70b_lora_plan()
    assert (best.tp, best.pp, best.recomputed) == (4, 1, 43)
    full, _ = plan(M70, RECIPE_HW, 8192, 64)
    assert best.step_s < full.step_s


def test_plan_refuses_what_training_refuses_with_lora() -> None:
    with pytest.raises(ConfigError, match="zb-h1 with --lora-rank"):
        plan(M70, HW70, 8192, 64, R16, schedule="zb-h1")
    with pytest.raises(ConfigError, match="not divisible by --tp 8"):
        plan(M70, HW70, 8192, 64, LoraConfig(lora_rank=12), tp=8)


def test_memory_and_check_config_count_lora(capsys) -> None:
    from threed.cli.main import main  # the whole command line (argparse): the flags as a user types them

    flags = ["--model", "llama3.1-8b", "--tp", "1", "--pp", "1", "--micro-batch-size", "1", "--seq-length", "4096"]
    assert main(["memory", *flags, "--dp", "8", "--grad-accum-steps", "8", "--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert "M LoRA" in out and "predicted:" in out, out
    assert main(["check-config", "--world", "8", *flags, "--lora-rank", "16"]) == 0
    out = capsys.readouterr().out
    assert "M LoRA" in out.splitlines()[-1], out
    assert main(["memory", *flags, "--dp", "8", "--grad-accum-steps", "8", "--lora-rank", "16", "--cp", "2"]) == 2
    assert "context-parallel-size > 1" in capsys.readouterr().err


def test_plan_command_prints_the_lora_recipe_lines(capsys) -> None:
    """`threed plan ... --lora-rank 16` (tp and micro given: a second): the 70B LoRA recipe's layout and variables,
    and at pp 2 the schedule line says why 1F1B."""
    from threed.cli.main import main  # the whole command line (argparse): the flags as a user types them

    hw = ["--nodes", "4", "--gpus-per-node", "8", "--gpu-memory", "80", "--reserve", "8", "--seq-length", "8192"]
    args = ["plan", "--model", "llama3.1-70b", *hw, "--global-batch-size", "64", "--micro-batch-size", "1"]
    assert main([*args, "--tp", "4", "--vpp", "1", "--lora-rank", "16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for line in (
        "TP=${TP-4}",
        "PP=${PP-1}",
        "RECOMPUTE_NUM_LAYERS=${RECOMPUTE_NUM_LAYERS-43}",
        "LORA_RANK=${LORA_RANK-16}",
    ):
        assert line in lines, lines
    assert "pipeline schedule: 1f1b: one stage, no bubble" in lines and not any(" zb-h1 " in x for x in lines)
    assert any("LoRA rank 16 on q k v o gate up down" in line for line in lines)
    assert main([*args, "--tp", "8", "--pp", "2", "--lora-rank", "16"]) == 0  # a pipeline: 1F1B, and why not ZB-H1
    lines = capsys.readouterr().out.splitlines()
    assert "pipeline schedule: 1f1b: LoRA's frozen base has no weight gradient for zb-h1 to defer" in lines


def test_a_lora_checkpoint_is_counted_as_its_adapters() -> None:
    """70B LoRA r16 from a base at tp8 pp4 dp2: a checkpoint is the adapters' bf16 weights and their fp32 master and
    AdamW moments (14 B per adapter element, ~2.9 GB) instead of ~140 GB more of frozen bf16 base; what each rank writes
    (--async-save's host copy) is its stage's adapters, ZeRO-1 sharded over dp, weights from dp rank 0 only. A LoRA
    run from random init (no base to name) saves its frozen weights too."""
    from threed.checkpoint.format import checkpoint_bytes, node_checkpoint_bytes
    from threed.config import CheckpointConfig, ParallelConfig, RunConfig, TrainConfig
    from threed.memory.model import host_copy_bytes

    adapters = block_elements(M70, R16) * M70.num_layers
    parallel, train = ParallelConfig(tp=8, pp=4), TrainConfig(dtype="bf16")
    cfg = RunConfig(model=M70, parallel=parallel, train=train, checkpoint=CheckpointConfig(init_from="b"), lora=R16)
    assert checkpoint_bytes(cfg) == 14 * adapters and 2.5e9 < 14 * adapters < 3e9
    random_init = RunConfig(model=M70, parallel=parallel, train=train, lora=R16)
    assert checkpoint_bytes(random_init) > 140e9
    kinds = [["block"] * 20] * 4
    per_rank = block_elements(M70, R16, 8) * 20
    first, second = (node_checkpoint_bytes(M70, "bf16", (8, 2, 1), kinds, [r], R16) for r in (0, 8))
    assert first == 12 * -(-per_rank // 2) + 2 * per_rank and second == 12 * -(-per_rank // 2)
    world = range(8 * 4 * 2)
    assert sum(node_checkpoint_bytes(M70, "bf16", (8, 2, 1), kinds, [r], R16) for r in world) == pytest.approx(
        14 * adapters, rel=1e-6
    )
    assert host_copy_bytes(M70, 8, 4, 2, 8192, range(8), lora=R16) < host_copy_bytes(M70, 8, 4, 2, 8192, range(8)) / 50
