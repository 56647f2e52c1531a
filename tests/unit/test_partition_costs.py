"""`--partition-method costs:...` (threed.parallel.layer_costs + threed.parallel.partition) and `threed profile-layers`
(threed.plan.profile): the parsing and its one-line refusals, the split the min-max programme gives for hand-made
costs, the profiler on the tiny preset (positive costs, a method string that parses back), and check-config
accepting a costs: method. No timings are asserted.

    .venv/bin/python -m pytest -q tests/unit/test_partition_costs.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import BENCH
from threed.config import ConfigError, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.layer_costs import format_costs, parse_costs
from threed.parallel.partition import resolve_partition


def test_parse_fills_missing_kinds_with_zero() -> None:
    assert parse_costs("block=1, lm_head=1.2") == {"embedding": 0.0, "block": 1.0, "final_norm": 0.0, "lm_head": 1.2}
    assert parse_costs("LM_HEAD=2e-1,block=0.5,embedding=0") == {
        "embedding": 0.0,
        "block": 0.5,
        "final_norm": 0.0,
        "lm_head": 0.2,
    }


def test_format_is_relative_to_a_block_and_parses_back() -> None:
    method = format_costs({"embedding": 0.5, "block": 10.0, "final_norm": 0.1, "lm_head": 12.0})
    assert method == "costs:embedding=0.05,block=1,final_norm=0.01,lm_head=1.2"
    assert parse_costs(method[len("costs:") :])["lm_head"] == 1.2


@pytest.mark.parametrize(
    "spec, says",
    [
        ("", "no costs given"),
        ("lm_head=1.2", "no block cost"),
        ("block=0,lm_head=1", "block=0"),
        ("block=1,head=1.2", "unknown layer kind 'head'; the kinds are embedding, block, final_norm, lm_head"),
        ("block=1,block=2", "block is given twice"),
        ("block=one", "block='one' is not a number"),
        ("block=1,lm_head=-0.5", "lm_head=-0.5 must be a finite number >= 0"),
        ("block=inf", "must be a finite number"),
        ("block=1,,lm_head=1", "an empty entry"),
        ("block", "'block' is not KIND=COST"),
    ],
)
def test_bad_costs_are_one_line_naming_the_fix(spec: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        resolve_partition("costs:" + spec, BENCH, 2, 128)
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_split_follows_the_costs() -> None:
    # A head worth 1.2 blocks: 5 | 3 + 1.2 beats 4 | 4 + 1.2.
    assert resolve_partition("costs:block=1,lm_head=1.2", BENCH, 2, 128) == [0, 6, 11]
    # Nothing but blocks: 4 | 4. An embedding worth a block: embedding + 3 | 5 and embedding + 4 | 4 tie at 5, and
    # ties take the earliest boundary.
    assert resolve_partition("costs:block=1", BENCH, 2, 128) == [0, 5, 11]
    assert resolve_partition("costs:embedding=1,block=1", BENCH, 2, 128) == [0, 4, 11]
    # A head worth 4 blocks: 6 | 2 + 4 (5 | 3 + 4 and 7 | 1 + 4 are worse); at pp 4 the last stage holds one block
    # (1 + 4 = 5; two would be 6) and the other seven blocks spread over three stages.
    assert resolve_partition("costs:block=1,lm_head=4", BENCH, 2, 128) == [0, 7, 11]
    bounds = resolve_partition("costs:block=1,lm_head=4", BENCH, 4, 128)
    assert bounds[-2] == 8, bounds  # the last stage: block 7 + final_norm + lm_head
    # The same costs as `balanced`'s formula give `balanced`'s split (one programme for both).
    from threed.model.spec import layer_training_flops

    flops = {k: layer_training_flops(BENCH, k, 128) for k in ("embedding", "block", "final_norm", "lm_head")}
    assert resolve_partition(format_costs(flops), BENCH, 2, 128) == resolve_partition("balanced", BENCH, 2, 128)


def test_every_stage_keeps_a_block_however_heavy_the_head() -> None:
    bounds = resolve_partition("costs:block=1,lm_head=100", BENCH, 4, 128)
    blocks = [sum(1 <= i <= 8 for i in range(a, b)) for a, b in zip(bounds, bounds[1:])]
    assert min(blocks) >= 1 and sum(blocks) == 8, bounds


def test_profiler_on_tiny_gives_positive_costs_and_a_method_that_resolves() -> None:
    from threed.convert.resolve import model_config
    from threed.plan.profile import balance, profile_layers, report, stage_costs

    cfg = RunConfig(
        model=model_config("tiny"), parallel=ParallelConfig(pp=2), train=TrainConfig(dtype="fp32", seq_length=32)
    )
    profile = profile_layers(cfg, threads=1, warmup=1, repeats=2)
    assert set(profile.seconds) == {"embedding", "block", "final_norm", "lm_head"}
    assert all(t > 0 for t in profile.seconds.values()), profile.seconds
    assert profile.threads == 1
    method = profile.method
    costs = parse_costs(method[len("costs:") :])
    assert costs["block"] == 1 and all(c > 0 for c in costs.values()), method
    bounds, stages = stage_costs(method, cfg.model, 2, 32)
    assert bounds == resolve_partition(method, cfg.model, 2, 32) and len(stages) == 2
    spread, fraction = balance(stages)
    assert spread >= 1 and 0 < fraction <= 1
    lines = report(profile, cfg)
    assert f"--partition-method {method}" in lines and any("spread (slowest / fastest)" in x for x in lines)


def test_profiler_runs_trainings_swiglu_and_fresh_gradients() -> None:
    """profile-layers builds its layers with the switch training uses (`cuda_only`: megatron's fused SwiGLU on
    CUDA, the unfused one on CPU), and every repeat's backward starts from no weight gradients, as training's do
    (DeepSpeed's hooks free each .grad): the gradients left after warm-up + repeats are one backward's, bit for
    bit, not their sum."""
    import torch

    from threed.convert.resolve import model_config
    from threed.plan import profile

    cfg = RunConfig(
        model=model_config("tiny"), parallel=ParallelConfig(pp=2), train=TrainConfig(dtype="bf16", seq_length=32)
    )
    assert profile.megatron_config_as_trained(cfg, torch.device("cpu")).bias_activation_fusion is False
    assert profile.megatron_config_as_trained(cfg, torch.device("cuda", 0)).bias_activation_fusion is True
    cpu = torch.device("cpu")
    with profile._world_of_one():
        modules, steps = profile._layer_steps(cfg, cpu)
        steps["block"]()
        once = {n: p.grad.clone() for n, p in modules["block"].named_parameters()}
        profile._median_times([steps["block"]], cpu, 1, 2, before=lambda: profile._drop_grads(modules.values()))
        for name, param in modules["block"].named_parameters():
            assert torch.equal(param.grad, once[name]), f"{name}: accumulated over the repeats"


def test_check_config_accepts_a_costs_method_and_refuses_a_bad_one() -> None:
    base = [
        sys.executable,
        "-m",
        "threed.cli",
        "check-config",
        "--model",
        "tiny",
        "--world",
        "2",
        "--pp",
        "2",
        "--partition-method",
    ]
    out = subprocess.run(base + ["costs:block=1,lm_head=2.5"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "stages: 0: embedding + blocks 0-2 | 1: block 3 + final_norm + lm_head;" in out.stdout, out.stdout
    out = subprocess.run(base + ["costs:block=1,lm_hed=2"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "unknown layer kind 'lm_hed'" in out.stderr, out.stderr
