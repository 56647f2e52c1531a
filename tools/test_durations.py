"""Turns the per-test times CI kept into the dated tables of docs/performance.md's "Test suite times".

Why: the suite's budget (`make test` within ~10 min, `.ci/run` within ~25 min on 2 cores) is kept by moving or
speeding up the tests that cost most, and those are found from what each test took in the last CI run, not from a
guess. `.ci/run` has every make target's pytest write a JUnit XML file (`make test DURATIONS_DIR=...`), whose
`time` of a test is its setup, call and teardown together, so a module-scoped launch counts towards the first test
that uses it. This tool reads those files and prints markdown: each target's total, the time per folder and per file,
and the slowest tests.

    .venv/bin/python tools/test_durations.py runs/ci-durations                 # print the tables
    .venv/bin/python tools/test_durations.py runs/ci-durations --update docs/performance.md --note "2 cores, idle"

`--update` replaces the section "## Test suite times" of the page (or appends it). Only the standard library: it
runs wherever the XML files are.

Beside an XML file, `<name>.rank-pool.json` (tests/ranks/rank_pool.py) holds every request the session's rank pool
served: its seconds and the CPU seconds of all its ranks. A module's pooled worker run counts in the XML towards its
first test only, and on N ranks it spends N cores' CPU, so the costliest requests get a table of their own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

SECTION = "## Test suite times"


@dataclass(frozen=True)
class Case:
    target: str  # the XML file's name: the make target (or pytest run) it came from
    file: str  # tests/unit/test_config.py
    name: str  # test_x[param]
    seconds: float
    outcome: str  # passed | failed | skipped

    @property
    def folder(self) -> str:
        return str(Path(self.file).parent)


@dataclass(frozen=True)
class Run:
    target: str
    seconds: float  # pytest's own wall time of the run (the testsuite's `time`)
    stamp: str  # when it started (the testsuite's `timestamp`)
    cases: tuple[Case, ...]


def _file_of(classname: str) -> str:
    """pytest's junit classname `tests.unit.test_config` (or `...test_x.TestClass`) as the file path."""
    parts = classname.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()  # a test class inside the file
    return "/".join(parts) + ".py" if parts else classname


def _outcome(case: ET.Element) -> str:
    if case.find("skipped") is not None:
        return "skipped"
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "passed"


