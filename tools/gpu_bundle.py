"""`make gpu-bundle`: the wheels the lent GPU machine lacks, fetched and built here, where PyPI answers.

Why: the device image (Python 3.12.3, torch 2.11.0+cu130, transformers 5.17, triton, pytest, tensorboard) has no
network, no deepspeed, no megatron-core, no pydantic, no hjson, and a typing-extensions too old for pydantic-core
(../shared/stack-notes.md, "The lent GPU machine"). Those wheels travel with the working tree (the device tool's
`carry`, 64 MiB for everything carried) and `tools/gpu_check.sh` installs them there with
`pip install --no-index --no-deps --target DIR`. So the set must be exact: one pinned wheel per package, for
CPython 3.12 on x86-64 manylinux (or pure Python), nothing the image already has (torch above all), and small.

    python tools/gpu_bundle.py [--out gpu-bundle] [--force]   fetch and build (needs PyPI), write MANIFEST.json
    python tools/gpu_bundle.py --check gpu-bundle             the folder matches its manifest and SPEC (offline)

deepspeed has no wheel on PyPI: it is built from its sdist with DS_BUILD_OPS=0, which compiles none of its CUDA or
C++ ops and gives a pure-Python wheel (threed uses torch's AdamW and kernels, none of DeepSpeed's ops). Everything
else is downloaded as published. The manifest names each wheel, its size, its sha256 and why it is there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "MANIFEST.json"
PYTHON = "3.12"  # the device image's CPython
ABI = "cp312"
# pip matches manylinux tags exactly: the ones these wheels are published under, newest first.
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
# What travels with the tree is at most 64 MiB in all (the device tool); the bundle may take this much of it.
LIMIT_BYTES = 24 * 1024 * 1024
# The image has these (and torch must never travel: its CUDA build is the image's); a spec naming one is refused.
IMAGE_HAS = frozenset(
    {"torch", "transformers", "triton", "numpy", "safetensors", "sentencepiece", "tokenizers", "tensorboard", "pytest"}
)


@dataclass(frozen=True)
class Wheel:
    package: str  # the PyPI name
    version: str  # pinned exactly
    source: str  # "wheel": downloaded as published | "sdist": built here from the sdist (pure Python)
    why: str


SPEC: tuple[Wheel, ...] = (
    Wheel(
        "deepspeed",
        "0.19.8",
        "sdist",
        "threed's pipeline engine, ZeRO-1 and checkpoints; no wheel on PyPI, so built from the sdist with "
        "DS_BUILD_OPS=0 (pure Python, no CUDA ops: threed uses torch's AdamW and kernels)",
    ),
    Wheel(
        "megatron-core",
        "0.16.1",
        "wheel",
        "tensor-parallel layers, parallel state and datasets (cp312 manylinux: ships the compiled dataset helpers)",
    ),
    Wheel("pydantic", "2.14.4", "wheel", "DeepSpeed's config models"),
    Wheel("pydantic-core", "2.50.5", "wheel", "pydantic's compiled core (cp312 manylinux), the version pydantic pins"),
    Wheel("annotated-types", "0.8.0", "wheel", "needed by pydantic"),
    Wheel("typing-inspection", "0.4.5", "wheel", "needed by pydantic"),
    Wheel("typing-extensions", "4.16.0", "wheel", "pydantic and pydantic-core need >= 4.16; the image's is older"),
    Wheel("hjson", "3.1.0", "wheel", "DeepSpeed imports it to read config files"),
)


class BundleError(Exception):
    """A bundle that does not match the spec or its manifest; the message is one line naming the fix."""


def normalize(name: str) -> str:
    """PEP 503: `Typing_Extensions` and `typing-extensions` are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_wheel(filename: str) -> tuple[str, str, str]:
    """(package, version, tags) of a wheel file name `name-version(-build)?-python-abi-platform.whl`."""
    parts = filename[: -len(".whl")].split("-") if filename.endswith(".whl") else []
    if len(parts) not in (5, 6):
        raise BundleError(f"{filename} is not a wheel file name (name-version-python-abi-platform.whl)")
    return normalize(parts[0]), parts[1], "-".join(parts[-3:])


