"""--generate-interval / --harness-interval are checked before anything is built: each bad combination is one
ConfigError line (the flags' checks in config.py, the files' in threed.train.samples.prepare).

    .venv/bin/python -m pytest -q tests/unit/test_samples_config.py
"""

from __future__ import annotations

import dataclasses

import pytest

from threed.config import ConfigError, DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.model.presets import PRESETS
from threed.train.samples import harness_scores, prepare


def config(tmp_path, parallel=None, **train) -> RunConfig:
    return RunConfig(
        model=PRESETS["tiny"],
        parallel=parallel or ParallelConfig(),
        train=TrainConfig(seq_length=32, **train),
        data=DataConfig(tokenizer=str(tmp_path / "tok.json")),
    )


@pytest.mark.parametrize(
    "train,line",
    [
        (dict(generate_interval=5), r"--generate-interval 5 needs --generate-prompts FILE.jsonl"),
        (dict(generate_prompts="p.jsonl"), r"--generate-prompts takes effect with --generate-interval N"),
        (dict(harness_interval=5), r"--harness-interval 5 needs --harness-tasks a,b"),
        (dict(harness_tasks="arc_easy"), r"--harness-tasks takes effect with --harness-interval N"),
        (dict(harness_interval=-1, harness_tasks="x"), r"--harness-interval must be >= 0"),
    ],
)
def test_flag_combinations_are_refused(tmp_path, train, line):
    with pytest.raises(ConfigError, match=line):
        config(tmp_path, **train).validate(1)


def test_off_by_default_builds_nothing(tmp_path):
    assert prepare(config(tmp_path)) is None


def test_a_missing_tokenizer_or_prompts_file_is_one_line(tmp_path):
    cfg = config(tmp_path, generate_interval=2, generate_prompts=str(tmp_path / "none.jsonl"))
    with pytest.raises(ConfigError, match=r"need the run's tokenizer: pass --tokenizer"):
        prepare(cfg)
    (tmp_path / "tok.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"--generate-prompts .*none.jsonl: no such file"):
        prepare(cfg)


def test_samples_during_an_interleaved_run_are_prepared(tmp_path, tok_dirs):
    """--vpp 2 is no refusal: the decode loop runs each rank's chunks in virtual-stage order (threed.generate.decode;
    the run: tests/ranks/test_samples.py), and the prompts are read and encoded as at vpp 1."""
    (tmp_path / "p.jsonl").write_text('{"prompt": "hello world"}\n')
    cfg = config(tmp_path, ParallelConfig(pp=2, vpp=2), generate_interval=2, generate_prompts=str(tmp_path / "p.jsonl"))
    cfg = dataclasses.replace(cfg, data=DataConfig(tokenizer=tok_dirs["plain"]))
    state = prepare(cfg)
    assert state is not None and state.texts == ["hello world"] and len(state.prompt_ids[0]) > 1


def test_harness_scores_are_named_task_and_metric():
    results = {"results": {"arc": {"alias": "arc", "acc,none": 0.5, "acc_stderr,none": "N/A", "sample_len": 9}}}
    assert harness_scores(results) == {"harness/arc/acc": 0.5}
