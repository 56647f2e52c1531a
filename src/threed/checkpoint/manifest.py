"""Crash-safe checkpoints: a manifest of every file with its size, `latest` written last, the newest complete
checkpoint found on load, and old ones pruned (`--keep-last N`).

A save is complete only when every rank has written its files: `threed.checkpoint.save` waits for all of them
(a barrier), then rank 0 writes `<tag>/threed_manifest.json` and only then `latest`, each through a temporary
file renamed into place (threed.atomic). A kill at any moment therefore leaves either no manifest (the save is
ignored) or a manifest that names every file: `find_resumable` checks the files against it and falls back to the
newest checkpoint whose files are all there at their recorded sizes, saying which file was missing or short.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from threed.atomic import write_atomic
from threed.checkpoint.format import (
    LATEST,
    MANIFEST_NAME,
    UNIVERSAL_DIR,
    CheckpointLayout,
    layout_of_files,
    list_tags,
    missing_files,
    read_latest,
    step_of,
)


def write_manifest(step_dir: Path, files: dict[str, int], meta: dict[str, Any]) -> dict[str, Any]:
    manifest = {
        "format": 1,
        "tag": step_dir.name,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **meta,
        "files": dict(sorted(files.items())),
    }
    write_atomic(step_dir / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(step_dir: Path) -> Optional[dict[str, Any]]:
    f = step_dir / MANIFEST_NAME
    if not f.is_file():
        return None
    try:
        manifest = json.loads(f.read_text())
    except (json.JSONDecodeError, OSError):
        return None  # cannot be torn (written by rename); unreadable means damaged: treat as absent
    return manifest if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict) else None


def manifest_damage(step_dir: Path) -> Optional[str]:
    """Why the manifest in `step_dir` cannot be read, or None (absent, or readable). A manifest is written by
    rename, so it is never torn: one that does not parse was damaged afterwards (a disk or a hand)."""
    f = step_dir / MANIFEST_NAME
    try:
        manifest = json.loads(f.read_text())
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return f"it is not valid JSON ({e})"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)):
        return "it has no 'files' table"
    return None


def manifest_problem(step_dir: Path, manifest: dict[str, Any]) -> Optional[str]:
    """The first file the manifest names that is missing or has another size, or None if all match."""
    for name, size in manifest["files"].items():
        f = step_dir / name
        try:
            actual = f.stat().st_size
        except FileNotFoundError:
            return f"{f} is missing"
        if actual != size:
            return f"{f} is {actual} bytes, the manifest says {size} ({'short' if actual < size else 'changed'})"
    return None


@dataclass(frozen=True)
class Found:
    """A complete checkpoint to resume from."""

    path: str  # the directory given as --save / --load
    tag: str
    step: int
    layout: CheckpointLayout
    verified: bool  # True: checked against its manifest; False: an older checkpoint without one (file counts)
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def has_optimizer(self) -> bool:
        return self.layout.optimizer_files > 0


def find_resumable(path: str) -> tuple[Optional[Found], list[str]]:
    """The newest complete checkpoint under `path`, and a warning for each newer one that was skipped.

    Candidates are tag directories with a manifest, plus the tag `latest` names when it has none (checkpoints
    written before manifests, and `threed convert` output), whose file counts are checked instead."""
    warnings: list[str] = []
    latest = read_latest(path)
    for tag in list_tags(path):
        step_dir = Path(path) / tag
        manifest = read_manifest(step_dir)
        damage = manifest_damage(step_dir) if manifest is None else None
        if damage:  # said, then treated as absent: the file counts of `latest`'s tag can still vouch for it
            warnings.append(
                f"warning: {step_dir / MANIFEST_NAME} is damaged: {damage}; "
                + ("checking the checkpoint's files by count instead" if tag == latest else "skipping that checkpoint")
            )
        if manifest is not None:
            problem = manifest_problem(step_dir, manifest)
            if problem is None:
                return Found(
                    path, tag, step_of(tag) or 0, layout_of_files(tag, list(manifest["files"])), True, manifest
                ), warnings
            warnings.append(f"skipping checkpoint {step_dir}: {problem}")
        elif tag == latest:
            names = [f.name for f in step_dir.iterdir()]
            layout = layout_of_files(tag, names)
            problem = missing_files(layout, names)
            if problem is None:
                return Found(path, tag, step_of(tag) or 0, layout, False), warnings
            warnings.append(f"skipping checkpoint {step_dir}: {problem}")
        elif not damage:
            warnings.append(
                f"skipping checkpoint {step_dir}: it has no {MANIFEST_NAME}, so its save never finished on every rank"
            )
    if latest is not None and step_of(latest) is None and (Path(path) / latest).is_dir():
        # A tag not named global_step<N> (written by hand or another tool): trust `latest` with a file check.
        names = [f.name for f in (Path(path) / latest).iterdir()]
        layout = layout_of_files(latest, names)
        if missing_files(layout, names) is None:
            return Found(path, latest, 0, layout, False), warnings
    return None, warnings


def prune(save_dir: Path, keep_last: int, current: str) -> list[str]:
    """Delete what a restart can no longer need: checkpoints beyond the newest `keep_last` complete ones (0 keeps
    all), unfinished saves older than `current`, and universal conversions of steps before it. Returns what was
    removed. Never touches `current` (the tag `latest` names). A directory without a manifest whose file counts
    are complete (an older threed's checkpoint) counts as complete: keeping a leftover beats deleting a run."""
    removed: list[str] = []
    current_step = step_of(current) or 0
    complete = 0
    for tag in list_tags(save_dir):
        step_dir = save_dir / tag
        if tag == current:
            complete += 1
            continue
        if (step_of(tag) or 0) > current_step:
            continue  # a newer directory: leave it to whoever writes it
        if is_complete(step_dir):
            complete += 1
            if not keep_last or complete <= keep_last:
                continue
        remove_checkpoint(step_dir)
        removed.append(tag)
    universal = save_dir / UNIVERSAL_DIR
    if universal.is_dir():
        for d in universal.iterdir():
            if d.is_dir() and (step_of(d.name.split("-")[0]) or 0) < current_step:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(f"{UNIVERSAL_DIR}/{d.name}")
    return removed


def is_complete(step_dir: Path) -> bool:
    """Whether a tag directory is a whole checkpoint: its manifest's files all there at their sizes, or, without a
    manifest (an older threed's checkpoint), its file counts complete."""
    manifest = read_manifest(step_dir)
    if manifest is not None:
        return manifest_problem(step_dir, manifest) is None
    names = [f.name for f in step_dir.iterdir()]
    return missing_files(layout_of_files(step_dir.name, names), names) is None


def directory_bytes(path: Path) -> int:
    """The bytes the files under `path` hold."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def save_dir_contents(save_dir: Path) -> tuple[int, list[tuple[Path, int]]]:
    """How many complete checkpoints `save_dir` holds, and its torn ones (a save cut short: by a kill, a full disk)
    with the bytes each holds, for the start's free-space check."""
    complete, torn = 0, []
    latest = step_of(read_latest(save_dir) or "") or 0
    for tag in list_tags(save_dir):
        # Newer than `latest` without a manifest: a save cut short even when its files are all there (a full disk
        # leaves the file it was writing, short). `latest` is written only after the manifest.
        cut_short = (step_of(tag) or 0) > latest and read_manifest(save_dir / tag) is None
        if not cut_short and is_complete(save_dir / tag):
            complete += 1
        else:
            torn.append((save_dir / tag, directory_bytes(save_dir / tag)))
    return complete, torn


def remove_checkpoint(step_dir: Path) -> None:
    """The manifest goes first, so a removal cut short never leaves a manifest over missing files."""
    (step_dir / MANIFEST_NAME).unlink(missing_ok=True)
    shutil.rmtree(step_dir, ignore_errors=True)


def clear_run(save_dir: Path) -> list[str]:
    """`--overwrite true`: remove the checkpoints of the run in `save_dir` (latest first, so no reader ever sees
    it name a half-deleted directory)."""
    removed = []
    (save_dir / LATEST).unlink(missing_ok=True)
    for tag in list_tags(save_dir):
        remove_checkpoint(save_dir / tag)
        removed.append(tag)
    shutil.rmtree(save_dir / UNIVERSAL_DIR, ignore_errors=True)
    return removed
