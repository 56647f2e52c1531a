"""One line for each refusal of issue 29's section 4, with the exact input: a negative `--split`, a `--load` that
does not exist (unlike an empty directory), `threed verify` on a damaged checkpoint, a file or unwritable
`--tensorboard-dir` and `--wandb-project` without wandb (nothing left behind: no save directory, no lock),
`--zero-stage 0` with bf16, `threed plan --gpu-memory nan|inf`, plan filters that leave nothing, the launcher's
invalid values (the variable named, no usage dump) and a `DATA` path with spaces. Each row: exit 2, exactly one
error line matching the row, no traceback, no usage dump, and the sandbox unchanged (sizes and times)."""

from __future__ import annotations

import importlib.util
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import write_dataset
from test_bad_inputs import VENV_PY, run_cli, run_shell, snapshot

# `threed train` runs in this process (a world of one): conftest.py's own_process_group undoes it after each test.
pytestmark = pytest.mark.usefixtures("own_process_group")

TRAIN = ["train", "--model", "tiny", "--data-path", "{w}/data/corpus", "--seq-length", "32", "--steps", "2"]
CHECK = ["check-config", "--model", "tiny", "--seq-length", "32", "--world", "1", "--data-path", "{w}/data/corpus"]
PLAN = ["plan", "--model", "llama3.1-8b", "--nodes", "1", "--seq-length", "4096", "--global-batch-size", "64"]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """A dataset (also under a directory with a space), a plain file, an empty directory, a tiny HF model and its
    conversion with one layer file cut short, and stand-ins that stop the launcher before torchrun."""
    from threed.cli.main import main

    w = tmp_path_factory.mktemp("refusals")
    write_dataset(w / "data" / "corpus", np.random.default_rng(0).integers(0, 500, 20000), 512)
    (w / "my data").mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(w / "data" / f"corpus{suffix}", w / "my data" / f"corpus{suffix}")
    (w / "afile").write_text("not a directory\n")
    (w / "empty").mkdir()
    assert main(["make-tiny-hf", "--out", str(w / "hf"), "--like", "tiny"]) == 0
    argv = ["convert", "--hf", str(w / "hf"), "--tp", "1", "--pp", "1", "--out", str(w / "ckpt")]
    assert main(argv + ["--make-vocab-size-divisible-by", "32", "--quiet"]) == 0
    shutil.copytree(w / "ckpt", w / "swapped")
    layer = w / "ckpt" / "global_step0" / "layer_03-model_00-model_states.pt"
    layer.write_bytes(layer.read_bytes()[:100])  # a copy cut short
    steps = w / "swapped" / "global_step0"  # a block's file where the embedding's should be
    shutil.copy(steps / "layer_02-model_00-model_states.pt", steps / "layer_00-model_00-model_states.pt")
    bin_ = w / "bin"
    bin_.mkdir()
    stub = (
        f'case "$1 $2" in "-m torch.distributed.run"|"-m threed.parallel.launch") '
        f'echo "torchrun reached" >&2; exit 99;; esac\nexec "{VENV_PY}" "$@"'
    )
    (bin_ / "python").write_text("#!/bin/bash\n" + stub + "\n")
    (bin_ / "python").chmod(0o755)
    return w


