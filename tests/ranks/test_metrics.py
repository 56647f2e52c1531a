"""Metrics: metrics.jsonl and TensorBoard after a 3-step tp2 pp2 dp2 run (8 gloo ranks), per-stage idle fractions
against the bubble and the wall clock (2 ranks, pp2, gas 2 and 16), `threed report`, and `--partition-method`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from helpers import BENCH, RANKS
from threed.cli.main import main as cli_main
from threed.config import ConfigError, MetricsConfig, ModelConfig, RunConfig

MEGATRON_NAMES = (
    "lm loss",
    "learning-rate",
    "grad-norm",
    "iteration-time",
    "batch-size",
    "tokens-per-sec",
    "throughput",
    "mem-allocated-bytes",
    "mem-max-allocated-bytes",
)
STAGE_NAMES = ("compute-time", "p2p-wait-time", "idle-fraction", "mem-max-allocated-bytes")
# How far the idle fraction (p2p wait / (compute + p2p wait)) may lie from the wall-clock split
# 1 - compute / (wall time of train_batch measured by the worker - gradient reduction - optimizer - loss sync), per
# stage: what the instruction timers do not see is DeepSpeed's schedule bookkeeping (and, on a loaded machine, time
# descheduled between instructions). Measured: <= 0.01 at a load average of 7-11 on 2 cores, 0.03 at 30; 0.063 once
# with a pytest-xdist worker's tests on the other core (2026-11-29), hence the `alone` mark: these run by themselves.
WALL_CLOCK_TOL = 0.05
GLOBAL_BATCH, SEQ = 8, 32  # metrics_worker.train: micro 2 x gas 2 x dp 2, seq 32


@pytest.fixture(scope="module")
def train_run(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("metrics")
    rank_pool.run(8, str(RANKS / "metrics_worker.py"), ["train", "--out", str(out)], timeout=900)
    ranks = [json.loads((out / f"train_rank{r}.json").read_text()) for r in range(8)]
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return {"dir": out / "run", "ranks": ranks, "records": records}


@pytest.fixture(scope="module")
def bubble_run(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("bubble")
    rank_pool.run(2, str(RANKS / "metrics_worker.py"), ["bubble", "--out", str(out)], timeout=900)
    return [json.loads((out / f"bubble_rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def zb_timing_run(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("zb_timing")
    rank_pool.run(2, str(RANKS / "metrics_worker.py"), ["zb_timing", "--out", str(out)], timeout=900)
    return [json.loads((out / f"zb_timing_rank{r}.json").read_text()) for r in range(2)]


def train_records(run):
    return [r for r in run["records"] if "lm loss" in r]


def test_jsonl_has_one_record_per_step_with_megatron_names(train_run):
    records = train_records(train_run)
    assert [r["iteration"] for r in records] == [1, 2, 3]
    writer = train_run["ranks"][4]
    assert [r["lm loss"] for r in records] == writer["logged"]
    for r in records:
        missing = [n for n in MEGATRON_NAMES if n not in r]
        assert not missing, f"step {r['iteration']} lacks {missing}"
        assert r["samples"] == r["iteration"] * GLOBAL_BATCH and r["tokens"] == r["samples"] * SEQ
        assert r["batch-size"] == GLOBAL_BATCH
        assert 50e6 < r["mem-max-allocated-bytes"] < 8e9, "CPU memory is the process's resident high-water mark"
    assert records[0]["learning-rate"] == pytest.approx(1e-3)  # warmup 1: full lr at step 1, cosine after
    valid = [r for r in train_run["records"] if "lm loss validation" in r]
    assert len(valid) == 1 and valid[0]["iteration"] == 3
    assert valid[0]["lm loss validation ppl"] == pytest.approx(np.exp(valid[0]["lm loss validation"]))
    assert {"lm loss validation/web", "lm loss validation/code"} <= valid[0].keys()
    summary = json.loads((train_run["dir"] / "run_config.json").read_text())
    assert (summary["tp"], summary["pp"], summary["dp"], summary["world_size"]) == (2, 2, 2, 8)
    assert summary["config"]["train"]["steps"] == 3 and summary["deepspeed_config"]["train_batch_size"] == 8


def test_only_last_stage_tp0_dp0_writes(train_run):
    # Rank order (pipe, data, model): rank 4 is pipe 1 (last), data 0, model 0.
    assert [r["writer"] for r in train_run["ranks"]] == [r == 4 for r in range(8)]


def test_per_stage_records_name_both_stages(train_run):
    for r in train_records(train_run):
        for stage in (0, 1):
            for name in STAGE_NAMES:
                assert f"stage{stage}/{name}" in r, f"step {r['iteration']} lacks stage{stage}/{name}"
            assert 0.0 <= r[f"stage{stage}/idle-fraction"] < 1.0
            assert r[f"stage{stage}/compute-time"] > 0
        assert r["pipeline/ideal-bubble"] == pytest.approx(1 / 3)  # pp 2, gas 2


def test_tensorboard_holds_the_same_values(train_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(train_run["dir"] / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    records = train_records(train_run)
    for name in (*MEGATRON_NAMES, "stage0/idle-fraction", "stage1/idle-fraction"):
        events = acc.Scalars(name)
        assert [e.step for e in events] == [r["iteration"] for r in records], name
        # TensorBoard stores float32.
        assert [e.value for e in events] == [float(np.float32(r[name])) for r in records], name
    assert [e.step for e in acc.Scalars("lm loss vs samples")] == [r["samples"] for r in records]
    assert [e.step for e in acc.Scalars("lm loss vs tokens")] == [r["tokens"] for r in records]
    assert {"lm loss validation", "lm loss validation ppl", "lm loss validation/web"} <= tags
    assert "config/text_summary" in acc.Tags()["tensors"], "the run config is written as TensorBoard text"


def test_logging_on_or_off_gives_bit_identical_losses(train_run):
    for rank, r in enumerate(train_run["ranks"]):
        assert r["logged"] == r["plain"], f"rank {rank}: {r['logged']} with metrics vs {r['plain']} without"


def bubble_idle(run: list[dict], gas: str) -> float:
    """The pipeline's idle fraction at `gas`, summed over its two stages (rank 1, the last stage, writes them)."""
    return sum(run[1][gas]["record"][f"stage{s}/idle-fraction"] for s in (0, 1))