def installable(tags: str) -> bool:
    """Whether pip on CPython 3.12, x86-64 Linux (glibc 2.28 or newer) can install a wheel with these tags."""
    python, abi, platform = tags.split("-")
    pure = platform == "any" and abi == "none" and any(p in ("py3", "py312", ABI) for p in python.split("."))
    binary = ABI in python.split(".") and abi in (ABI, "abi3") and any(p in PLATFORMS for p in platform.split("."))
    return pure or binary


def check_spec(spec: tuple[Wheel, ...] = SPEC) -> None:
    """The spec itself: one entry per package, each pinned and explained, none the image already has."""
    names = [normalize(w.package) for w in spec]
    if len(set(names)) != len(names):
        raise BundleError(f"the spec names a package twice: {sorted(n for n in names if names.count(n) > 1)}")
    for w in spec:
        if normalize(w.package) in IMAGE_HAS:
            raise BundleError(f"{w.package} is in the device image already; drop it from the bundle spec")
        if not re.fullmatch(r"\d+(\.\d+)*", w.version):
            raise BundleError(f"{w.package} must be pinned to one release, got {w.version!r}")
        if w.source not in ("wheel", "sdist") or not w.why.strip():
            raise BundleError(f"{w.package}: source must be wheel or sdist and `why` must say why it travels")


def check_files(files: dict[str, int], spec: tuple[Wheel, ...] = SPEC, limit: int = LIMIT_BYTES) -> int:
    """`files` (wheel file name -> bytes) is exactly the spec: one installable wheel of each pinned version, nothing
    else, at most `limit` bytes together. Returns the total."""
    want = {normalize(w.package): w.version for w in spec}
    seen: dict[str, str] = {}
    for name in sorted(files):
        package, version, tags = parse_wheel(name)
        if package not in want:
            raise BundleError(f"{name} is not in the bundle spec (tools/gpu_bundle.py SPEC); remove it")
        if package in seen:
            raise BundleError(f"two wheels of {package} ({seen[package]} and {name}); pip --no-deps needs one")
        if version != want[package]:
            raise BundleError(f"{name}: {package} is pinned to {want[package]}; rebuild with make gpu-bundle")
        if not installable(tags):
            raise BundleError(f"{name} does not install on CPython {PYTHON} x86-64 manylinux (tags {tags})")
        seen[package] = name
    missing = sorted(set(want) - set(seen))
    if missing:
        raise BundleError(f"the bundle lacks {', '.join(missing)}; run make gpu-bundle")
    total = sum(files.values())
    if total > limit:
        raise BundleError(
            f"the bundle is {total / 2**20:.1f} MiB, over its {limit / 2**20:.0f} MiB share of what the device "
            f"tool carries (64 MiB in all); drop a wheel or raise LIMIT_BYTES knowingly"
        )
    return total


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifest(folder: Path, spec: tuple[Wheel, ...] = SPEC) -> dict:
    """What MANIFEST.json holds for the wheels in `folder` (checked against the spec first)."""
    files = {p.name: p.stat().st_size for p in sorted(folder.glob("*.whl"))}
    total = check_files(files, spec)
    why = {normalize(w.package): w for w in spec}
    wheels = []
    for name, size in sorted(files.items()):
        package, version, _ = parse_wheel(name)
        w = why[package]
        wheels.append(
            dict(file=name, package=w.package, version=version, bytes=size, sha256=sha256(folder / name), why=w.why)
        )
    return {
        "python": PYTHON,
        "platforms": list(PLATFORMS),
        "install": "python3 -m pip install --no-index --no-deps --target DIR *.whl; PYTHONPATH=DIR",
        "limit_bytes": LIMIT_BYTES,
        "total_bytes": total,
        "wheels": wheels,
    }


