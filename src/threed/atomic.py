"""Writes that a crash never leaves half done: a reader sees the old content or the new, never a torn file or a
half-filled directory. Every file or directory threed publishes (checkpoint manifests and `latest`, run configs,
metrics state, converted checkpoints, preprocessed datasets, universal conversions) goes through here, and a
checkpoint's data files, which DeepSpeed writes, are flushed here (`fsync_file`) before a manifest names them.

    write_atomic(path, text)                   # a small text file: temp beside it, fsync, rename, fsync the dir
    fsync_file(path); fsync_dir(folder)        # a file written by someone else, then the directory naming it
    with atomic_dir(out) as tmp: ...write...   # a directory: built under a temp name, renamed into place at the end
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional, Union

PathLike = Union[str, os.PathLike]


def fsync_dir(path: PathLike) -> None:
    """Flush a directory entry (after a rename) so the rename survives a power cut."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the rename is still atomic
        pass
    finally:
        os.close(fd)


def fsync_file(path: PathLike) -> None:
    """Flush a file that another writer (torch.save inside DeepSpeed) has already written and closed, so that its
    contents survive a power cut: a descriptor of our own flushes the same pages."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_name(path: PathLike, what: str = "tmp") -> Path:
    """A hidden name beside `path`, unique per process: `.<name>.<what>-<pid>`."""
    p = Path(path)
    return p.with_name(f".{p.name}.{what}-{os.getpid()}")


def unwritable(folder: PathLike) -> Optional[str]:
    """Why no file can be made in the existing directory `folder` ("not writable", "full"), None when one can:
    checked before the work that would write there, so a refusal costs nothing."""
    st = os.statvfs(folder)
    if not os.access(folder, os.W_OK | os.X_OK) or st.f_flag & os.ST_RDONLY:
        return "not writable"
    if st.f_bavail * st.f_frsize == 0:
        return "full"
    return None


def write_atomic(path: PathLike, data: Union[str, bytes]) -> None:
    """Write `data` to `path`: a temporary file beside it, flushed to disk, renamed over it, the directory flushed."""
    path = Path(path)
    tmp = temp_name(path)
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def replace_dir(tmp: PathLike, out: PathLike) -> None:
    """Move the finished directory `tmp` to `out`. An existing `out` is moved aside first and deleted only once the
    new one is in place, so a crash leaves the old or the new, and at worst a hidden `.out.old-PID` to delete."""
    tmp, out = Path(tmp), Path(out)
    old = temp_name(out, "old")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    fsync_dir(out.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(out: PathLike) -> Iterator[Path]:
    """Build a directory under a temporary name beside `out`; on success it replaces `out`, on any exception
    (Ctrl-C included) the temporary directory is removed and `out` is untouched."""
    out = Path(out)
    tmp = temp_name(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out)