@pytest.mark.slow
@pytest.mark.alone  # a clock: run with nothing beside it (Makefile)
def test_idle_fraction_falls_with_more_micro_batches(bubble_run, tmp_path_factory, rank_pool):
    """The pipeline's idle fraction (summed over its stages) falls with more micro-batches. On a shared 2-core
    machine another process can stall a rank and swamp the difference (seen in clean-clone runs, 2026-11-25 and
    -26), and such noise only ever adds waiting. So the bubble run is run three times and each micro-batch
    count is judged by its least disturbed run (the minimum, as timeit does); an idle fraction that does not
    fall still fails every run. The agreement with the wall clock below stays in `make test`."""
    runs = [bubble_run]
    for k in range(2):
        out = tmp_path_factory.mktemp(f"bubble_again{k}")
        rank_pool.run(2, str(RANKS / "metrics_worker.py"), ["bubble", "--out", str(out)], timeout=900)
        runs.append([json.loads((out / f"bubble_rank{r}.json").read_text()) for r in range(2)])
    idle = {gas: [round(bubble_idle(run, gas), 3) for run in runs] for gas in ("gas2", "gas16")}
    print(f"idle summed over both stages, per run: {idle} (ideal: gas2 0.667, gas16 0.118)")
    assert min(idle["gas2"]) > min(idle["gas16"]), idle


@pytest.mark.alone  # a clock: run with nothing beside it (Makefile)
def test_idle_fraction_tracks_the_wall_clock(bubble_run):
    writer = bubble_run[1]  # pp2, tp1, dp1: rank 1 is the last stage
    for stage in (0, 1):
        for gas in ("gas2", "gas16"):
            rec = writer[gas]["record"]
            wall = bubble_run[stage][gas]["wall_per_step"]
            pipelined = wall - sum(rec[f"stage{stage}/{k}-time"] for k in ("dp-reduce", "optimizer", "loss-sync"))
            split = 1 - rec[f"stage{stage}/compute-time"] / pipelined
            print(f"  stage {stage} {gas}: idle {rec[f'stage{stage}/idle-fraction']:.3f}, wall-clock split {split:.3f}")
            assert abs(rec[f"stage{stage}/idle-fraction"] - split) < WALL_CLOCK_TOL


def test_report_writes_plots_and_summary(train_run, tmp_path, capsys):
    assert cli_main(["report", str(train_run["dir"]), "--out", str(tmp_path / "one")]) == 0
    out = capsys.readouterr().out
    assert "lm loss" in out and "stage 1: idle" in out and "validation at step 3" in out
    pngs = sorted(p.name for p in (tmp_path / "one").glob("*.png"))
    assert pngs == sorted(["loss.png", "learning_rate.png", "throughput.png", "memory.png", "idle.png"])
    assert all((tmp_path / "one" / p).stat().st_size > 5000 for p in pngs)
    other = tmp_path / "other"
    shutil.copytree(train_run["dir"], other, ignore=shutil.ignore_patterns("tensorboard"))
    assert cli_main(["report", str(train_run["dir"]), str(other), "--out", str(tmp_path / "two")]) == 0
    assert len(list((tmp_path / "two").glob("*.png"))) == 5