NO_WANDB = importlib.util.find_spec("wandb") is not None
ROWS = [
    # --split with a negative part: argparse said "expected one argument"; now the split's own check
    ("split-negative", TRAIN + ["--split", "-5,105,0"], r"--split '-5,105,0' needs up to three non-negative numbers"),
    ("check-split-negative", CHECK + ["--paths", "--split", "-5,105,0"], r"--split '-5,105,0' needs up to three"),
    ("lr-exponent-negative", TRAIN + ["--lr", "-1e-4"], r"--lr must be >= 0, got -0.0001"),
    # --load: a path that does not exist is said so; an empty directory holds no checkpoint
    ("load-does-not-exist", TRAIN + ["--load", "{w}/nothing"], r"load=.*nothing does not exist; check the path"),
    ("load-empty-dir", TRAIN + ["--load", "{w}/empty"], r"load=.*empty holds no DeepSpeed checkpoint"),
    # threed verify on a damaged checkpoint: the file named, no per-rank tracebacks
    (
        "verify-damaged",
        ["verify", "--hf", "{w}/hf", "--ckpt", "{w}/ckpt"],
        r"cannot read .*ckpt/global_step0/layer_03-model_00-model_states\.pt: RuntimeError: .*\(truncated or corrupt\)",
    ),
    (
        "verify-layer-swapped",
        ["verify", "--hf", "{w}/hf", "--ckpt", "{w}/swapped"],
        r"swapped/global_step0/layer_00-model_00-model_states\.pt holds \[.*\], expected \['word_embeddings\.weight'\]",
    ),
    # --tensorboard-dir and --wandb-project: before the engine, nothing left behind (no --save directory made)
    (
        "tensorboard-dir-file",
        TRAIN + ["--tensorboard-dir", "{w}/afile", "--save", "{w}/newsave"],
        r"--tensorboard-dir .*afile is a file, not a directory; choose a directory .* or --tensorboard false",
    ),
    (
        "tensorboard-dir-under-file",
        TRAIN + ["--tensorboard-dir", "{w}/afile/tb", "--save", "{w}/newsave"],
        r"--tensorboard-dir .*afile/tb: .*afile is a file, not a directory",
    ),
    (
        "tensorboard-dir-unwritable",
        TRAIN + ["--tensorboard-dir", "/proc/threed-tb", "--save", "{w}/newsave"],
        r"--tensorboard-dir /proc/threed-tb(: /proc has no free space| is not writable)",
    ),
    (
        "check-tensorboard-dir-file",
        CHECK + ["--paths", "--tensorboard-dir", "{w}/afile"],
        r"--tensorboard-dir .*afile is a file, not a directory",
    ),
    # --zero-stage 0 with bf16: refused (DeepSpeed accumulates bf16 gradients in fp32 only under ZeRO 1)
    (
        "zero0-bf16",
        TRAIN + ["--zero-stage", "0", "--dtype", "bf16"],
        r"--zero-stage 0 with --dtype bf16 is not supported: .* --zero-stage 1 \(the default\), or --dtype fp32",
    ),
    ("check-zero0-bf16", CHECK + ["--zero-stage", "0"], r"--zero-stage 0 with --dtype bf16 is not supported"),
    # threed plan: non-finite sizes, and filters that leave nothing (the filters named by their real flags)
    ("plan-gpu-memory-nan", PLAN + ["--gpu-memory", "nan"], r"--gpu-memory must be a finite number, got nan"),
    ("plan-gpu-memory-inf", PLAN + ["--gpu-memory", "inf"], r"--gpu-memory must be a finite number, got inf"),
    (
        "plan-filter-tp",
        PLAN + ["--gpu-memory", "80", "--tp", "3"],
        r"with --tp 3 \(--global-batch-size 64 is fine without them\): --tp 3 alone leaves none\..* drop or "
        r"change --tp 3$",
    ),
    (
        "plan-filter-pair",
        PLAN + ["--gpu-memory", "80", "--pp", "1", "--pipeline-schedule", "zb-h1"],
        r"none together\. .*drop or change --pp 1 --pipeline-schedule zb-h1$",
    ),
    # --async-save with nothing to save into
    ("async-save-no-save", TRAIN + ["--async-save"], r"--async-save without --save: no checkpoint would be written"),
    ("check-async-save-no-save", CHECK + ["--async-save"], r"--async-save without --save: .* drop --async-save"),
    # --vpp (interleaved 1F1B): Megatron's rules, before any process group
    ("vpp-pp1", TRAIN + ["--vpp", "2"], r"--vpp 2 needs pp > 1 .*use --pipeline-model-parallel-size 2 or more$"),
    (
        "vpp-layers-per-stage",
        TRAIN + ["--pp", "2", "--num-layers-per-virtual-pipeline-stage", "3"],
        r"--num-layers-per-virtual-pipeline-stage 3: pp x N = 2 x 3 must divide the 4 blocks; use N = 1 or 2$",
    ),
    (
        "check-vpp-two-ways",
        CHECK + ["--world", "2", "--pp", "2", "--vpp", "2", "--num-layers-per-virtual-pipeline-stage", "2"],
        r"--num-layers-per-virtual-pipeline-stage 2 means --vpp 1 at pp 2 \(4 blocks\), not --vpp 2; give one of them$",
    ),
    (
        "check-vpp-zb-h1",
        CHECK + ["--world", "2", "--pp", "2", "--vpp", "2", "--pipeline-schedule", "zb-h1"],
        r"--vpp 2 with --pipeline-schedule zb-h1 is not built .*use --pipeline-schedule 1f1b, or --vpp 1$",
    ),
    (
        "check-vpp-blocks",
        CHECK + ["--world", "2", "--pp", "2", "--virtual-pipeline-model-parallel-size", "3"],
        r"--vpp 3 cuts the 4 blocks into pp x vpp = 6 virtual stages of equal blocks .* use --vpp 1 or 2$",
    ),
    (
        "check-vpp-gas",
        CHECK + ["--world", "2", "--pp", "2", "--vpp", "2", "--grad-accum-steps", "3"],
        r"--vpp 2: interleaved 1F1B runs the micro-batches in groups of pp = 2 .* 3 micro-batches per step is not",
    ),
    (
        "plan-filter-vpp",
        PLAN + ["--gpu-memory", "80", "--vpp", "3"],
        r"--vpp 3 alone leaves none\..* vpp > 1 1f1b with pp x vpp dividing the blocks .*change --vpp 3$",
    ),
    # the launcher's values: the variable named, no usage dump
    (
        "launch-schedule",
        ("launch", "recipes/tiny.sh", {"PIPELINE_SCHEDULE": "zb-h2"}, True),
        r"PIPELINE_SCHEDULE=zb-h2 is not one of 1f1b, zb-h1 \(it becomes --pipeline-schedule zb-h2\); fix "
        r"PIPELINE_SCHEDULE",
    ),
    (
        "launch-vpp",
        ("launch", "recipes/tiny.sh", {"VPP": "two"}, True),
        r"VPP=two is not a whole number \(it becomes --vpp two\); fix VPP",
    ),
    (
        "launch-recompute-layers",
        ("launch", "recipes/tiny.sh", {"RECOMPUTE_NUM_LAYERS": "abc"}, True),
        r"RECOMPUTE_NUM_LAYERS=abc is not a whole number",
    ),
    (
        "launch-data-spaces-blend",
        ("launch", "recipes/tiny.sh", {"DATA": "0.5 {w}/my data/corpus 0.5 {w}/data/corpus"}, True),
        r"DATA=.* holds a path with spaces inside a blend: .* link the data",
    ),
]
if NO_WANDB:
    ROWS.append(
        (
            "wandb-not-installed",
            TRAIN + ["--wandb-project", "p", "--save", "{w}/newsave"],
            r"wandb_project=p needs the wandb package, which is not installed",
        )
    )


