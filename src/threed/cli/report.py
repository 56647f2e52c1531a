"""`threed report RUN_DIR [RUN_DIR2]`: the command line of `threed.metrics.report` (plots and a summary from a run's
metrics.jsonl).

    threed report runs/llama3-8b/ckpt                       # PNGs into runs/llama3-8b/ckpt/report/
"""

from __future__ import annotations

import argparse

from threed.errors import guarded, os_error_line
from threed.metrics.report import ReportError, report


def _report(ns: argparse.Namespace) -> None:
    if len(ns.run_dirs) > 2:
        raise ReportError(f"at most two run directories, got {len(ns.run_dirs)}")
    try:
        report(ns.run_dirs, ns.out)
    except OSError as e:  # a file vanishing or unreadable meanwhile, a disk full: bad input, one line
        raise ReportError(os_error_line(e)) from e


def _run(ns: argparse.Namespace) -> int:
    return guarded("threed report", lambda: _report(ns))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="plots and a summary from a run's metrics.jsonl (one or two runs)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="directory holding metrics.jsonl (at most two)")
    p.add_argument("--out", help="where the PNGs go (default: RUN_DIR/report)")
    p.set_defaults(run=_run)