def read_run(path: Path) -> Run:
    """One pytest JUnit XML file (`--junitxml`)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = [
        Case(path.stem, _file_of(c.get("classname", "")), c.get("name", ""), float(c.get("time", 0)), _outcome(c))
        for suite in suites
        for c in suite.iter("testcase")
    ]
    seconds = sum(float(s.get("time", 0)) for s in suites)
    stamp = min((s.get("timestamp", "") for s in suites), default="")
    return Run(path.stem, seconds, stamp, tuple(cases))


def _xml_files(paths: Sequence[Path]) -> list[Path]:
    """The given XML files, and every `*.xml` of the given directories, in name order."""
    files: list[Path] = []
    for p in paths:
        files.extend(sorted(p.glob("*.xml")) if p.is_dir() else [p])
    return files


def read_runs(paths: Sequence[Path]) -> list[Run]:
    """Every `*.xml` of the given files and directories, in name order."""
    files = _xml_files(paths)
    if not files:
        raise SystemExit(f"test_durations: no JUnit XML files in {', '.join(map(str, paths))}; run `.ci/run` first")
    return [read_run(f) for f in files]


def read_pool_requests(paths: Sequence[Path]) -> list[dict]:
    """Every rank-pool request kept beside the XML files (`<name>.rank-pool.json`), each with the run it came from."""
    kept = [(x.stem, x.with_suffix(".rank-pool.json")) for x in _xml_files(paths)]
    return [{**r, "target": name} for name, f in kept if f.exists() for r in json.loads(f.read_text())]


def pool_table(requests: list[dict], top: int) -> list[str]:
    """The `top` requests costing most CPU, and what all of them cost."""
    if not requests:
        return []
    cpu, wall = sum(r["cpu_seconds"] for r in requests), sum(r["seconds"] for r in requests)
    out = [
        "",
        f"Rank-pool requests: {len(requests)}, {wall:.0f} s, {cpu:.0f} CPU-s over their ranks; the {top} costliest:",
    ]
    rows = sorted(requests, key=lambda r: -r["cpu_seconds"])[:top]
    cells = [
        [f"{r['cpu_seconds']:.1f}", f"{r['seconds']:.1f}", str(r["world"]), r["target"], f"`{r['request']}`"]
        for r in rows
    ]
    return out + [""] + _table(["CPU-s", "seconds", "ranks", "run", "request"], cells)


def _table(header: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _totals(cases: list[Case], key) -> list[tuple[str, float, int]]:
    seconds: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for c in cases:
        seconds[key(c)] += c.seconds
        count[key(c)] += 1
    return sorted(((k, seconds[k], count[k]) for k in seconds), key=lambda t: -t[1])


def _run_row(label: str, seconds: float, cases: list[Case]) -> list[str]:
    passed = sum(c.outcome == "passed" for c in cases)
    return [label, str(passed), f"{seconds:.0f}", f"{sum(c.seconds for c in cases):.0f}"]


def markdown(runs: list[Run], slowest: int = 25, files: int = 20, note: str = "", requests: Sequence[dict] = ()) -> str:
    """The section: each run's total, the folders, the costliest files, the slowest tests and pool requests."""
    cases = [c for r in runs for c in r.cases]
    dates = sorted({r.stamp[:10] for r in runs if r.stamp}) or [datetime.date.today().isoformat()]
    out = [SECTION, "", f"Measured {', '.join(dates)}{f' ({note})' if note else ''}; `tools/test_durations.py`."]
    out += ["", "Per run (pytest's wall time; a test's time is its setup, call and teardown):", ""]
    rows = [_run_row(f"`{r.target}`", r.seconds, list(r.cases)) for r in runs]
    rows.append(_run_row("all", sum(r.seconds for r in runs), cases))
    out += _table(["run", "tests passed", "seconds", "in tests (the rest: start-up, collection)"], rows)
    out += ["", "Per folder:", ""]
    out += _table(
        ["folder", "tests", "seconds"],
        [[f"`{k}`", str(n), f"{s:.1f}"] for k, s, n in _totals(cases, lambda c: c.folder)],
    )
    out += ["", f"The {files} costliest files:", ""]
    per_file = _totals(cases, lambda c: f"{c.target}: {c.file}")[:files]
    out += _table(["run: file", "tests", "seconds"], [[f"`{k}`", str(n), f"{s:.1f}"] for k, s, n in per_file])
    out += ["", f"The {slowest} slowest tests:", ""]
    top = sorted(cases, key=lambda c: -c.seconds)[:slowest]
    out += _table(["seconds", "run", "test"], [[f"{c.seconds:.1f}", c.target, f"`{c.file}::{c.name}`"] for c in top])
    out += pool_table(list(requests), slowest)
    return "\n".join(out) + "\n"


def replace_section(page: str, section: str) -> str:
    """`page` with its "## Test suite times" section (up to the next `## ` heading) replaced, or `section` appended."""
    lines = page.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == SECTION), None)
    if start is None:
        return page.rstrip("\n") + "\n\n" + section
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    tail = "".join(lines[end:])
    return "".join(lines[:start]) + section + ("\n" + tail if tail else "")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path, help="JUnit XML files, or directories of them")
    parser.add_argument("--update", type=Path, help="write the section into this markdown page")
    parser.add_argument("--note", default="", help="the conditions, said after the date (cores, what else ran)")
    parser.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)
    runs, requests = read_runs(args.paths), read_pool_requests(args.paths)
    section = markdown(runs, slowest=args.slowest, note=args.note, requests=requests)
    if args.update is None:
        sys.stdout.write(section)
    else:
        args.update.write_text(replace_section(args.update.read_text(), section))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
