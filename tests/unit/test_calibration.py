"""The step-time model's rates fitted to measured GPU runs (`threed.plan.calibration`, issue 35): the fit recovers known
rates from synthetic points and says how it was constrained; the committed H200 JSON is what its committed
bench_gpu.py log says; `threed plan --calibrate` on it reproduces each measured step within 5%; the default rates
are that fit, and the two runs without recompute alone give the per-micro-batch cost docs/gpu.md quotes; a noisy
third run is fitted on relative errors; gpu_check.json is read as well, and a run, a point or a file the fit cannot
use is refused in one line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from threed.cli.plan import main as plan_main
from threed.config import ConfigError
from threed.plan.calibration import Run, calibrate, fit, from_bench_log, predict, read_measured, run_point
from threed.plan.steptime import DEFAULT_RATES, Hardware

MEASURED = Path(__file__).parents[2] / "benchmarks" / "measured"
H200 = MEASURED / "2026-11-28-h200.json"
HW = Hardware(nodes=1, gpus_per_node=1, gpu_memory_gb=141)
BENCH_GPU = Path(__file__).parents[2] / "benchmarks" / "bench_gpu.py"


def points(u: float, v: float, c: float, shapes: list[tuple[float, float, float]]) -> list[tuple[float, ...]]:
    return [(m, a, n, m * u + a * v + n * c) for m, a, n in shapes]


def test_fit_recovers_known_rates_free_when_the_runs_separate_them() -> None:
    """Four runs that move matmul FLOPs, attention FLOPs and micro-batches apart (as micro 2 at seq 4096 does
    beside micro 1): all three free, recovered exactly."""
    u, v, c = 1 / 650e12, 1 / 280e12, 0.021
    shapes = [(2.4e14, 2.6e13, 8), (2.4e14, 2.6e13, 4), (2.4e14, 5.3e13, 4), (3.1e14, 7.0e13, 4)]
    f = fit(points(u, v, c, shapes))
    assert f.how == "R_mm, R_attn and c free"
    assert (f.mm_tflops, f.attn_tflops, f.micro_s) == pytest.approx((650, 280, 0.021), rel=1e-9)


def test_fit_ties_attention_when_the_free_solution_is_not_a_rate() -> None:
    """Points shaped as the H200 runs (seq 4096 gas 8, 8192 gas 4, 8192 recomputed), made with R_attn = R_mm / 2,
    then two nudged by 1% (a step's spread): the free solution lands at R_attn = 4,588 or 155 TFLOP/s or goes
    negative, so the fit ties R_attn = R_mm / 2 and recovers (R_mm, c) to the nudge; two runs: tied and exact;
    one: c = 0."""
    u, c = 1 / 600e12, 0.03
    shapes = [(2.4e14, 2.6e13, 8), (2.4e14, 5.3e13, 4), (3.1e14, 7.0e13, 4)]
    exact = points(u, 2 * u, c, shapes)
    for nudge in ((0.0, -0.01, 0.01), (0.0, 0.01, -0.01), (0.0, -0.02, 0.02)):
        f = fit([(m, a, n, t * (1 + e)) for (m, a, n, t), e in zip(exact, nudge)])
        assert f.how == "R_attn tied to R_mm / 2, c free", nudge
        assert f.attn_tflops == pytest.approx(f.mm_tflops / 2) and f.mm_tflops == pytest.approx(600, rel=0.05)
    f2 = fit(exact[:2])
    assert f2.how == "R_attn tied to R_mm / 2, c free"
    assert (f2.mm_tflops, f2.micro_s) == pytest.approx((600, 0.03), rel=1e-9)
    f1 = fit(exact[:1])
    assert f1.how == "R_attn tied to R_mm / 2, c = 0" and f1.micro_s == 0
    assert exact[0][0] / (f1.mm_tflops * 1e12) + exact[0][1] / (f1.attn_tflops * 1e12) == pytest.approx(exact[0][3])


def test_committed_json_is_its_log() -> None:
    """benchmarks/measured/2026-11-28-h200.json is tools/measured_from_log.py of the log beside it."""
    derived = from_bench_log((MEASURED / "2026-11-28-h200.bench.log").read_text(), "2026-11-28", "2.11.0+cu130")
    assert json.loads(H200.read_text()) == json.loads(json.dumps(derived.as_json()))
    assert [(r.seq, r.gas, r.recompute, r.tokens_per_s) for r in derived.runs] == [
        (4096, 8, False, 41875.0),
        (8192, 4, False, 45901.0),
        (8192, 4, True, 36887.0),
    ]


def test_plan_calibrate_reproduces_the_h200_steps_within_5_percent(capsys) -> None:
    argv = "--model llama3.2-1b --nodes 1 --gpus-per-node 1 --gpu-memory 141 --seq-length 8192 --global-batch-size 4"
    assert plan_main([*argv.split(), "--calibrate", str(H200)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^step-time model fitted to NVIDIA H200, 2026-11-28, bench_gpu.py: ", out, re.M), out
    rows = re.findall(r"^  llama3.2-1b seq (\d+) .*: measured ([\d.]+) s/step, fitted model ([\d.]+) s/step", out, re.M)
    assert [int(seq) for seq, _, _ in rows] == [4096, 8192, 8192], out
    for _, measured, predicted in rows:
        assert abs(float(predicted) / float(measured) - 1) < 0.05, out
    # tokens/s of each run, from the function the lines print
    measured = read_measured(H200)
    rates, _ = calibrate(measured, HW)
    for run in measured.runs:
        tokens = run.seq * run.micro * run.gas / predict(run, dataclasses.replace(HW, rates=rates))
        assert tokens == pytest.approx(run.tokens_per_s, rel=0.05), run


def test_default_rates_are_the_h200_fit_and_say_so(capsys) -> None:
    rates, how = calibrate(read_measured(H200), Hardware(nodes=1, gpus_per_node=8, gpu_memory_gb=80))
    assert how == "R_attn tied to R_mm / 2, c free"  # the free solution's attention rate is negative here
    got = (rates.mm_tflops, rates.attn_tflops, rates.micro_s)
    assert got == pytest.approx((DEFAULT_RATES.mm_tflops, DEFAULT_RATES.attn_tflops, DEFAULT_RATES.micro_s), rel=1e-3)
    argv = "--model llama3.1-8b --nodes 1 --gpu-memory 80 --seq-length 8192 --global-batch-size 64 --tp 8"
    assert plan_main(argv.split()) == 0
    assert "step-time model fitted to NVIDIA H200, 2026-11-28, bench_gpu.py" in capsys.readouterr().out


def test_reads_gpu_check_json(tmp_path: Path) -> None:
    """gpu_check.json's `bench` part: threed runs that finished, HF and skipped runs left out, unknown keys ignored;
    the device and torch from it, the step its median."""
    bench = {
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0+cu130",
        "model": "llama3.2-1b",
        "new_profile_field": {"top_kernels": []},
        "runs": [
            {"impl": "threed", "seq": 4096, "micro": 2, "gas": 4, "activation_checkpointing": False,
             "median_step_s": 0.75, "tokens_per_s": 43690.7, "sustained_tflops": 1},
            {"impl": "hf", "seq": 4096, "micro": 1, "gas": 8, "activation_checkpointing": False, "median_step_s": 0.9},
            {"impl": "threed", "seq": 8192, "activation_checkpointing": True, "skipped": "budget"},
        ],
    }  # fmt: skip
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps({"dry": False, "phases": [], "bench": bench, "date": "2026-11-30"}))
    m = read_measured(path)
    assert (m.device, m.torch, m.date) == ("NVIDIA H100 80GB HBM3", "2.11.0+cu130", "2026-11-30")
    assert m.runs == (Run("llama3.2-1b", 4096, 2, 4, False, 4096 * 8 / 0.75, 0.75),)


def test_refusals_in_one_line(tmp_path: Path, capsys) -> None:
    run = Run("llama3.2-1b", 4096, 1, 8, False, 40000.0, 0.82, tp=2)
    with pytest.raises(ConfigError, match=r"calibration reads runs at tp 1, pp 1 .* has tp 2, pp 1"):
        run_point(run, HW)
    bad = tmp_path / "x.json"
    bad.write_text('{"runs": [{"seq": 1}]}')
    argv = "--model llama3.2-1b --nodes 1 --gpus-per-node 1 --gpu-memory 141 --seq-length 4096 --global-batch-size 8"
    assert plan_main([*argv.split(), "--calibrate", str(bad)]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a measured JSON" in err, err
    assert plan_main([*argv.split(), "--calibrate", str(H200), "--tflops", "400"]) != 0
    assert "--tflops and --calibrate both set the compute rates" in capsys.readouterr().err


def test_the_h200s_two_runs_without_recompute_give_the_documented_per_micro_batch_cost() -> None:
    """Seq 4096 (gas 8) and 8192 (gas 4), the two runs without recompute (docs/gpu.md's predictions quote these
    figures): two runs, two unknowns once R_attn is tied, so the fit goes through both exactly."""
    measured = read_measured(H200)
    two = dataclasses.replace(measured, runs=tuple(r for r in measured.runs if not r.recompute))
    rates, how = calibrate(two, HW)
    assert [r.seq for r in two.runs] == [4096, 8192] and how == "R_attn tied to R_mm / 2, c free"
    assert rates.micro_s == pytest.approx(0.0378, abs=5e-5) and rates.mm_tflops == pytest.approx(639.5, abs=0.1)
    fitted = dataclasses.replace(HW, rates=rates)
    assert all(abs(predict(r, fitted) / r.step_s - 1) < 1e-9 for r in two.runs)


def test_a_third_noisy_run_is_fitted_on_relative_errors() -> None:
    """Three runs made with R_attn = R_mm / 2, 1% of noise on two, the third ten times the first (ten times the
    micro-batches: the same shape, so the free fit cannot separate the rates): the fit minimises the relative
    errors, not the seconds (its normal equations hold on relative residuals, not on absolute ones, where the
    long run would outweigh the others a hundredfold), and lands within the noise of the truth."""
    u, c = 1 / 600e12, 0.03
    shapes = [(2.4e14, 2.6e13, 8), (2.4e14, 2.6e13, 4), (2.4e15, 2.6e14, 80)]
    exact = points(u, 2 * u, c, shapes)
    noisy = [(m, a, n, t * e) for (m, a, n, t), e in zip(exact, (1.01, 0.99, 1.0))]
    f = fit(noisy)
    assert f.how == "R_attn tied to R_mm / 2, c free"
    assert f.mm_tflops == pytest.approx(600, rel=0.05) and f.micro_s == pytest.approx(0.03, rel=0.15)
    x = np.array([(m / 1e12 + 2 * a / 1e12, n) for m, a, n, _ in noisy])  # tied columns: R_mm in TFLOP/s
    y = np.array([t for *_, t in noisy])
    theta = np.array([1 / f.mm_tflops, f.micro_s])
    relative = x @ theta / y - 1
    assert np.abs(relative).max() < 0.015
    assert np.abs((x / y[:, None]).T @ relative).max() < 1e-9 * np.abs(x / y[:, None]).max()
    assert np.abs(x.T @ (x @ theta - y)).max() > 1e-6 * np.abs(x).max()  # not least squares on the seconds
    f3 = fit(exact)
    assert (f3.mm_tflops, f3.micro_s) == pytest.approx((600, 0.03), rel=1e-9)


@pytest.mark.parametrize(
    "runs,message",
    [
        ([], "calibration needs runs with positive FLOPs and step times"),
        ([(2.4e14, 0.0, 8, 0.78)], "calibration needs runs with positive FLOPs and step times"),
        ([(2.4e14, 2.6e13, 8, 0.78), (2.4e14, 2.6e13, 4, -0.01)], "calibration needs runs with positive FLOPs"),
    ],
)
def test_points_the_fit_cannot_use_are_refused_in_one_line(runs, message) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        fit(runs)
    assert "\n" not in str(e.value)


def test_no_threed_run_is_refused_in_one_line() -> None:
    """A benchmark whose threed runs all failed or were skipped (bench_gpu.py writes this line as its `fit`)."""
    empty = dataclasses.replace(read_measured(H200), runs=(), source="bench_gpu.json (bench_gpu.py)")
    with pytest.raises(ConfigError, match=r"no threed run in the calibration file \(bench_gpu.json") as e:
        calibrate(empty, HW)
    assert "\n" not in str(e.value)


def test_the_benchmarks_fit_is_the_planners() -> None:
    """benchmarks/bench_gpu.py's `fit` (what gpu_check.json carries on top) of the H200's runs, given as its own
    JSON's runs beside an HF one: the default rates, with the errors `threed plan --calibrate` prints for them
    (docs/performance.md: -0.2%, +1.1%, -0.9%); before any threed run, the one line saying why there is none."""
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH_GPU)  # benchmarks/ is not a package
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    hf = {"impl": "hf", "seq": 4096, "micro": 1, "gas": 8, "activation_checkpointing": False, "median_step_s": 0.83}
    runs = [
        {"impl": "threed", "seq": r.seq, "micro": r.micro, "gas": r.gas, "activation_checkpointing": r.recompute,
         "median_step_s": r.step_s}
        for r in read_measured(H200).runs
    ]  # fmt: skip
    fit = bench.step_fit({"model": "llama3.2-1b", "runs": [runs[0], hf, *runs[1:]]})
    assert fit["runs"] == ["threed:4096:off", "threed:8192:off", "threed:8192:on"], fit
    assert fit["how"] == "R_attn tied to R_mm / 2, c free", fit
    got = (fit["mm_tflops"], fit["attn_tflops"], fit["per_micro_batch_ms"] / 1e3)
    assert got == pytest.approx((DEFAULT_RATES.mm_tflops, DEFAULT_RATES.attn_tflops, DEFAULT_RATES.micro_s), rel=1e-3)
    assert fit["relative_errors"] == pytest.approx([-0.002, 0.011, -0.009], abs=5e-4), fit
    none = bench.step_fit({"model": "llama3.2-1b", "runs": [hf, {**runs[0], "median_step_s": None, "error": "OOM"}]})
    assert list(none) == ["error"] and none["error"].startswith("no threed run") and "\n" not in none["error"]
