"""`make test-gpu`'s context-parallel attention on one GPU (issue 27): each CP rank's computation, as
threed.model.context runs it, in bf16 on CUDA against the fp32 math reference of the whole row.

One GPU cannot hold a CP group (NCCL wants a GPU per rank), but a CP rank's attention is local once K and V are
gathered: its two query chunks (`split`, `_local_chunks`) each attend to their key prefix through `attend_prefix`,
which on CUDA in bf16 takes flash varlen with offsets (`_varlen_usable`; its causal mask checked bottom-right by
`preflight`). So every rank of cp 2 and cp 4 runs here in turn on the whole row's K/V leaves: the outputs are each
rank's share of the reference, and the gradients the leaves collect are what the all-gather's reduce-scatter sums
(dK, dV from every rank's queries). The 2-GPU cp2 training parity is tests/gpu/test_gpu.py's.

Tolerance: 2e-2 of the largest element, bf16's, as tests/gpu/test_gpu.py's attention checks against an fp32
reference with no bf16 rounding of its own. TF32 is off (torch's default).

Skips without a CUDA GPU. THREED_DEVICE=cpu runs it on CPU in bf16 (the exact masked SDPA path, smaller shapes),
as a check of its own logic:

    THREED_DEVICE=cuda python -m pytest -q -s -m gpu tests/gpu/test_cp_gpu.py
    THREED_DEVICE=cpu python -m pytest -q -s -m gpu tests/gpu/test_cp_gpu.py
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from threed.model import context as cpx

DEVICE = "cpu" if os.environ.get("THREED_DEVICE") == "cpu" else "cuda"
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE == "cuda" and not torch.cuda.is_available(),
        reason="no CUDA GPU visible (torch.cuda.is_available() is False); THREED_DEVICE=cpu runs these on CPU",
    ),
]
BF16_TOL = 2e-2
# CUDA: 4096 tokens, GQA 8:1, Llama 3 70B's head size (test_gpu.py's attention shapes). CPU: small, the same logic.
SEQ, HEADS, KV_HEADS, HEAD_DIM = (4096, 32, 4, 128) if DEVICE == "cuda" else (256, 8, 2, 32)
# Packed rows, as fractions of SEQ in 1/64ths: documents that cross chunk edges at cp 2 and cp 4 (chunks of 16/64 and
# 8/64), one of a single 64th, one that spans several CP ranks; the second row one document.
DOCS_64THS = ([13, 1, 22, 28], [64])


def _segments(device: str) -> torch.Tensor:
    """Segment ids `[b, SEQ]` of DOCS_64THS, counted on the whole row (equal ids: one document)."""
    unit = SEQ // 64
    rows = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r) * unit) for r in DOCS_64THS]
    return torch.stack(rows).to(device)


def _reference(q, k, v, segments, grad) -> list[torch.Tensor]:
    """fp32 math attention of the whole row under a causal (and same-document) mask built here: out `[s, b, h*d]`
    and dq, dk, dv."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    s, b = q.shape[:2]
    allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
    if segments is not None:
        allowed = allowed & (segments[:, None, :, None] == segments[:, None, None, :])
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in leaves)  # [b, heads, s, d]
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, enable_gqa=True)
    out = out.permute(2, 0, 1, 3).reshape(s, b, -1)
    out.backward(grad.float())
    return [out.detach()] + [t.grad for t in leaves]


def _every_rank(q, k, v, segments, grad, cp: int) -> list[torch.Tensor]:
    """Each CP rank's attention in turn, on its share of the queries and the whole row's K/V (what the all-gather
    gives it): the rank outputs put back in row order, and the leaves' gradients, summed over ranks as the
    reduce-scatter sums them."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    outs = []
    for rank in range(cp):
        mine = cpx.split(leaves[0], cp, rank, dim=0)
        parts, held = [], 0
        for start, length in cpx._local_chunks(SEQ, cp, rank):
            end = start + length
            seg = None if segments is None else segments[:, :end]
            parts.append(cpx.attend_prefix(mine[held : held + length], leaves[1][:end], leaves[2][:end], seg))
            held += length
        out = torch.cat(parts).reshape(SEQ // cp, q.shape[1], -1)
        (out.float() * cpx.split(grad, cp, rank, dim=0).float()).sum().backward()
        outs.append(out.detach())
    return [cpx.from_ranks(outs, dim=0)] + [t.grad for t in leaves]


@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_rank_attention_in_bf16_matches_the_fp32_reference(cp: int, packed: bool) -> None:
    torch.manual_seed(0)
    b = len(DOCS_64THS)
    q, k, v = (
        torch.randn(SEQ, b, h, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16) for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    grad = torch.randn(SEQ, b, HEADS * HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    segments = _segments(DEVICE) if packed else None
    if DEVICE == "cuda":  # the kernel path CP takes on CUDA in bf16, and the check that refuses a top-left one
        assert cpx._varlen_usable(q), "bf16 CUDA queries must take flash varlen (no s x s mask)"
        cpx.preflight(cp, torch.device(DEVICE), "bf16")
    ranks = _every_rank(q, k, v, segments, grad, cp)
    ref = _reference(q, k, v, segments, grad)
    for name, got, want in zip(("out", "dq", "dk", "dv"), ranks, ref):
        rel = ((got.float() - want).abs().max() / want.abs().max()).item()
        print(f"cp{cp} {'documents' if packed else 'causal'} {name}: max rel diff vs fp32 math {rel:.2e}")
        assert rel < BF16_TOL, f"cp{cp} {name}: {rel:.2e} (bf16 tolerance {BF16_TOL})"
