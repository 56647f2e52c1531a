"""The SFT dataset (`threed.data.sft_dataset`) on its own: rows of whole examples, labels and loss mask shifted
inside each example (never across), padding masked, example ids per position, every example once per epoch, a
seeded order that differs per epoch and does not depend on anything but (seed, split, epoch)."""

from __future__ import annotations

import pytest

from helpers import gpt_dataset, model_config, sft_examples, write_sft_dataset
from threed.config import DataConfig, RunConfig, TrainConfig

SEQ = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    examples = sft_examples(120, 200, length=(3, SEQ + 2), seed=3)  # up to SEQ + 1 tokens: fills a row exactly
    return write_sft_dataset(tmp_path_factory.mktemp("sftds") / "chat", examples, 200), examples


def build(prefix: str, pack: bool, rows: int, seed: int = 1234):
    cfg = RunConfig(
        model=model_config("gqa31"),
        train=TrainConfig(seq_length=SEQ, steps=rows, micro_batch_size=1, eval_interval=0, seed=seed),
        data=DataConfig(data_path=(prefix,), split="100,0,0", pack=pack),
    )
    return gpt_dataset(cfg, 1).train


@pytest.mark.parametrize("pack", [True, False])
def test_rows_hold_whole_examples_shifted_inside_each(data, pack):
    prefix, examples = data
    ds = build(prefix, pack, rows=10)
    seen = []
    for row in range(len(ds)):
        sample, ids = ds[row], ds.examples(row).tolist()
        assert ("doc_ids" in sample) == pack
        at = 0
        for k, e in enumerate(ids):
            x, m = examples[e]
            n = len(x) - 1
            assert sample["tokens"][at : at + n].tolist() == x[:-1].tolist()
            assert sample["labels"][at : at + n].tolist() == x[1:].tolist()  # the last token is only a label
            assert sample["loss_mask"][at : at + n].tolist() == m[1:].tolist()
            if pack:
                assert (sample["doc_ids"][at : at + n] == k).all()
            at += n
        assert at <= SEQ and (pack or len(ids) == 1)
        assert not sample["loss_mask"][at:].any() and ds.real_tokens(row) == at
        if pack:
            assert (sample["doc_ids"][at:] == len(ids)).all()  # padding: its own segment
        seen += ids
    # One epoch at least: every example of 2+ tokens exactly once per epoch, in a seeded order.
    usable = sorted(i for i, (x, _) in enumerate(examples) if len(x) >= 2)
    first_epoch = seen[: len(usable)]
    assert sorted(first_epoch) == usable and first_epoch != usable
    assert ds.epochs == 1 and len(seen) == len(usable)


def test_packing_fills_rows_greedily(data):
    prefix, _ = data
    ds = build(prefix, True, rows=10)
    for row in range(len(ds) - 1):  # the next row's first example did not fit into this row
        nxt = ds.examples(row + 1)[0]
        assert ds.real_tokens(row) + int(ds.dataset.tokens.sequence_lengths[nxt]) - 1 > SEQ


def test_more_rows_than_an_epoch_take_new_shuffles_and_the_order_is_seeded(data):
    prefix, _ = data
    one = build(prefix, True, rows=10)
    many = build(prefix, True, rows=len(one) * 2 + 5)
    assert many.epochs == 3 and len(many) >= len(one) * 2 + 5
    assert [many.examples(i).tolist() for i in range(len(one))] == [one.examples(i).tolist() for i in range(len(one))]
    second = [e for i in range(len(one), 2 * len(one)) for e in many.examples(i).tolist()]
    first = [e for i in range(len(one)) for e in one.examples(i).tolist()]
    assert sorted(second) == sorted(first) and second != first
    other_seed = build(prefix, True, rows=10, seed=7)
    assert [other_seed.examples(i).tolist() for i in range(3)] != [one.examples(i).tolist() for i in range(3)]
