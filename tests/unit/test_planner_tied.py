"""`threed plan`, threed.memory and the throughput metrics for tied models (Llama 3.2 1B / 3B), checked against
numbers derived here independently: HF's own parameter count (transformers on the meta device) and the Llama
block written out by hand. No engine is built."""

from __future__ import annotations

import dataclasses

import pytest

from threed.convert.resolve import model_config
from threed.memory.model import GB, estimate, stages
from threed.metrics.flops import flops_per_token
from threed.model.spec import parameter_count
from threed.plan.planner import Hardware, plan, step_time, tied_allreduce_s

# Their HF model cards / config.json (tie_word_embeddings: true); recomputed from transformers below.
HF_PARAMS = {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824}
SEQ = 8192


def by_hand(name: str) -> tuple[int, int]:
    """(one block's parameters, the embedding's), from the architecture alone."""
    m = model_config(name)
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.head_dim
    q, kv = m.num_heads * d, m.num_kv_heads * d
    block = h * (q + 2 * kv) + q * h + 3 * h * f + 2 * h  # qkv, o, gate/up/down, two norms
    return block, m.vocab_size * h


@pytest.mark.parametrize("name", list(HF_PARAMS))
def test_parameter_count_is_hf_count(name: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    m = model_config(name)
    assert m.tie_word_embeddings
    with torch.device("meta"):
        hf = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=m.vocab_size,
                hidden_size=m.hidden_size,
                num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_heads,
                num_key_value_heads=m.num_kv_heads,
                intermediate_size=m.ffn_hidden_size,
                tie_word_embeddings=True,
            )
        )
    unique = {id(p): p.numel() for p in hf.parameters()}  # the tied weight is one Parameter
    assert sum(unique.values()) == HF_PARAMS[name] == parameter_count(m)
    block, embedding = by_hand(name)
    assert parameter_count(m) == m.num_layers * block + embedding + m.hidden_size


@pytest.mark.parametrize(
    "name, tp, pp",
    [("llama3.2-1b", 1, 1), ("llama3.2-1b", 1, 2), ("llama3.2-3b", 1, 2), ("llama3.2-3b", 2, 1), ("llama3.2-3b", 1, 4)],
)
def test_stage_memory_holds_the_tied_weight_per_end_stage(name: str, tp: int, pp: int) -> None:
    """The first and the last stage each hold [V/tp, h] (128256 is a multiple of 128 x tp here: no padding),
    with bf16 weight, fp32 grad and 12 B / dp of master + AdamW; at pp = 1 one copy."""
    m = model_config(name)
    assert m.padded_vocab_size(tp) == m.vocab_size
    block, embedding = by_hand(name)
    h, dp = m.hidden_size, 8 // (tp * pp)
    mems = estimate(m, tp, pp, dp, 1, 64, SEQ, False)
    for mem in mems:
        st = mem.stage
        matrices, norms = block - 2 * h, 2 * h  # a block's; norms are replicated over TP
        expected = st.blocks * (matrices // tp + norms) + st.last * h + (st.first or st.last) * embedding // tp
        assert mem.params == expected, st
        assert 2 * mem.params <= mem.weights <= 2 * (mem.params + 2 * 2 * dp)
        assert mem.grads == 2 * mem.weights
        assert abs(mem.optimizer - 12 * mem.params / dp) <= 64


def test_tied_and_untied_differ_by_one_embedding_at_pp1_only() -> None:
    m = model_config("llama3.2-3b")
    untied = dataclasses.replace(m, tie_word_embeddings=False)
    e = m.vocab_size * m.hidden_size
    assert parameter_count(untied) - parameter_count(m) == e
    for pp in (1, 2):
        tied_mems, untied_mems = (estimate(x, 1, pp, 8 // pp, 1, 64, SEQ, False) for x in (m, untied))
        diff = [u.params - t.params for t, u in zip(tied_mems, untied_mems)]
        # pp 1: the head is the embedding, e fewer; pp 2: the last stage's copy replaces the head, same size.
        assert diff == ([e] if pp == 1 else [0, 0])
        assert [s.blocks for s in stages(m, pp, 1, SEQ)] == [s.blocks for s in stages(untied, pp, 1, SEQ)]


def test_flops_count_the_lm_head_matmul() -> None:
    """MFU's FLOPs: the tied head still runs its [V, h] matmul (6 V h per token); the embedding lookup counts 0."""
    m = model_config("llama3.2-1b")
    untied = dataclasses.replace(m, tie_word_embeddings=False)
    block, embedding = by_hand("llama3.2-1b")
    attention = 12 * SEQ * m.hidden_size
    matmul_block = block - 2 * m.hidden_size
    assert (
        flops_per_token(m, SEQ)
        == flops_per_token(untied, SEQ)
        == m.num_layers * (6 * matmul_block + attention) + 6 * embedding
    )


def test_tied_gradient_all_reduce_in_the_step_time() -> None:
    m = model_config("llama3.2-3b")
    untied = dataclasses.replace(m, tie_word_embeddings=False)
    hw = Hardware(nodes=2, gpus_per_node=8, gpu_memory_gb=80)
    assert tied_allreduce_s(m, hw, 1, 1, 8) == 0 and tied_allreduce_s(untied, hw, 1, 2, 8) == 0
    grad = 4 * m.vocab_size * m.hidden_size  # fp32, the whole weight at tp 1
    assert tied_allreduce_s(m, hw, 1, 2, 4) == pytest.approx(grad / (hw.nvlink_gbps * 1e9))  # 4 ranks apart
    assert tied_allreduce_s(m, hw, 1, 2, 8) == pytest.approx(grad / (hw.network_gbps * 1e9))  # the next node
    assert tied_allreduce_s(m, hw, 2, 2, 4) == pytest.approx(grad / 2 / (hw.network_gbps * 1e9))
    args = (hw, 1, 2, 8, 1, 32, SEQ, False, 2_000_000_000)
    assert step_time(m, *args) - step_time(untied, *args) == pytest.approx(tied_allreduce_s(m, hw, 1, 2, 8))


@pytest.mark.parametrize("name", list(HF_PARAMS))
def test_plan_runs_for_llama32_on_one_node(name: str) -> None:
    m = model_config(name)
    best, every = plan(m, Hardware(nodes=1, gpus_per_node=8, gpu_memory_gb=80), SEQ, 512)
    assert best.fits and best.tp * best.pp * best.dp == 8 and best.micro * best.gas * best.dp == 512
    assert best.memory.peak <= 75 * GB
    at_pp1 = [la for la in every if la.pp == 1 and la.tp == 1]
    assert at_pp1 and all(la.memory.params == HF_PARAMS[name] for la in at_pp1)  # counted once
