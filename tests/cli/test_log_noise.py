"""A run's log is ours (issue 19): the libraries' start-up and per-step chatter is dropped at its source
(threed.parallel.distributed: `quiet_libraries`, `library_prints`), so `make demo` needs no grep filter. Real warnings
and errors still print: each filter matches one expected message, not a logger or a category."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from helpers import SRC_ENV, START_UP_NOISE, learnable_tokens, write_dataset

# What a bf16 run at dp > 1 on a blend printed before: BF16_Optimizer's memory reports (rank 0), torch's
# FutureWarning from DeepSpeed's all-gather (every rank, twice), megatron-core's cache-path warning (data ranks).
NOISE = START_UP_NOISE + (
    "bf16_optimizer",
    "bf16_ optimizer",
    "initializing group",
    "Max_MA",
    "CPU Virtual Memory",
    "FutureWarning",
    "all_gather_into_tensor",
    "return func(*args, **kwargs)",
    "path_to_cache is None",
    "_load_legacy_checkpoint",
)
# The lines a training run prints: ours only (tools/demo.sh shows them unfiltered).
OURS = re.compile(r"^(threed|pipeline stages|metrics|step \d|validation at step|saved checkpoint)")


# ----------------------------------------------------------------------------------------- no ranks: fast


def test_deepspeed_memory_reports_are_dropped_and_other_prints_pass():
    from threed.parallel.distributed import library_prints

    out = io.StringIO()
    sys_stdout, sys.stdout = sys.stdout, out
    try:
        with library_prints():
            for line in (
                "begin bf16_optimizer",
                "MA 0.39 GB         Max_MA 0.39 GB         CA 0.39 GB         Max_CA 0 GB ",
                "CPU Virtual Memory:  used = 2.97 GB, percent = 12.6%",
                "before initializing group 0",
                "after initializing group 12",
                "end bf16_ optimizer",
                "_load_legacy_checkpoint current_rank_sd[BASE_OPTIMIZER_STATE]",  # every rank, every bf16 resume
                "a real line",
                "MA is not a memory report",
                "end bf16_optimizer and more",
            ):
                print(line)
    finally:
        sys.stdout = sys_stdout
    assert out.getvalue().splitlines() == ["a real line", "MA is not a memory report", "end bf16_optimizer and more"]


def test_megatron_cache_path_warning_is_dropped_and_its_other_warnings_pass():
    from threed.parallel.distributed import quiet_libraries

    quiet_libraries()  # run at the import of threed.parallel.distributed; again here, as it is idempotent
    # A handler on the loggers themselves: earlier tests may have changed megatron's propagation or levels, and the
    # filters under test sit on these loggers, before any handler.
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    names = ("megatron.core.datasets.blended_dataset", "megatron.core.datasets.gpt_dataset")
    loggers = [logging.getLogger(n) for n in names]
    saved = [(lg.level, lg.disabled) for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.WARNING)
        lg.disabled = False
    try:
        loggers[0].warning("Cannot save the BlendedDataset indexes because path_to_cache is None")
        loggers[0].warning("Building a BlendedDataset for a single MegatronDataset")
        loggers[1].warning("Unable to save GPTDataset indexes because path_to_cache is None")
    finally:
        for lg, (level, disabled) in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.setLevel(level)
            lg.disabled = disabled
    assert seen == ["Building a BlendedDataset for a single MegatronDataset"]


def test_only_the_all_gather_deprecation_is_ignored():
    from threed.parallel.distributed import quiet_libraries

    with warnings.catch_warnings(record=True) as caught:
        # pytest restores the warnings filters after each test: set ours again (at a rank's start, the import of
        # threed.parallel.distributed does), with "always" below them so that every other warning shows
        warnings.filterwarnings("always", category=FutureWarning)
        quiet_libraries()
        warnings.warn(
            "`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
            "`torch.distributed.all_gather_single` instead.",
            FutureWarning,
        )
        warnings.warn("`torch.something_else` is deprecated.", FutureWarning)
    assert [str(w.message) for w in caught] == ["`torch.something_else` is deprecated."]


def test_the_sequence_parallel_and_barrier_warnings_are_ignored_and_their_neighbours_pass():
    """--sequence-parallel: megatron-core's reduce-scatter warned per rank (a FutureWarning); on CUDA, torch's
    barrier() device warning (a UserWarning) at generate's and eval-harness's barriers (issue 39)."""
    from threed.parallel.distributed import quiet_libraries

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # below ours: every other warning shows
        quiet_libraries()
        warnings.warn(
            "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
            "`torch.distributed.reduce_scatter_single` instead.",
            FutureWarning,
        )
        warnings.warn(
            "barrier(): using the device under current context. You can specify `device_id` in "
            "`init_process_group` to mute this warning."
        )
        warnings.warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.")
        warnings.warn("`torch.distributed.reduce_scatter` is deprecated.", FutureWarning)
        warnings.warn("barrier() timed out")
    assert [str(w.message) for w in caught] == [
        "`torch.distributed.reduce_scatter` is deprecated.",
        "barrier() timed out",
    ]


def test_lm_evals_progress_bars_are_dropped_and_other_stderr_lines_pass():
    """--harness-interval: lm-eval's tqdm bars (one per task and stage) went into the training log (issue 39)."""
    from tqdm import tqdm

    from threed.parallel.distributed import library_bars

    err = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        with library_bars():
            for _ in tqdm(range(3), desc="Tokenizing inputs"):
                pass
            for _ in tqdm(range(1200)):
                pass
            print("a real warning | with bars | 3/4 in it", file=sys.stderr)
            print("100% sure", file=sys.stderr)
    finally:
        sys.stderr = sys_stderr
    assert err.getvalue().splitlines() == ["a real warning | with bars | 3/4 in it", "100% sure"]


