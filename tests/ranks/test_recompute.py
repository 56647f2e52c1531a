"""Partial and selective recomputation (issue 18), Megatron-LM's flags: full recompute of whole blocks (`uniform`:
every block, in chunks of N; `block`: the first N blocks of each stage) and selective recompute (the core attention
of every block, megatron-core's own). They change memory, not numbers: one 8-rank run (tp2 pp2 dp2, fp32, HF's
gqa31 weights) trains 3 steps each way and counts forward calls to show what is recomputed. Layouts that cannot
hold N are refused before anything is built, by `threed check-config` as by `threed train`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import RANKS, model_config, write_dataset
from threed.config import ConfigError, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.dims import resolve_dims
from threed.parallel.partition import recompute_chunks

REL = 1e-6
BLOCK1 = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, rank_pool) -> list[dict]:
    out = tmp_path_factory.mktemp("recompute")
    data = write_dataset(out / "random", np.random.default_rng(0).integers(0, 200, 5000), 200)
    rank_pool.run(8, str(RANKS / "recompute_worker.py"), ["--out", str(out), "--data", data], timeout=900)
    return [json.loads((out / f"recompute_rank{r}.json").read_text()) for r in range(8)]


def assert_same_numbers(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=REL), f"{what}: losses"
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=REL), f"{what}: gradient norms"


@pytest.mark.parametrize("name", ["uniform1", "block1", "uniform2", "selective"])
def test_recompute_changes_memory_not_numbers(ranks, name) -> None:
    for rank, r in enumerate(ranks):
        assert r["none"]["grad_norms"][0] > 0.5, "a run that learns something"
        assert_same_numbers(r[name], r["none"], f"rank {rank} {name}")


@pytest.mark.parametrize("name", ["sp_block1", "sp_selective"])
def test_recompute_under_sequence_parallelism(ranks, name) -> None:
    for rank, r in enumerate(ranks):
        assert_same_numbers(r[name], r["sp_none"], f"rank {rank} {name}")
        assert_same_numbers(r[name], r["none"], f"rank {rank} {name} against no sequence parallelism")


@pytest.mark.parametrize("name", ["packed_block1", "packed_selective"])
def test_recompute_on_packed_rows(ranks, name) -> None:
    """Packed rows pass (hidden, doc_ids) between blocks and the segments as the core attention's mask; DeepSpeed
    checkpoints them with its non-reentrant function, megatron the core attention with its own."""
    for rank, r in enumerate(ranks):
        assert_same_numbers(r[name], r["packed_none"], f"rank {rank} {name}")
    assert ranks[0]["packed_none"]["losses"] != ranks[0]["none"]["losses"], "packed rows are other data"


# Forward calls per micro-batch of a stage's two blocks and of their core attentions: a recomputed block runs
# twice (forward, then again in backward), a kept one once.
FORWARDS = {
    "none": ([1, 1], [1, 1]),
    "uniform1": ([2, 2], [2, 2]),
    "uniform2": ([2, 2], [2, 2]),
    "block1": ([2, 1], [2, 1]),  # partial: only the first block of each stage
    "selective": ([1, 1], [2, 2]),  # the block once, its core attention twice
    "sp_block1": ([2, 1], [2, 1]),
    "sp_selective": ([1, 1], [2, 2]),
    "packed_block1": ([2, 1], [2, 1]),
    "packed_selective": ([1, 1], [2, 2]),
}


@pytest.mark.parametrize("name", list(FORWARDS))
def test_only_the_chosen_blocks_are_recomputed(ranks, name) -> None:
    blocks, core = FORWARDS[name]
    for rank, r in enumerate(ranks):
        assert (r[name]["blocks"], r[name]["core_attn"]) == (blocks, core), f"rank {rank} stage {r[name]['stage']}"


def test_uniform_chunks_keep_only_each_chunks_input(ranks) -> None:
    """Stage 0 is embedding + 2 blocks, stage 1 2 blocks + norm + head: uniform 2 recomputes the two blocks as one
    chunk (one checkpoint: only its input kept), uniform 1 each alone, block 1 the first only."""
    runs = {
        0: {
            "uniform2": [[0, 1, False], [1, 3, True]],
            "uniform1": [[0, 1, False], [1, 2, True], [2, 3, True]],
            "block1": [[0, 1, False], [1, 2, True], [2, 3, False]],
        },
        1: {
            "uniform2": [[0, 2, True], [2, 4, False]],
            "uniform1": [[0, 1, True], [1, 2, True], [2, 4, False]],
            "block1": [[0, 1, True], [1, 4, False]],
        },
    }
    for r in ranks:
        for name, want in runs[r["none"]["stage"]].items():
            assert r[name]["runs"] == want, name
        assert r["selective"]["runs"] == [] and r["none"]["runs"] == [], "DeepSpeed's own forward"


def test_recompute_chunks() -> None:
    layers = [False] + [True] * 5 + [False, False]  # embedding, 5 blocks, norm, head
    assert recompute_chunks(layers, "uniform", 3) == [(0, 1, False), (1, 4, True), (4, 6, True), (6, 8, False)]
    assert recompute_chunks(layers, "block", 2) == [(0, 1, False), (1, 2, True), (2, 3, True), (3, 8, False)]
    assert recompute_chunks([True] * 3, "uniform", 5) == [(0, 3, True)]
    assert recompute_chunks([True] * 3, "block", 3) == [(0, 1, True), (1, 2, True), (2, 3, True)]


def run_config(pp: int = 2, **train) -> RunConfig:
    return RunConfig(
        model=model_config("gqa31"),
        parallel=ParallelConfig(pp=pp, partition_method="layers:3,1"),
        train=TrainConfig(**train),
    )


def recompute_summary(cfg: RunConfig) -> str:
    """The start-up line's phrase, as the run resolves it (threed.parallel.dims) at pp ranks."""
    return resolve_dims(cfg, cfg.parallel.pp).recompute_phrase


