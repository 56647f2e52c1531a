"""The tasks `threed eval-harness` (and --harness-tasks during training) scores, found and loaded before any engine
is built: an unknown task or data that is not available offline is one line, not a traceback after the model
loaded.

lm-eval indexes its ~14.7k stock tasks in ~18 s; with --include-path and only local tasks asked for, the index is
built from that folder alone (`TaskManager(include_defaults=False)`, under a second), and a name that no stock file
mentions is refused before the stock index (`unmentioned`, ~1 s). A local task is a YAML file
whose data may be local JSONL (`dataset_path: json`, `dataset_kwargs.data_files`; relative paths are read from the
working directory).

    threed eval-harness --load CKPT --tasks my_mc,my_ppl --include-path tasks/ --limit 20
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from threed.checkpoint.format import read_latest
from threed.errors import ThreedError

EXTRA = "pip install 'threed[eval]'"  # the optional extra that installs lm-eval (pyproject.toml)
PREDOWNLOAD = (
    'on a machine with network access run `python -c "from lm_eval.tasks import TaskManager, get_task_dict; '
    "get_task_dict(['TASK'], TaskManager())\"` with the same HF_DATASETS_CACHE / HF_HOME, then rerun offline"
)


def default_output(load: str, tag: Optional[str] = None) -> Path:
    """CKPT/harness/<tag>_<time>.json: the scores of the checkpoint `tag` (default: the one `latest` names), beside
    it."""
    tag = tag or read_latest(load) or "checkpoint"
    return Path(load) / "harness" / f"{tag}_{time.strftime('%Y%m%d-%H%M%S')}.json"


def require_lm_eval() -> None:
    """One line naming the extra when lm-eval is not installed."""
    try:
        import lm_eval  # noqa: F401  lm-eval: the optional extra, ~47 packages; only these commands need it
    except ImportError:
        raise ThreedError(f"lm-eval is not installed: {EXTRA} (the eval extra)") from None


def split_tasks(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ThreedError("--tasks names no task; give a comma-separated list, e.g. --tasks arc_easy,hellaswag")
    return names


def task_manager(names: Sequence[str], include_path: Optional[str]) -> Any:
    """lm-eval's TaskManager that knows every name in `names`: the --include-path folder alone when it holds them
    all (no stock index), else the stock index too. Unknown names: one line, before the stock index (~18 s) when
    no stock YAML file mentions them."""
    # lm-eval: the optional extra (threed[eval]); only the harness commands import it
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise ThreedError(f"--include-path {include_path}: no such directory; give the folder of your task YAML files")
    with quiet_lm_eval():
        local_names: set = set()
        if include_path is not None:
            local = TaskManager(include_defaults=False, include_path=include_path)
            if all(n in local.all_tasks for n in names):
                return local
            local_names = set(local.all_tasks)
            for name in (n for n in names if n not in local_names):  # before the stock index (~18 s)
                broken = broken_yaml(name, include_path, mentioned_only=True)
                if broken:
                    raise ThreedError(broken)
        nowhere = unmentioned([n for n in names if n not in local_names], stock_task_dir())
        if nowhere:
            raise ThreedError(unknown_task(nowhere[0], include_path))
        manager = TaskManager(include_path=include_path)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ThreedError(unknown_task(unknown[0], include_path))
    return manager


def stock_task_dir() -> Path:
    """The folder of lm-eval's stock task YAML files (what `TaskManager()` indexes besides --include-path)."""
    # lm-eval: the optional extra (threed[eval]); only the harness commands import it
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def unmentioned(names: Sequence[str], root: Path) -> list[str]:
    """The names that no file under `root` holds anywhere in its text. lm-eval's index takes every name it knows
    from a YAML file's `task:`, `group:` or `tag:` or from a file that one `include:`s (which may have any name:
    `_arc_yaml`, `_default_template_yaml`; lm_eval.tasks._index.TaskIndex), so such a name is no stock task, group
    or tag: reading the files as bytes takes ~1 s where the index parses them all (~18 s). A name found in some file
    is left to the index (it may still be unknown)."""
    left = {n: n.encode() for n in names}
    for path in root.rglob("*"):
        if not left:
            break
        if "__pycache__" in path.parts or not path.is_file():
            continue
        data = path.read_bytes()
        for name in [n for n, b in left.items() if b in data]:
            del left[name]
    return [n for n in names if n in left]