@pytest.mark.parametrize(
    "imports",
    [
        "from threed.generate.prompts import check_checkpoint; from threed.generate.run import run_generate",
        "from threed.harness.run import HarnessRequest, run_harness",
    ],
    ids=["generate", "eval-harness"],
)
def test_the_generate_and_harness_ranks_import_without_library_warnings(imports):
    """A rank of `threed generate` / `threed eval-harness` imports the CLI, then its command's code (megatron-core,
    DeepSpeed, lm-eval): megatron-core's four "Transformer Engine and Apex" warnings per rank stay out (issue 39)."""
    out = subprocess.run(
        [sys.executable, "-c", f"import threed.cli.main; {imports}"],
        env={**os.environ, **SRC_ENV, "THREED_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    noise = [line for line in (out.stdout + out.stderr).splitlines() if any(n in line for n in NOISE)]
    assert not noise, "\n".join(noise)


# ---------------------------------------------------------------------------------------------- 2 ranks


def bf16_blend_run(tmp_path: Path, steps: int) -> subprocess.CompletedProcess[str]:
    """tp1 pp1 dp2 bf16 on a 2-source blend with validation, through `threed train --nproc-per-node 2`, saving to
    tmp_path/ckpt (a second call resumes there)."""
    a = write_dataset(tmp_path / "a", learnable_tokens(20_000, seed=1), 512, seed=1)
    b = write_dataset(tmp_path / "b", learnable_tokens(20_000, seed=2), 512, seed=2)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "threed.cli",
            "train",
            "--nproc-per-node",
            "2",
            "--model",
            "tiny",
            "--seq-length",
            "64",
            "--steps",
            str(steps),
            "--micro-batch-size",
            "2",
            "--grad-accum-steps",
            "2",
            "--dtype",
            "bf16",
            "--data-path",
            "0.3",
            a,
            "0.7",
            b,
            "--split",
            "95,5,0",
            "--eval-interval",
            "2",
            "--eval-iters",
            "1",
            "--save",
            str(tmp_path / "ckpt"),
            "--log-interval",
            "1",
        ],
        env={**os.environ, **SRC_ENV, "THREED_DEVICE": "cpu", "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )


def only_ours(out: subprocess.CompletedProcess[str]) -> str:
    both = out.stdout + out.stderr
    assert out.returncode == 0, both[-4000:]
    noise = [line for line in both.splitlines() if any(n in line for n in NOISE)]
    assert not noise, "\n".join(noise)
    assert "Traceback" not in both
    theirs = [line for line in both.splitlines() if line.strip() and not OURS.match(line)]
    assert not theirs, "lines that are not threed's:\n" + "\n".join(theirs)
    return both


@pytest.mark.slow  # a 2-rank bf16 run (~30 s); the filters themselves are tested above
def test_a_two_rank_bf16_run_on_a_blend_prints_only_our_lines(tmp_path: Path):
    """tp1 pp1 dp2 bf16 (BF16_Optimizer and its DP all-gather), a 2-source blend with validation (megatron's
    BlendedDataset): stdout and stderr hold our lines and nothing else."""
    out = bf16_blend_run(tmp_path, 3)
    both = only_ours(out)
    assert re.search(r"^step 3/3 ", out.stdout, re.M) and "validation at step 2" in out.stdout, both


@pytest.mark.slow
def test_a_bf16_resume_prints_only_our_lines(tmp_path: Path):
    """Each bf16 resume printed BF16_Optimizer's `_load_legacy_checkpoint ...` once per rank, before threed's lines
    (issue 29)."""
    only_ours(bf16_blend_run(tmp_path, 2))
    out = bf16_blend_run(tmp_path, 3)
    both = only_ours(out)
    assert "resumed from" in out.stdout and re.search(r"^step 3/3 ", out.stdout, re.M), both
