"""megatron-core's fusers off CUDA (threed.parallel.megatron_device.skip_fuser_compile): a CPU rank decorates with
the plain function and never imports torch's compiler (inductor: ~1.5 s of every rank's start), while on CUDA the
decorators stay megatron's `torch.compile`. And DeepSpeed's Muon, which its engine start-up imports and which
decorates with `torch.compile` at import, is imported with plain functions (`threed.parallel.distributed.
import_muon_uncompiled`: ~1.5 s of CPU per rank), DeepSpeed's decorator put back after.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/unit/test_megatron_device.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import threed.parallel.distributed  # noqa: F401  (first, as every entry point: the device policy, then megatron)
import megatron.core
from threed.parallel import megatron_device
from threed.parallel.megatron_device import JIT_MODULE, skip_fuser_compile

# What a CPU rank's entry imports (threed.parallel.pipeline: the device policy, deepspeed, megatron-core, the layers),
# then what it reports: whether torch's compiler was imported, and what megatron's fusers decorate with.
PROBE = """
import json, sys
import threed.parallel.pipeline
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu, fused_cross_entropy
print(json.dumps({
    "inductor": "torch._inductor" in sys.modules,
    "noop_fuser": jit.jit_fuser is jit.noop_decorator,
    "plain_swiglu": not hasattr(fused_bias_swiglu.swiglu, "__wrapped__"),  # torch.compile's wrapper has one
    "plain_cross_entropy": not hasattr(fused_cross_entropy.calculate_logits_max, "__wrapped__"),  # bf16 loss's
}))
"""


def test_a_cpu_rank_never_imports_the_compiler() -> None:
    env = {**os.environ, "THREED_DEVICE": "cpu"}  # the device policy's CPU, also on a machine with a GPU
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"inductor": False, "noop_fuser": True, "plain_swiglu": True, "plain_cross_entropy": True}, seen


@pytest.fixture
def megatron_unimported(monkeypatch):
    """This process as if megatron's jit module were not imported yet, with a meta path of its own."""
    monkeypatch.delitem(sys.modules, JIT_MODULE, raising=False)
    monkeypatch.setattr(
        sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, megatron_device._FuserOffFinder)]
    )


def _finders() -> int:
    return sum(isinstance(f, megatron_device._FuserOffFinder) for f in sys.meta_path)


def test_cuda_keeps_megatrons_decorators(megatron_unimported) -> None:
    skip_fuser_compile("cuda")
    assert _finders() == 0


def test_cpu_switches_megatrons_own_fuser_off(megatron_unimported) -> None:
    skip_fuser_compile("cpu")
    skip_fuser_compile("cpu")  # idempotent: distributed is imported once, but a second call adds nothing
    assert _finders() == 1
    finder = next(f for f in sys.meta_path if isinstance(f, megatron_device._FuserOffFinder))
    assert finder.find_spec("megatron.core.utils", megatron.core.__path__) is None  # every other module: untouched
    spec = finder.find_spec(JIT_MODULE, megatron.core.__path__)
    jit = importlib.util.module_from_spec(spec)  # a fresh copy, outside sys.modules
    spec.loader.exec_module(jit)
    assert jit.jit_fuser is jit.noop_decorator
    assert "def disable_jit_fuser" in spec.loader.get_source(JIT_MODULE)  # the wrapper still reads megatron's file


def test_late_call_changes_nothing(monkeypatch) -> None:
    """Once megatron's jit module is imported its decorators are applied: nothing is installed after the fact."""
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setitem(sys.modules, JIT_MODULE, sys.modules.get(JIT_MODULE) or object())
    before = _finders()
    skip_fuser_compile("cpu")
    assert _finders() == before


MUON_PROBE = """
import json
from threed.parallel.distributed import init_distributed
init_distributed()
from deepspeed.runtime import compiler
from deepspeed.runtime.zero.muon import original_muon
import torch
print(json.dumps({
    "plain_muon": not hasattr(original_muon.zeropower_via_newtonschulz5, "__wrapped__"),  # torch.compile's has one
    "decorator_back": compiler.compile() is torch.compile,
}))
"""


def test_deepspeeds_muon_is_imported_uncompiled() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["THREED_DEVICE"] = "cpu"
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", MUON_PROBE], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"plain_muon": True, "decorator_back": True}
