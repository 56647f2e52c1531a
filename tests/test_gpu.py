"""`make test-gpu`: the CPU suite's parity, training-parity and resume checks on CUDA/NCCL, and our SDPA attention
against the math kernel at a real sequence length. Each test skips, naming the reason, where the GPUs it needs are
not there; none runs in `make test` (marker `gpu`).
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers import TESTS, hf_model
from threed.launch import run_ranks

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU visible (torch.cuda.is_available() is False)")
CUDA_ENV = {"THREED_DEVICE": "cuda"}


@needs_gpu
def test_sdpa_attention_matches_math_kernel_seq4096_gqa8():
    """Forward and backward of our core attention (whichever fused kernel SDPA picks) vs the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from threed.model.attention import SDPACoreAttention

    torch.manual_seed(0)
    s, b, heads, kv, d = 4096, 1, 32, 4, 128  # GQA 8:1, Llama 3 70B's head size
    q = torch.randn(s, b, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, b, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(s, b, heads * d, device="cuda", dtype=torch.bfloat16)
    attn = SDPACoreAttention(None, layer_number=1)

    def run():
        for t in (q, k, v):
            t.grad = None
        out = attn(q, k, v)
        out.backward(grad)
        return [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]

    fast = run()
    with sdpa_kernel(SDPBackend.MATH):
        ref = run()
    for name, a, r in zip(("out", "dq", "dk", "dv"), fast, ref):
        rel = ((a - r).abs().max() / r.abs().max()).item()
        print(f"{name}: max rel diff vs math kernel {rel:.2e}")
        assert rel < 2e-2, f"{name}: {rel:.2e} (bf16 tolerance 2e-2)"


@needs_gpu
def test_packed_varlen_attention_matches_each_document_alone():
    """Packed rows on CUDA in bf16 take `varlen_attn` (no s x s mask): forward and backward equal SDPA run on each
    document alone, GQA 8:1, documents of uneven lengths in two rows of 4096."""
    from threed.model.attention import SDPACoreAttention, _varlen_usable, document_segments

    torch.manual_seed(0)
    rows = [[1000, 17, 2048, 1031], [4096]]
    s, b, heads, kv, d = 4096, len(rows), 32, 4, 128
    q, k, v = (torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (heads, kv, kv))
    grad = torch.randn(s, b, heads * d, device="cuda", dtype=torch.bfloat16)
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows]).cuda()
    assert _varlen_usable(q), "bf16 CUDA queries must take the varlen path"
    attn = SDPACoreAttention(None, layer_number=1)
    out = attn(q, k, v, attention_mask=document_segments(doc_ids))
    out.backward(grad)
    packed = [out.float(), q.grad.float(), k.grad.float(), v.grad.float()]
    for t in (q, k, v):
        t.grad = None
    pieces = []
    for row, lengths in enumerate(rows):
        start = 0
        for n in lengths:
            sl = slice(start, start + n)
            o = attn(q[sl, row:row + 1], k[sl, row:row + 1], v[sl, row:row + 1])  # plain causal, alone
            o.backward(grad[sl, row:row + 1])
            pieces.append((row, sl, o))
            start += n
    alone_out = torch.zeros_like(packed[0])
    for row, sl, o in pieces:
        alone_out[sl, row] = o[:, 0].float()
    for name, a, r in zip(("out", "dq", "dk", "dv"), packed, [alone_out, q.grad.float(), k.grad.float(),
                                                              v.grad.float()]):
        rel = ((a - r).abs().max() / r.abs().max()).item()
        print(f"{name}: packed (varlen) vs each document alone {rel:.2e}")
        assert rel < 2e-2, f"{name}: {rel:.2e} (bf16 tolerance 2e-2)"


@needs_gpu
def test_logits_parity_on_cuda(tmp_path):
    """dist_worker's parity scenario on min(4, GPUs) NCCL ranks: every layout that fits, against HF on CPU."""
    nproc = min(4, GPUS)
    run_ranks(nproc, str(TESTS / "dist_worker.py"), ["parity", "--out", str(tmp_path)], env=CUDA_ENV, timeout=1200)
    files = sorted(tmp_path.glob("*_tp*_pp*.pt"))
    assert files, "no layout ran"
    for f in files:
        got = torch.load(f)
        assert got["logits"].device.type == "cpu", "logits must come back on CPU"
        with torch.no_grad():
            ref = hf_model(f.name.split("_tp")[0])(got["tokens"]).logits
        rel = ((got["logits"] - ref).abs().max() / ref.abs().max()).item()
        print(f"{f.stem}: max rel {rel:.2e}")
        # TF32 matmuls may be on by default on Ampere+: allow their precision, not bf16's.
        assert rel <= 1e-3


@pytest.mark.skipif(GPUS < 8, reason=f"training parity and resume run tp2 x pp2 x dp2: need 8 GPUs, see {GPUS}")
def test_training_parity_and_resume_on_cuda():
    """tests/test_training.py on 8 NCCL ranks (its worker picks CUDA through threed.distributed)."""
    import subprocess
    import sys

    env = {**os.environ, **CUDA_ENV}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(TESTS / "test_training.py")], env=env)
    assert proc.returncode == 0
