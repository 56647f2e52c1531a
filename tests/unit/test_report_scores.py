"""`threed report` on a run that scored lm-evaluation-harness tasks during training (--harness-interval, issue 28):
the `harness/<task>/<metric>` records of metrics.jsonl (as threed.train.samples writes them) get a panel each in
harness.png and a line each in the summary (latest score, first score); a run without scores gets no harness.png.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/unit/test_report_scores.py
"""

from __future__ import annotations

import json

from threed.cli.main import main as cli_main
from threed.metrics.report import HARNESS_PLOT, load_run, summary_lines, write_plots
from threed.train.samples import harness_scores

from test_report_marks import record, write


def scored(step: int, acc: float, ppl: float) -> dict:
    """The record MetricsWriter.log writes for the harness scores at `step` (global batch 8 x seq 32)."""
    results = {"results": {"mc": {"acc,none": acc, "acc_stderr,none": 0.1}, "ppl": {"word_perplexity,none": ppl}}}
    return {"iteration": step, "samples": step * 8, "tokens": step * 256, "time": 0.0, **harness_scores(results)}


def scored_run(tmp_path) -> str:
    records = []
    for i in range(1, 13):  # scores after steps 4, 8, 12, as the loop logs them
        records.append(record(i, 5.0 - i / 10, 0.5))
        if i % 4 == 0:
            records.append(scored(i, {4: 0.25, 8: 0.3, 12: 0.45}[i], {4: 90.0, 8: 70.0, 12: 55.0}[i]))
    records.append(scored(12, 0.5, 50.0))  # the same step scored again (a resumed run): the last wins
    return write(tmp_path, records)


def test_scores_are_listed_in_the_summary(tmp_path):
    run = load_run(scored_run(tmp_path / "run"))
    assert run.score_keys() == ["harness/mc/acc", "harness/ppl/word_perplexity"]  # stderr left out
    assert [r["iteration"] for r in run.scores] == [4, 8, 12]
    lines = [line.strip() for line in summary_lines(run) if line.strip().startswith("harness")]
    assert lines == [
        "harness mc acc: 0.5000 at step 12 (first 0.2500 at step 4; 3 scores)",
        "harness ppl word_perplexity: 50.0000 at step 12 (first 90.0000 at step 4; 3 scores)",
    ]
    assert len(run.train) == 12  # score records are not training steps


def test_harness_png_has_a_panel_per_task_and_metric(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    a, b = load_run(scored_run(tmp_path / "a")), load_run(scored_run(tmp_path / "b"))
    b.scores = b.scores[:2]  # the second run scored fewer steps
    panels = []
    keep = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: (panels.append(fig), keep(fig)))
    paths = write_plots([a, b], tmp_path / "plots")
    assert [p.name for p in paths][-1] == HARNESS_PLOT and (tmp_path / "plots" / HARNESS_PLOT).stat().st_size > 5000
    axes = [ax for ax in panels[-1].axes if ax.axison]
    assert [ax.get_title() for ax in axes] == ["mc acc", "ppl word_perplexity"]
    lines = axes[0].get_lines()
    assert [len(line.get_xdata()) for line in lines] == [3, 2]
    assert list(lines[0].get_xdata()) == [4 * 256, 8 * 256, 12 * 256] and list(lines[0].get_ydata()) == [0.25, 0.3, 0.5]


def test_report_command_prints_scores_and_skips_the_panel_without_them(tmp_path, capsys):
    assert cli_main(["report", scored_run(tmp_path / "run"), "--out", str(tmp_path / "one")]) == 0
    assert "harness mc acc: 0.5000 at step 12" in capsys.readouterr().out
    assert (tmp_path / "one" / HARNESS_PLOT).is_file()
    plain = write(tmp_path / "plain", [record(i, 5.0, 0.5) for i in range(1, 4)])
    assert cli_main(["report", plain, "--out", str(tmp_path / "two")]) == 0
    assert "harness" not in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "two").glob("*.png")) == sorted(
        ["loss.png", "learning_rate.png", "throughput.png", "memory.png", "idle.png"]
    )
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[4])["harness/mc/acc"] == 0.25
