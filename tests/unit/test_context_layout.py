"""Context parallelism's pieces that need no process group (threed.model.context): the zigzag layout and its
inverse, the balance of causal work over CP ranks, positions and labels computed on the full row before the split,
the sequence-length refusal, the varlen offsets the CUDA half-precision path feeds flash with (run here through a
CPU stand-in of the kernel, fp64, against the exact masked path), and the refusal of a kernel that aligns its causal
mask top-left. The collectives and the attention over ranks: tests/ranks/test_context_attention.py.

    PYTHONPATH=$PWD/src .venv/bin/python -m pytest -q tests/unit/test_context_layout.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from threed.errors import ConfigError
from threed.model.attention import document_segments
from threed.model.rope import document_positions
from threed.model import context as cpx

CPS = (1, 2, 3, 4)


@pytest.mark.parametrize("cp", CPS)
def test_split_takes_chunks_i_and_its_mirror_and_from_ranks_undoes_it(cp):
    seq = 2 * cp * 3
    row = torch.arange(seq).expand(2, seq)
    shares = [cpx.split(row, cp, r) for r in range(cp)]
    c = seq // (2 * cp) if cp > 1 else seq
    for r, share in enumerate(shares):
        want = [j * c + t for j in cpx.chunk_index(cp, r) for t in range(c)] if cp > 1 else list(range(seq))
        assert share[1].tolist() == want
    assert torch.equal(cpx.from_ranks(shares), row)
    acts = torch.randn(seq, 2, 3)  # megatron's [s, b, h]: the sequence is dim 0
    assert torch.equal(cpx.from_ranks([cpx.split(acts, cp, r, dim=0) for r in range(cp)], dim=0), acts)


def causal_work(positions: torch.Tensor) -> int:
    """Query-key pairs a causal mask lets through for these query positions: position p sees p+1 keys."""
    return int((positions + 1).sum())


@pytest.mark.parametrize("cp", (2, 3, 4, 8))
def test_every_cp_rank_does_the_same_causal_work(cp):
    seq = 2 * cp * 5
    work = [causal_work(cpx.local_positions(seq, cp, r)) for r in range(cp)]
    assert len(set(work)) == 1 and sum(work) == seq * (seq + 1) // 2, work
    contiguous = [causal_work(torch.arange(seq).chunk(cp)[r]) for r in range(cp)]  # what zigzag avoids
    assert len(set(contiguous)) == cp


def test_chunk_index_pairs_each_chunk_with_its_mirror():
    assert [cpx.chunk_index(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError, match="outside a group of 2"):
        cpx.chunk_index(2, 2)


def packed_doc_ids(seq: int) -> torch.Tensor:
    """Two rows of documents whose edges fall inside chunks and on them, one spanning several chunks (seq 24)."""
    lengths = ([5, 9, 1, 9], [12, 3, 3, 6])
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(row)]) for row in lengths])[:, :seq]


def test_rope_positions_restart_per_document_on_the_full_row():
    segments = document_segments(packed_doc_ids(24))
    for cp in (2, 3):
        for r in range(cp):
            got = cpx.rope_positions(24, cp, r, segments)
            assert torch.equal(got, cpx.split(document_positions(segments), cp, r))
    # Counted on a rank's own chunks instead, a document that began on another rank would restart at 0.
    local = document_positions(cpx.split(segments, 2, 1))
    assert not torch.equal(local, cpx.rope_positions(24, 2, 1, segments))
    assert torch.equal(cpx.rope_positions(24, 2, 1), torch.tensor([6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]))


def test_labels_are_shifted_on_the_full_row_before_the_split():
    tokens = torch.arange(100, 125).expand(2, 25)  # s + 1 = 25 tokens: s = 24
    inputs, labels = cpx.local_inputs_and_labels(tokens, 2, 0)
    assert torch.equal(labels, inputs + 1)  # every label is the next token, at chunk ends too
    assert labels[0, 5].item() == 106  # chunk 0 ends at token 105: its label is chunk 1's first token
    split_then_shifted = cpx.split(tokens[:, :-1], 2, 0)[:, 1:]
    assert not torch.equal(split_then_shifted, labels[:, :-1])


def test_check_divisible_names_the_numbers_and_the_fix():
    cpx.check_divisible(24, 2)
    cpx.check_divisible(7, 1)
    cpx.check_divisible(32, 2, tp=4, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"seq_length 30 is not a multiple of 2·cp = 2·4 = 8 .* of 24 or 32$"):
        cpx.check_divisible(30, 4)
    with pytest.raises(ConfigError, match=r"2·cp·tp = 2·2·4 = 16 .*--sequence-parallel splits again .* 16 or 32$"):
        cpx.check_divisible(24, 2, tp=4, sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"seq_length 6 is not a multiple of 2·cp = 2·4 = 8 .* of 8$"):
        cpx.check_divisible(6, 4)
    with pytest.raises(ConfigError, match=r"cp=0 must be >= 1"):
        cpx.check_divisible(24, 0)
    with pytest.raises(ConfigError, match="multiple of 2·cp = 2·2 = 4"):
        cpx.split(torch.zeros(2, 6), 2, 0)


def token_losses(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(b, s, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5


def test_token_weighted_loss_sum_counts_masked_tokens():
    losses = token_losses(2, 8)
    mask = torch.zeros(2, 8)
    mask[0, 2:5] = 1
    total, count = cpx.token_weighted_loss_sum(losses, mask)
    assert count.item() == 3 and count.dtype == torch.float64
    assert total.item() == pytest.approx(losses[0, 2:5].sum().item(), rel=1e-15)
    assert cpx.token_weighted_loss_sum(losses)[1].item() == 16


# ----------------------------------------------------------------------------------- the CUDA half-precision path


def cpu_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """varlen_attn's contract on CPU: each sequence alone, causal aligned bottom-right (flash's)."""
    return _per_sequence(q, k, v, cu_q, cu_k, scale, enable_gqa, window_size == (-1, 0), top_left=False)


def cpu_varlen_top_left(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """A kernel that aligns its causal mask top-left (SDPA's is_causal=True): what must be refused."""
    return _per_sequence(q, k, v, cu_q, cu_k, scale, enable_gqa, window_size == (-1, 0), top_left=True)


def _per_sequence(q, k, v, cu_q, cu_k, scale, gqa, causal, top_left):
    out = []
    for j in range(len(cu_q) - 1):
        qs = q[cu_q[j] : cu_q[j + 1]].transpose(0, 1)[None]  # [1, heads, len, d]
        ks, vs = (t[cu_k[j] : cu_k[j + 1]].transpose(0, 1)[None] for t in (k, v))
        mask = causal_lower_right(qs.shape[2], ks.shape[2]) if causal and not top_left else None
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=causal and top_left, scale=scale, enable_gqa=gqa
        )
        out.append(o[0].transpose(0, 1))
    return torch.cat(out)


