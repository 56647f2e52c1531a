"""The two Python halves of `tools/gpu_check.sh`: what the machine is (`env`), and the one JSON that sums a run up
(`summary`). Why a file of its own: the shell script times and orders the phases, and whatever a phase left
behind (a log, a JUnit XML, the benchmark's JSON, or nothing when it was killed) still becomes one readable
result, because the device tool brings back at most 8 files and only what lies under $OUT.

    python tools/gpu_check_report.py env --json ENV.json          print the environment, write it as JSON
    python tools/gpu_check_report.py summary --tmp TMP --out OUT  read TMP's phases.tsv, *.xml, bench.json,
                                                                  env.json; write OUT/gpu_check.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import inspect
import json
import platform
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Optional

SUMMARY = "gpu_check.json"
# The packages the bundle brings and those the image must have; their versions and where each is imported from.
PACKAGES = (
    "torch",
    "deepspeed",
    "megatron-core",
    "transformers",
    "triton",
    "pydantic",
    "pydantic-core",
    "typing-extensions",
    "hjson",
    "numpy",
    "packaging",
    "pytest",
)
MODULES = {"deepspeed": "deepspeed", "megatron-core": "megatron.core", "pydantic": "pydantic", "torch": "torch"}


def versions() -> dict[str, Optional[str]]:
    out: dict[str, Optional[str]] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def origins() -> dict[str, Optional[str]]:
    """Where each key module would be imported from (the bundle's --target folder, or the image), not importing."""
    out: dict[str, Optional[str]] = {}
    for name, module in MODULES.items():
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        out[name] = spec.origin if spec else None
    return out


def gpu() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"cuda_build": torch.version.cuda, "available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            name=p.name,
            count=torch.cuda.device_count(),
            memory_gib=round(p.total_memory / 2**30, 1),
            capability=f"{p.major}.{p.minor}",
            multiprocessors=p.multi_processor_count,
            flash_sdp=torch.backends.cuda.flash_sdp_enabled(),
            mem_efficient_sdp=torch.backends.cuda.mem_efficient_sdp_enabled(),
            cudnn_sdp=torch.backends.cuda.cudnn_sdp_enabled(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    if shutil.which("nvidia-smi"):
        q = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"]
        proc = subprocess.run(q, capture_output=True, text=True)
        info["nvidia_smi"] = proc.stdout.strip() or proc.stderr.strip()
    return info


def capabilities() -> dict[str, Any]:
    """What differs between torch releases and matters to threed, probed rather than read off a version."""
    out: dict[str, Any] = {}
    try:
        from torch.nn.attention.varlen import varlen_attn

        out["varlen_attn"] = True
        out["varlen_attn_enable_gqa"] = "enable_gqa" in inspect.signature(varlen_attn).parameters
    except ImportError:
        out["varlen_attn"] = False
    from torch.distributed.run import get_args_parser

    flags = {s for a in get_args_parser()._actions for s in a.option_strings}
    out["torchrun_shutdown_timeout"] = "--shutdown-timeout" in flags or "--shutdown_timeout" in flags
    return out


def threed_imports() -> str:
    """Whether threed's engine imports (deepspeed, megatron-core, pydantic from the bundle): 'ok' or the error."""
    try:
        import threed.engine.build  # noqa: F401

        return "ok"
    except Exception as e:  # report it; the phases after this one will fail the same way
        return f"{type(e).__name__}: {e}"


def env(path: Optional[Path]) -> int:
    t0 = time.perf_counter()
    info = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "versions": versions(),
        "imported_from": origins(),
        "gpu": gpu(),
        "capabilities": capabilities(),
        "threed_imports": threed_imports(),
    }
    info["seconds"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(info, indent=1)
    print(text)
    if path:
        path.write_text(text + "\n")
    return 0 if info["threed_imports"] == "ok" else 1


def junit(path: Path) -> Optional[dict[str, Any]]:
    """Counts and every case (id, outcome, seconds, the first line of its message) of a pytest JUnit XML."""
    if not path.is_file():
        return None
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        return {"error": f"unreadable {path.name}: {e}"}
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for kind, name in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            child = case.find(kind)
            if child is not None:
                outcome, message = name, (child.get("message") or child.text or "").strip().splitlines()[:1]
                message = message[0][:300] if message else ""
                break
        counts[outcome] += 1
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"id": test_id, "outcome": outcome, "seconds": float(case.get("time", 0)), "message": message})
    return {**counts, "cases": cases}


