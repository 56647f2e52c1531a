"""MFU in two conventions (`threed.model.spec`'s docstring): the attention scores over the full seq x seq square
(torchtitan's `get_num_flop_per_token`) and over its causal half (Megatron-LM's `num_floating_point_operations`
since mid-2025). Checked against counts made without the spec: by hand for a tiny shape, and by each project's
published formula, written out here, for Llama-3.2-1B; a training record and its stdout line hold both.

    .venv/bin/python -m pytest -q tests/unit/test_flops_conventions.py
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from threed.config import ModelConfig
from threed.metrics.flops import flops_per_token
from threed.metrics.sinks import stdout_line
from threed.metrics.writer import RunMetrics
from threed.model.presets import PRESETS
from threed.model.spec import attention_training_flops, layer_training_flops, training_flops_per_token

# hidden 8, 2 heads of 4, 1 KV head, ffn 16, 2 blocks, vocabulary 200 (padded to 256 at tp 1), untied
TINY = ModelConfig("hand", vocab_size=200, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                   ffn_hidden_size=16, max_position_embeddings=64)  # fmt: skip


def test_a_hand_count_of_a_tiny_shape():
    s = 4
    # matmul weights of a block: qkv (2 + 2 x 1) heads x 4 rows x 8 = 128, proj 8 x 8 = 64, fc1 32 x 8 = 256,
    # fc2 8 x 16 = 128: 576 elements, 6 FLOPs each per token in training (2 forward, 4 backward)
    block = 6 * 576
    # QK^T and AV: 2 matmuls x 2 FLOPs x s keys x 8 per query token forward, x 3 in training: 384; causal 192
    full_attention, causal_attention = 3 * 2 * 2 * s * 8, 3 * 2 * 2 * s * 8 // 2
    head = 6 * 256 * 8  # the LM head over the padded vocabulary; the embedding is a lookup
    assert training_flops_per_token(TINY, s) == 2 * (block + full_attention) + head == 19968
    assert training_flops_per_token(TINY, s, attention="causal") == 2 * (block + causal_attention) + head == 19584
    assert layer_training_flops(TINY, "block", s, attention="causal") == block + causal_attention


def torchtitan_flops_per_token(m: ModelConfig, seq: int) -> float:
    """torchtitan's llama: 6 x matmul parameters + 12 x layers x heads x head_dim x seq (full square; its count
    of parameters is written here as the matmul weights, the LM head over the padded vocabulary)."""
    d, heads, kv = m.head_dim, m.num_heads, m.num_kv_heads
    per_block = m.hidden_size * (heads + 2 * kv) * d + heads * d * m.hidden_size + 3 * m.hidden_size * m.ffn_hidden_size
    head = m.hidden_size * m.padded_vocab_size(1)
    return 6 * (m.num_layers * per_block + head) + 12 * m.num_layers * heads * d * seq


def megatron_flops_per_token(m: ModelConfig, seq: int) -> float:
    """Megatron-LM's `transformer_flops()` (GQA, SwiGLU, no MoE) per token: 3 x 2 x (h (q + k + v) + q s / 2 x 2
    + q h) per layer for attention, 3 x 2 x h x 3 ffn for the MLP, 3 x 2 x h x padded vocabulary for the logits."""
    h, q, kv = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    attention = 3 * 2 * (h * (q + 2 * kv) + q * seq / 2 * 2 + q * h)
    mlp = 3 * 2 * h * m.ffn_hidden_size * 3
    return m.num_layers * (attention + mlp) + 3 * 2 * h * m.padded_vocab_size(1)


@pytest.mark.parametrize("seq", [4096, 8192])
def test_llama_1b_against_torchtitans_and_megatrons_formulas(seq):
    m = PRESETS["llama3.2-1b"]
    full, causal = training_flops_per_token(m, seq), training_flops_per_token(m, seq, attention="causal")
    assert full == pytest.approx(torchtitan_flops_per_token(m, seq), rel=1e-12)
    assert causal == pytest.approx(megatron_flops_per_token(m, seq), rel=1e-12)
    # the two differ by half the attention term, 6 x seq x hidden per block
    assert full - causal == m.num_layers * attention_training_flops(m, seq) / 2 == m.num_layers * 6 * seq * 2048
    assert flops_per_token(m, seq, attention="causal") == causal and flops_per_token(m, seq) == full


def test_the_1b_figures_the_docs_quote():
    m = PRESETS["llama3.2-1b"]
    assert round(training_flops_per_token(m, 4096) / 1e9, 2) == 9.03
    assert round(training_flops_per_token(m, 4096, attention="causal") / 1e9, 2) == 8.22
    assert round(training_flops_per_token(m, 8192) / 1e9, 2) == 10.64
    assert round(training_flops_per_token(m, 8192, attention="causal") / 1e9, 2) == 9.03


def test_an_unknown_convention_is_refused():
    with pytest.raises(ValueError, match="one of full, causal"):
        attention_training_flops(TINY, 4, "sparse")  # type: ignore[arg-type]


def test_a_training_record_holds_both_conventions():
    """RunMetrics' per-step record (the writer rank's; here with the engine, timer and dims it reads stubbed)."""
    m = PRESETS["llama3.2-1b"]
    metrics = RunMetrics.__new__(RunMetrics)  # the record alone: no engine, no sinks, no collective
    metrics.batch, metrics.seq, metrics.dims, metrics.device = 8, 4096, SimpleNamespace(world=1), torch.device("cpu")
    metrics.flops_per_token = flops_per_token(m, 4096)
    metrics.flops_per_token_causal = flops_per_token(m, 4096, attention="causal")
    metrics.timer = SimpleNamespace(last_iteration=32768 / 41875)  # the H200's step at 4096
    metrics.engine = SimpleNamespace(get_lr=lambda: [1e-4])
    metrics.peak_tflops = 989.0
    r = metrics._step_record(3, 2.0, 1.0, None)
    assert r["mfu"] == pytest.approx(0.382, abs=5e-4) and r["mfu-causal"] == pytest.approx(0.348, abs=5e-4)
    assert r["throughput"] - r["throughput-causal"] == pytest.approx(41875 * 16 * 6 * 4096 * 2048 / 1e12)


def test_the_stdout_line_shows_both_conventions():
    record = {"iteration": 3, "lm loss": 2.0, "learning-rate": 1e-4, "grad-norm": 1.0, "iteration-time": 0.5,
              "tokens-per-sec": 1000.0, "throughput": 380.0, "mfu": 0.384, "mfu-causal": 0.35,
              "mem-allocated-bytes": 2**20, "mem-max-allocated-bytes": 2**21}  # fmt: skip
    assert "MFU 38.4% (causal 35.0%)" in stdout_line(record, 10, None, 1)
    del record["mfu-causal"], record["mfu"]
    assert "MFU n/a |" in stdout_line(record, 10, None, 1) + " |"
