"""The megatron-core data path, in one process: blends, Megatron's sample order (by consumed samples, the same at
any dp), exactly-once epochs, resume position, and the bad inputs refused before anything is built."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import gpt_dataset, write_dataset
from threed.config import ConfigError, DataConfig, ModelConfig, RunConfig, TrainConfig
from threed.data.checks import check_data
from threed.data.splits import parse_blend, read_data_flags
from threed.data.loader import micro_batches

MODEL = ModelConfig(
    name="t",
    vocab_size=1000,
    hidden_size=8,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    ffn_hidden_size=8,
    max_position_embeddings=64,
)


def run_cfg(data: DataConfig, seq: int = 16, steps: int = 10, **train) -> RunConfig:
    return RunConfig(model=MODEL, train=TrainConfig(seq_length=seq, steps=steps, **train), data=data)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    rng = np.random.default_rng(0)
    a = write_dataset(d / "a", rng.integers(0, 500, 60_000), 1000, seed=1)  # ids < 500: source A
    b = write_dataset(d / "b", rng.integers(500, 1000, 60_000), 1000, seed=2)  # ids >= 500: source B
    return a, b


def rows(batches, n: int) -> list[tuple[int, ...]]:
    out = []
    for _ in range(n):
        tokens, _ = next(batches)
        out += [tuple(r) for r in tokens.tolist()]
    return out


def test_blend_shares_follow_weights(two_sources):
    a, b = two_sources
    cfg = run_cfg(DataConfig(data_path=("0.3", a, "0.7", b), split="100,0,0"), steps=100)
    ds = gpt_dataset(cfg, 100).train
    assert len(ds) >= 10_000
    ids = np.array([int(ds[i]["dataset_id"]) for i in range(10_000)])
    share_a = float((ids == 0).mean())
    print(f"share of A over 10,000 samples: {share_a:.4f} (weight 0.3)")
    assert abs(share_a - 0.3) <= 0.01
    # dataset_id names the source the tokens came from.
    first_a = next(i for i in range(100) if ids[i] == 0)
    assert int(torch.as_tensor(ds[first_a]["tokens"]).max()) < 500


def test_sample_order_is_the_same_at_any_dp_and_resumes_by_consumed_samples(two_sources):
    a, _ = two_sources
    gbs, micro, steps = 8, 2, 12
    ds = gpt_dataset(run_cfg(DataConfig(data_path=(a,)), steps=steps), gbs).train
    single = rows(micro_batches(ds, gbs, gbs, 1, 0, 0, 1000), steps)
    # dp=2: global batch k = rank 0's share then rank 1's, each [micro] x (gas = 2) micro-batches.
    per_rank = [rows(micro_batches(ds, gbs, micro, 2, r, 0, 1000), 2 * steps) for r in range(2)]
    at_dp2 = [row for k in range(steps) for r in range(2) for row in per_rank[r][4 * k : 4 * k + 4]]
    assert at_dp2 == single
    # dp=4, micro 1
    per_rank4 = [rows(micro_batches(ds, gbs, 1, 4, r, 0, 1000), 2 * steps) for r in range(4)]
    at_dp4 = [row for k in range(steps) for r in range(4) for row in per_rank4[r][2 * k : 2 * k + 2]]
    assert at_dp4 == single
    # Resuming after 5 global batches (40 consumed samples) reads what the uninterrupted run read next.
    resumed = rows(micro_batches(ds, gbs, gbs, 1, 0, 5 * gbs, 1000), steps - 5)
    assert resumed == single[5 * gbs :]


def test_every_sample_exactly_once_per_epoch_at_dp2(tmp_path):
    rng = np.random.default_rng(3)
    prefix = write_dataset(tmp_path / "small", rng.integers(0, 1000, 3_000), 1000)
    seq, gbs = 16, 4
    probe = gpt_dataset(run_cfg(DataConfig(data_path=(prefix,), split="100,0,0"), seq=seq, steps=1), gbs).train
    epoch = len(probe)  # samples in one epoch (the builder makes at least one)
    steps = epoch // gbs
    ds = gpt_dataset(run_cfg(DataConfig(data_path=(prefix,), split="100,0,0"), seq=seq, steps=steps), gbs).train
    read = [row for r in range(2) for row in rows(micro_batches(ds, gbs, 2, 2, r, 0, 1000), steps)]
    everything = [tuple(torch.as_tensor(ds[i]["tokens"]).tolist()) for i in range(steps * gbs)]
    assert len(set(everything)) == len(everything), "random tokens: every sample differs"
    assert sorted(read) == sorted(everything)
    assert steps * gbs > 0.9 * epoch


def test_labels_are_next_tokens_and_loss_mask_honours_eod(tmp_path):
    from threed.data.tokenizer import train_tokenizer
    from threed.data.demo_text import write_demo_text

    text = write_demo_text(str(tmp_path / "corpus.txt"))
    tok = train_tokenizer([text], 512, str(tmp_path / "tok"))  # eos id 2
    rng = np.random.default_rng(0)
    stream = np.concatenate([np.append(rng.integers(3, 512, rng.integers(5, 30)), 2) for _ in range(300)])
    prefix = write_dataset(tmp_path / "eod", stream, 512)
    model = ModelConfig(
        name="t",
        vocab_size=512,
        hidden_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        ffn_hidden_size=8,
        max_position_embeddings=64,
    )
    for mask_eod in (False, True):
        cfg = RunConfig(
            model=model,
            train=TrainConfig(seq_length=32, steps=2),
            data=DataConfig(data_path=(prefix,), tokenizer=tok, eod_mask_loss=mask_eod),
        )
        s = gpt_dataset(cfg, 4).train[0]
        tokens, labels, mask = (torch.as_tensor(s[k]) for k in ("tokens", "labels", "loss_mask"))
        assert torch.equal(tokens[1:], labels[:-1])
        # Megatron's eod_mask_loss: no loss where the *input* is the end of a document (predicting across it).
        assert bool((mask[tokens == 2] == 0).all()) == mask_eod and int((tokens == 2).sum()) > 0
        assert bool((mask[tokens != 2] == 1).all())


def test_megatron_flag_grammar():
    assert parse_blend(["0.3", "a", "0.7", "b"], "--data-path").weights == (0.3, 0.7)
    assert parse_blend(["a", "b"], "--data-path").weights is None
    assert parse_blend(["a"], "--data-path").prefixes == ("a",)
    from threed.cli.flags import parse_run_config

    cfg = parse_run_config(
        [
            "--model",
            "tiny",
            "--data-path",
            "0.3",
            "A",
            "0.7",
            "B",
            "--split",
            "969,30,1",
            "--data-cache-path",
            "/c",
            "--eval-interval",
            "5",
            "--eval-iters",
            "2",
            "--train-iters",
            "7",
        ]
    )
    assert cfg.data.data_path == ("0.3", "A", "0.7", "B") and cfg.data.data_cache_path == "/c"
    assert (cfg.train.eval_interval, cfg.train.eval_iters, cfg.train.steps) == (5, 2, 7)


def test_every_train_flag_has_help():
    import argparse

    from threed.cli.flags import add_run_flags

    p = argparse.ArgumentParser()
    add_run_flags(p)
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and not action.help.startswith("(default"), f"{action.option_strings} has no help"
            assert action.metavar and "." not in str(action.metavar), f"{action.option_strings}: {action.metavar}"


def _bad_inputs(tmp_path, good):
    """(flags, expected message) for each bad input."""
    missing_bin = write_dataset(tmp_path / "nobin", np.arange(500) % 100, 1000)
    os.remove(missing_bin + ".bin")
    small = write_dataset(tmp_path / "small", np.arange(10) % 100, 1000)
    big_vocab = write_dataset(tmp_path / "bigvocab", np.arange(30_000) % 5000, 70_000)
    not_a_dir = tmp_path / "file"  # (root ignores permission bits, so "unwritable" is a path under a file)
    not_a_dir.write_text("x")
    return [
        (dict(data_path=(str(tmp_path / "nothere"),)), r"nothere.idx, .*nothere.bin not found"),
        (dict(data_path=(missing_bin,)), r"nobin.bin not found"),
        (dict(data_path=("0.3", good, "x", good)), r"weights and prefixes must alternate"),
        (dict(data_path=("-0.3", good, "0.7", good)), r"weights must be finite and >= 0"),
        (dict(data_path=("0", good, "0", good)), r"sum to 0"),
        (dict(data_path=("0.5", good, "0.5", str(tmp_path / "gone"))), r"gone.idx.*not found"),
        (dict(data_path=(good,), split="0,0,0"), r"sums to 0"),
        (dict(data_path=(good,), split="a,b"), r"not a list of numbers"),
        (dict(data_path=(good,), split="0,100,0"), r"gives training no documents"),
        (dict(data_path=(big_vocab,)), r"token id 4999, beyond the model's vocab_size 1000"),
        (dict(data_path=(small,)), r"fewer than one sample of seq_length 16"),
        (dict(data_path=(good,), data_cache_path=str(not_a_dir / "cache")), r"cache .* is not writable"),
        (dict(data_path=(good,), split="100,0,0", eval_interval=5), r"--eval-interval 5 needs a validation split"),
        (dict(), r"no training data: pass --data-path"),
        (dict(data_path=(good,), train_data_path=(good,)), r"either --data-path .* not both"),
        (dict(data_path=(good,), eod_mask_loss=True), r"--eod-mask-loss needs --tokenizer"),
        (dict(data_path=(good,), tokenizer=str(tmp_path / "no.model")), r"--tokenizer: no tokenizer at"),
    ]


def test_bad_data_inputs_are_one_clear_error_before_anything_is_built(two_sources, tmp_path):
    good = two_sources[0]
    before = sorted(p.name for p in Path(good).parent.iterdir())
    for flags, pattern in _bad_inputs(tmp_path, good):
        train = {k: flags.pop(k) for k in ("eval_interval",) if k in flags}
        with pytest.raises(ConfigError, match=pattern) as err:
            check_data(run_cfg(DataConfig(**flags), **train))
        assert "\n" not in str(err.value), f"{flags}: one line, got {err.value}"
    assert sorted(p.name for p in Path(good).parent.iterdir()) == before, "a refused run wrote nothing"


def test_eval_interval_defaults_like_megatron(two_sources):
    a, _ = two_sources
    assert read_data_flags(run_cfg(DataConfig(data_path=(a,)))).eval_interval == 1000
    assert read_data_flags(run_cfg(DataConfig(data_path=(a,), split="100,0,0"))).eval_interval == 0
    assert read_data_flags(run_cfg(DataConfig(data_path=(a,)), eval_interval=0)).eval_interval == 0
