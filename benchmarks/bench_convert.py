"""Converter benchmark: a synthetic HF Llama of a few GB (random bf16 weights, real Llama 3 8B layer shapes,
sharded safetensors + index), converted to tp=8 pp=4; compared with `cp -r` of the same bytes.

    .venv/bin/python benchmarks/bench_convert.py                   # 4 layers of Llama-3-8B shape: 3.9 GB
    .venv/bin/python benchmarks/bench_convert.py --layers 8 --workers 1,2 --workdir /tmp/threed-bench

Prints two ratios: convert wall time / `cp -r` wall time, and the converter's peak RSS / checkpoint size. The
page cache is dropped before each timed command when this process may (root), so both read from disk; each
command's time includes `sync`, so both pay for their writes. The convert time includes Python start-up and
imports (about 2 s here), as a user sees it; the line also gives the time after start-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def make_source(out: Path, layers: int, shard_gb: float) -> int:
    """Write the synthetic model with the converter's own streaming writer (one tensor in memory at a time)."""
    from threed.hf.names import hf_names, hf_shapes
    from threed.hf.config import to_hf_config
    from threed.hf.write import Planned, ShardedSafetensorsWriter, plan_shards
    from threed.model.spec import pipeline_layers
    from threed.model.presets import PRESETS

    cfg = dataclasses.replace(PRESETS["llama3-8b"], num_layers=layers, name="synthetic-llama3-8b-shapes")
    out.mkdir(parents=True)
    planned = [
        Planned(n, torch.bfloat16, hf_shapes(cfg, layer)[n])
        for layer in pipeline_layers(cfg)
        for names in hf_names(layer).values()
        for n in names
    ]
    writer = ShardedSafetensorsWriter(out, plan_shards(planned, int(shard_gb * 1e9)))
    gen = torch.Generator().manual_seed(0)
    for t in planned:
        writer.write(t.name, (torch.randn(t.shape, generator=gen) * 0.02).to(torch.bfloat16))
    writer.close()
    hf = to_hf_config(cfg)
    hf["dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    return sum(t.nbytes for t in planned)


def drop_caches() -> bool:
    subprocess.run(["sync"], check=True)
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int]:
    """Wall seconds (command + sync) and peak RSS in bytes of the command's largest process (GNU time)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "MAXRSS_KB=%M", *cmd],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{cmd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rss_kb = int([ly for ly in proc.stderr.splitlines() if ly.startswith("MAXRSS_KB=")][-1].split("=")[1])
    return wall, rss_kb * 1024


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks (pp=4 needs >= 4)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--workers", default="1", help="comma-separated writer-process counts to time")
    p.add_argument("--shard-gb", type=float, default=1.0, help="safetensors shard size of the synthetic source")
    p.add_argument("--workdir", default="/tmp/threed-bench-convert")
    p.add_argument("--repeat", type=int, default=2, help="runs of each command; the fastest is reported")
    p.add_argument("--keep", action="store_true", help="keep the synthetic model")
    args = p.parse_args()

    work = Path(args.workdir)
    src = work / "hf"
    if not (src / "model.safetensors.index.json").is_file():
        shutil.rmtree(work, ignore_errors=True)
        t0 = time.time()
        size = make_source(src, args.layers, args.shard_gb)
        print(
            f"synthetic source: {src}, {size / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} shards "
            f"({time.time() - t0:.0f} s to generate)"
        )
    src_bytes = du(src)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    # cp and convert alternate, each after dropping the page cache; the best of --repeat runs is kept
    # (this VM shares its disk and 2 cores with other jobs, and the first run after a cache drop pays extra).
    cold = drop_caches()
    _, import_rss = timed([sys.executable, "-c", "import threed.convert.from_hf, threed.model.presets"], env)
    cp_walls: list[float] = []
    dd_walls: list[float] = []
    results: dict[int, list[tuple[float, int, int, float]]] = {}
    # dd: the same bytes copied through user space (read + write, 64 MiB blocks), which is what any converter
    # must do; cp -r (coreutils 9 copy_file_range) copies inside the kernel.
    dd = f"mkdir -p {work}/dd && for f in {src}/*; do dd if=$f of={work}/dd/$(basename $f) bs=64M status=none; done"
    for _ in range(args.repeat):
        shutil.rmtree(work / "cp", ignore_errors=True)
        drop_caches()
        cp_walls.append(timed(["cp", "-r", str(src), str(work / "cp")])[0])
        shutil.rmtree(work / "cp")
        drop_caches()
        dd_walls.append(timed(["bash", "-c", dd])[0])
        shutil.rmtree(work / "dd")
        for workers in [int(w) for w in args.workers.split(",")]:
            out = work / f"ckpt-w{workers}"
            shutil.rmtree(out, ignore_errors=True)
            drop_caches()
            wall, rss = timed(
                [
                    sys.executable,
                    "-m",
                    "threed.cli",
                    "convert",
                    "--hf",
                    str(src),
                    "--tp",
                    str(args.tp),
                    "--pp",
                    str(args.pp),
                    "--out",
                    str(out),
                    "--workers",
                    str(workers),
                    "--quiet",
                ],
                env,
            )
            inner = json.loads((out / "threed_convert.json").read_text())["seconds"]
            results.setdefault(workers, []).append((wall, rss, du(out), inner))
            shutil.rmtree(out)
    cp_wall, dd_wall = min(cp_walls), min(dd_walls)
    print(
        f"cp -r: {cp_wall:.2f} s for {src_bytes / 1e9:.2f} GB ({src_bytes / cp_wall / 1e9:.2f} GB/s; runs "
        f"{', '.join(f'{w:.2f}' for w in cp_walls)} s); page cache "
        f"{'dropped' if cold else 'NOT dropped (not root): warm-cache figures'} before each timed command"
    )
    print(
        f"dd bs=64M (user-space copy of the same files): {dd_wall:.2f} s (runs "
        f"{', '.join(f'{w:.2f}' for w in dd_walls)} s)"
    )
    for workers, runs in results.items():
        wall, rss, ckpt, inner = min(runs)
        print(
            f"convert tp={args.tp} pp={args.pp} workers={workers}: {wall:.2f} s wall ({inner:.2f} s after "
            f"start-up; runs {', '.join(f'{r[0]:.2f}' for r in runs)} s), checkpoint {ckpt / 1e9:.2f} GB, "
            f"peak RSS {max(r[1] for r in runs) / 1e9:.2f} GB (bare imports {import_rss / 1e9:.2f} GB)"
        )
        print(
            f"  RATIO convert/cp = {wall / cp_wall:.2f}x   RATIO peak RSS/checkpoint = "
            f"{max(r[1] for r in runs) / ckpt:.3f}x   (convert/dd = {wall / dd_wall:.2f}x; peak RSS: the "
            f"largest process)"
        )
    if not args.keep:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
