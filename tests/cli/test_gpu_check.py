"""The one call on the lent GPU machine (`tools/gpu_check.sh`, docs/gpu.md) and the wheels it installs there
(`tools/gpu_bundle.py`, `make gpu-bundle`), checked where CI runs: no GPU, no network.

- The dry run (DRY=1: every phase on CPU at a tiny shape; the GPU tests skip) leaves at most 8 files, the device
  tool's limit, and one JSON holding every phase, the environment, the test outcomes, the benchmark, the profile
  (top kernels, idle holes: on CPU the aten ops, through the same code) and the planner's step-time model fitted
  to the benchmark's runs (the rates `threed plan --calibrate gpu_check.json` fits).
- The bundle's spec names exactly the packages the image lacks, each pinned and explained; the manifest and size
  checks refuse a missing, extra, duplicated, mispinned, uninstallable, altered or oversized wheel in one line.
- A bundle built here (`make gpu-bundle`, git-ignored) matches its manifest and the spec; skipped when absent.

    .venv/bin/python -m pytest -q tests/cli/test_gpu_check.py
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from threed.plan.calibration import calibrate, predict, read_measured
from threed.plan.steptime import Hardware

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
import gpu_bundle  # noqa: E402  (tools/ is not a package)

EXPECTED = {
    "deepspeed": "0.19.8",
    "megatron-core": "0.16.1",
    "pydantic": "2.14.4",
    "pydantic-core": "2.50.5",
    "annotated-types": "0.8.0",
    "typing-inspection": "0.4.5",
    "typing-extensions": "4.16.0",
    "hjson": "3.1.0",
}
SUMMARY_KEYS = {
    *("dry", "budget_s", "elapsed_s", "phases", "env", "tests", "one_gpu", "bench", "profile", "save", "fit", "files"),
}


@pytest.fixture(scope="module")
def dry(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {k: v for k, v in os.environ.items() if k not in ("THREED_DEVICE", "PYTHON")}
    proc = subprocess.run(
        ["bash", str(REPO / "tools" / "gpu_check.sh"), str(out)],
        env={**env, "DRY": "1"},
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=900,
    )
    return {"proc": proc, "out": out}


@pytest.mark.slow  # the dry run of every phase (~250 s on 2 loaded cores): make test-slow
def test_dry_run_passes_and_leaves_at_most_8_files(dry):
    proc, out = dry["proc"], dry["out"]
    assert proc.returncode == 0, proc.stdout[-6000:]
    files = sorted(p.name for p in out.iterdir())
    print(proc.stdout[-3000:])
    assert all((out / f).is_file() and re.fullmatch(r"[A-Za-z0-9._-]+", f) for f in files), files
    assert len(files) <= 8, files
    assert [f for f in files if f.endswith(".json")] == ["gpu_check.json"], files
    assert {"env.log", "tests.log", "bench.log", "profile.log", "save.log", "one_gpu.log"} <= set(files)


@pytest.mark.slow  # the dry run of every phase (~250 s on 2 loaded cores): make test-slow
def test_dry_run_summary_holds_every_phase(dry):
    s = json.loads((dry["out"] / "gpu_check.json").read_text())
    assert SUMMARY_KEYS <= set(s), sorted(s)
    assert s["dry"] is True and s["elapsed_s"] <= s["budget_s"]
    assert [(p["name"], p["status"]) for p in s["phases"]] == [  # the most valuable first: a budget cuts the tail
        ("env", "ok"),
        ("bench", "ok"),
        ("profile", "ok"),
        ("save", "ok"),
        ("tests", "ok"),
        ("one_gpu", "ok"),
    ]
    assert s["env"]["threed_imports"] == "ok" and s["env"]["versions"]["deepspeed"] == "0.19.8"
    assert "varlen_attn" in s["env"]["capabilities"]
    for key in ("tests", "one_gpu"):  # on CPU every GPU test is collected and skips, saying why
        t = s[key]
        assert t["skipped"] > 0 and t["failed"] == t["errors"] == t["passed"] == 0, t
        assert all("GPU" in c["message"] for c in t["cases"]), t["cases"]
    assert sorted(s["files"]) == sorted(p.name for p in dry["out"].iterdir())


@pytest.mark.slow  # the dry run of every phase (~250 s on 2 loaded cores): make test-slow
def test_dry_run_benchmark_measured_both_sides(dry):
    bench = json.loads((dry["out"] / "gpu_check.json").read_text())["bench"]
    runs = bench["runs"]
    assert [(r["impl"], r["activation_checkpointing"], r["micro"], r["gas"], r.get("variant")) for r in runs] == [
        ("threed", False, 1, 8, None),
        ("hf", False, 1, 8, None),
        ("threed", False, 2, 4, None),  # the same 512 tokens per step in half the micro-batches
        ("threed", False, 1, 8, "chunks8"),  # the opt-in flags, each against the first run
        ("threed", False, 1, 8, "rope-norm"),
        ("threed", True, 1, 8, None),
        ("hf", True, 1, 8, None),
    ]
    for r in runs:
        assert "error" not in r and "skipped" not in r, r
        assert r["tokens_per_s"] > 0 and r["kernels"]["sdpa_ops"], r
        # the causal convention counts half the attention square: fewer FLOPs for the same step
        assert 0 < r["tflops_causal"] < r["tflops"], r
    threed = [r for r in runs if r["impl"] == "threed"]
    assert all(r["estimate"]["peak_bytes"] > 0 and r["optimizer"] == "BF16_Optimizer" for r in threed)
    assert bench["flops_convention"].startswith("threed.model.spec.training_flops_per_token")
    assert "seq64_acoff_threed_over_hf_tokens_per_s" in bench["ratios"]


@pytest.mark.slow  # the dry run of every phase (~250 s on 2 loaded cores): make test-slow
def test_dry_run_measures_each_opt_in_flag_against_the_default_run(dry):
    """--lm-head-chunks 8 and --torch-compile rope-norm run as flags, not as the default path: the compiled run
    shows compiled regions where the default shows none, the chunked run's head was built with 8 chunks, both
    train the same tokens to the default's losses (bf16 on CPU: the chunked head's bf16 weight-gradient
    sum and the compiled kernels' rounding move the later steps in the 3rd decimal at most), and both have their
    ratio over the default run."""
    bench = json.loads((dry["out"] / "gpu_check.json").read_text())["bench"]
    by = {
        r.get("variant", ""): r
        for r in bench["runs"]
        if r["impl"] == "threed" and r["micro"] == 1 and not r["activation_checkpointing"]
    }
    default, chunked, compiled = by[""], by["chunks8"], by["rope-norm"]
    assert not default["activation_checkpointing"] and not default["kernels"]["compiled_regions"], default
    assert any("Torch-Compiled Region" in n for n in compiled["kernels"]["compiled_regions"]), compiled["kernels"]
    assert (default["lm_head_chunks"], chunked["lm_head_chunks"], compiled["lm_head_chunks"]) == (1, 8, 1)
    assert chunked["losses"][0] == default["losses"][0], (chunked["losses"], default["losses"])  # the same forward
    for r in (chunked, compiled):
        assert r["losses"] == pytest.approx(default["losses"], abs=5e-3), (r["losses"], default["losses"])
        key = f"seq64_acoff_{r['variant']}"
        assert bench["ratios"][f"{key}_over_default_tokens_per_s"] > 0, bench["ratios"]
        assert f"{key}_threed_over_hf_tokens_per_s" in bench["ratios"], bench["ratios"]
    assert bench["flops_per_token_causal"]["64"] < bench["flops_per_token"]["64"]


@pytest.mark.slow  # the dry run of every phase (~250 s on 2 loaded cores): make test-slow
def test_dry_run_profile_says_where_the_time_goes(dry):
    s = json.loads((dry["out"] / "gpu_check.json").read_text())
    p = s["profile"]
    assert "error" not in p, p
    assert (p["seq"], p["micro"], p["gas"]) == (64, 1, 8) and len(p["profiled_step_s"]) == 2
    top = p["top_kernels"]
    assert top and any(k["name"].startswith("aten::") for k in top), top  # on CPU the device's work is aten ops
    assert all(k["total_ms"] > 0 and k["count"] > 0 and 0 < k["share"] <= 1 for k in top), top
    assert [k["total_ms"] for k in top] == sorted((k["total_ms"] for k in top), reverse=True)
    g = p["gaps"]
    assert g["steps"] == 2 and 0 < g["busy_ms_per_step"] <= g["wall_ms_per_step"], g
    idle = g["idle_between_kernels_ms_per_step"] + g["idle_before_first_ms_per_step"] + g["idle_after_last_ms_per_step"]
    assert g["busy_ms_per_step"] + idle == pytest.approx(g["wall_ms_per_step"], abs=1e-2), g
    assert g["largest"] and all(h["ms"] > 0 and h["after"] and h["before"] for h in g["largest"]), g


@pytest.mark.slow  # the dry run of every phase (~250 s on 2 loaded cores): make test-slow
def test_dry_run_save_phase_measures_a_sync_and_an_async_save(dry):
    """Issue 37's save phase (benchmarks/bench_checkpoint.py --json), on CPU at a tiny shape in bf16: one durable
    synchronous save and one asynchronous one, the seconds each blocked, the host copy's bytes (the memory model's
    figure for the rank, within 10%), its speed, and the seconds until it was published; the summary prints it."""
    s = json.loads((dry["out"] / "gpu_check.json").read_text())["save"]
    assert s["dtype"] == "bf16" and s["device"] == "cpu" and s["pinned"] is False, s
    assert s["sync_save_s"] > 0 and s["async_blocked_s"] > 0 and s["blocked_ratio"] > 0, s
    assert s["async_published_s"] >= s["async_blocked_s"], s
    assert abs(s["host_copy_bytes"] / s["model_host_copy_bytes"] - 1) < 0.10, s
    assert s["host_copy_bytes"] <= s["checkpoint_bytes"] and s["host_copy_gbps"] > 0, s
    assert f"  save: synchronous {s['sync_save_s']} s, async blocked {s['async_blocked_s']} s" in dry["proc"].stdout


@pytest.mark.slow  # the dry run of every phase (~250 s on 2 loaded cores): make test-slow
def test_dry_run_fit_is_the_planners(dry):
    """`fit` on top of gpu_check.json is the planner's step-time model fitted to the bench's threed runs (micro 1
    and 2, and recomputed): the very rates `threed plan --calibrate gpu_check.json` fits, each run's error the
    planner's prediction against its measured step; the summary prints it."""
    path = dry["out"] / "gpu_check.json"
    fit = json.loads(path.read_text())["fit"]
    assert "error" not in fit, fit
    assert fit["runs"] == ["threed:64:off", "threed:64:off:mb2", "threed:64:on"], fit
    measured = read_measured(path)
    rates, how = calibrate(measured, Hardware(nodes=1, gpus_per_node=8, gpu_memory_gb=80))
    assert fit["how"] == how and fit["mm_tflops"] == pytest.approx(rates.mm_tflops, rel=1e-3), fit
    assert fit["attn_tflops"] == pytest.approx(rates.attn_tflops, rel=1e-3), fit
    assert fit["per_micro_batch_ms"] == pytest.approx(rates.micro_s * 1e3, abs=1e-3), fit
    hw = Hardware(nodes=1, gpus_per_node=1, gpu_memory_gb=80, rates=rates)
    errors = [predict(r, hw) / r.step_s - 1 for r in measured.runs]
    assert fit["relative_errors"] == pytest.approx(errors, abs=1e-4), fit
    assert f"  fit ({how}): matmuls {fit['mm_tflops']} TFLOP/s" in dry["proc"].stdout


