"""Sizes for people: one formatter for every byte count threed prints (checkpoint sizes, free disk, converted and
exported models), so the same size reads the same in every message."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """`1.5 GiB`, `920.1 GiB`, `17.0 B` (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