@pytest.mark.parametrize("case,command,expected", ROWS, ids=[r[0] for r in ROWS])
def test_refused_in_one_line(world, case, command, expected, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    before = snapshot(world)
    rc, output = run_cli(world, command, capsys) if isinstance(command, list) else run_shell(world, command)
    assert rc == 2, f"{case}: exit status {rc}\n{output[-3000:]}"
    assert "Traceback" not in output and "usage:" not in output, f"{case}\n{output[-3000:]}"
    assert "reached" not in output, f"{case}: got past the checks\n{output[-2000:]}"
    errors = [line for line in output.splitlines() if re.search(r"\berror\b", line, re.I)]
    assert len(errors) == 1, f"{case}: expected one error line, got {errors}\n{output[-3000:]}"
    assert re.search(expected, errors[0]), f"{case}: {errors[0]!r} does not match {expected!r}"
    assert snapshot(world) == before, f"{case}: the sandbox changed"
    assert not (world / "newsave").exists()


def test_zero_stage_help_says_bf16_needs_stage_1():
    import argparse

    from threed.cli.flags import add_run_flags

    p = argparse.ArgumentParser()
    add_run_flags(p)
    help_text = " ".join(p.format_help().split())
    assert "1 shards the optimizer state over data parallel (bf16 needs it); 0 shards nothing and is fp32 only" in (
        help_text
    )


def test_a_data_path_with_spaces_works_in_the_launcher(world):
    """DATA naming one dataset whose path holds a space: passed as one word, checked by check-config --paths (the
    data, its index), and the run gets as far as torchrun (the stand-in)."""
    data = str(world / "my data" / "corpus")
    rc, out = run_shell(world, ("launch", "recipes/tiny.sh", {"DATA": data}, True))
    assert rc == 0, out
    assert f"--data-path {data.replace(' ', chr(92) + ' ')} " in out  # one word, quoted by printf %q
    env = {"DATA": data, "TP": "1", "PP": "1", "GPUS_PER_NODE": "1", "SAVE": str(world / "spaced-save")}
    rc, out = run_shell(world, ("launch", "recipes/tiny.sh", {**env, "TOKENIZER": ""}, False))
    assert rc == 99 and "torchrun reached" in out and "error" not in out.lower(), out
    assert not (world / "spaced-save").exists()


def test_the_dry_run_says_where_the_weights_come_from(world):
    rc, out = run_shell(world, ("launch", "recipes/tiny.sh", {"INIT_FROM": str(world / "ckpt")}, True))
    assert rc == 0, out
    assert f"start: weights from --init-from {world / 'ckpt'} (not read: --paths checks it)" in out
    assert "start: random init" not in out


def test_the_verify_ranks_failure_is_their_one_error_line():
    """When the ranks themselves fail (a file that loads but is not the layer it should be), the refusal is their
    last exception line (with its detail line), not each rank's traceback and torchrun's report."""
    from threed.verify.parity import ranks_error

    output = (
        "Traceback (most recent call last):\n"
        '[rank0]:   File "worker.py", line 3, in main\n'
        "[rank0]: RuntimeError: Error(s) in loading state_dict for EmbeddingPipe:\n"
        '[rank0]: \tMissing key(s) in state_dict: "word_embeddings.weight".\n'
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "threed.verify.worker FAILED\n"
    )
    assert ranks_error(output) == (
        'RuntimeError: Error(s) in loading state_dict for EmbeddingPipe: Missing key(s) in state_dict: "word_embeddings'
        '.weight".'
    )
    assert ranks_error("ranks ended\n") == "ranks ended"


@pytest.mark.parametrize(
    "flags,start",
    [
        ([], "start: random init;"),
        (["--load", "/nowhere/ck"], "start: resume from --load /nowhere/ck (not read: --paths checks it)"),
        (["--save", "/nowhere/ck"], "start: random init, or resume from --save /nowhere/ck if it holds a run"),
    ],
)
def test_check_config_without_paths_says_where_the_run_would_start(flags, start, capsys):
    from threed.cli.main import main

    assert main(["check-config", "--model", "tiny", "--world", "1", *flags]) == 0
    assert start in capsys.readouterr().out
