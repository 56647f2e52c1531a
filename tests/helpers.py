"""What tests of every kind share (tests/ is on sys.path: pyproject.toml's pytest `pythonpath`, and
tests/ranks/worker_setup.py for the workers): where things are, tiny random HF Llamas built locally, synthetic token
files, `threed` command lines run in a world of their own, and fake checkpoint directories."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from threed.checkpoint.manifest import write_manifest
from threed.checkpoint.start import decide_start
from threed.config import CheckpointConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.hf.config import from_hf_config
from threed.model.presets import PRESETS
from threed.parallel.dims import resolve_dims

TESTS = Path(__file__).resolve().parent
RANKS = TESTS / "ranks"  # the multi-rank tests and the *_worker.py scripts torchrun runs for them
REPO = TESTS.parent
SRC = REPO / "src"
# For a child process that must import this checkout's threed whatever the venv's editable install points at.
SRC_ENV = {"PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}

LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}

# name -> LlamaConfig kwargs. Vocab 200 with padding multiple 16 pads to 208/224/256 at tp 1/2/4: padding is real.
HF_CONFIGS: dict[str, dict[str, Any]] = {
    # GQA (4 query heads / 2 KV heads) with Llama 3.1 rope scaling, short original context so scaling matters.
    "gqa31": dict(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=176,
        rope_theta=500000.0,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_scaling=LLAMA31_SCALING,
    ),
    # Llama-2-like multi-head attention, default RoPE.
    "mha2": dict(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=160,
        rope_theta=10000.0,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    ),
}

# benchmarks/bench_pipeline.py's model, for partition checks: 8 blocks; pipeline layers 0 embedding, 1-8 blocks,
# 9 final_norm, 10 lm_head.
BENCH = ModelConfig(
    name="bench",
    vocab_size=4096,
    hidden_size=256,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    ffn_hidden_size=704,
    max_position_embeddings=256,
)


def hf_model(name: str, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**HF_CONFIGS[name], tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def model_config(name: str) -> ModelConfig:
    """threed's config of `hf_model(name)`, read from its LlamaConfig kwargs (what the model is built from) without
    importing transformers: ~1.5 s of CPU in every rank of a worker that needs no HF weights. test_model_spec.py
    checks that it equals the config read from transformers' own `LlamaConfig.to_dict()`."""
    hf = dict(HF_CONFIGS[name], tie_word_embeddings=False)
    return dataclasses.replace(from_hf_config(hf, name=name), make_vocab_size_divisible_by=16)


def write_dataset(
    prefix: Path | str, tokens: np.ndarray, vocab_size: int, doc_len: tuple[int, int] = (40, 400), seed: int = 0
) -> str:
    """Cut a token stream into documents of random length and write them as a megatron-core `.bin/.idx` pair with
    megatron's own IndexedDatasetBuilder (the format Megatron-LM's preprocess_data.py writes). Returns the prefix."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=DType.optimal_dtype(vocab_size))
    rng = np.random.default_rng(seed)
    start = 0
    while start < len(tokens):
        n = int(rng.integers(*doc_len))
        builder.add_item(torch.from_numpy(np.asarray(tokens[start : start + n], dtype=np.int64)))
        builder.end_document()
        start += n
    builder.finalize(prefix + ".idx")
    return prefix


def gpt_dataset(cfg, global_batch: int):
    """The train dataset `threed train` builds for `cfg` (a RunConfig), built here in one process: the reference
    side of data-order tests."""
    from threed.data.datasets import build_datasets
    from threed.data.splits import read_data_flags

    return build_datasets(cfg, read_data_flags(cfg), global_batch, builds_here=True)


def learnable_tokens(n: int, alphabet: int = 16, seed: int = 0) -> np.ndarray:
    """A noisy bigram pattern over a few token ids (next = 7*prev + 3 mod alphabet, 10% random): loss falls fast."""
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int64)
    out[0] = 1
    for i in range(1, n):
        out[i] = rng.integers(alphabet) if rng.random() < 0.1 else (out[i - 1] * 7 + 3) % alphabet
    return out


def sft_examples(n: int, vocab_size: int, length: tuple[int, int] = (6, 40), seed: int = 0) -> list[tuple]:
    """`n` synthetic chat examples (tokens, mask): a random prompt (mask 0) then a response (mask 1) that follows a
    learnable bigram pattern, as `threed preprocess --sft` would store them."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        total = int(rng.integers(*length))
        prompt = int(rng.integers(1, total - 1))
        tokens = rng.integers(0, vocab_size, total)
        for i in range(prompt, total):
            tokens[i] = (tokens[i - 1] * 7 + 3) % min(vocab_size, 16) if rng.random() > 0.1 else rng.integers(16)
        out.append((tokens.astype(np.int64), np.r_[np.zeros(prompt), np.ones(total - prompt)].astype(np.uint8)))
    return out


