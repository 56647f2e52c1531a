"""A stale JIT build lock, said in one line instead of waited for forever.

On CPU, DeepSpeed's `init_distributed` JIT-compiles its shared-memory comm op through `torch.utils.cpp_extension`,
which lets one process build and the others wait while a `lock` file exists in the op's build directory (torch's
FileBaton: created with O_EXCL, held open by the builder, removed when the build ends). A builder killed by SIGKILL
(the OOM killer, Slurm, `kill -9`) never removes it, and every later run on that directory waits at start-up forever
without a word. The Makefile keeps the directory across runs (TORCH_EXTENSIONS_DIR=~/.cache/threed/torch_extensions),
so one such kill stops every later CPU run.

A lock is stale when no process on this machine holds it open and it is older than STALE_LOCK_MINUTES (a build on
another node sharing the directory cannot be seen from here; none takes that long: ~20 s cold on 2 cores).
`threed.parallel.distributed.init_distributed` asks before DeepSpeed builds, and refuses with the file and its `rm`.
Nothing here imports torch: the caller names the build directories.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Iterable, Optional

STALE_LOCK_MINUTES = 10.0


def lock_candidates(root: Path, name: str) -> list[Path]:
    """Where torch.utils.cpp_extension puts the lock of extension `name` under its extensions root: `<root>/<name>`
    when TORCH_EXTENSIONS_DIR is set, `<root>/<python>_<accelerator>/<name>` under torch's default root (the
    folder's name differs between torch releases, so any one folder deep is looked at)."""
    return [root / name / "lock", *sorted(root.glob(f"*/{name}/lock"))]


def held_open(path: Path, proc: Path = Path("/proc")) -> Optional[bool]:
    """Whether a process on this machine has `path` open (torch's builder keeps its lock open while it builds);
    None where that cannot be told (no /proc: not Linux)."""
    if not proc.is_dir():
        return None
    target = os.path.realpath(path)
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            fds = list(fd_dir.iterdir())
        except OSError:  # another user's process, or one that has just ended
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    return True
            except OSError:
                continue
    return False


def stale_lock(paths: Iterable[Path], now: Optional[float] = None) -> Optional[str]:
    """The one line naming the first stale lock among `paths` and its fix, or None."""
    now = time.time() if now is None else now
    for path in paths:
        try:
            age_min = (now - path.stat().st_mtime) / 60
        except OSError:  # no lock (the usual case), or it went away meanwhile
            continue
        if age_min < STALE_LOCK_MINUTES or held_open(path):
            continue
        return (
            f"{path} is the lock of a JIT build that was killed ({age_min:.0f} minutes old, no process here holds it "
            f"open); DeepSpeed would wait for it forever at start-up. Remove it: rm {path}"
        )
    return None
