"""`threed report` on a run that went wrong must not read like a healthy short run (issue 29): steps whose loss or
gradient norm was not finite (null in metrics.jsonl) and a stop by the guard (the loop's `exit-status` record) are
marked with `!`; a gradient norm that was never reported is not a non-finite one."""

from __future__ import annotations

import json

from threed.metrics.report import load_run, summary_lines


def record(i: int, loss, norm) -> dict:
    timing = {"iteration-time": 0.1, "tokens-per-sec": 2560.0, "throughput": 0.01}
    return {"iteration": i, "samples": i * 8, "tokens": i * 256, "lm loss": loss, "grad-norm": norm, **timing}


def write(tmp_path, records, steps: int = 100) -> str:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    train = {"steps": steps, "seq_length": 32, "dtype": "fp32"}
    shape = {"tp": 1, "pp": 1, "dp": 1, "world_size": 1, "global_batch_size": 8, "micro_batch_size": 8}
    config = {"config": {"model": {"name": "tiny"}, "train": train}, **shape, "grad_accum_steps": 1}
    (tmp_path / "run_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def marks(run_dir: str) -> list[str]:
    return [line.strip() for line in summary_lines(load_run(run_dir)) if line.strip().startswith("!")]


def test_non_finite_steps_and_an_exit_3_stop_are_marked(tmp_path):
    records = [record(i, 5.0 - i / 10, 0.5) for i in range(1, 13)]
    records[4]["lm loss"] = None  # step 5: nan loss, skipped
    records[8]["grad-norm"] = None  # step 9: inf grad norm
    records.append({"iteration": 12, "samples": 96, "tokens": 3072, "exit-status": 3})
    assert marks(write(tmp_path, records)) == [
        "! 2 step(s) with a non-finite loss or gradient norm (optimizer step skipped): 5, 9",
        "! the run stopped at step 12 of the 100 it was to run with exit 3 (diverged: the divergence guard's line "
        "in the run's log says why)",
    ]


def test_a_healthy_run_and_a_never_reported_norm_have_no_marks(tmp_path):
    assert marks(write(tmp_path / "a", [record(1, 5.0, 0.5)])) == []
    assert marks(write(tmp_path / "b", [record(i, 5.0, None) for i in range(1, 4)])) == []


def test_a_stop_that_a_resume_went_past_is_not_marked(tmp_path):
    records = [record(i, 5.0, 0.5) for i in range(1, 5)]
    records.append({"iteration": 4, "samples": 32, "tokens": 1024, "exit-status": 3})
    records += [record(i, 4.0, 0.5) for i in range(3, 9)]  # resumed from step 2 with a lower lr
    assert marks(write(tmp_path, records)) == []
