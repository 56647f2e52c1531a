"""What bad input is, and what every command line does with it.

Bad input (a flag out of range, a missing file, a checkpoint of another model, a corpus that does not parse) is a
`ThreedError` whose message names the problem and the fix. Every entry point (`threed ...`, `python -m
threed.train`, `threed plan`, ...) runs through `guarded`, the one exit policy:

    ThreedError        one line `<prog>: <prefix><message>` on stderr, from rank 0 only under torchrun, exit 2
                       (another rank first waits for rank 0 to fail alike: `_after_rank_0`)
    KeyboardInterrupt  one line `<prog>: interrupted...`, exit 130 (the shell's code for SIGINT)

Anything else is a bug and keeps its traceback. This module imports nothing of threed: it is the floor.

A write that failed (an OSError, or torch's file writer's RuntimeError, which carries no errno) is said by
`write_failure` / `os_error_line`, the one place that tells a full disk (ENOSPC), a quota (EDQUOT) and a per-file
size limit (EFBIG: `ulimit -f`, a job's file-size limit) apart, each with its own fix: the checkpoint save, the
converters, preprocessing and the report all go through it.
"""

from __future__ import annotations

import errno
import os
import resource
import signal
import sys
import time
from typing import Callable, Optional

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# How long a rank other than 0 waits for rank 0 to fail alike before it speaks itself (`_after_rank_0`).
PEER_WAIT_S = 15.0


class ThreedError(ValueError):
    """Bad input: the message names the problem and the fix. Never a bug (those keep their traceback)."""


class ConfigError(ThreedError):
    """A configuration that cannot run. The message names the numbers and how to fix them."""


def is_first_rank() -> bool:
    """Under torchrun every rank fails alike: only global rank 0 speaks (RANK is unset outside torchrun)."""
    return os.environ.get("RANK", "0") == "0"


def guarded(
    prog: str, main: Callable[[], Optional[int]], prefix: str = "error: ", interrupted: str = "interrupted"
) -> int:
    """Run `main` under the exit policy above and return the process's exit status."""
    try:
        return int(main() or 0)
    except ThreedError as e:
        if is_first_rank():
            print(f"{prog}: {prefix}{e}", file=sys.stderr, flush=True)
        else:
            _after_rank_0()
            print(f"{prog}: rank {os.environ.get('RANK')}: {prefix}{e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        if is_first_rank():
            print(f"{prog}: {interrupted}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _after_rank_0() -> None:
    """A rank other than 0 that meets bad input waits for rank 0 to say it. Under torchrun every rank
    checks the same config, so rank 0 fails alike and says it; but the rank that exits first makes torchrun stop
    the others, and a quick refusal (a config checked before the heavy imports) could stop rank 0 before its line.
    So this rank waits, and torchrun ends it (SIGTERM, back to its default action here) once rank 0 has failed.
    Still running after PEER_WAIT_S: rank 0 did not fail alike (a problem local to this rank's node), so it speaks."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a training run's stop handler would only set a flag
    except ValueError:  # not the main thread: signals stay as they are
        pass
    time.sleep(PEER_WAIT_S)


# What each errno of a failed write means to the user, and the fix; the rest are said with their errno name only.
_WRITE_FIXES = {
    errno.ENOSPC: "free space on that file system",
    errno.EDQUOT: "free space within your quota, or ask for a larger one",
}


def file_size_limit() -> Optional[int]:
    """The process's per-file size limit in bytes (`ulimit -f`, RLIMIT_FSIZE), None when there is none. Python
    ignores SIGXFSZ, so a write past it fails with EFBIG instead of killing the process."""
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def _size_limit_fix(limit: Optional[int]) -> str:
    """The fix of EFBIG: the process's limit when it has one, else the file system's own largest file."""
    if limit is None:
        return "the file system's largest file size was reached (the disk is not full): write to another file system"
    return (
        f"raise the per-file size limit (now {limit:,} bytes, `ulimit -f` {limit // 1024}), e.g. `ulimit -f "
        f"unlimited` in the job script or a larger file-size limit from the scheduler; the disk is not full"
    )


def torch_write_failed(e: BaseException) -> bool:
    """torch.save's C++ writer reports a failed write (a full disk, a file-size limit) as a RuntimeError without an
    errno: "[enforce fail at inline_container.cc] . unexpected pos ..." or "PytorchStreamWriter failed writing"."""
    return isinstance(e, RuntimeError) and any(s in str(e) for s in ("inline_container", "PytorchStreamWriter"))


def write_failure(e: BaseException, writing: bool = False) -> tuple[str, str]:
    """(what failed, the fix) of a failed write: an OSError by its errno (EFBIG named as a per-file size limit, not
    a full disk), torch's writer's RuntimeError as EFBIG when a per-file size limit is in force; the fix is "" when
    there is no specific one (the caller says its own). `writing`: the caller only writes (any errno is a write's)."""
    if isinstance(e, OSError):
        code = errno.errorcode.get(e.errno or 0, "")
        wrote = writing or e.errno in _WRITE_FIXES or e.errno == errno.EFBIG
        where = (f" writing {e.filename}" if wrote else f": {e.filename}") if e.filename else ""
        what = f"{e.strerror or e} ({code}){where}" if code else f"{e}{where}"
        if e.errno == errno.EFBIG:
            return f"{what}: a per-file size limit stopped the write", _size_limit_fix(file_size_limit())
        return what, _WRITE_FIXES.get(e.errno or 0, "")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    limit = file_size_limit()
    if torch_write_failed(e) and limit is not None:
        return (
            f"torch's writer failed ({first}) under a per-file size limit of {limit:,} bytes: the limit (EFBIG)",
            _size_limit_fix(limit),
        )
    return f"torch's writer failed: {first}", ""


def os_error_line(e: BaseException) -> str:
    """`write_failure` as one clause: what failed, then its fix where there is one."""
    what, fix = write_failure(e)
    return f"{what}; {fix}" if fix else what