def write_sft_dataset(base: Path | str, examples: list[tuple], vocab_size: int) -> str:
    """BASE_text_document + BASE_mask_document (one example per document, the mask as uint8), the pair `threed
    preprocess --sft` writes, through megatron's IndexedDatasetBuilder. Returns the text prefix."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    base = str(base)
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    text = IndexedDatasetBuilder(base + "_text_document.bin", dtype=DType.optimal_dtype(vocab_size))
    mask = IndexedDatasetBuilder(base + "_mask_document.bin", dtype=np.uint8)
    for tokens, m in examples:
        text.add_item(torch.from_numpy(np.asarray(tokens, dtype=np.int64)))
        mask.add_item(torch.from_numpy(np.asarray(m, dtype=np.uint8)))
        text.end_document()
        mask.end_document()
    text.finalize(base + "_text_document.idx")
    mask.finalize(base + "_mask_document.idx")
    return base + "_text_document"


def preprocess_cli(args: Sequence[str]) -> int:
    """`threed preprocess ARGS` in this process (its parser as `threed` registers it); the exit status."""
    from threed.cli.preprocess import register

    p = argparse.ArgumentParser(prog="threed")
    register(p.add_subparsers(dest="command", required=True))
    ns = p.parse_args(["preprocess", *args])
    return ns.run(ns)


# torchrun's variables: a process started without them is a world of its own (threed makes a world of one).
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def own_world_env(*more: str) -> dict[str, str]:
    """This process's environment without torchrun's variables (and `more`), one OpenMP thread: for a `threed`
    command that must not join the pytest process's world of one."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV + more}
    env["OMP_NUM_THREADS"] = "1"
    return env


def tiny_train_argv(data: str, save: Path | str, *flags: str) -> list[str]:
    """`threed train` of the tiny preset on `data` (all of it for training), fp32 at sequence length 32, saving to
    `save`; `flags` follow."""
    return [
        "train",
        "--model",
        "tiny",
        "--data-path",
        data,
        "--split",
        "100,0,0",
        "--seq-length",
        "32",
        "--dtype",
        "fp32",
        "--save",
        str(save),
        *flags,
    ]