def qkv(length: int, b: int, heads: int, kv_heads: int, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(length, b, h, d, generator=g, dtype=torch.float64) for h in (heads, kv_heads, kv_heads)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("documents", [True, False])
@pytest.mark.parametrize("start", [0, 6, 11, 18])
def test_varlen_offsets_give_the_masked_attention(documents, start):
    L, b = 24, 2
    segments = document_segments(packed_doc_ids(L)) if documents else None
    q, k, v = qkv(L, b, 4, 2)
    q = q[start:]
    want = cpx.attend_prefix(q, k, v, segments, scale=0.3)
    got = cpx._attend_varlen(q, k, v, segments, 0.3, kernel=cpu_varlen)
    assert rel(got, want) <= 1e-12
    if documents and start == 6:
        index, cu_q, cu_k, max_q, max_k = cpx.varlen_offsets(segments, start)
        # row 0, queries 6..13 of document 1 (positions 5..13) see keys 5..13; row 1's first piece (doc 0: 0..11)
        assert cu_q.tolist() == [0, 8, 9, 18, 24, 27, 30, 36] and max_q == 9 and max_k == 12
        assert index[: cu_k[1]].tolist() == list(range(5, 14))
        assert index[cu_k[3] : cu_k[4]].tolist() == [24 + p for p in range(12)]


def test_attend_prefix_of_the_whole_row_is_full_attention():
    from threed.model.attention import SDPACoreAttention

    q, k, v = qkv(24, 2, 4, 2)
    segments = document_segments(packed_doc_ids(24))
    core = SDPACoreAttention(None, 1, softmax_scale=0.3)
    for seg in (None, segments):
        want = core(q, k, v, attention_mask=seg).reshape(24, 2, 4, 8)
        assert rel(cpx.attend_prefix(q, k, v, seg, scale=0.3), want) <= 1e-12


def test_a_kernel_that_aligns_the_causal_mask_top_left_is_refused():
    cpx.check_bottom_right(cpu_varlen, torch.device("cpu"), torch.float64)
    with pytest.raises(cpx.KernelRefused, match=r"cpu_varlen_top_left .* aligns its causal mask top-left .* 0\.000"):
        cpx.check_bottom_right(cpu_varlen_top_left, torch.device("cpu"), torch.float64)
    q, k, v = qkv(24, 1, 2, 2)
    with pytest.raises(cpx.KernelRefused):
        cpx._attend_varlen(q[12:], k, v, None, None, kernel=cpu_varlen_top_left)
