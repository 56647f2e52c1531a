"""The one way `threed preprocess` (plain and `--sft`) writes its datasets: megatron-core's own
`IndexedDatasetBuilder` (so Megatron-LM reads ours and we read theirs), into a temporary directory beside the
output, published only when complete.

    check_output(prefix, outputs, force)                      # before any work: refuse a directory or old files
    with indexed_output(prefix, outputs, dtypes) as out:      # temp dir + one builder per output
        out.builders["text"].add_document(...)
    # on success: every .idx finalized, then renamed into place (old .idx first, .bin and sidecar, new .idx last)
    # on any exception (Ctrl-C included): the temp dir and any directory created for it removed, old output intact

A `kill -9` runs no cleanup: the temporary directory (`.NAME.HOST.PID.XXXX.preprocess-tmp`) stays, and the next run
for the same output prefix on the same host removes it once that pid is dead (`remove_stale_tmpdirs`); the worker
processes die with their parent (`threed.data.encode.die_with_parent`).

With `provenance` (the tokenizer's identity and the flags), each output gets its sidecar `PREFIX.threed.json`
(`threed.data.sidecar`: what `threed train` checks the data against), written in the temporary directory from the
finished `.bin` and renamed with it. A reader finds the old pair, no .idx, or the new pair (with its sidecar),
never a mixed or partial one. The renames are flushed to
disk like every other publish (`threed.atomic`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import socket
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

from threed.atomic import fsync_dir
from threed.data.chunks import PreprocessError
from threed.data.sidecar import SUFFIX as SIDECAR, sidecar_text


def indexed_dataset() -> Any:
    """megatron-core's indexed_dataset module. Importing it loads all of megatron.core, which warns four times
    that Transformer Engine and Apex are absent: irrelevant to writing token files, so kept off the console."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        # megatron: heavy (seconds to import), only once the inputs have been checked
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def check_output(prefix: str, outputs: dict[str, str], force: bool) -> None:
    """`prefix` names files, not a directory; the outputs (key -> PREFIX_{key}_document) exist only with force."""
    if prefix.endswith(("/", os.sep)) or Path(prefix).is_dir() or not Path(prefix).name:
        raise PreprocessError(
            f"--output-prefix {prefix} is a directory; give a file prefix like {prefix.rstrip('/')}/corpus"
        )
    for out in outputs.values():
        for path in (out + ".bin", out + ".idx"):
            if os.path.lexists(path) and not force:
                raise PreprocessError(
                    f"output exists: {path}; pass --force to replace it or choose another --output-prefix"
                )


@dataclasses.dataclass
class IndexedOutput:
    """What is being written: the temporary directory (workers put their partial files there too) and one
    `IndexedDatasetBuilder` per output key."""

    tmpdir: str
    builders: dict[str, Any]


@contextlib.contextmanager
def indexed_output(
    prefix: str, outputs: dict[str, str], dtypes: dict[str, Any], provenance: Optional[dict[str, Any]] = None
) -> Iterator[IndexedOutput]:
    """Builders for `outputs` (key -> final prefix) with `dtypes` (key -> numpy type), published when the block
    ends without an exception, and nothing left behind when it raises. `provenance`: {"tokenizer": identity,
    "flags": {...}} for the sidecars (None: no sidecar; an old one is removed, it would describe other data)."""
    idx = indexed_dataset()
    tmpdir, created = _make_tmpdir(prefix)
    try:
        tmp = {k: os.path.join(tmpdir, Path(p).name) for k, p in outputs.items()}
        builders = {k: idx.IndexedDatasetBuilder(tmp[k] + ".bin", dtype=dtypes[k]) for k in outputs}
        yield IndexedOutput(tmpdir, builders)
        _publish(builders, tmp, outputs, provenance)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        _remove_dirs(created)
        raise
    shutil.rmtree(tmpdir, ignore_errors=True)


def _make_tmpdir(prefix: str) -> tuple[str, list[Path]]:
    """The output's parent directory and a temporary directory in it (same file system: renames are atomic).
    Returns the temporary directory and the directories created here (removed again on failure)."""
    parent = Path(prefix).absolute().parent
    created: list[Path] = []
    d = parent
    while not os.path.lexists(d) and d != d.parent:
        created.append(d)
        d = d.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_tmpdirs(prefix)
        return tempfile.mkdtemp(prefix=_tmp_prefix(prefix) + f"{os.getpid()}.", suffix=_TMP_SUFFIX, dir=parent), created
    except OSError as e:
        _remove_dirs(created)
        raise PreprocessError(
            f"cannot write to {parent} ({e.strerror or e}); choose a writable --output-prefix"
        ) from None


_TMP_SUFFIX = ".preprocess-tmp"


def _tmp_prefix(prefix: str) -> str:
    """What this output's temporary directories are named by: `.NAME.HOST.` then the pid, a random part and the
    suffix. The host keeps a run on another machine sharing the directory from being judged by our pids."""
    return f".{Path(prefix).name}.{socket.gethostname()}."


def remove_stale_tmpdirs(prefix: str) -> list[str]:
    """Remove the temporary directories a killed run (`kill -9`, a node lost) left for this output: ours by name
    (this output prefix, this host) whose pid is no longer alive. Returns what was removed; says so on stderr."""
    parent, head = Path(prefix).absolute().parent, _tmp_prefix(prefix)
    pattern = re.compile(re.escape(head) + r"(\d+)\.[^./]+" + re.escape(_TMP_SUFFIX) + "$")
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        if not m or _alive(int(m.group(1))) or not (parent / name).is_dir() or (parent / name).is_symlink():
            continue
        shutil.rmtree(parent / name, ignore_errors=True)
        removed.append(str(parent / name))
        print(
            f"threed preprocess: removed {parent / name}, left by a run that was killed (pid {m.group(1)})",
            file=sys.stderr,
        )
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def _publish(
    builders: dict[str, Any], tmp: dict[str, str], outputs: dict[str, str], provenance: Optional[dict[str, Any]]
) -> None:
    """Finalize each builder's temporary .idx, write the sidecars, flush the files, and move the datasets into
    place. Old .idx files (and sidecars) go first (--force), then the .bin files and sidecars, then the new .idx
    files that make each dataset readable."""
    for k, b in builders.items():
        b.finalize(tmp[k] + ".idx")
    suffixes = (".bin", ".idx")
    if provenance is not None:
        suffixes = (".bin", SIDECAR, ".idx")
        for k in outputs:
            flags = {**provenance.get("flags", {}), "key": k}
            with open(tmp[k] + SIDECAR, "w", encoding="utf-8") as f:
                f.write(sidecar_text(tmp[k] + ".bin", provenance["tokenizer"], flags))
    for path in (tmp[k] + suffix for k in outputs for suffix in suffixes):
        with open(path, "rb") as f:
            os.fsync(f.fileno())  # the data on disk before the names that make it visible
    for k in outputs:
        for old in (outputs[k] + ".idx", outputs[k] + SIDECAR):
            if os.path.lexists(old):
                os.remove(old)
    for suffix in suffixes:
        for k in outputs:
            os.replace(tmp[k] + suffix, outputs[k] + suffix)
    for parent in {str(Path(p).absolute().parent) for p in outputs.values()}:
        fsync_dir(parent)


def _remove_dirs(dirs: list[Path]) -> None:
    for d in dirs:  # deepest first
        try:
            d.rmdir()
        except OSError:
            pass
