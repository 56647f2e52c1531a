"""A flag the model or the layout does not allow is refused before torch, DeepSpeed or megatron-core is imported:
`threed train` resolves its config at the world torchrun names (threed.cli.main._train -> threed.engine.resolved)
and only then imports the stack, so a refusal costs a second, not the ~13 s of the imports.

    .venv/bin/python -m pytest -q tests/cli/test_refused_before_imports.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import SRC

# Runs `threed train ARGS` in process, then reports its exit status and which heavy libraries it imported.
PROBE = """
import json, sys
from threed.cli.main import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "heavy": sorted(m for m in ("torch", "deepspeed", "megatron") if m in sys.modules)}))
"""

CASES = {
    # 4 heads (tiny) do not split over tp 3
    "tp3": (["--tp", "3"], "3", "heads"),
    "world": (["--tp", "2"], "3", "not divisible"),
    "steps0": (["--steps", "0"], "1", "--steps 0 trains nothing"),
    "batch": (["--global-batch-size", "3", "--micro-batch-size", "2"], "1", "global_batch_size 3"),
    "recompute": (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "9",
                   "--pp", "2"], "2", "--recompute-num-layers"),
    "compile": (["--torch-compile", "block", "--pp", "2", "--pipeline-schedule", "zb-h1"], "2",
                "--torch-compile block"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refusal_imports_no_heavy_library(case: str, tmp_path) -> None:
    flags, world, says = CASES[case]
    argv = ["train", "--model", "tiny", "--data-path", str(tmp_path / "none"), "--steps", "2", *flags]
    env = {"PYTHONPATH": str(SRC), "WORLD_SIZE": world, "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=60)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rc"] == 2, out.stdout + out.stderr
    assert says in out.stderr and out.stderr.count("configuration error") == 1, out.stderr
    assert report["heavy"] == [], f"{case}: imported {report['heavy']} before refusing"


@pytest.mark.parametrize("model", ["tiny", "llama3.1-70b"])
def test_check_config_answers_without_the_heavy_libraries(model: str) -> None:
    # The launcher runs it before every start and every dry run (recipes/launch.sh): its answer, the memory
    # model's line included, needs no torch.
    argv = ["check-config", "--world", "8", "--model", model, "--tp", "2", "--pp", "2", "--seq-length", "64"]
    argv += ["--lora-rank", "2"] if model == "tiny" else []  # LoRA's memory terms (threed.memory.lora) too
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=60)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rc"] == 0, out.stdout + out.stderr
    assert "config ok:" in out.stdout and "\nmemory: ~" in out.stdout, out.stdout
    assert ("M LoRA params" in out.stdout) == (model == "tiny"), out.stdout
    assert report["heavy"] == [], f"check-config imported {report['heavy']}"
