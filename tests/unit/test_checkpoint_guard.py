"""threed.train.guard's decisions in one process (no ranks): non-finite steps skipped up to --skip-nonfinite then a stop
with exit 3 naming the step and the last good checkpoint; the time budget raising the stop request; the watchdog
limit. tests/ranks/test_checkpoint_faults.py runs the same guard inside real multi-rank runs."""

from __future__ import annotations

import dataclasses

import pytest

from threed.train import guard
from threed.config import CheckpointConfig, RunConfig, RunControlConfig
from threed.model.presets import PRESETS


class FakeEngine:
    def __init__(self) -> None:
        self.applied = True

    def was_step_applied(self) -> bool:
        return self.applied


class Stop:
    flag = False

    def requested(self) -> bool:
        return self.flag


def make(tmp_path, **control) -> tuple[guard.RunGuard, FakeEngine, Stop]:
    cfg = RunConfig(
        model=PRESETS["tiny"],
        checkpoint=CheckpointConfig(save=str(tmp_path)),
        control=RunControlConfig(watchdog_factor=0, **control),
    )
    engine, stop = FakeEngine(), Stop()
    return guard.RunGuard(cfg.control, cfg.checkpoint.save, 0, engine, stop), engine, stop


def test_nonfinite_step_stops_with_exit_3_naming_step_and_checkpoint(tmp_path, capsys):
    (tmp_path / "latest").write_text("global_step10")
    g, engine, _ = make(tmp_path)
    assert g.after_step(11, 2.5, 0.7) is False
    engine.applied = False  # DeepSpeed skipped the step: the gradient norm was inf
    with pytest.raises(guard.RunAborted) as e:
        g.after_step(12, float("nan"), float("inf"))
    assert e.value.code == guard.EXIT_DIVERGED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "non-finite loss nan / grad norm inf at step 12: stopping without saving" in err[0]
    assert f"Last good checkpoint: {tmp_path}/global_step10" in err[0] and "--skip-nonfinite N" in err[0]


def test_skip_nonfinite_allows_n_batches(tmp_path, capsys):
    g, _, _ = make(tmp_path, skip_nonfinite=2)
    g.after_step(1, float("inf"), 1.0)
    g.after_step(2, 3.0, float("nan"))
    assert capsys.readouterr().err.count("the optimizer step was skipped") == 2
    with pytest.raises(guard.RunAborted):
        g.after_step(3, 3.0, float("nan"))
    assert "3 non-finite step(s), --skip-nonfinite 2" in capsys.readouterr().err


def test_no_checkpoint_yet_is_said_so(tmp_path, capsys):
    g, _, _ = make(tmp_path / "empty")
    with pytest.raises(guard.RunAborted):
        g.after_step(1, float("nan"), 1.0)
    assert f"Last good checkpoint: none yet in {tmp_path}/empty" in capsys.readouterr().err


def test_time_budget_raises_the_stop_request_once(tmp_path, capsys, monkeypatch):
    g, _, stop = make(tmp_path, exit_duration_in_mins=10.0)
    monkeypatch.setattr(guard, "_STARTED", guard.time.time() - 9 * 60)
    assert g.after_step(1, 1.0, 1.0) is False and not stop.flag
    monkeypatch.setattr(guard, "_STARTED", guard.time.time() - 10 * 60)
    assert g.after_step(2, 1.0, 1.0) is True and stop.flag
    g.after_step(3, 1.0, 1.0)
    assert capsys.readouterr().err.count("--exit-duration-in-mins 10 is near") == 1


def test_watchdog_times_only_calls_in_flight_against_their_median():
    w = guard.Watchdog(rank=0, factor=10, min_seconds=5)

    class Engine:
        def train_batch(self):
            return "loss"

    engine = Engine()
    w.wrap(engine, "train_batch")
    assert engine.train_batch() == "loss" and w.current is None and len(w.durations["train_batch"]) == 1
    w.durations["train_batch"] = [0.1, 0.2, 100.0]  # one slow step does not move the median much
    assert w.limit() == 5
    w.durations["train_batch"] = [2.0] * 5
    assert w.limit() == 20
    assert dataclasses.fields(CheckpointConfig)  # the flags exist: --watchdog-factor, --watchdog-min-seconds
