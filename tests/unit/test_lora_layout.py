"""LoRA without ranks: the bad inputs refused in one line before anything is built, the flags that set it, and each
TP rank's adapter slices (threed.convert.lora), which put back together give the PEFT tensors at any tp."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import model_config
from threed.cli.flags import parse_run_config
from threed.config import ConfigError, LoraConfig, ParallelConfig, RunConfig, TrainConfig
from threed.convert.lora import (
    fresh_adapters,
    full_shapes,
    gather_adapters,
    read_peft,
    shard,
    target_slices,
    write_peft,
)
from threed.model.spec import pipeline_layers

MODEL = model_config("gqa31")  # 4 heads / 2 KV heads, hidden 64, ffn 176
BLOCKS = [ly for ly in pipeline_layers(MODEL) if ly.kind == "block"]


def lora_run(tp=2, pp=1, cp=1, schedule="1f1b", dtype="fp32", zero_stage=1, **lora) -> RunConfig:
    return RunConfig(
        model=MODEL,
        parallel=ParallelConfig(tp=tp, pp=pp, cp=cp, pipeline_schedule=schedule),
        train=TrainConfig(dtype=dtype, seq_length=32, zero_stage=zero_stage),
        lora=LoraConfig(**lora),
    )


@pytest.mark.parametrize(
    "cfg,pattern",
    [
        (lora_run(lora_rank=-1), r"--lora-rank must be >= 0, got -1"),
        (lora_run(lora_rank=0, lora_init_from="x"), r"--lora-init-from needs --lora-rank > 0 \(got 0\)"),
        (lora_run(lora_rank=4, lora_targets=("q", "qkv")), r"--lora-targets: unknown target\(s\) qkv; choose from q k"),
        (lora_run(tp=2, lora_rank=3), r"--lora-rank 3 is not divisible by --tp 2: the adapters of q k v gate up"),
        (lora_run(tp=2, pp=2, schedule="zb-h1", lora_rank=4), r"zb-h1 with --lora-rank: the frozen base has no"),
        # DeepSpeed's FP16_Optimizer (bf16 at ZeRO 0) would keep buffers for the frozen base: refused for every run.
        (lora_run(dtype="bf16", zero_stage=0, lora_rank=4), r"--zero-stage 0 with --dtype bf16 is not supported"),
        (lora_run(cp=2, lora_rank=4), r"--lora-rank with --context-parallel-size > 1 is not supported in this build"),
    ],
)
def test_bad_lora_input_is_one_line(cfg, pattern):
    with pytest.raises(ConfigError, match=pattern) as err:
        cfg.validate(world_size=cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.cp)
    assert "\n" not in str(err.value)


def test_row_targets_alone_take_any_rank_at_any_tp():
    """o and down shard A's input columns and B's output rows over TP, never the rank."""
    lora_run(tp=2, lora_rank=3, lora_targets=("o", "down")).validate(world_size=2)


def test_lora_flags_land_in_their_section():
    cfg = parse_run_config(
        ["--model", "tiny", "--dtype", "fp32", "--lora-rank", "8", "--lora-alpha", "16", "--lora-targets", "q", "v"]
    )
    assert cfg.lora == LoraConfig(lora_rank=8, lora_alpha=16.0, lora_targets=("q", "v"))
    assert RunConfig.from_dict(cfg.to_dict()).lora.lora_rank == 8


@pytest.mark.parametrize("tp", [1, 2])
def test_rank_slices_put_together_give_the_peft_tensors(tp):
    lora = LoraConfig(lora_rank=4)
    gen = torch.Generator().manual_seed(0)
    full = {k: torch.randn(s, generator=gen) for k, s in full_shapes(MODEL, BLOCKS[1], lora).items()}
    shards = []
    for rank in range(tp):
        state = {}
        for t in target_slices(MODEL, BLOCKS[1], lora, tp, rank):
            state[t.key("A")], state[t.key("B")] = shard(full, t.a), shard(full, t.b)
        shards.append(state)
    back = gather_adapters(MODEL, BLOCKS[1], lora, shards)
    assert back.keys() == full.keys() and all(torch.equal(back[k], full[k]) for k in full)


def test_qkv_adapter_rows_land_in_megatron_grouped_layout():
    """At tp 1 the fused QKV output is [q of group 0 | k0 | v0 | q of group 1 | k1 | v1] (32 + 16 + 16 rows each)."""
    got = {t.target: t.placement for t in target_slices(MODEL, BLOCKS[0], LoraConfig(lora_rank=4), 1, 0)}
    assert got["q"] == ((0, 32, 0), (32, 32, 64))
    assert got["k"] == ((0, 16, 32), (16, 16, 96))
    assert got["v"] == ((0, 16, 48), (16, 16, 112))
    assert got["up"] == ((0, 176, 176),)


def test_fresh_adapters_start_at_the_base_and_do_not_depend_on_layout():
    lora = LoraConfig(lora_rank=4)
    a, b = fresh_adapters(MODEL, BLOCKS[2], lora, 5), fresh_adapters(MODEL, BLOCKS[2], lora, 5)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(not v.any() for k, v in a.items() if "lora_B" in k)
    assert all(v.abs().max() > 0 for k, v in a.items() if "lora_A" in k)


def test_peft_folder_round_trip_and_a_foreign_base_is_refused(tmp_path):
    lora = LoraConfig(lora_rank=4, lora_alpha=8.0)
    tensors = {}
    for layer in BLOCKS:
        tensors.update({k: torch.randn(s) for k, s in full_shapes(MODEL, layer, lora).items()})
    write_peft(tmp_path / "a", tensors, lora)
    back = read_peft(tmp_path / "a", MODEL, lora)
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    with pytest.raises(ConfigError, match=r"its r \(--lora-rank\) is 4, this run's is 8"):
        read_peft(tmp_path / "a", MODEL, dataclasses.replace(lora, lora_rank=8))
    wider = dataclasses.replace(MODEL, ffn_hidden_size=192)
    with pytest.raises(ConfigError, match=r"mlp.gate_proj.lora_B.weight is \(176, 4\), this base needs \(192, 4\)"):
        read_peft(tmp_path / "a", wider, lora)