@pytest.mark.parametrize("setup", ["missing", "no_file", "empty", "garbage"])
def test_report_bad_input_is_one_line_and_exit_2(tmp_path, capsys, setup):
    run = tmp_path / "run"
    if setup != "missing":
        run.mkdir()
    if setup == "empty":
        (run / "metrics.jsonl").write_text("")
    if setup == "garbage":
        (run / "metrics.jsonl").write_text('{not json\n{"iteration": 1}\n')
    assert cli_main(["report", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("threed report: error:") and "\n" not in err, err


def test_wandb_asked_for_but_missing_is_a_config_error():
    import importlib.util

    from threed.metrics.sinks import check_metrics_config
    from threed.convert.resolve import model_config

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    cfg = RunConfig(model=model_config("tiny"), metrics=MetricsConfig(wandb_project="p"))
    with pytest.raises(ConfigError, match="pip install wandb"):
        check_metrics_config(cfg.metrics)


def test_partition_methods():
    from threed.parallel.partition import resolve_partition

    # The LM head (6·h·V = 1.3 blocks here) sits on the last stage: balanced moves a block off it; the old default
    # spreads the blocks evenly.
    assert resolve_partition("balanced", BENCH, 2, 128) == [0, 6, 11]
    assert resolve_partition("type:LlamaBlock", BENCH, 2, 128) == [0, 5, 11]
    assert resolve_partition("layers:3,5", BENCH, 2, 128) == [0, 4, 11]
    assert resolve_partition("layers:2,2,2,2", BENCH, 4, 128) == [0, 3, 5, 7, 11]
    # Every stage keeps a block even when the head outweighs several blocks.
    huge_vocab = ModelConfig(**{**BENCH.__dict__, "vocab_size": 200000})
    bounds = resolve_partition("balanced", huge_vocab, 4, 128)
    assert all(a <= 8 and b >= 2 for a, b in zip(bounds, bounds[1:])), bounds  # blocks are layers 1..8
    for bad in ("layers:4,3", "layers:8,0", "layers:a,b", "layers:4,2,2", "nope", "type:Nothing", "type:("):
        with pytest.raises(ConfigError):
            resolve_partition(bad, BENCH, 2, 128)


def test_jsonl_on_resume_drops_the_steps_after_the_checkpoint(tmp_path):
    from threed.metrics.sinks import JsonlSink

    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path, start_iteration=0)
    for it in (1, 2, 3):
        sink.write({"iteration": it, "samples": it, "tokens": it, "time": 0.0, "lm loss": float("nan")})
    sink.close()
    with path.open("a") as f:
        f.write('{"iteration": 4, "sam')  # a line cut off by a crash
    sink = JsonlSink(path, start_iteration=2)  # resumed from the checkpoint of step 2
    sink.write({"iteration": 3, "samples": 3, "tokens": 3, "time": 0.0, "lm loss": 1.0})
    sink.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["iteration"], r["lm loss"]) for r in records] == [(1, None), (2, None), (3, 1.0)]


def test_stage_timing_makes_no_zb_h1_send_wait(zb_timing_run):
    """On CUDA the stage timer used to synchronize the whole device around every instruction, which also waits for
    NCCL's send kernels: ZB-H1's sends, which do not wait for their receiver, blocked again whenever timing was on
    (the default). Counted on CPU with torch.cuda's timing calls faked (a device-wide synchronize waits for, and
    counts, the sends in flight): with the timer on, a ZB-H1 step has its timing wrappers wait for no more sends
    than with it off; the old device-wide synchronize, as a control, waits for some on every rank."""
    for rank, r in enumerate(zb_timing_run):
        assert r["class"] == "ZeroBubbleEngine"
        assert r["stream_clock"]["sends_waited"] <= r["off"]["sends_waited"] == 0, f"rank {rank}"
        assert r["device_wide"]["sends_waited"] > 0, f"rank {rank}: the counter sees a device-wide synchronize"
        totals = r["stream_clock"]["totals"]
        assert totals["compute"] > 0 and totals["iteration"] >= totals["compute"] + totals["p2p"], f"rank {rank}"


def test_the_clock_follows_the_device() -> None:
    """CUDA: events on the compute stream (no device-wide synchronize); CPU: the host clock, as before."""
    import torch

    from threed.metrics.stages import HostClock, StreamClock, clock_for

    assert isinstance(clock_for(torch.device("cuda", 0)), StreamClock)
    assert isinstance(clock_for(torch.device("cpu")), HostClock)


def test_peak_memory_window_starts_on_every_rank(zb_timing_run):
    """DeepSpeed's BF16_Optimizer resets the peak-memory counters on rank 0 alone; build_engine resets them on
    every rank once the engine is built, so every stage's peak covers the same window."""
    assert [r["peak_resets"] for r in zb_timing_run] == [["cpu"], ["cpu"]]