def phases(path: Path) -> list[dict[str, Any]]:
    out = []
    for row in path.read_text().splitlines() if path.is_file() else []:
        name, rc, seconds, limit, log = row.split("\t")
        status = (
            "skipped" if rc == "skipped" else "timed out" if rc in ("124", "137") else "ok" if rc == "0" else "failed"
        )
        out.append(dict(name=name, rc=rc, status=status, seconds=int(seconds), limit_s=int(limit), log=log or None))
    return out


def read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError as e:
        return {"error": f"unreadable {path.name}: {e}"}


def summary(tmp: Path, out: Path, dry: bool, budget: int, elapsed: int) -> int:
    result = {
        "dry": dry,
        "budget_s": budget,
        "elapsed_s": elapsed,
        "phases": phases(tmp / "phases.tsv"),
        "env": read_json(tmp / "env.json"),
        "tests": junit(tmp / "tests.xml"),
        "one_gpu": junit(tmp / "one_gpu.xml"),
        "bench": read_json(tmp / "bench.json"),
        "profile": read_json(tmp / "profile.json"),
        "save": read_json(tmp / "save.json"),  # benchmarks/bench_checkpoint.py --json: sync against async save
    }
    # the planner's step-time model fitted to the benchmark's threed runs (bench_gpu.py writes it after every run,
    # as `threed plan --calibrate gpu_check.json` would fit them): on top, where a reader looks first
    result["fit"] = (result["bench"] or {}).get("fit")
    result["files"] = sorted(p.name for p in out.iterdir() if p.is_file()) + [SUMMARY]
    (out / SUMMARY).write_text(json.dumps(result, indent=1) + "\n")
    print(f"gpu_check: {SUMMARY} written ({elapsed} s of {budget} s)")
    for p in result["phases"]:
        print(f"  {p['name']:<8} {p['status']:<9} rc {p['rc']:<7} {p['seconds']:>4} s of {p['limit_s']} s")
    for key in ("tests", "one_gpu"):
        r = result[key]
        if r and "cases" in r:
            print(f"  {key}: {r['passed']} passed, {r['failed']} failed, {r['errors']} errors, {r['skipped']} skipped")
            for c in r["cases"]:
                if c["outcome"] in ("failed", "errors"):
                    print(f"    {c['outcome']}: {c['id']}: {c['message']}")
    for key, value in ((result["bench"] or {}).get("ratios") or {}).items():
        print(f"  bench {key}: {value}")
    for line in profile_lines(result["profile"], result["fit"]):
        print(line)
    save = result["save"] or {}
    if "async_blocked_s" in save:
        print(
            f"  save: synchronous {save['sync_save_s']} s, async blocked {save['async_blocked_s']} s (host copy "
            f"{save['host_copy_gbps']} GB/s, pinned {save['pinned']}), published after "
            f"{save.get('async_published_s')} s"
        )
    return 0


def profile_lines(profile: Optional[dict[str, Any]], fit: Optional[dict[str, Any]]) -> list[str]:
    """The profile's headline (top kernels, the device's idle time per step) and the step-time model's fit (or why
    there is none), for stdout."""
    out = []
    if profile and "error" in profile:
        out.append(f"  profile: {profile['error']}")
    elif profile:
        g = profile["gaps"]
        out.append(
            f"  profile: {g['wall_ms_per_step']:.1f} ms a step, device busy {g['busy_ms_per_step']:.1f} ms, idle "
            f"{g['idle_between_kernels_ms_per_step']:.1f} ms between kernels in {g['holes_per_step']:.0f} holes"
        )
        for k in profile["top_kernels"][:5]:
            out.append(f"    {k['share'] * 100:5.1f}% {k['total_ms']:9.1f} ms x{k['count']:<6} {k['name'][:90]}")
    if fit and "error" in fit:
        out.append(f"  fit: {fit['error']}")
    elif fit:
        out.append(
            f"  fit ({fit['how']}): matmuls {fit['mm_tflops']} TFLOP/s, attention {fit['attn_tflops']} TFLOP/s on "
            f"causal FLOPs, {fit['per_micro_batch_ms']} ms per micro-batch; errors {fit['relative_errors']}"
        )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    e = sub.add_parser("env", help="print the environment")
    e.add_argument("--json", type=Path)
    s = sub.add_parser("summary", help="write OUT/gpu_check.json")
    s.add_argument("--tmp", type=Path, required=True)
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--dry", action="store_true")
    s.add_argument("--budget", type=int, default=0)
    s.add_argument("--elapsed", type=int, default=0)
    a = p.parse_args(argv)
    if a.what == "env":
        return env(a.json)
    return summary(a.tmp, a.out, a.dry, a.budget, a.elapsed)


if __name__ == "__main__":
    raise SystemExit(main())
