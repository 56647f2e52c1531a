"""`threed.model.layers.whole_sequences`, the one switch generation and scoring run under (threed.generate.decode's
`evaluation`): inside it every split attribute of a stage's modules says "whole sequences" (megatron's
`sequence_parallel` / `reduce_scatter_embeddings` and its config's, the blocks' `sequence_shards` / `context`, the
core attention's CP group, the LM head's `loss_chunks`), including the linear of a tied head that no module tree
holds; on exit, also when its body raises, every attribute holds its own object again. No process group: stand-in
modules carry the attributes (the real layers under tp2 cp2 sp: tests/ranks/test_samples_split.py). And
`threed.train.samples.prepare` takes runs with --sequence-parallel or --context-parallel-size > 1 (it refused them
before the switch).

    .venv/bin/python -m pytest -q tests/unit/test_whole_sequences.py
"""

from __future__ import annotations

import functools

import pytest
import torch

from threed.config import ConfigError, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.model.attention import SDPACoreAttention
from threed.model.layers import LlamaBlock, TiedLMHead, megatron_config, whole_sequences
from threed.model.presets import PRESETS
from threed.train.samples import prepare

MODEL = ModelConfig(
    name="ws", vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=64,
    max_position_embeddings=32,
)  # fmt: skip
CP_GROUP = object()  # stands in for the CP process group: only its identity matters


class Linear(torch.nn.Module):
    """What megatron's Column/RowParallelLinear carry that the switch reads: `sequence_parallel` and the config."""

    def __init__(self, config, sequence_parallel: bool):
        super().__init__()
        self.config, self.sequence_parallel = config, sequence_parallel
        self.weight = torch.nn.Parameter(torch.zeros(2))


class Embedding(torch.nn.Module):
    def __init__(self, reduce_scatter: bool):
        super().__init__()
        self.reduce_scatter_embeddings = reduce_scatter


def block(config, shards: int, context: tuple[int, int]) -> LlamaBlock:
    """A LlamaBlock as far as the switch sees it (megatron's TransformerLayer needs process groups to build)."""
    b = LlamaBlock.__new__(LlamaBlock)
    torch.nn.Module.__init__(b)
    b.sequence_shards, b.context = shards, context
    b.core = SDPACoreAttention(config, layer_number=1)
    b.core.cp_group = CP_GROUP if context[0] > 1 else None
    b.linear_qkv, b.linear_proj = Linear(config, config.sequence_parallel), Linear(config, config.sequence_parallel)
    b.norm = torch.nn.RMSNorm(4)
    if config.sequence_parallel:
        b.norm.weight.sequence_parallel = True  # the gradient reduction's tag: not the switch's
    return b


def stage(sequence_parallel: bool = True, cp: int = 2, chunks: int = 4):
    """(kind, callable) pairs as `threed.generate.decode.stage_of` lists them, the head a tied one (DeepSpeed's
    `partial(TiedLMHead, embedding)`), and the config they share."""
    config = megatron_config(MODEL, 2, initialize=False, sequence_parallel=sequence_parallel)
    embedding = torch.nn.Module()
    embedding.word_embeddings = Embedding(sequence_parallel)
    head = TiedLMHead.__new__(TiedLMHead)
    head.linear = Linear(config, sequence_parallel)
    head.loss_chunks = chunks  # --lm-head-chunks: the training loss makes the logits in chunks
    blocks = [block(config, 2 if sequence_parallel else 1, (cp, 1) if cp > 1 else (1, 0)) for _ in range(2)]
    funcs = [("embedding", embedding), *[("block", b) for b in blocks], ("lm_head", functools.partial(head, embedding))]
    return funcs, config, embedding, blocks, head


def snapshot(funcs, config, embedding, blocks, head) -> list:
    """Every attribute the switch may touch, by value (the CP group by identity), and the norms' parameter tags."""
    out = [config.sequence_parallel, embedding.word_embeddings.reduce_scatter_embeddings, head.linear.sequence_parallel]
    out.append(head.loss_chunks)
    for b in blocks:
        out += [b.sequence_shards, b.context, id(b.core.cp_group), b.linear_qkv.sequence_parallel]
        out += [b.linear_proj.sequence_parallel, getattr(b.norm.weight, "sequence_parallel", None)]
    return out


def test_inside_every_split_is_off_and_after_every_attribute_is_back():
    funcs, config, embedding, blocks, head = parts = stage()
    before = snapshot(*parts)
    assert before[:3] == [True, True, True] and blocks[0].core.cp_group is CP_GROUP
    with whole_sequences(fn for _, fn in funcs):
        assert config.sequence_parallel is False
        assert embedding.word_embeddings.reduce_scatter_embeddings is False
        assert head.linear.sequence_parallel is False  # reached through the partial: no module tree holds it
        assert head.loss_chunks == 1  # generation and scoring read the logits themselves
        for b in blocks:
            assert (b.sequence_shards, b.context, b.core.cp_group) == (1, (1, 0), None)
            assert not b.linear_qkv.sequence_parallel and not b.linear_proj.sequence_parallel
            assert b.norm.weight.sequence_parallel is True  # read only by a gradient reduction: left alone
    assert snapshot(*parts) == before
    assert blocks[1].core.cp_group is CP_GROUP  # the very group object, not a copy


def test_restored_when_the_body_raises():
    funcs, *rest = parts = stage()
    before = snapshot(*parts)
    with pytest.raises(RuntimeError, match="decode failed"):
        with whole_sequences(fn for _, fn in funcs):
            assert rest[0].sequence_parallel is False
            raise RuntimeError("decode failed")
    assert snapshot(*parts) == before


def test_nested_and_repeated_modules_restore_their_own_values():
    """The config is shared by every linear and a module may be listed twice (a tied embedding at pp=1): each
    attribute is saved once, before its first change, so the outer state comes back, also after a nested use."""
    funcs, *_ = parts = stage()
    before = snapshot(*parts)
    twice = [fn for _, fn in funcs] + [fn for _, fn in funcs]
    with whole_sequences(twice):
        with whole_sequences(twice):
            pass
        assert parts[1].sequence_parallel is False
    assert snapshot(*parts) == before


def test_a_stage_without_splits_is_left_as_it_is():
    funcs, *_ = parts = stage(sequence_parallel=False, cp=1, chunks=1)
    before = snapshot(*parts)
    with whole_sequences(fn for _, fn in funcs):
        assert snapshot(*parts) == before
    assert snapshot(*parts) == before


@pytest.mark.parametrize(
    "parallel", [ParallelConfig(tp=2, sequence_parallel=True), ParallelConfig(cp=2)], ids=["sp", "cp2"]
)
def test_prepare_takes_a_split_sequence(tmp_path, parallel):
    """No refusal for the layout: prepare goes on to its next check (here the missing tokenizer file)."""
    cfg = RunConfig(
        model=PRESETS["tiny"],
        parallel=parallel,
        train=TrainConfig(seq_length=32, generate_interval=2, generate_prompts="p"),
        data=DataConfig(tokenizer=str(tmp_path / "tok.json")),
    )
    with pytest.raises(ConfigError, match=r"need the run's tokenizer: pass --tokenizer"):
        prepare(cfg)
