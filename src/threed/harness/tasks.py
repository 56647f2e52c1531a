"""The tasks `threed eval-harness` (and --harness-tasks during training) scores, found and loaded before any engine
is built: an unknown task or data that is not available offline is one line, not a traceback after the model
loaded.

lm-eval indexes its ~14.7k stock tasks in ~18 s; with --include-path and only local tasks asked for, the index is
built from that folder alone (`TaskManager(include_defaults=False)`, under a second). A local task is a YAML file
whose data may be local JSONL (`dataset_path: json`, `dataset_kwargs.data_files`; relative paths are read from the
working directory).

    threed eval-harness --load CKPT --tasks my_mc,my_ppl --include-path tasks/ --limit 20
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from typing import Any, Optional, Sequence

from threed.errors import ThreedError

EXTRA = "pip install 'threed[eval]'"  # the optional extra that installs lm-eval (pyproject.toml)
PREDOWNLOAD = (
    'on a machine with network access run `python -c "from lm_eval.tasks import TaskManager, get_task_dict; '
    "get_task_dict(['TASK'], TaskManager())\"` with the same HF_DATASETS_CACHE / HF_HOME, then rerun offline"
)


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
    all (no stock index), else the stock index too. Unknown names: one line."""
    # lm-eval: the optional extra (threed[eval]); only the harness commands import it
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise ThreedError(f"--include-path {include_path}: no such directory; give the folder of your task YAML files")
    with quiet_lm_eval():
        if include_path is not None:
            local = TaskManager(include_defaults=False, include_path=include_path)
            if all(n in local.all_tasks for n in names):
                return local
        manager = TaskManager(include_path=include_path)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        where = f" or under --include-path {include_path}" if include_path else " (local tasks: --include-path DIR)"
        raise ThreedError(f"unknown task {unknown[0]!r}: not an lm-eval task{where}; `lm-eval ls tasks` lists them")
    return manager


def load_tasks(names: Sequence[str], manager: Any) -> dict:
    """lm-eval's task dict, datasets loaded (from the cache or local files); a task whose data cannot be had is one
    line naming the pre-download step."""
    # lm-eval: the optional extra (threed[eval]); only the harness commands import it
    from lm_eval.tasks import get_task_dict

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
