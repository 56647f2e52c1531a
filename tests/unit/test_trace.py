"""Reading a profiled step (`threed.metrics.trace`) on hand-made intervals: GPU kernels that do not nest, CPU ops
that do (each charged its self time), the device's idle holes inside each step window and their neighbours.

    .venv/bin/python -m pytest -q tests/unit/test_trace.py
"""

from __future__ import annotations

import pytest

from threed.metrics.trace import Span, busy_intervals, idle_gaps, self_times, top_kernels

# two steps of a device: step 0 [0, 100) µs, step 1 [100, 200); kernels on two streams
KERNELS = [
    Span("gemm", 10, 40, "s0"),
    Span("gemm", 45, 75, "s0"),
    Span("copy", 30, 50, "s1"),  # overlaps both gemms: no hole there
    Span("norm", 80, 90, "s0"),  # a 5 µs hole before it (75 -> 80)
    Span("gemm", 110, 140, "s0"),
    Span("norm", 160, 170, "s0"),  # a 20 µs hole (140 -> 160)
]


def test_kernels_that_do_not_nest_are_charged_their_duration():
    assert self_times(KERNELS) == [30, 30, 20, 10, 30, 10]
    top = top_kernels(KERNELS)
    assert [(k["name"], k["total_ms"], k["count"]) for k in top] == [
        ("gemm", 0.09, 3),
        ("copy", 0.02, 1),
        ("norm", 0.02, 2),
    ]
    assert sum(k["share"] for k in top) == pytest.approx(1.0, abs=1e-3) and top[0]["share"] == pytest.approx(
        90 / 130, abs=1e-4
    )


def test_nested_ops_are_charged_their_self_time():
    ops = [
        Span("linear", 0, 10),
        Span("mm", 1, 8),
        Span("t", 8.5, 9),
        Span("mm", 11, 12),
        Span("linear", 20, 30, "other"),
    ]
    # linear: 10 - 7 (mm) - 0.5 (t); the other thread's linear nests nothing
    assert self_times(ops) == pytest.approx([2.5, 7, 0.5, 1, 10])


def test_holes_between_kernels_per_step_and_their_neighbours():
    g = idle_gaps(KERNELS, [(0, 100), (100, 200)], n=2)
    assert g["steps"] == 2 and g["wall_ms_per_step"] == 0.1
    # busy: step 0 10-75 (65) + 80-90 (10); step 1 30 + 10: 115 µs in 2 steps
    assert g["busy_ms_per_step"] == pytest.approx(0.0575)
    assert g["idle_between_kernels_ms_per_step"] == pytest.approx(0.0125)  # (5 + 20) / 2
    assert g["idle_before_first_ms_per_step"] == pytest.approx(0.01)  # (10 + 10) / 2
    assert g["idle_after_last_ms_per_step"] == pytest.approx(0.02)  # (10 + 30) / 2
    assert g["holes_per_step"] == 1.0
    assert g["largest"] == [
        {"step": 1, "ms": 0.02, "after": "gemm", "before": "norm"},
        {"step": 0, "ms": 0.005, "after": "gemm", "before": "norm"},
    ]


def test_a_window_is_clipped_and_an_empty_one_is_all_idle():
    assert busy_intervals(KERNELS, 35, 60) == [(35, 60)]
    g = idle_gaps(KERNELS, [(300, 400)])
    assert g["busy_ms_per_step"] == 0 and g["idle_before_first_ms_per_step"] == 0.1 and g["largest"] == []
