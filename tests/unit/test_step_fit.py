"""The step-time fit (`threed.plan.fit`: step = gas x c + FLOPs / R) on the H200's measured runs of 2026-11-28
(raw logs: ../shared/gpu-runs/2026-11-28-h200/bench.log): the ~30 ms per micro-batch issue 35 quotes comes out of
the causal FLOPs, and a third run at micro-batch 2 is fitted in the least-squares sense.

    .venv/bin/python -m pytest -q tests/unit/test_step_fit.py
"""

from __future__ import annotations

import pytest

from threed.model.presets import PRESETS
from threed.model.spec import training_flops_per_token
from threed.plan.fit import Run, StepFit, fit_step_time

TOKENS = 32768
M = PRESETS["llama3.2-1b"]
H200 = {4096: 41875.0, 8192: 45901.0}  # threed's tokens/s, micro-batch 1, no recompute


def h200_runs(attention: str) -> list[Run]:
    return [
        Run(TOKENS // seq, training_flops_per_token(M, seq, attention=attention) * TOKENS, TOKENS / tps)  # type: ignore[arg-type]
        for seq, tps in H200.items()
    ]


def test_two_runs_are_fitted_exactly_and_give_the_issues_30_ms():
    causal = fit_step_time(h200_runs("causal"))
    assert causal.per_micro_batch_s == pytest.approx(0.0304, abs=5e-4)
    assert causal.flops_per_s / 1e12 == pytest.approx(499, abs=2)
    full = fit_step_time(h200_runs("full"))
    assert full.per_micro_batch_s == pytest.approx(0.0384, abs=5e-4)
    assert full.flops_per_s / 1e12 == pytest.approx(622, abs=2)
    assert max(abs(e) for e in causal.relative_errors + full.relative_errors) < 1e-12


def test_a_third_run_is_fitted_on_relative_errors():
    truth = StepFit(0.02, 500e12, ())
    points = [(8, 3e14), (4, 3e14), (4, 3.5e14)]
    noise = (1.01, 0.99, 1.0)
    runs = [Run(g, f, truth.predict(g, f) * n) for (g, f), n in zip(points, noise)]
    fit = fit_step_time(runs)
    assert fit.per_micro_batch_s == pytest.approx(0.02, rel=0.15) and fit.flops_per_s == pytest.approx(5e14, rel=0.05)
    assert len(fit.relative_errors) == 3 and max(abs(e) for e in fit.relative_errors) < 0.01
    exact = fit_step_time([Run(g, f, truth.predict(g, f)) for g, f in points])
    assert exact.per_micro_batch_s == pytest.approx(0.02) and exact.flops_per_s == pytest.approx(5e14)


@pytest.mark.parametrize(
    "runs,message",
    [
        ([Run(8, 3e14, 0.78)], "at least 2 runs"),
        ([Run(8, 3e14, 0.78), Run(4, 1.5e14, 0.39)], "proportional"),
        ([Run(8, 3e14, 0.78), Run(0, 3e14, 0.5)], "gas >= 1"),
        ([Run(4, 3e14, 0.5), Run(4, 6e14, 0.3)], "FLOP rate is not positive"),
    ],
)
def test_runs_that_cannot_be_fitted_are_refused_in_one_line(runs, message):
    with pytest.raises(ValueError, match=message):
        fit_step_time(runs)
