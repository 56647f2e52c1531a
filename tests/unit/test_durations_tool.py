"""tools/test_durations.py, which turns the JUnit XML files `.ci/run` keeps into docs/performance.md's "Test suite
times": a test's time lands in its file and folder, the slowest come first, and the page's section is replaced
(not appended twice) while the rest of the page stays; the rank pool's requests kept beside the XML are listed by
their CPU.

    .venv/bin/python -m pytest -q tests/unit/test_durations_tool.py
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

XML = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" errors="0"
 failures="1" skipped="1" tests="4" time="30.5" timestamp="2026-11-28T10:00:00+00:00" hostname="vm">
<testcase classname="tests.ranks.test_parity" name="test_logits[gqa31-2-2]" time="20.25" />
<testcase classname="tests.unit.test_config" name="test_a" time="1.5" />
<testcase classname="tests.unit.test_config.TestGroup" name="test_b" time="0.5"><failure message="x" /></testcase>
<testcase classname="tests.cli.test_recipes" name="test_c" time="0.1"><skipped message="y" /></testcase>
</testsuite></testsuites>"""


def _tool():
    """tools/test_durations.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location("test_durations", ROOT / "tools" / "test_durations.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_times_land_in_their_file_and_folder_slowest_first(tmp_path) -> None:
    tool = _tool()
    (tmp_path / "test.xml").write_text(XML)
    runs = tool.read_runs([tmp_path])
    assert [(c.file, c.outcome) for c in runs[0].cases] == [
        ("tests/ranks/test_parity.py", "passed"),
        ("tests/unit/test_config.py", "passed"),
        ("tests/unit/test_config.py", "failed"),
        ("tests/cli/test_recipes.py", "skipped"),
    ]
    text = tool.markdown(runs, slowest=2)
    assert text.startswith(tool.SECTION + "\n\nMeasured 2026-11-28")
    assert "| `test` | 2 | 30 | 22 |" in text  # 2 passed, pytest's 30.5 s, 22.35 s in the tests
    assert "| `tests/unit` | 2 | 2.0 |" in text
    slowest = text.split("slowest tests:")[1]
    assert slowest.index("test_parity.py::test_logits[gqa31-2-2]") < slowest.index("test_config.py::test_a")
    assert "test_recipes" not in slowest  # only the 2 slowest


def test_the_section_is_replaced_and_the_page_kept(tmp_path) -> None:
    tool = _tool()
    page = "# Perf\n\nintro\n\n## Test suite times\n\nold table\n\n## Later\n\nkept\n"
    once = tool.replace_section(page, "## Test suite times\n\nnew table\n")
    assert once == "# Perf\n\nintro\n\n## Test suite times\n\nnew table\n\n## Later\n\nkept\n"
    assert tool.replace_section(once, "## Test suite times\n\nnew table\n") == once
    appended = tool.replace_section("# Perf\n", "## Test suite times\n\nt\n")
    assert appended == "# Perf\n\n## Test suite times\n\nt\n"


def test_rank_pool_requests_are_listed_by_their_cpu(tmp_path) -> None:
    tool = _tool()
    (tmp_path / "test.xml").write_text(XML)
    requests = [
        {"world": 2, "request": "bytes_worker.py compare --out", "seconds": 7.5, "cpu_seconds": 10.25},
        {"world": 8, "request": "cp_worker.py --out --data", "seconds": 80.0, "cpu_seconds": 143.0},
        {"world": 4, "request": "init_worker.py --out", "seconds": 12.5, "cpu_seconds": 16.0},
    ]
    (tmp_path / "test.rank-pool.json").write_text(json.dumps(requests))
    found = tool.read_pool_requests([tmp_path])
    assert [r["target"] for r in found] == ["test"] * 3
    assert tool.read_pool_requests([tmp_path / "test.xml"]) == found  # an XML file named: the file beside it
    text = tool.markdown(tool.read_runs([tmp_path]), slowest=2, requests=found)
    pool = text.split("Rank-pool requests:")[1]
    assert pool.startswith(" 3, 100 s, 169 CPU-s over their ranks; the 2 costliest:"), pool
    assert pool.index("| 143.0 | 80.0 | 8 | test | `cp_worker.py --out --data` |") < pool.index("init_worker.py")
    assert "bytes_worker" not in pool  # only the 2 costliest
    assert "Rank-pool" not in tool.markdown(tool.read_runs([tmp_path]))  # none kept: no table
