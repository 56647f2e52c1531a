"""The measured figures of a GPU benchmark, as the JSON `threed plan --calibrate` reads, from bench_gpu.py's log.
Why: a log is what a lent GPU leaves behind (benchmarks/measured/*.bench.log, copied as it came back); the JSON
beside it is derived from it by this one documented step, and tests/unit/test_calibration.py re-derives it, so the
two cannot drift. The log names the model, the device and each run's tokens/s; the date, the torch version and the
micro-batch size (bench_gpu.py's --micro) are not in it and are given here.

    python tools/measured_from_log.py benchmarks/measured/2026-11-28-h200.bench.log --date 2026-11-28 \\
        --torch 2.11.0+cu130 > benchmarks/measured/2026-11-28-h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from threed.plan.calibration import from_bench_log


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", type=Path, help="bench_gpu.py's output (tools/gpu_check.sh's bench.log)")
    p.add_argument("--date", required=True, help="the day it ran, YYYY-MM-DD")
    p.add_argument("--torch", required=True, help="the torch version it ran with")
    p.add_argument("--micro", type=int, default=1, help="bench_gpu.py's --micro (default 1)")
    a = p.parse_args(argv)
    print(json.dumps(from_bench_log(a.log.read_text(), a.date, a.torch, a.micro).as_json(), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
