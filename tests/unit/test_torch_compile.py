"""`--torch-compile rope-norm | block` (threed.model.compiled) in one process at tp 1, fp32 on CPU (inductor's C++
kernels): one forward and backward of the tiny model gives the eager path's loss and gradients within MAX_REL, with
plain labels, packed SFT rows, full recompute and selective recompute; the compiler really ran (dynamo compiled
graphs) and was never imported while the flag was off; the config and the device check refuse what cannot work in one
line.

The model half runs in a child process (as tests/unit/test_lm_head_chunks.py): megatron's parallel state needs
torch.distributed (a world of one), which must not leak into the pytest process. Eager references first, then the
blocks compiled, then rope-norm last: its RoPE replacement is process-wide (threed.model.compiled.compile_rope).

    PYTHONPATH=src .venv/bin/python -m pytest -q -m "slow or not slow" tests/unit/test_torch_compile.py

The child is slow (~50 s of CPU, mostly compiling), so its two tests are marked slow; the refusals run always.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from helpers import child_json, gradients_against, pipeline_module, tiny_batch
from threed.config import ConfigError, ParallelConfig, RunConfig, TrainConfig
from threed.convert.resolve import model_config

SEQ, MICRO = 32, 2
# The bound: per tensor, max |compiled - eager| over max |eager|. Inductor may fuse and reorder fp32 reductions (the
# norm's mean of squares), so the last bits may move (2^-23 = 1.2e-7 relative per rounding).
MAX_REL = 1e-5
FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SELECTIVE = dict(recompute_granularity="selective")
# (name, --torch-compile, packed rows, recompute flags), in the order the child runs them (rope-norm last)
CASES = [
    ("block", "block", False, {}),
    ("block_full", "block", False, FULL),
    ("block_selective_packed", "block", True, SELECTIVE),
    ("rope_norm", "rope-norm", False, {}),
    ("rope_norm_full_packed", "rope-norm", True, FULL),
]


@pytest.fixture(scope="module")
def measured() -> dict:
    return child_json(Path(__file__).resolve(), timeout=900)


def config(mode: str, recompute: dict) -> RunConfig:
    train = TrainConfig(dtype="fp32", seq_length=SEQ, micro_batch_size=MICRO, torch_compile=mode, **recompute)
    return RunConfig(model=model_config("tiny"), train=train)


def batch(packed: bool, seed: int = 0):
    return tiny_batch(MICRO, SEQ, packed, seed)


def loss_and_grads(mode: str, packed: bool, recompute: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """One forward and backward of the tiny model (seconds, the first call's compile included)."""
    torch.manual_seed(0)
    module = pipeline_module(config(mode, recompute), 1)
    # DeepSpeed's engine sets the checkpoint function of a recomputing module (reentrant; non-reentrant for packed
    # rows, whose integer ids cannot require grad: threed.engine.ds_config); without an engine, torch's own.
    module.activation_checkpoint_func = functools.partial(checkpoint, use_reentrant=not packed)
    inputs, targets = batch(packed)
    start = time.perf_counter()
    loss = module.loss_fn(module(inputs), targets)
    loss.backward()
    seconds = time.perf_counter() - start
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}, seconds


def compare(mode: str, packed: bool, recompute: dict, eager: tuple) -> dict:
    """The compiled run against the eager one (`helpers.gradients_against`), its seconds and dynamo's graph count."""
    from torch._dynamo.utils import counters  # torch's compiler: imported by now (the flag is on)

    graphs = counters["stats"]["unique_graphs"]
    loss, grads, seconds = loss_and_grads(mode, packed, recompute)
    out = gradients_against(loss, grads, *eager[:2])
    return {**out, "seconds": seconds, "eager_seconds": eager[2], "graphs": counters["stats"]["unique_graphs"] - graphs}


def _worker() -> dict:
    torch.set_num_threads(1)
    from threed.parallel.distributed import init_distributed, init_megatron_parallel_state, shutdown_distributed

    init_distributed()
    init_megatron_parallel_state(1, 1)
    try:
        eager = {CASES[0][0]: loss_and_grads("none", *CASES[0][2:])}
        # What the flag off imported, after a forward and backward (the test's recompute cases come after: torch's
        # own checkpoint, which an engine does not use, imports dynamo)
        off = {"dynamo": "torch._dynamo" in sys.modules, "inductor": "torch._inductor" in sys.modules}
        eager.update({name: loss_and_grads("none", packed, recompute) for name, _, packed, recompute in CASES[1:]})
        cases = {name: compare(mode, packed, recompute, eager[name]) for name, mode, packed, recompute in CASES}
        return {"off": off, "cases": cases}
    finally:
        shutdown_distributed()


@pytest.mark.slow  # ~50 s of CPU, most of it inductor compiling the blocks' C++ kernels
def test_compiled_loss_and_gradients_equal_the_eager_path(measured) -> None:
    for name, mode, _, _ in CASES:
        r = measured["cases"][name]
        print(
            f"{name}: loss equal {r['loss_equal']}, max relative grad diff {r['max_rel']:.3g} ({len(r['differing'])} "
            f"tensors differ), {r['graphs']} graphs, first step {r['seconds']:.1f} s (eager {r['eager_seconds']:.2f} s)"
        )
        assert abs(r["loss"]) > 0 and r["all_nonzero"], name
        assert r["max_rel"] <= MAX_REL, name
        assert r["graphs"] >= 1, f"{name}: --torch-compile {mode} compiled nothing"


@pytest.mark.slow  # the same child process as above
def test_the_flag_off_imports_no_compiler(measured) -> None:
    assert measured["off"] == {"dynamo": False, "inductor": False}


def test_zb_h1_with_compiled_blocks_is_refused_in_one_line() -> None:
    cfg = dataclasses.replace(config("block", {}), parallel=ParallelConfig(pp=2, pipeline_schedule="zb-h1"))
    with pytest.raises(ConfigError) as e:
        cfg.validate(2)
    line = str(e.value)
    assert "\n" not in line and "--torch-compile block" in line and "zb-h1" in line and "1f1b" in line, line
    dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, torch_compile="rope-norm")).validate(2)


def test_a_cpu_without_a_cpp_compiler_is_refused_in_one_line(monkeypatch) -> None:
    import threed.parallel.distributed  # noqa: F401  (first, as every entry point: the device policy, then megatron)
    from threed.model.compiled import refusal  # megatron: heavy, only this test

    assert refusal("none", "cpu") is None
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    line = refusal("rope-norm", "cpu")
    assert line is not None and "\n" not in line and "no-such-compiler-here" in line and "CXX" in line, line
    monkeypatch.setattr(torch.nn.Module, "compile", None)
    line = refusal("block", "cpu")
    assert line is not None and "Module.compile" in line, line


if __name__ == "__main__":
    # Inductor compiles in this process, not in a pool of compile workers (its default on a machine of 2+ cores): each
    # worker imports torch anew. Measured on 2 cores (2026-11-29, cold caches): 54 s of CPU instead of 140, the same
    # losses, gradients and graph counts. Read when the compiler is first imported, after the eager cases.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    print(json.dumps(_worker()))
