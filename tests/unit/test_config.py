"""Config validation (each invalid combination fails with a message naming the numbers), presets with the
published hyperparameters, HF config.json round trip, the DeepSpeed config, CLI flags and checkpoint layouts."""

from __future__ import annotations

import dataclasses

import pytest

from threed.config import (
    CheckpointConfig,
    ConfigError,
    ParallelConfig,
    RunConfig,
    RunControlConfig,
    TrainConfig,
    check_ranges,
    meta,
)
from threed.engine.resolved import resolve
from threed.cli.flags import parse_run_config
from threed.hf.config import from_hf_config, to_hf_config
from threed.model.presets import PRESETS
from threed.model.spec import parameter_count

LLAMA2_70B = PRESETS["llama2-70b"]


def run(tp=1, pp=1, model=LLAMA2_70B, cp=1, **train) -> RunConfig:
    return RunConfig(model=model, parallel=ParallelConfig(tp=tp, pp=pp, cp=cp), train=TrainConfig(**train))


@pytest.mark.parametrize(
    "cfg,world,pattern",
    [
        (run(tp=3), 3, r"tp=3 does not divide num_heads=64"),
        (run(tp=16), 16, r"tp=16 does not divide num_kv_heads=8"),
        (run(pp=81), 81, r"pp=81 is larger than num_layers=80"),
        (run(tp=8, pp=4), 48, r"world size 48 is not divisible by tp\*pp\*cp = 8\*4\*1 = 32"),
        (
            run(tp=8, pp=4, micro_batch_size=1, grad_accum_steps=8, global_batch_size=256),
            64,
            r"micro x gas x dp = 1 x 8 x 2 = 16, got global_batch_size 256\. dp is world / \(tp x pp x cp\)",
        ),
        (run(micro_batch_size=3, global_batch_size=16), 1, r"global_batch_size 16 is not divisible by .* 3 x 1"),
        (run(seq_length=8192), 1, r"seq_length 8192 exceeds max_position_embeddings 4096"),
        (run(grad_accum_dtype="bf16"), 1, r"grad_accum_dtype must be 'fp32'"),
        (run(zero_stage=2), 1, r"ZeRO 0 or 1 only"),
        (run(dtype="fp16"), 1, r"dtype must be 'bf16' or 'fp32'"),
    ],
)
def test_invalid_configs_name_the_numbers(cfg, world, pattern):
    with pytest.raises(ConfigError, match=pattern):
        cfg.validate(world)


def test_batch_uses_dp_not_world():
    cfg = run(tp=8, pp=4, micro_batch_size=1, grad_accum_steps=16)
    ds = resolve(cfg, 128).ds_config  # 4 nodes x ... : dp = 128 / 32 = 4
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (
        64,
        1,
        16,
    )
    derived = run(tp=8, pp=4, micro_batch_size=2, global_batch_size=512)
    assert derived.train.resolve_batch(derived.parallel.dp(256)) == (2, 32, 512)


def test_deepspeed_config_bf16_uses_fp32_accumulation_and_zero1():
    ds = resolve(run(dtype="bf16"), 1).ds_config
    assert ds["bf16"]["enabled"] and ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["zero_optimization"]["stage"] == 1
    assert "bf16" not in resolve(run(dtype="fp32"), 1).ds_config


