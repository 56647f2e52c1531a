"""What training does with context parallelism before any rank starts or without a process group: each CP rank's
share of a loader micro-batch (tokens, shifted labels and loss masks cut with one index; packed rows' document ids
and evaluation's per-sample sources kept whole), the start-up refusal of a kernel that aligns its causal mask
top-left, and why the loss needs the whole row's token count (the mean of per-rank means is another number).

    PYTHONPATH=$PWD/src .venv/bin/python -m pytest -q tests/unit/test_context_share.py
"""

from __future__ import annotations

import pytest
import torch

from test_context_layout import cpu_varlen, cpu_varlen_top_left, token_losses
from threed.model import context as cpx


def loader_batch(b: int = 2, s: int = 16, sources: int = 0) -> tuple:
    """A collate()-shaped micro-batch of whole rows: labels are the next tokens (shifted on the whole row)."""
    row = torch.arange(b * (s + 1)).reshape(b, s + 1)
    tokens, labels = row[:, :-1], row[:, 1:]
    mask = (torch.arange(s)[None, :] % 3 != 0).float().expand(b, s)
    doc_ids = (torch.arange(s)[None, :] // 5).to(torch.int32).expand(b, s)
    targets = (labels, mask) if not sources else (labels, mask, torch.eye(sources)[:b])
    return (tokens, doc_ids), targets


@pytest.mark.parametrize("cp", [2, 4])
def test_each_cp_rank_takes_its_chunks_of_every_per_token_tensor(cp):
    (tokens, doc_ids), (labels, mask, onehot) = loader_batch(sources=3)
    shares = [cpx.share_micro_batch(((tokens, doc_ids), (labels, mask, onehot)), cp, r) for r in range(cp)]
    for rank, ((t, d), (lab, m, oh)) in enumerate(shares):
        assert t.shape == (2, 16 // cp) and torch.equal(t, cpx.split(tokens, cp, rank))
        assert torch.equal(lab, t + 1)  # each token's label is still its own next token, also at chunk edges
        assert torch.equal(m, cpx.split(mask, cp, rank))
        assert d is doc_ids and oh is onehot  # whole rows: positions and segments are counted on them
    assert torch.equal(cpx.from_ranks([s[0][0] for s in shares]), tokens)


def test_cp1_and_plain_label_targets():
    batch = loader_batch()
    assert cpx.share_micro_batch(batch, 1, 0) is batch
    tokens, labels = torch.arange(8).reshape(1, 8), torch.arange(1, 9).reshape(1, 8)
    t, lab = cpx.share_micro_batch((tokens, labels), 2, 1)
    assert t.tolist() == [[2, 3, 4, 5]] and lab.tolist() == [[3, 4, 5, 6]]
    assert [b[0].tolist() for b in cpx.share_batches(iter([(tokens, labels)]), 2, 0)] == [[[0, 1, 6, 7]]]


def test_a_cp_run_with_a_top_left_kernel_is_refused_before_it_builds():
    cpu = torch.device("cpu")
    cpx.preflight(2, cpu, "fp32")  # CPU: the exact masked path, nothing to check
    cpx.preflight(1, cpu, "bf16", kernel=cpu_varlen_top_left)  # no CP: no query chunk shorter than its keys
    cpx.preflight(2, cpu, "fp32", kernel=cpu_varlen)
    with pytest.raises(cpx.KernelRefused, match=r"aligns its causal mask top-left .* context parallelism needs it"):
        cpx.preflight(2, cpu, "fp32", kernel=cpu_varlen_top_left)


def test_the_mean_of_per_rank_means_is_not_the_token_mean_when_masks_differ_between_chunks():
    """The exact token mean is the sum over CP ranks of (local loss sum / the whole row's count), which is what each
    rank's loss is (threed.model.layers.context_token_count, threed.data.loader.token_weighted); the mean of the
    ranks' own means differs whenever their loss-token counts differ, as SFT masks do."""
    cp, losses = 2, token_losses(2, 16).double()
    mask = torch.zeros(2, 16, dtype=torch.float64)
    mask[:, 2:6] = 1  # response tokens only in chunk 0 (rank 0) and a few in chunk 3 (rank 0) / 1 (rank 1)
    mask[:, 13:] = 1
    mask[:, 5:7] = 1
    exact = (losses * mask).sum() / mask.sum()
    parts = [cpx.token_weighted_loss_sum(cpx.split(losses, cp, r), cpx.split(mask, cp, r)) for r in range(cp)]
    ours = sum(s / mask.sum() for s, _ in parts)
    per_rank = sum(s / c for s, c in parts) / cp
    assert abs(ours - exact) <= 1e-12 * exact
    assert abs(per_rank - exact) > 1e-3 * exact


def cpu_varlen_without_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """torch 2.11's varlen_attn signature: no enable_gqa keyword."""
    assert k.shape[1] == q.shape[1], "K/V heads must arrive repeated"
    return cpu_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)


def test_a_varlen_kernel_without_enable_gqa_gets_repeated_kv_heads():
    from test_context_layout import qkv, rel

    q, k, v = qkv(24, 2, 4, 2)
    want = cpx._attend_varlen(q[12:], k, v, None, 0.3, kernel=cpu_varlen)
    got = cpx._attend_varlen(q[12:], k, v, None, 0.3, kernel=cpu_varlen_without_gqa)
    assert rel(got, want) <= 1e-12


def test_rank_coordinates_follow_megatrons_tp_cp_dp_pp_order():
    """tp fastest, then cp, dp, pp (megatron-core's default order; the multi-rank runs check it against both
    libraries' groups with check_groups_agree): every (stage, dp, cp, tp) once, and the loss rank is the last
    stage's tp 0, cp 0 rank of its replica."""
    from threed.parallel.distributed import context_rank, grid_coordinates, loss_rank

    tp, pp, cp, dp = 2, 2, 2, 2
    seen = {}
    for rank in range(tp * pp * cp * dp):
        stage, dp_rank, tp_rank = grid_coordinates(rank, tp, dp, cp)
        seen[(stage, dp_rank, context_rank(rank, tp, cp), tp_rank)] = rank
    assert len(seen) == 16 and seen[(0, 0, 1, 0)] == 2 and seen[(0, 1, 0, 0)] == 4 and seen[(1, 0, 0, 0)] == 8
    assert [loss_rank(tp, pp, dp, r, cp=cp) for r in range(dp)] == [seen[(1, r, 0, 0)] for r in range(dp)] == [8, 12]
    assert grid_coordinates(5, 2, 2) == (1, 0, 1) and loss_rank(2, 2, 2, 1) == 6  # cp 1: as before