def tiny_train(data: str, save: Path | str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`python -m threed.cli` + `tiny_train_argv` in a world of its own, its output captured."""
    cmd = [sys.executable, "-m", "threed.cli", *tiny_train_argv(data, save, *flags)]
    return subprocess.run(cmd, env=own_world_env(), capture_output=True, text=True, timeout=300)


# Start-up lines of the libraries that a run's log must not show (threed.parallel.distributed quiets them).
START_UP_NOISE = (
    "real_accelerator",
    "Setting accelerator",
    "Transformer Engine and Apex are not installed",
    "full scope is deprecated",
    "SEED_LAYERS=",
    "Using topology",
    "tied_comms",
    "built successfully",
)


def fake_checkpoint(
    root: Path,
    step: int,
    tp: int = 1,
    pp: int = 2,
    dp: int = 1,
    complete: bool = True,
    latest: bool = True,
    dtype: str = "fp32",
) -> Path:
    """A checkpoint directory shaped like DeepSpeed's (tiny: 7 pipeline layers), with our manifest."""
    tiny = PRESETS["tiny"]
    d = root / f"global_step{step}"
    d.mkdir(parents=True)
    files = {}
    names = [f"layer_{i:02d}-model_{t:02d}-model_states.pt" for i in range(tiny.num_layers + 3) for t in range(tp)]
    names += [f"mp_rank_{r:02d}_model_states.pt" for r in range(tp * pp)]
    prefix = "bf16_" if dtype == "bf16" else ""
    names += [f"{prefix}zero_pp_rank_{d_}_mp_rank_{r:02d}_optim_states.pt" for d_ in range(dp) for r in range(tp * pp)]
    for i, name in enumerate(names):
        (d / name).write_bytes(b"x" * (100 + i))
        files[name] = 100 + i
    if complete:
        write_manifest(
            d,
            files,
            {
                "step": step,
                "dtype": dtype,
                "model": RunConfig(model=tiny).to_dict()["model"],
                "layout": {"tp": tp, "pp": pp, "dp": dp},
            },
        )
        if latest:
            (root / "latest").write_text(d.name)
    return d


def checkpoint_config(save=None, tp=1, pp=2, dtype="fp32", **ck) -> RunConfig:
    """The tiny preset's RunConfig at (tp, pp), 10 steps, saving to `save`: what `fake_checkpoint`'s runs were."""
    return RunConfig(
        model=PRESETS["tiny"],
        parallel=ParallelConfig(tp=tp, pp=pp),
        train=TrainConfig(dtype=dtype, seq_length=32, steps=10),
        checkpoint=CheckpointConfig(save=str(save) if save else None, **ck),
    )


def pipeline_module(cfg: RunConfig, world: int, **kw: Any):
    """threed.parallel.pipeline.build_pipeline_module of `cfg` at `world` ranks, its dimensions resolved as a run
    resolves them (threed.parallel.dims): the tests describe their modules as RunConfigs."""
    # deepspeed, megatron: heavy, only for the tests that build a module
    from threed.parallel.dims import resolve_dims
    from threed.parallel.pipeline import build_pipeline_module

    dims = resolve_dims(cfg, world)
    return build_pipeline_module(cfg.model, dims, cfg.train, sequence_parallel=cfg.parallel.sequence_parallel, **kw)


def decide(cfg: RunConfig, world_size: int):
    """threed.checkpoint.start.decide_start of `cfg` at `world_size` ranks, its dimensions resolved as a run's."""
    return decide_start(cfg, resolve_dims(cfg, world_size))


def child_json(script: Path | str, timeout: float = 600) -> dict:
    """Runs a test file as a child process (its `__main__`: a world of one, so torch.distributed stays out of the
    pytest process) and returns the JSON its last stdout line holds."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def tiny_batch(micro: int, seq: int, packed: bool, seed: int = 0):
    """(inputs, targets) for `tiny`: random tokens and labels; packed: two documents per row (the second from token
    13) and a loss mask (SFT's)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 512, (micro, seq), generator=gen)
    labels = torch.randint(0, 512, (micro, seq), generator=gen)
    if not packed:
        return tokens, labels
    doc_ids = (torch.arange(seq) >= 13).to(torch.int32).expand(micro, seq).contiguous()
    mask = (torch.rand(micro, seq, generator=gen) > 0.4).float()
    return (tokens, doc_ids), (labels, mask)


def gradients_against(loss, grads: dict, whole_loss, whole: dict) -> dict:
    """A run's loss and gradients (name -> tensor) against a reference run's: whether the losses are the same bits,
    the largest per-tensor relative difference (max |diff| over max |reference|), which tensors differ at all, and
    whether every reference gradient is non-zero (tests/unit/test_lm_head_chunks.py, tests/ranks/bytes_worker.py)."""
    assert grads.keys() == whole.keys()
    return {
        "loss": loss.item(),
        "loss_equal": torch.equal(loss, whole_loss),
        "max_rel": max(((grads[n] - whole[n]).abs().max() / whole[n].abs().max()).item() for n in whole),
        "differing": [n for n in whole if not torch.equal(grads[n], whole[n])],
        "all_nonzero": all(bool(g.abs().max() > 0) for g in whole.values()),
    }
