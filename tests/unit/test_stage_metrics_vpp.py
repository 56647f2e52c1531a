"""Per-chunk idle time at --vpp > 1 (threed.metrics.stages.per_stage / per_chunk, threed.metrics.sinks.stdout_line),
on rows as the metrics writer gathers them: a rank's chunks' idle fractions are their waits over the rank's busy
time, in the records and in the log line. The numbers of a real interleaved run: tests/ranks/test_interleaved.py."""

from __future__ import annotations

import pytest
import torch

from threed.metrics.sinks import stdout_line
from threed.metrics.stages import BUCKETS, CHUNK_BUCKETS, ROW, per_stage


def row(stage: int, compute: float, p2p: float, chunks: list[tuple[float, float]], steps: int = 2) -> list[float]:
    """One rank's gathered row over `steps` steps: totals in seconds, then (compute, p2p) of each chunk."""
    buckets = dict.fromkeys(BUCKETS, 0.0) | {"compute": compute, "p2p": p2p, "iteration": compute + p2p}
    return [stage, steps, *(buckets[b] for b in BUCKETS), 1.0, 2.0, *(x for c in chunks for x in c)]


def log_line(stages: dict[str, float]) -> str:
    """The stdout line of a record carrying `stages` (per_stage's keys) at pp 2."""
    record = {"iteration": 3, "lm loss": 2.0, "learning-rate": 1e-4, "grad-norm": 1.0, "iteration-time": 0.5,
              "tokens-per-sec": 1000.0, "throughput": 380.0, "mem-allocated-bytes": 2**20,
              "mem-max-allocated-bytes": 2**21, "pipeline/ideal-bubble": 0.2, **stages}  # fmt: skip
    return stdout_line(record, 10, None, 2)


def test_chunk_idle_is_each_chunk_s_wait_over_the_rank_s_busy_time() -> None:
    assert CHUNK_BUCKETS == ("compute", "p2p")
    rows = torch.tensor(
        [row(0, 6.0, 2.0, [(3.0, 0.5), (3.0, 1.0)]), row(1, 6.0, 4.0, [(2.0, 3.0), (4.0, 0.5)])], dtype=torch.float64
    )
    assert rows.shape[1] == len(ROW) + 2 * len(CHUNK_BUCKETS)
    out = per_stage(rows, 2)
    assert out["stage0/idle-fraction"] == pytest.approx(2.0 / 8.0)
    assert out["stage0/chunk0/idle-fraction"] == pytest.approx(0.5 / 8.0)
    assert out["stage0/chunk1/idle-fraction"] == pytest.approx(1.0 / 8.0)
    assert out["stage1/chunk0/idle-fraction"] == pytest.approx(3.0 / 10.0)
    assert out["stage1/chunk1/compute-time"] == pytest.approx(2.0)  # per step: 4 s over 2 steps
    assert out["stage1/chunk0/p2p-wait-time"] == pytest.approx(1.5)
    assert "stage0/chunk2/idle-fraction" not in out
    line = log_line(out)
    assert "stages idle 25/40% (ideal 20%)" in line and "chunks idle 6+12/30+5%" in line, line


def test_vpp1_rows_have_no_chunk_keys_nor_chunk_part_in_the_line() -> None:
    out = per_stage(torch.tensor([row(0, 6.0, 2.0, []), row(1, 6.0, 4.0, [])], dtype=torch.float64), 2)
    assert out["stage1/idle-fraction"] == pytest.approx(0.4) and not any("chunk" in k for k in out)
    assert "chunks idle" not in log_line(out)
