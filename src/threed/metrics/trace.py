"""Where a profiled step's device time goes, from plain intervals: the top kernels by time, and the holes in which
the device waited for the host. Why a pure module: the GPU machine is lent for minutes, so the reading of a trace
is written and tested here, on numbers, and the one call only collects (`benchmarks/bench_gpu.py --profile`).

The same code reads a CUDA trace (the intervals are kernels, copies and memsets on their streams; they do not
nest) and a CPU trace (the intervals are aten ops on their threads; they nest, so each op is charged its self
time, its duration less its children's). A `Span`'s lane is its stream or thread: spans nest only within a lane.

    top_kernels(spans)             name, total ms and count over all the spans, share of the device time
    idle_gaps(spans, windows)      per step window: busy time, the holes between the first and the last kernel
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

NAME_CHARS = 160  # CUDA kernel names are whole C++ template signatures; the head says which kernel it is


@dataclass(frozen=True)
class Span:
    name: str
    start_us: float
    end_us: float
    lane: Hashable = 0


def self_times(spans: Sequence[Span]) -> list[float]:
    """Each span's duration less its direct children's (spans of its lane inside it), in the order given."""
    out = [s.end_us - s.start_us for s in spans]
    lanes: dict[Hashable, list[int]] = {}
    for i, s in enumerate(spans):
        lanes.setdefault(s.lane, []).append(i)
    for order in lanes.values():
        order.sort(key=lambda i: (spans[i].start_us, -spans[i].end_us))
        stack: list[int] = []
        for i in order:
            while stack and spans[stack[-1]].end_us <= spans[i].start_us:
                stack.pop()
            if stack and spans[i].end_us <= spans[stack[-1]].end_us:
                out[stack[-1]] -= spans[i].end_us - spans[i].start_us
            stack.append(i)
    return out


def top_kernels(spans: Sequence[Span], n: int = 15) -> list[dict[str, Any]]:
    """The `n` names with the most self time: total ms, count and share of all the spans' self time."""
    totals: dict[str, list[float]] = {}
    for span, t in zip(spans, self_times(spans)):
        entry = totals.setdefault(span.name, [0.0, 0])
        entry[0] += t
        entry[1] += 1
    whole = sum(t for t, _ in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:n]
    return [
        {"name": name[:NAME_CHARS], "total_ms": round(t / 1e3, 3), "count": int(c), "share": round(t / whole, 4)}
        for name, (t, c) in ranked
    ]


def busy_intervals(spans: Sequence[Span], start: float, end: float) -> list[tuple[float, float]]:
    """The union of the spans (every lane) clipped to [start, end], as sorted disjoint intervals."""
    parts = sorted((max(s.start_us, start), min(s.end_us, end)) for s in spans if s.end_us > start and s.start_us < end)
    merged: list[list[float]] = []
    for a, b in parts:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def idle_gaps(spans: Sequence[Span], windows: Sequence[tuple[float, float]], n: int = 5) -> dict[str, Any]:
    """Per step window (host time from the step's start to its end, a device sync included): the device's busy
    time, its idle time between its first and its last span (summed, and the `n` largest holes, each with the
    names of the spans on either side), and the idle time before the first and after the last."""
    holes: list[dict[str, Any]] = []
    wall = busy = before = after = between = 0.0
    for k, (start, end) in enumerate(windows):
        intervals = busy_intervals(spans, start, end)
        wall += end - start
        if not intervals:
            before += end - start
            continue
        busy += sum(b - a for a, b in intervals)
        before += intervals[0][0] - start
        after += end - intervals[-1][1]
        for (_, b), (a, _) in zip(intervals, intervals[1:]):
            between += a - b
            holes.append({"step": k, "ms": (a - b) / 1e3, "at_us": b})
    holes.sort(key=lambda h: -h["ms"])
    for h in holes[:n]:
        h["after"], h["before"] = neighbours(spans, h.pop("at_us"))
        h["ms"] = round(h["ms"], 4)
    ms = 1e3 * max(1, len(windows))  # per step
    return {
        "steps": len(windows),
        "wall_ms_per_step": round(wall / ms, 4),
        "busy_ms_per_step": round(busy / ms, 4),
        "idle_between_kernels_ms_per_step": round(between / ms, 4),
        "idle_before_first_ms_per_step": round(before / ms, 4),
        "idle_after_last_ms_per_step": round(after / ms, 4),
        "holes_per_step": round(len(holes) / max(1, len(windows)), 1),
        "largest": [{k: h[k] for k in ("step", "ms", "after", "before")} for h in holes[:n]],
    }


def neighbours(spans: Sequence[Span], at_us: float) -> tuple[str, str]:
    """The names of the span that ended last at `at_us` and of the first to start after it (the hole's edges)."""
    ended = max((s for s in spans if s.end_us <= at_us), key=lambda s: s.end_us, default=None)
    started = min((s for s in spans if s.start_us > at_us), key=lambda s: s.start_us, default=None)
    return ((ended.name[:NAME_CHARS] if ended else ""), (started.name[:NAME_CHARS] if started else ""))
