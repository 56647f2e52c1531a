"""Start N local ranks with torchrun (what `threed verify` and the tests use). Under Slurm the slurm/ scripts
start torchrun themselves; this is for a single machine."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional, Sequence


class RanksFailed(RuntimeError):
    pass


def torchrun_command(nproc: int, module: str, args: Sequence[str]) -> list[str]:
    """`module` is a dotted module name, or a path to a script (ending in .py)."""
    target = [module] if module.endswith(".py") else ["-m", module]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *target, *args]


def run_ranks(nproc: int, module: str, args: Sequence[str], env: Optional[dict[str, str]] = None,
              timeout: Optional[float] = None, capture: bool = True) -> subprocess.CompletedProcess:
    """Run `python -m module args` on `nproc` local ranks; raises RanksFailed with the output tail."""
    full_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                "CUDA_DEVICE_MAX_CONNECTIONS": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "1"), **(env or {})}
    proc = subprocess.run(torchrun_command(nproc, module, args), env=full_env, timeout=timeout, text=True,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.STDOUT if capture else None)
    if proc.returncode != 0:
        raise RanksFailed(f"{' '.join(proc.args)} exited {proc.returncode}; output tail:\n"
                          f"{(proc.stdout or '')[-8000:]}")
    return proc
