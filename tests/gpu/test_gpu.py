"""`make test-gpu`: the CPU suite's parity, training-parity and resume checks on CUDA/NCCL (context parallelism's cp2
against cp1 among them; its per-rank attention on one GPU is tests/gpu/test_cp_gpu.py), and our SDPA attention
against the math kernel at a real sequence length. Each test skips, naming the reason, where the GPUs it needs are
not there; none runs in `make test` (marker `gpu`). `make test-gpu` itself fails in one line on a machine with no
GPU, instead of passing with every test skipped.

Precision: TF32 is off (torch's default for matmuls; nothing here turns it on), so fp32 runs are compared with fp32
tolerances, and bf16 kernels are compared with an fp32 reference at a bf16 tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers import RANKS, hf_model
from threed.parallel.launch import run_ranks

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU visible (torch.cuda.is_available() is False)")
CUDA_ENV = {"THREED_DEVICE": "cuda"}


FUSED_BACKENDS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]


@needs_gpu
@pytest.mark.parametrize("backend", FUSED_BACKENDS)
def test_sdpa_attention_matches_math_kernel_seq4096_gqa8(backend):
    """Forward and backward of our core attention on one pinned fused kernel (bf16) against the math kernel run in
    fp32 on the same inputs: the reference carries no bf16 rounding of its own, so the tolerance is bf16's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from threed.model.attention import SDPACoreAttention

    torch.manual_seed(0)
    s, b, heads, kv, d = 4096, 1, 32, 4, 128  # GQA 8:1, Llama 3 70B's head size
    q = torch.randn(s, b, heads, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(s, b, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(s, b, kv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(s, b, heads * d, device="cuda", dtype=torch.bfloat16)
    attn = SDPACoreAttention(None, layer_number=1)

    def run(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = attn(*leaves)
        out.backward(grad.to(dtype))
        return [out.float()] + [t.grad.float() for t in leaves]

    try:
        with sdpa_kernel(getattr(SDPBackend, backend)):
            fast = run(torch.bfloat16)
    except RuntimeError as e:  # "No available kernel": this GPU / build lacks that backend
        if "No available kernel" in str(e):
            pytest.skip(f"{backend} is not available on {torch.cuda.get_device_name()}: {str(e)[:200]}")
        raise
    with sdpa_kernel(SDPBackend.MATH):
        ref = run(torch.float32)
    for name, a, r in zip(("out", "dq", "dk", "dv"), fast, ref):
        rel = ((a - r).abs().max() / r.abs().max()).item()
        print(f"{backend} {name}: max rel diff vs the fp32 math kernel {rel:.2e}")
        assert rel < 2e-2, f"{backend} {name}: {rel:.2e} (bf16 tolerance 2e-2)"


@needs_gpu
def test_packed_varlen_attention_matches_each_document_alone():
    """Packed rows on CUDA in bf16 take `varlen_attn` (no s x s mask): forward and backward equal SDPA run on each
    document alone, GQA 8:1, documents of uneven lengths in two rows of 4096."""
    from threed.model.attention import SDPACoreAttention, _varlen_usable, document_segments

    torch.manual_seed(0)
    rows = [[1000, 17, 2048, 1031], [4096]]
    s, b, heads, kv, d = 4096, len(rows), 32, 4, 128
    q, k, v = (
        torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (heads, kv, kv)
    )
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
            o = attn(q[sl, row : row + 1], k[sl, row : row + 1], v[sl, row : row + 1])  # plain causal, alone
            o.backward(grad[sl, row : row + 1])
            pieces.append((row, sl, o))
            start += n
    alone_out = torch.zeros_like(packed[0])
    for row, sl, o in pieces:
        alone_out[sl, row] = o[:, 0].float()
    for name, a, r in zip(
        ("out", "dq", "dk", "dv"), packed, [alone_out, q.grad.float(), k.grad.float(), v.grad.float()]
    ):
        rel = ((a - r).abs().max() / r.abs().max()).item()
        print(f"{name}: packed (varlen) vs each document alone {rel:.2e}")
        assert rel < 2e-2, f"{name}: {rel:.2e} (bf16 tolerance 2e-2)"


@needs_gpu
def test_logits_parity_on_cuda(tmp_path):
    """dist_worker's parity scenario on min(4, GPUs) NCCL ranks: every layout that fits, against HF on CPU."""
    nproc = min(4, GPUS)
    run_ranks(nproc, str(RANKS / "dist_worker.py"), ["parity", "--out", str(tmp_path)], env=CUDA_ENV, timeout=1200)
    files = sorted(tmp_path.glob("*_tp*_pp*.pt"))
    assert files, "no layout ran"
    for f in files:
        got = torch.load(f)
        assert got["logits"].device.type == "cpu", "logits must come back on CPU"
        with torch.no_grad():
            ref = hf_model(f.name.split("_tp")[0])(got["tokens"]).logits
        rel = ((got["logits"] - ref).abs().max() / ref.abs().max()).item()
        print(f"{f.stem}: max rel {rel:.2e}")
        # fp32 on both sides (TF32 off): only the order of the sums differs between the GPU and HF on CPU.
        assert rel <= 1e-4


@pytest.mark.skipif(GPUS < 8, reason=f"training parity and resume run tp2 x pp2 x dp2: need 8 GPUs, see {GPUS}")
def test_training_parity_and_resume_on_cuda():
    """tests/ranks/test_training.py on 8 NCCL ranks (its worker picks CUDA through threed.parallel.distributed)."""
    import subprocess
    import sys

    env = {**os.environ, **CUDA_ENV}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", str(RANKS / "test_training.py")], env=env)
    assert proc.returncode == 0


def _pytest_on_cuda(*args: str, timeout: float = 3600) -> None:
    """A CPU test module run again with THREED_DEVICE=cuda: its workers pick CUDA/NCCL through
    threed.parallel.distributed (and with it fused AdamW, fused SwiGLU, nccl groups only)."""
    env = {**os.environ, **CUDA_ENV}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *args], env=env, timeout=timeout
    )
    assert proc.returncode == 0, f"pytest {' '.join(args)} on CUDA exited {proc.returncode}"


@pytest.mark.skipif(GPUS < 8, reason=f"packed SFT runs tp2 x pp2 x dp2: need 8 GPUs, see {GPUS}")
def test_packed_sft_through_the_pipeline_on_cuda():
    """tests/ranks/test_sft_train.py on 8 NCCL ranks: packed rows (doc_ids between stages, varlen attention in bf16 on
    CUDA, the non-reentrant activation checkpointing DeepSpeed needs for them) against HF per example."""
    _pytest_on_cuda(str(RANKS / "test_sft_train.py"))


@pytest.mark.skipif(GPUS < 8, reason=f"the universal reference runs tp2 x pp2 x dp2: need 8 GPUs, see {GPUS}")
def test_universal_resume_with_fused_adamw_on_cuda():
    """tests/ranks/test_checkpoint_universal.py (every layout, slow ones included) and the resume-path cases on CUDA,
    where AdamW is fused=True: after the universal load every optimizer state tensor, `step` included, must be on
    its parameter's GPU (threed.engine.build.place_optimizer_state), or the fused kernel is handed a host pointer."""
    _pytest_on_cuda(str(RANKS / "test_checkpoint_universal.py"), "-m", "slow or not slow")
    _pytest_on_cuda(str(RANKS / "test_resume_path.py"), "-k", "cut_short or two_rank")


@pytest.fixture(scope="module")
def train_data(tmp_path_factory) -> str:
    import numpy as np

    from helpers import write_dataset

    d = tmp_path_factory.mktemp("gpu_train_data")
    return write_dataset(d / "corpus", np.random.default_rng(0).integers(0, 500, 50000), 512)


def _threed_train(argv: list[str], nproc: int, tmp_path) -> str:
    """`threed train` as a user types it (under torchrun for nproc > 1); returns its output, asserting exit 0,
    finite losses, and no traceback."""
    base = (
        [sys.executable, "-m", "threed.cli", "train"]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            "-m",
            "threed.train",
        ]
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(CUDA_ENV, OMP_NUM_THREADS="1")
    proc = subprocess.run(base + argv, env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    losses = [
        float(line.split("loss ")[1].split()[0])
        for line in out.splitlines()
        if line.startswith("step ") and "loss " in line
    ]
    assert losses and all(x == x and abs(x) < 1e4 for x in losses), out[-4000:]
    return out


@needs_gpu
def test_threed_train_entry_on_cuda(train_data, tmp_path):
    """The `threed train` command on one GPU: bf16, a checkpoint, and the same command resuming from it."""
    argv = [
        "--model",
        "tiny",
        "--data-path",
        train_data,
        "--split",
        "100,0,0",
        "--seq-length",
        "128",
        "--micro-batch-size",
        "2",
        "--steps",
        "4",
        "--save-interval",
        "2",
        "--log-interval",
        "1",
        "--dtype",
        "bf16",
        "--save",
        str(tmp_path / "save"),
    ]
    _threed_train(argv, 1, tmp_path)
    assert (tmp_path / "save" / "latest").read_text() == "global_step4"
    out = _threed_train([*argv[: argv.index("--steps") + 1], "6", *argv[argv.index("--steps") + 2 :]], 1, tmp_path)
    assert "resumed from" in out and "at step 4" in out


@pytest.mark.skipif(GPUS < 2, reason=f"bf16 with activation checkpointing runs pp2: need 2 GPUs, see {GPUS}")
def test_bf16_with_activation_checkpointing_on_cuda(train_data, tmp_path):
    """bf16 + activation checkpointing through a 2-stage pipeline on NCCL (DeepSpeed's reentrant checkpointing with
    megatron's CUDA RNG tracker): trains, and its losses match the same run without recomputation. Recompute runs
    the same kernels on the same inputs, but fused attention's backward may sum in a nondeterministic order, so
    the losses agree to bf16's precision, not bit for bit."""
    argv = [
        "--model",
        "tiny",
        "--data-path",
        train_data,
        "--split",
        "100,0,0",
        "--seq-length",
        "128",
        "--micro-batch-size",
        "2",
        "--grad-accum-steps",
        "2",
        "--steps",
        "4",
        "--log-interval",
        "1",
        "--dtype",
        "bf16",
        "--pp",
        "2",
    ]

    def losses(out: str) -> list[float]:
        return [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]

    with_ckpt = losses(_threed_train([*argv, "--activation-checkpointing", "true"], 2, tmp_path))
    without = losses(_threed_train(argv, 2, tmp_path))
    assert len(with_ckpt) == len(without) == 4, (with_ckpt, without)
    for a, b in zip(with_ckpt, without):
        assert abs(a - b) <= 1e-2 * abs(b), (with_ckpt, without)


@pytest.mark.skipif(GPUS < 2, reason=f"sequence parallelism runs tp2: need 2 GPUs, see {GPUS}")
def test_sequence_parallel_tp2_matches_tp1_in_bf16_on_cuda(train_data, tmp_path):
    """Megatron's sequence parallelism at tp 2 (NCCL all-gather / reduce-scatter, norms on half the sequence, their
    gradients summed over TP) trains like tp 1: the same weights (threed.model.init does not depend on the layout)
    and the same data, so the losses differ only by bf16 rounding in other summation orders. Tolerance: 1e-2
    relative per step, bf16's ~2^-8 grown over four steps (the bound test_bf16_with_activation_checkpointing uses)."""
    argv = [
        "--model",
        "tiny",
        "--data-path",
        train_data,
        "--split",
        "100,0,0",
        "--seq-length",
        "128",
        "--micro-batch-size",
        "2",
        "--grad-accum-steps",
        "2",
        "--steps",
        "4",
        "--log-interval",
        "1",
        "--dtype",
        "bf16",
    ]

    def losses(out: str) -> list[float]:
        return [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]

    sp = losses(_threed_train([*argv, "--tp", "2", "--sequence-parallel"], 2, tmp_path))
    tp1 = losses(_threed_train(argv, 1, tmp_path))
    assert len(sp) == len(tp1) == 4, (sp, tp1)
    for a, b in zip(sp, tp1):
        assert abs(a - b) <= 1e-2 * abs(b), (sp, tp1)


@pytest.mark.skipif(GPUS < 2, reason=f"context parallelism runs cp2: need 2 GPUs, see {GPUS}")
def test_context_parallel_cp2_matches_cp1_in_bf16_on_cuda(train_data, tmp_path):
    """Context parallelism at cp 2 on NCCL (each GPU 2 of each row's 4 chunks; K/V all-gathered and dK/dV
    reduce-scattered per block; bf16 attention through flash varlen, checked bottom-right at start-up) trains like
    cp 1 on one GPU: the same weights, the same rows (dp 1 both), the exact token mean. The losses differ only by
    bf16 rounding in other summation orders: 1e-2 relative per step, the sequence-parallel case's bound."""
    argv = [
        "--model",
        "tiny",
        "--data-path",
        train_data,
        "--split",
        "100,0,0",
        "--seq-length",
        "128",
        "--micro-batch-size",
        "2",
        "--grad-accum-steps",
        "2",
        "--steps",
        "4",
        "--log-interval",
        "1",
        "--dtype",
        "bf16",
    ]

    def losses(out: str) -> list[float]:
        return [float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ")]

    cp2 = losses(_threed_train([*argv, "--context-parallel-size", "2"], 2, tmp_path))
    cp1 = losses(_threed_train(argv, 1, tmp_path))
    assert len(cp2) == len(cp1) == 4, (cp2, cp1)
    for a, b in zip(cp2, cp1):
        assert abs(a - b) <= 1e-2 * abs(b), (cp2, cp1)


@pytest.mark.skipif(GPUS < 2, reason=f"the SP memory check runs tp2: need 2 GPUs, see {GPUS}")
def test_sp_activation_estimate_against_cuda_peak(tmp_path):
    """threed.memory's activations (CUDA kernels: fused RMSNorm and SwiGLU) against torch.cuda.max_memory_allocated
    over one micro-batch's forward and backward on each of 2 GPUs (tests/ranks/memory_worker.py --stage-activations),
    with sequence parallelism, without and with recompute; and SP's saving against tp alone. The CUDA caching
    allocator rounds every block up (512 B, 2 MiB segments), hence 10% rather than the CPU test's 5%."""
    import json

    run_ranks(
        2, str(RANKS / "memory_worker.py"), ["--out", str(tmp_path), "--stage-activations"], env=CUDA_ENV, timeout=1800
    )
    ranks = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("stage_activations_rank*.json"))]
    assert len(ranks) == 2
    for r in ranks:
        for case in ("tp", "sp", "sp_full"):
            m, e = r[case]["measured"], r[case]["estimate_cpu_kernels"]  # the worker's estimate: its device's
            print(f"{case}: measured {m / 1e6:.2f} MB, estimate {e / 1e6:.2f} MB (ratio {e / m:.3f})")
            assert abs(e - m) <= 0.10 * m, (case, m, e)
        assert r["sp"]["measured"] < r["tp"]["measured"]


@pytest.mark.skipif(GPUS < 2, reason=f"the ZB-H1 memory check runs pp2: need 2 GPUs, see {GPUS}")
def test_zb_h1_peak_against_the_estimate_on_cuda(tmp_path):
    """A whole bf16 train step (pp 2, gas 4) under 1F1B and under ZB-H1 (tests/ranks/memory_zb_worker.py
    --schedule-peaks): torch.cuda.max_memory_allocated above the step's start against threed.memory's activation
    phase with CUDA kernels, per stage, and what ZB-H1 adds (the last stage's micro-batch awaiting W) against the
    deferred-bytes count. 10% as test_sp_activation_estimate_against_cuda_peak (the caching allocator's rounding);
    5% on the difference."""
    import json

    run_ranks(
        2, str(RANKS / "memory_zb_worker.py"), ["--out", str(tmp_path), "--schedule-peaks"], env=CUDA_ENV, timeout=1800
    )
    ranks = {
        r["1f1b"]["stage"]: r
        for r in (json.loads(p.read_text()) for p in sorted(tmp_path.glob("schedule_peaks_rank*.json")))
    }
    assert sorted(ranks) == [0, 1]
    for stage, r in sorted(ranks.items()):
        one, zb = r["1f1b"], r["zb-h1"]
        print(
            f"stage {stage}: 1f1b {one['measured']} B (estimate {one['phase']:.0f}), zb-h1 {zb['measured']} B "
            f"(estimate {zb['phase']:.0f})"
        )
        for x in (one, zb):
            assert abs(x["phase"] - x["measured"]) <= 0.10 * x["measured"], (stage, x)
    one, zb = ranks[1]["1f1b"], ranks[1]["zb-h1"]
    want = zb["activations"] - one["activations"]
    assert abs((zb["measured"] - one["measured"]) - want) <= 0.05 * want
