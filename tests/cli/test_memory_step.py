"""`threed memory` predicts the step of the one layout it is given by `threed plan`'s own path (issue 35): the same
seconds and tokens/s as the planner for that layout, under the same --calibrate file and hardware flags; by default
the line of the rates fitted to the committed H200 runs; and a bad calibration file or flag is one line, exit 2,
before torch, DeepSpeed or megatron-core is imported.

    .venv/bin/python -m pytest -q tests/cli/test_memory_step.py
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import SRC
from threed.cli.main import main
from threed.plan.steptime import DEFAULT_RATES, Rates

H200 = Path(__file__).parents[2] / "benchmarks" / "measured" / "2026-11-28-h200.json"
# tp 2, cp 2, pp 2, dp 2 (16 GPUs: two nodes of 8), sequence parallel, ZB-H1, every block recomputed
MEMORY = (
    "memory --model llama3.1-8b --tp 2 --pp 2 --cp 2 --dp 2 --micro-batch-size 1 --grad-accum-steps 8 "
    "--seq-length 16384 --sequence-parallel --pipeline-schedule zb-h1 --activation-checkpointing"
).split()
PLAN = ("plan --model llama3.1-8b --gpu-memory 141 --seq-length 16384 --global-batch-size 16 --tp 2 "
        "--pp 2 --cp 2 --micro-batch-size 1 --sequence-parallel true --pipeline-schedule zb-h1 "
        "--activation-checkpointing true").split()  # fmt: skip
PREDICTED = re.compile(r"^predicted: ([\d.]+) s/step \(([\d,]+) tokens/s, 262,144 tokens per step\)", re.M)


def run(capsys, argv: list[str]) -> str:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


# (threed memory's hardware flags, threed plan's --nodes for the same 16 GPUs)
HARDWARE = {"default": ([], "2"), "4-per-node": (["--network-gbps", "12.5", "--gpus-per-node", "4"], "4")}


@pytest.mark.parametrize("hardware", sorted(HARDWARE))
def test_memory_predicts_the_planners_step_for_its_layout(capsys, hardware: str) -> None:
    """The plan's best (its filters leave this one layout) and its table row: the seconds and tokens/s that
    `threed memory` prints, the hardware flags and the calibration taken alike by both."""
    flags, nodes = HARDWARE[hardware]
    calibrate = ["--calibrate", str(H200), *flags]
    mem = run(capsys, [*MEMORY, *calibrate])
    plan = run(capsys, [*PLAN, "--nodes", nodes, *calibrate])
    seconds, tokens = PREDICTED.search(mem).groups()
    best = re.search(r"^best: tp2 cp2 pp2 dp2, micro 1 x gas 8, sequence parallel, zb-h1, recomputing every block: "
                     r"[\d.]+ s/step predicted \(([\d,]+) tokens/s\)", plan, re.M)  # fmt: skip
    assert best and best[1] == tokens, (mem, plan)
    row = re.search(r"^ +1 +2 +2 +2 +2 +1 +8 +yes zb-h1 +1 +\S+ +[\d.]+ +[\d.]+% +([\d.]+)  yes$", plan, re.M)
    assert row and row[1] == seconds, (mem, plan)
    # the fit's lines, the same in both
    fitted = [line for line in mem.splitlines() if "fitted" in line]
    assert fitted[0].startswith("step-time model fitted to NVIDIA H200, 2026-11-28, bench_gpu.py: ")
    assert len(fitted) == 4 and all(line in plan.splitlines() for line in fitted), (mem, plan)


def test_the_default_names_its_fit_and_the_flags_move_the_step(capsys) -> None:
    default = run(capsys, MEMORY)
    assert default.splitlines()[-1] == DEFAULT_RATES.line(), default
    assert default.startswith("~") and len(default.splitlines()) == 3, default
    flat = run(capsys, [*MEMORY, "--tflops", "400"])
    assert flat.splitlines()[-1] == Rates.flat(400).line(), flat
    slow = run(capsys, [*MEMORY, "--network-gbps", "5"])  # pp and dp cross the two nodes
    steps = [float(PREDICTED.search(out)[1]) for out in (default, flat, slow)]
    assert steps[1] != steps[0] and steps[2] > steps[0], steps
    # the memory line is the estimate's, whatever the rates
    assert default.splitlines()[0] == flat.splitlines()[0] == slow.splitlines()[0]


# Runs `threed ARGS` in process, then reports its exit status and which heavy libraries it imported.
PROBE = """
import json, sys
from threed.cli.main import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "heavy": sorted(m for m in ("torch", "deepspeed", "megatron") if m in sys.modules)}))
"""
LAYOUT = "memory --model llama3.2-1b --tp 1 --pp 2 --dp 1 --micro-batch-size 1 --grad-accum-steps 4 --seq-length 8192"
BAD = {
    "missing": (["--calibrate", "{tmp}/none.json"], r"--calibrate \S+none.json: cannot read it as JSON"),
    "not-json": (["--calibrate", "{tmp}/broken.json"], r"--calibrate \S+broken.json: cannot read it as JSON"),
    "not-measured": (["--calibrate", "{tmp}/runs.json"], r"runs.json: not a measured JSON \(missing "),
    "both": (["--calibrate", str(H200), "--tflops", "400"], r"--tflops and --calibrate both set the compute rates"),
    "nan": (["--nvlink-gbps", "nan"], r"--nvlink-gbps must be a finite number, got nan"),
    "zero": (["--gpus-per-node", "0"], r"--gpus-per-node must be a positive number, got 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_step_time_input_is_one_line_before_the_heavy_imports(case: str, tmp_path: Path) -> None:
    (tmp_path / "broken.json").write_text('{"device": "H200", ')
    (tmp_path / "runs.json").write_text(json.dumps({"runs": [{"seq": 1}]}))
    flags, says = BAD[case]
    argv = [*LAYOUT.split(), *(f.format(tmp=tmp_path) for f in flags)]
    env = {"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, timeout=60)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["rc"] == 2, out.stdout + out.stderr
    err = out.stderr.strip()
    assert len(err.splitlines()) == 1 and re.search(says, err) and "Traceback" not in err, err
    assert report["heavy"] == [], f"{case}: imported {report['heavy']} before refusing"
    assert "GB/GPU" not in out.stdout  # refused before the estimate