def test_start_up_phrase() -> None:
    assert recompute_summary(run_config()) == "none"
    assert (
        recompute_summary(run_config(recompute_granularity="selective"))
        == "selective (the core attention of every block)"
    )
    assert recompute_summary(run_config(activation_checkpointing=True)) == "full, uniform: every block, in chunks of 1"
    assert recompute_summary(run_config(**BLOCK1)) == "full, block 1 of 3 blocks on stage 0, 1 of 1 block on stage 1"


def check_config(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "threed.cli", "check-config", "--model", "tiny", "--world", "4", "--pp", "2", *flags],
        capture_output=True,
        text=True,
    )


def test_check_config_refuses_more_blocks_than_a_stage_holds() -> None:
    """tiny: 4 blocks, 2 per stage at pp 2."""
    out = check_config("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "3")
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "pipeline stage 0 holds 2 blocks" in lines[0], out.stderr
    assert "--recompute-num-layers 2 or fewer" in lines[0], lines[0]
    out = check_config(
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "2",
        "--partition-method",
        "layers:3,1",
    )
    assert out.returncode == 2 and "pipeline stage 1 holds 1 block, fewer than 2" in out.stderr, out
    out = check_config(
        "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"
    )
    assert out.returncode == 2 and "the largest, stage 0, holds 2 blocks" in out.stderr, out
    out = check_config("--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2")
    assert out.returncode == 0, out
    assert "recompute: full, block: the first 2 of 2 blocks on each of 2 stages" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "train, says",
    [
        (dict(recompute_granularity="selective", recompute_num_layers=2), "drop them"),
        (dict(recompute_granularity="selective", recompute_method="block"), "drop them"),
        (dict(recompute_granularity="full", recompute_num_layers=2), "needs --recompute-method"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers N"),
        (dict(activation_checkpointing=True, recompute_granularity="selective"), "not both"),
        (dict(recompute_method="block", recompute_num_layers=1), "add it, or drop them"),
    ],
)
def test_config_refuses_inconsistent_recompute_flags(train, says) -> None:
    with pytest.raises(ConfigError, match=says):
        RunConfig(model=model_config("gqa31"), train=TrainConfig(**train)).validate(1)
