"""Real English text that ships with every CPython: the Python reference topics in `pydoc_data` (~460 kB).
Used by `make demo` and the tests, so nothing is downloaded."""

from __future__ import annotations

from pathlib import Path


def write_demo_text(out: str) -> str:
    from pydoc_data.topics import topics  # a 1 MB dict: only when the demo corpus is written

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text("\n\n".join(topics[k] for k in sorted(topics)), encoding="utf-8")
    return out