@pytest.mark.parametrize(
    "name,hidden,layers,heads,kv,ffn,vocab,theta,max_pos,scaled,billions",
    [
        ("llama2-7b", 4096, 32, 32, 32, 11008, 32000, 1e4, 4096, False, 6.74),
        ("llama2-13b", 5120, 40, 40, 40, 13824, 32000, 1e4, 4096, False, 13.02),
        ("llama2-70b", 8192, 80, 64, 8, 28672, 32000, 1e4, 4096, False, 68.98),
        ("llama3-8b", 4096, 32, 32, 8, 14336, 128256, 5e5, 8192, False, 8.03),
        ("llama3-70b", 8192, 80, 64, 8, 28672, 128256, 5e5, 8192, False, 70.55),
        ("llama3.1-8b", 4096, 32, 32, 8, 14336, 128256, 5e5, 131072, True, 8.03),
        ("llama3.1-70b", 8192, 80, 64, 8, 28672, 128256, 5e5, 131072, True, 70.55),
        ("llama3.1-405b", 16384, 126, 128, 8, 53248, 128256, 5e5, 131072, True, 405.85),
    ],
)
def test_presets_are_the_published_models(
    name, hidden, layers, heads, kv, ffn, vocab, theta, max_pos, scaled, billions
):
    m = PRESETS[name]
    assert (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size) == (
        hidden,
        layers,
        heads,
        kv,
        ffn,
        vocab,
    )
    assert (m.rope_theta, m.max_position_embeddings, m.rms_norm_eps) == (theta, max_pos, 1e-5)
    assert (m.rope_scaling is not None) == scaled
    if scaled:
        s = m.rope_scaling
        assert (s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (
            8.0,
            1.0,
            4.0,
            8192,
        )
    assert parameter_count(m) / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.parametrize("name", ["llama2-70b", "llama3.1-405b", "tiny"])
def test_hf_config_round_trip(name):
    m = PRESETS[name]
    back = from_hf_config(to_hf_config(m), name=name)
    assert back == dataclasses.replace(m, make_vocab_size_divisible_by=back.make_vocab_size_divisible_by)


def test_transformers_v4_config_layout():
    hf = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }
    assert from_hf_config(hf) == dataclasses.replace(PRESETS["llama3.1-8b"], name="hf")
    # Llama 3.2 1B / 3B tie the LM head to the embedding; Llama 3.2 3B's published config.json is the preset.
    assert from_hf_config({**hf, "tie_word_embeddings": True}).tie_word_embeddings
    llama32_3b = {
        **hf,
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "head_dim": 128,
        "intermediate_size": 8192,
        "tie_word_embeddings": True,
        "rope_scaling": {**hf["rope_scaling"], "factor": 32.0},
    }
    assert from_hf_config(llama32_3b) == dataclasses.replace(PRESETS["llama3.2-3b"], name="hf")
    for flag in ("attention_bias", "mlp_bias"):
        with pytest.raises(ConfigError, match=flag):
            from_hf_config({**hf, flag: True})


def test_padded_vocab():
    assert LLAMA2_70B.padded_vocab_size(8) == 32768
    assert PRESETS["llama3-8b"].padded_vocab_size(8) == 129024
    assert PRESETS["llama3-8b"].padded_vocab_size(1) == 128256


def test_cli_flags_come_from_the_dataclasses():
    cfg = parse_run_config(
        [
            "--model",
            "tiny",
            "--tp",
            "2",
            "--pp",
            "2",
            "--micro-batch-size",
            "4",
            "--global-batch-size",
            "64",
            "--data-path",
            "x",
            "--dtype",
            "fp32",
            "--activation-checkpointing",
            "true",
            "--save",
            "ck",
        ]
    )
    assert cfg.parallel == ParallelConfig(tp=2, pp=2)
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.dtype) == (4, 64, "fp32")
    assert cfg.train.activation_checkpointing and cfg.data.data_path == ("x",) and cfg.checkpoint.save == "ck"
    assert cfg.model == PRESETS["tiny"]


def test_missing_checkpoint_fails_before_building(tmp_path):
    from threed.parallel.distributed import Runtime
    from threed.engine.build import build_engine
    import torch

    cfg = dataclasses.replace(run(model=PRESETS["tiny"]), checkpoint=CheckpointConfig(init_from=str(tmp_path)))
    rt = Runtime(device=torch.device("cpu"), backend="gloo", rank=0, world_size=1, local_rank=0)
    with pytest.raises(ConfigError, match="holds no DeepSpeed checkpoint"):
        build_engine(resolve(cfg, 1), rt)


def test_deepspeed_json_for_bf16_reduces_in_fp32_and_frees_bf16_grads():
    ds = resolve(run(tp=2, pp=2, model=PRESETS["tiny"]), 8).ds_config
    assert ds["bf16"] == {"enabled": True, "immediate_grad_update": True}
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    assert ds["communication_data_type"] == "fp32"
    assert ds["zero_optimization"] == {"stage": 1}


def test_run_control_and_partition_flags_land_in_their_sections():
    cfg = parse_run_config(
        [
            "--model",
            "tiny",
            "--skip-nonfinite",
            "2",
            "--exit-duration-in-mins",
            "5",
            "--dist-timeout-minutes",
            "3",
            "--watchdog-factor",
            "0",
            "--watchdog-min-seconds",
            "9",
            "--partition-method",
            "uniform",
            "--tensor-model-parallel-size",
            "2",
        ]
    )
    assert cfg.control == RunControlConfig(
        skip_nonfinite=2,
        exit_duration_in_mins=5.0,
        dist_timeout_minutes=3.0,
        watchdog_factor=0.0,
        watchdog_min_seconds=9.0,
    )
    assert cfg.parallel == ParallelConfig(tp=2, partition_method="uniform")