def test_the_bench_names_each_run_once_and_refuses_one_it_does_not_have(capsys):
    """Every run the bench can make has a key that names it back (a second call's BENCH_RUNS); the default plan
    holds the flags at the shortest length only, after the runs the fit needs; a misspelt run is refused, naming
    the grammar, instead of running nothing."""
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks" / "bench_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    seqs = (4096, 8192)
    default = bench.plan(seqs)
    every = bench.nameable(default, seqs)
    keys = [bench.run_key(*run) for run in every]
    assert len(set(keys)) == len(keys) and all(bench.parse_key(k) == run for k, run in zip(keys, every))
    assert [bench.run_key(*r) for r in default if r[4]] == ["threed:4096:off:chunks8", "threed:4096:off:rope-norm"]
    assert [r[4] for r in default].index("chunks8") > keys.index("threed:4096:off:mb2")
    assert bench.plan(seqs, "threed:8192:on:block,hf:4096:off:mb2") == [
        ("hf", 4096, False, 2, ""),
        ("threed", 8192, True, 1, "block"),
    ]
    with pytest.raises(SystemExit):
        bench.arguments(["--tiny", "--runs", "threed:64:off,threed:64:off:chunks9"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert "--runs: no run threed:64:off:chunks9 at --seqs 64" in err and "chunks8, rope-norm, block" in err, err


def test_gpu_check_without_an_outdir_says_how_to_call_it():
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode != 0 and "usage: tools/gpu_check.sh OUTDIR" in proc.stderr


def test_bundle_spec_names_exactly_the_packages_the_image_lacks():
    spec = {gpu_bundle.normalize(w.package): w for w in gpu_bundle.SPEC}
    assert {k: w.version for k, w in spec.items()} == EXPECTED
    assert [k for k, w in spec.items() if w.source == "sdist"] == ["deepspeed"], "only deepspeed has no wheel"
    assert all(len(w.why) > 15 for w in spec.values())
    assert not set(spec) & gpu_bundle.IMAGE_HAS and "torch" in gpu_bundle.IMAGE_HAS
    gpu_bundle.check_spec()


@pytest.mark.parametrize(
    "change,message",
    [
        (("torch", "2.11.0", "wheel", "the CUDA build"), "is in the device image already"),
        (("hjson", "3.1.0", "wheel", "twice"), "names a package twice"),
        (("einops", ">=0.8", "wheel", "unpinned"), "must be pinned to one release"),
        (("einops", "0.8.1", "wheel", " "), "must say why it travels"),
    ],
)
def test_a_bad_spec_is_refused_in_one_line(change, message):
    spec = (*gpu_bundle.SPEC, gpu_bundle.Wheel(*change))
    with pytest.raises(gpu_bundle.BundleError, match=message) as e:
        gpu_bundle.check_spec(spec)
    assert "\n" not in str(e.value)


def fake_files(size: int = 1000) -> dict[str, int]:
    """A wheel file name per spec entry, as pip names them (binary ones cp312 manylinux)."""
    out = {}
    for w in gpu_bundle.SPEC:
        stem = f"{w.package.replace('-', '_')}-{w.version}"
        binary = w.package in ("megatron-core", "pydantic-core")
        tags = "cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64" if binary else "py3-none-any"
        out[f"{stem}-{tags}.whl"] = size
    return out


def test_the_files_check_takes_the_spec_and_nothing_else():
    files = fake_files()
    assert gpu_bundle.check_files(files) == 1000 * len(EXPECTED)
    no_hjson = {k: v for k, v in files.items() if not k.startswith("hjson")}
    no_core = {k: v for k, v in files.items() if not k.startswith("pydantic_core")}
    cases = {
        "is not in the bundle spec": {**files, "einops-0.8.1-py3-none-any.whl": 10},
        "lacks hjson": no_hjson,
        "two wheels of hjson": {**files, "hjson-3.1.0-py2.py3-none-any.whl": 10},
        "hjson is pinned to 3.1.0": {**no_hjson, "hjson-3.2.0-py3-none-any.whl": 1},
        "does not install on CPython 3.12": {
            **no_core,
            "pydantic_core-2.50.5-cp311-cp311-manylinux_2_17_x86_64.whl": 1,
        },
        "not a wheel file name": {**files, "notes.whl": 1},
    }
    for message, bad in cases.items():
        with pytest.raises(gpu_bundle.BundleError, match=message) as e:
            gpu_bundle.check_files(bad)
        assert "\n" not in str(e.value)


def test_the_size_limit_counts_every_wheel():
    files = fake_files()
    per = (gpu_bundle.LIMIT_BYTES // len(files)) + 1  # one byte each over an even share: just over the limit
    with pytest.raises(gpu_bundle.BundleError, match=r"MiB, over its 24 MiB share") as e:
        gpu_bundle.check_files({k: per for k in files})
    assert "\n" not in str(e.value)
    assert gpu_bundle.check_files({k: per - 1 for k in files}) <= gpu_bundle.LIMIT_BYTES
    assert gpu_bundle.check_files(files, limit=1000 * len(files)) == 1000 * len(files)


def test_manifest_round_trip_and_what_it_catches(tmp_path):
    for name in fake_files():
        (tmp_path / name).write_bytes(name.encode())
    listed = gpu_bundle.manifest(tmp_path)
    (tmp_path / gpu_bundle.MANIFEST).write_text(json.dumps(listed))
    assert gpu_bundle.check_bundle(tmp_path) == listed
    assert {w["package"] for w in listed["wheels"]} == set(EXPECTED)
    assert all(w["bytes"] > 0 and len(w["sha256"]) == 64 and w["why"] for w in listed["wheels"])
    first = tmp_path / listed["wheels"][0]["file"]
    first.write_bytes(bytes(reversed(first.read_bytes())))  # same size, other bytes
    with pytest.raises(gpu_bundle.BundleError, match="is not the file MANIFEST.json lists"):
        gpu_bundle.check_bundle(tmp_path)
    (tmp_path / "einops-0.8.1-py3-none-any.whl").write_bytes(b"x")
    with pytest.raises(gpu_bundle.BundleError, match="disagree on the wheels"):
        gpu_bundle.check_bundle(tmp_path)


@pytest.mark.skipif(not (REPO / "gpu-bundle" / "MANIFEST.json").is_file(), reason="no gpu-bundle/ (make gpu-bundle)")
def test_the_built_bundle_matches_its_manifest_and_the_spec():
    listed = gpu_bundle.check_bundle(REPO / "gpu-bundle")
    assert {gpu_bundle.normalize(w["package"]): w["version"] for w in listed["wheels"]} == EXPECTED
    assert listed["total_bytes"] <= gpu_bundle.LIMIT_BYTES


def top_imports(path: Path) -> set[str]:
    """The top-level names a Python file imports (any depth in the file: lazy imports count too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_what_the_gpu_machine_collects_imports_only_what_it_has():
    """The first GPU call (2026-11-26) lost its tests phase to `pytest -m gpu tests` collecting tests/unit, whose
    test_house imports grimp (a dev extra the image lacks). The phases collect tests/gpu only; everything those
    files reach among the test modules imports nothing beyond the standard library, the image and the bundle."""
    tests = REPO / "tests"
    local = {p.stem: p for p in tests.rglob("*.py")}
    allowed = set(sys.stdlib_module_names) | set(gpu_bundle.IMAGE_HAS) | {"threed", "deepspeed", "megatron"}
    todo, seen, missing = [tests / "conftest.py", *sorted((tests / "gpu").glob("*.py"))], set(), {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in top_imports(path):
            if name in local:
                todo.append(local[name])
            elif name not in allowed:
                missing.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert not missing, f"the GPU image has none of these (tests/gpu reaches them): {missing}"
    marked = {p for p in tests.rglob("test_*.py") if re.search(r"pytest\.mark\.gpu\b", p.read_text())}
    assert marked and all(p.parent == tests / "gpu" for p in marked), "gpu-marked tests must live in tests/gpu"
    assert "-m gpu tests/gpu " in (REPO / "tools" / "gpu_check.sh").read_text()