def check_bundle(folder: Path, spec: tuple[Wheel, ...] = SPEC) -> dict:
    """The folder holds what its MANIFEST.json lists (same names, sizes, hashes), and that is the spec."""
    path = folder / MANIFEST
    if not path.is_file():
        raise BundleError(f"{path} is missing; run make gpu-bundle")
    listed = json.loads(path.read_text())
    files = {p.name: p.stat().st_size for p in folder.glob("*.whl")}
    names = {w["file"] for w in listed["wheels"]}
    if names != set(files):
        raise BundleError(f"{folder} and {MANIFEST} disagree on the wheels ({sorted(names ^ set(files))}); rebuild")
    for w in listed["wheels"]:
        if files[w["file"]] != w["bytes"] or sha256(folder / w["file"]) != w["sha256"]:
            raise BundleError(f"{w['file']} is not the file {MANIFEST} lists (size or sha256); rebuild")
    check_files(files, spec)
    return listed


def _pip(args: list[str], env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "\n".join(line for line in proc.stdout.splitlines() if "is ignored" not in line)[-3000:]
        raise BundleError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")


def fetch(into: Path, spec: tuple[Wheel, ...] = SPEC) -> None:
    """Download the published wheels for CPython 3.12 manylinux, build the sdist ones as pure-Python wheels."""
    published = [f"{w.package}=={w.version}" for w in spec if w.source == "wheel"]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    _pip(
        ["download", "-q", "--no-deps", "--no-cache-dir", "--only-binary=:all:", "--python-version", PYTHON]
        + ["--implementation", "cp", "--abi", ABI, *platforms, "-d", str(into), *published]
    )
    env = {**os.environ, "DS_BUILD_OPS": "0"}  # DeepSpeed: compile no op, the wheel is py3-none-any
    for w in spec:
        if w.source == "sdist":
            _pip(
                ["wheel", "-q", "--no-deps", "--no-cache-dir", "--no-binary", w.package, "-w", str(into)]
                + [f"{w.package}=={w.version}"],
                env,
            )


def build(out: Path, force: bool = False) -> dict:
    """Fetch into a temporary folder, check, then replace the wheels in `out` and write its manifest."""
    check_spec()
    if not force and (out / MANIFEST).is_file():
        try:
            listed = check_bundle(out)
            print(f"{out}: up to date ({len(listed['wheels'])} wheels); --force rebuilds")
            return listed
        except BundleError as e:
            print(f"{out}: rebuilding ({e})")
    with tempfile.TemporaryDirectory(prefix="gpu-bundle-") as tmp:
        fetch(Path(tmp))
        listed = manifest(Path(tmp))
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*.whl"):
            old.unlink()
        for w in listed["wheels"]:
            shutil.move(str(Path(tmp) / w["file"]), out / w["file"])
    (out / MANIFEST).write_text(json.dumps(listed, indent=1) + "\n")
    return listed


def table(listed: dict) -> str:
    rows = [f"{w['file']:<80} {w['bytes'] / 2**20:6.2f} MiB  {w['why']}" for w in listed["wheels"]]
    rows.append(f"{'total':<80} {listed['total_bytes'] / 2**20:6.2f} MiB  (limit {listed['limit_bytes'] / 2**20:.0f})")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu-bundle"), help="the bundle folder (git-ignored)")
    p.add_argument("--force", action="store_true", help="rebuild even when the folder matches its manifest")
    p.add_argument("--check", type=Path, metavar="FOLDER", help="only check FOLDER against its manifest and SPEC")
    a = p.parse_args(argv)
    try:
        listed = check_bundle(a.check) if a.check else build(a.out, a.force)
    except BundleError as e:
        print(f"gpu-bundle: {e}", file=sys.stderr)
        return 2
    print(table(listed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