def unknown_task(name: str, include_path: Optional[str]) -> str:
    """The line for a task name no index knows: a broken YAML file of --include-path first (lm-eval skips those
    without a word), else where the name was looked for."""
    broken = broken_yaml(name, include_path) if include_path is not None else None
    if broken:
        return broken
    where = f" or under --include-path {include_path}" if include_path else " (local tasks: --include-path DIR)"
    return f"unknown task {name!r}: not an lm-eval task{where}; `lm-eval ls tasks` lists them"


def load_tasks(names: Sequence[str], manager: Any) -> dict:
    """lm-eval's task dict, datasets loaded (from the cache or local files); a task whose data cannot be had is one
    line naming the pre-download step."""
    # lm-eval: the optional extra (threed[eval]); only the harness commands import it
    from lm_eval.tasks import get_task_dict

    missing = missing_data_file(names, manager)
    if missing:
        raise ThreedError(missing)
    try:
        with quiet_lm_eval():
            return get_task_dict(list(names), manager)
    except Exception as e:  # datasets raises many kinds (ConnectionError, FileNotFoundError, DatasetNotFoundError)
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        why = " and this machine is offline" if offline else ""
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ThreedError(
            f"the data of task(s) {', '.join(names)} could not be loaded{why} ({first[:200]}); "
            f"{PREDOWNLOAD.replace('TASK', names[0])}"
        ) from None


def broken_yaml(name: str, include_path: str, mentioned_only: bool = False) -> Optional[str]:
    """Why a task of --include-path is not in lm-eval's index: lm-eval skips a YAML file it cannot load (bad
    syntax, an `include:` that is not there) without a word, so the task looks unknown. The line names the file
    that mentions `name` (else, unless `mentioned_only`, the first broken one) and what is wrong with it; None when
    there is none."""
    # lm-eval: the optional extra (threed[eval]); its own loader, so the error is the one its index swallowed
    from lm_eval.tasks._yaml_loader import load_yaml

    found = []
    for path in sorted(Path(include_path).glob("**/*.yaml")):
        try:
            load_yaml(path, resolve_func=False, recursive=True)
        except Exception as e:  # yaml.YAMLError, FileNotFoundError of an include, ValueError (not a mapping)
            text = path.read_text(encoding="utf-8", errors="replace")
            mentions = path.stem == name or re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text)
            found.insert(0 if mentions else len(found), (path, e, mentions))
    if not found or (mentioned_only and not found[0][2]):
        return None
    path, e, mentions = found[0]
    if isinstance(e, FileNotFoundError):
        why = f"its include: {e.filename} does not exist; fix the include: path (relative to {path.parent})"
    else:
        first = " ".join(str(e).split())[:200]
        why = f"lm-eval cannot read it ({type(e).__name__}: {first}); fix the file"
    about = f"task {name!r} is in {path}, which" if mentions else f"task {name!r} is not indexed; {path}"
    return f"{about} does not load: {why}"


def missing_data_file(names: Sequence[str], manager: Any) -> Optional[str]:
    """A local task (`dataset_path: json`, csv, ...) whose `dataset_kwargs.data_files` is not there: one line naming
    the file and the YAML that names it (nothing to download: the path is wrong)."""
    for name in names:
        entry = manager.task_index.get(name)
        cfg = getattr(entry, "cfg", None) or {}
        files = (cfg.get("dataset_kwargs") or {}).get("data_files") if isinstance(cfg, dict) else None
        values = files.values() if isinstance(files, dict) else [files]
        for value in values:
            for f in value if isinstance(value, list) else [value]:
                if isinstance(f, str) and "://" not in f and not any(c in f for c in "*?[") and not os.path.exists(f):
                    return (
                        f"task {name!r}: its data file {f} (dataset_kwargs.data_files in {entry.yaml_path}) does not "
                        f"exist; fix the path (a relative one is read from the working directory, {os.getcwd()})"
                    )
    return None


@contextlib.contextmanager
def quiet_lm_eval():
    """lm-eval logs every task it indexes and loads at INFO/WARNING: the command's own lines are what matter."""
    logger = logging.getLogger("lm_eval")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)