def test_run_configs_written_before_the_sections_moved_still_load():
    """threed_run.json / manifests written before run control left `checkpoint` and partition_method left `train`."""
    cfg = run(model=PRESETS["tiny"], seq_length=64)
    old = cfg.to_dict()
    control, parallel = old.pop("control"), old["parallel"]
    old["checkpoint"].update(control, skip_nonfinite=3, watchdog_factor=0.0)
    old["train"]["partition_method"] = parallel.pop("partition_method")
    old["train"]["partition_method"] = "layers:1,3"
    back = RunConfig.from_dict(old)
    assert back.control == RunControlConfig(skip_nonfinite=3, watchdog_factor=0.0)
    assert back.parallel.partition_method == "layers:1,3" and back.train == cfg.train
    assert back.checkpoint == cfg.checkpoint
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_a_range_is_stated_on_its_field_not_by_name():
    """Ranges come from each field's metadata: a field named like a ranged one elsewhere gets only the default."""

    @dataclasses.dataclass(frozen=True)
    class Section:
        factor: float = -1.0  # RopeScaling.factor must be > 0; this one only gets the default (>= 0)
        tp: int = dataclasses.field(default=0, metadata=meta("x"))
        ratio: float = dataclasses.field(default=0.5, metadata=meta("x", above=0, below=1))

    with pytest.raises(ConfigError, match=r"^--factor must be >= 0, got -1.0$"):
        check_ranges("train", Section())
    check_ranges("train", Section(factor=0.0))  # tp 0 is fine here: ParallelConfig.tp's range is its own
    with pytest.raises(ConfigError, match=r"--ratio must be in \[0, 1\), got 1.0"):
        check_ranges("train", Section(factor=0.0, ratio=1.0))
    with pytest.raises(ConfigError, match=r"model field factor must be > 0, got 0.0"):
        RunConfig(
            model=dataclasses.replace(
                PRESETS["llama3.1-8b"],
                rope_scaling=dataclasses.replace(PRESETS["llama3.1-8b"].rope_scaling, factor=0.0),
            )
        ).validate(1)


def test_megatron_aliases_and_help_come_from_the_fields():
    import argparse

    from threed.cli.flags import add_run_flags

    p = argparse.ArgumentParser()
    add_run_flags(p)
    names = {a.dest: a.option_strings for a in p._actions}
    assert names["parallel.tp"] == ["--tp", "--tensor-model-parallel-size"]
    assert names["parallel.pp"] == ["--pp", "--pipeline-model-parallel-size"]
    assert names["train.steps"] == ["--steps", "--train-iters"]
    assert names["train.grad_clip"] == ["--grad-clip", "--clip-grad"]
    assert names["control.skip_nonfinite"] == ["--skip-nonfinite"]
    assert names["parallel.partition_method"] == ["--partition-method"]


@pytest.mark.parametrize(
    "cfg, world, message",
    [
        (run(tp=2, pp=2, cp=2), 12, r"world size 12 is not divisible by tp\*pp\*cp = 2\*2\*2 = 8"),
        (run(tp=2, pp=1, cp=2, seq_length=102), 8, r"seq_length 102 is not a multiple of 4; use a multiple of 4"),
        (
            RunConfig(
                model=LLAMA2_70B,
                parallel=ParallelConfig(tp=2, cp=2, sequence_parallel=True),
                train=TrainConfig(seq_length=132),
            ),
            8,
            r"of whole SP slices \(x tp\): seq_length 132 is not a multiple of 8",
        ),
    ],
)
def test_context_parallel_size_is_counted_apart_from_dp(cfg, world, message):
    """DP excludes CP (Megatron's semantics): dp = world / (tp x pp x cp). A world CP does not divide and a sequence
    2·cp (·tp under SP) does not divide are refused in one line, before anything is built."""
    assert cfg.parallel.dp(16) == 16 // (cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    with pytest.raises(ConfigError, match=message):
        cfg.validate(world)


def test_context_parallel_run_validates_and_its_batch_counts_dp_only():
    cfg = run(tp=2, pp=2, cp=2, seq_length=64, micro_batch_size=2, global_batch_size=8)
    cfg.validate(16)  # dp 2: 8 = micro 2 x gas 2 x dp 2 (CP ranks read the same rows)
    assert cfg.parallel.dp(16) == 2 and cfg.train.resolve_batch(2) == (2, 2, 8)
