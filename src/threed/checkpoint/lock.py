"""One run per save directory: rank 0 holds `<save>/threed.lock` for the run's life, so a second run on the same
`--save` (a resubmitted job while the old one still runs, a mistyped path) is refused before it writes anything,
instead of both writing the same `global_stepN` files.

    lock = SaveLock(cfg.checkpoint.save)     # every rank (threed.train); only rank 0 takes it
    start(cfg, dims, rank, lock=lock)  # threed.checkpoint.start: rank 0 acquires before writing to --save
    lock.release()                           # threed.train, on every exit path (idempotent; a no-op where not held)

How a dead job's lock is told from a live one. The lock is an `fcntl.flock` on the file, held open by rank 0 for
the run's life. The kernel drops it when the holding process ends, however it ends (a normal exit, exit 2/3/4,
an exception, SIGKILL, the OOM killer; on NFS the server drops a dead client's lock when its lease runs out), so a
dead job's lock never blocks a requeue and nothing has to guess from a pid. Linux's NFS client implements flock
with NFS byte-range locks, so it holds across nodes on NFS too. The file's contents (host, pid, Slurm job id,
start time) only name the holder in the refusal, and are emptied on release.

Two cases the kernel cannot settle:
- flock refused by the file system (ENOLCK, EOPNOTSUPP, ENOSYS: NFS without a lock daemon, Lustre mounted
  without `flock`): the record itself is the lock. A record names a live holder unless it is empty, was written
  by this same Slurm job (a requeued job keeps its job id: the writer was this job's earlier, dead incarnation),
  or names a process on this host that no longer exists. A record from a process on another host cannot be checked
  from here: it is refused, naming the file to delete if that job is gone (a rare manual step beats two runs
  overwriting each other's checkpoints). Two runs starting in the same second can both pass this check; it is
  best effort, which is why flock comes first.
- flock held, but the record says its holder is dead (this job's earlier incarnation, or a gone pid on this
  host): a node that died still holds its NFS lock until the server's lease expires (about 90 s), so the lock is
  retried for `wait_seconds` before the run is refused.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Callable, Optional

from threed.errors import ConfigError

LOCK_NAME = "threed.lock"
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class SaveDirBusy(ConfigError):
    """Another run holds the save directory."""


def _me() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": os.environ.get("SLURM_JOB_ID"),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def describe(record: dict[str, Any]) -> str:
    job = f", Slurm job {record['job']}" if record.get("job") else ""
    return f"pid {record.get('pid')} on {record.get('host')}{job}, since {record.get('started')}"


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # someone else's process, or a record we cannot read as a pid: assume it lives
    return True


def dead_holder(record: Optional[dict[str, Any]]) -> Optional[str]:
    """Why the run named in `record` is known to be gone, or None when it may still run."""
    if not record:
        return None
    me = _me()
    if record.get("job") and record.get("job") == me["job"]:
        return f"it was written by this Slurm job ({me['job']}) before it was requeued"
    if record.get("host") == me["host"] and not _alive(record.get("pid")):
        return f"its process {record.get('pid')} on {me['host']} no longer exists"
    return None


class SaveLock:
    """The lock on one save directory; see the module docstring for how a stale one is told apart."""

    def __init__(self, save_dir: Optional[str], wait_seconds: float = 120.0):
        self.save_dir = save_dir
        self.path = Path(save_dir) / LOCK_NAME if save_dir else None
        self.wait_seconds = wait_seconds
        self.fd: Optional[int] = None
        self.mode = ""  # "flock" | "record" once held

    @property
    def held(self) -> bool:
        return self.fd is not None

    def _read(self) -> Optional[dict[str, Any]]:
        try:
            text = self.path.read_text()
        except OSError:
            return None
        try:
            record = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            return None
        return record if isinstance(record, dict) else None

    def _busy(self, record: Optional[dict[str, Any]], extra: str = "") -> SaveDirBusy:
        who = describe(record) if record else "a run that is still starting"
        return SaveDirBusy(
            f"--save {self.save_dir} is in use by another run ({who}; lock {self.path}){extra}: two runs on one "
            f"directory would overwrite each other's checkpoints. Wait for it to end, stop it (`touch "
            f"{self.save_dir}/STOP` saves and exits it), or choose another --save"
        )

    def _try_flock(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def acquire(self, log: Optional[Callable[[str], None]] = None) -> None:
        """Take the lock (the directory must exist) or raise SaveDirBusy naming the holder and the fix."""
        if self.path is None or self.held:
            return
        log = log or (lambda m: None)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                got = self._try_flock(fd)
                self.mode = "flock"
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    raise
                got, self.mode = False, "record"
            record = self._read()
            if self.mode == "flock" and not got:
                gone = dead_holder(record)
                if gone is None:
                    raise self._busy(record)
                log(
                    f"the lock {self.path} is still held although {gone}; waiting up to {self.wait_seconds:.0f} s "
                    f"for the file system to release it"
                )
                deadline = time.monotonic() + self.wait_seconds
                while not got and time.monotonic() < deadline:
                    time.sleep(1.0)
                    got = self._try_flock(fd)
                if not got:
                    raise self._busy(record, f"; still locked after {self.wait_seconds:.0f} s although {gone}")
            elif self.mode == "record":
                if record and dead_holder(record) is None:
                    raise self._busy(
                        record, "; this file system has no flock, so if that run is gone, delete the lock file"
                    )
                if record:
                    log(f"taking over the stale lock {self.path} ({describe(record)}: {dead_holder(record)})")
            mine = _me()
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(mine) + "\n").encode(), 0)
            os.fsync(fd)
            if self.mode == "record":
                time.sleep(0.2)  # a run that checked at the same moment has written by now: the last writer wins
                if self._read() != mine:
                    raise self._busy(self._read())
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd

    def __enter__(self) -> "SaveLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Give the directory back (every exit path calls this; a killed process's flock goes with it)."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            if self.mode == "record":
                if (self._read() or {}).get("pid") == os.getpid():
                    self.path.unlink(missing_ok=True)
            else:
                os.ftruncate(fd, 0)  # empty: no holder (the file stays: unlinking a flock file races new lockers)
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:
            pass  # the directory went away (a test's tmp dir, a deleted run): nothing left to hold
        finally:
            os.close(fd)
