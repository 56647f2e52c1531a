"""A table of bad inputs across the commands a user types: `threed train` (in process, a world of one),
`threed check-config` (the launcher's Python validation), convert / export / reshard / verify, preprocess,
make-tiny-hf, recipes/launch.sh and the slurm/ scripts (with stand-in scontrol / squeue / srun). Each must exit
non-zero with exactly one error line that names the fix (a regex), print no traceback, start no rank, and leave
every file it was given exactly as it was (sizes and modification times of the whole sandbox compared)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, fake_checkpoint, sft_examples, write_dataset, write_sft_dataset

VENV_PY = Path(os.environ.get("THREED_TEST_PYTHON", REPO / ".venv" / "bin" / "python"))
TRAIN = ["train", "--model", "tiny", "--data-path", "{w}/data/corpus", "--seq-length", "32", "--steps", "2"]
SFT = TRAIN[:4] + ["{w}/sft/chat_text_document", "--pack", "true"] + TRAIN[5:]
CHECK = ["check-config", "--model", "tiny", "--seq-length", "32", "--steps", "2"]


# `threed train` runs in this process (a world of one): conftest.py's own_process_group undoes it after each test.
pytestmark = pytest.mark.usefixtures("own_process_group")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The sandbox: a dataset, a tiny HF model and its conversions at tp1 and tp2, a trained-looking run, a run
    whose newest files are gone, a plain file, recipes with typos, and stand-ins for Slurm and torchrun."""
    from threed.cli.main import main

    w = tmp_path_factory.mktemp("bad_inputs")
    write_dataset(w / "data" / "corpus", np.random.default_rng(0).integers(0, 500, 20000), 512)
    for suffix in (".bin", ".idx"):
        shutil.copy(w / "data" / f"corpus{suffix}", w / "data" / f"pre_text_document{suffix}")
    (w / "docs.jsonl").write_text('{"text": "hello world"}\n')
    examples = sft_examples(200, 512, length=(6, 30))
    write_sft_dataset(w / "sft" / "chat", examples, 512)
    write_sft_dataset(w / "sft" / "nomask", examples, 512)
    (w / "sft" / "nomask_mask_document.bin").unlink()
    write_sft_dataset(w / "sft" / "mismatch", examples[:-1] + [(examples[-1][0], examples[-1][1][:-1])], 512)
    assert main(["make-tiny-hf", "--out", str(w / "hf"), "--like", "tiny"]) == 0
    for tp in (1, 2):
        assert (
            main(
                [
                    "convert",
                    "--hf",
                    str(w / "hf"),
                    "--tp",
                    str(tp),
                    "--pp",
                    "1",
                    "--out",
                    str(w / f"ckpt{tp}"),
                    "--make-vocab-size-divisible-by",
                    "32",
                    "--quiet",
                ]
            )
            == 0
        )
    fake_checkpoint(w / "run", 4, tp=1, pp=1, dp=1)
    broken = fake_checkpoint(w / "broken", 4, tp=1, pp=1, dp=1)
    (broken / "mp_rank_00_model_states.pt").unlink()
    (w / "afile").write_text("not a directory\n")
    tiny = (REPO / "recipes" / "tiny.sh").read_text()
    (w / "typo.sh").write_text(tiny + "SAVE_INTERVL=${SAVE_INTERVL-5}\n")
    (w / "typo2.sh").write_text(tiny.replace("MICRO=${MICRO-4}", "MICR0=${MICR0-4}"))
    bin_ = w / "bin"
    bin_.mkdir()
    stubs = {
        "scontrol": 'if [ "$1 $2" = "show hostnames" ]; then echo localhost; fi',
        "squeue": "echo 1:00:00",
        "srun": 'echo "srun reached: the checks did not stop the job" >&2; exit 99',
        # torchrun must never start: the checks in front of it have to catch every case of the table.
        "python": (
            f'case "$1 $2" in "-m torch.distributed.run"|"-m threed.parallel.launch") '
            f'echo "torchrun reached" >&2; exit 99;; esac\n'
            f'exec "{VENV_PY}" "$@"'
        ),
    }
    for name, body in stubs.items():
        (bin_ / name).write_text("#!/bin/bash\n" + body + "\n")
        (bin_ / name).chmod(0o755)
    return w


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return out


# (id, command, expected: a regex on the one error line). Commands: a list for `threed` in process, or
# ("launch", recipe, env, dry) / ("slurm", script, args, env) for the shell scripts.
CLI = [
    # --- threed train: ranges (every numeric flag)
    ("train-steps-negative", TRAIN + ["--steps", "-5"], r"--steps must be >= 0, got -5"),
    ("train-save-interval-negative", TRAIN + ["--save-interval", "-1"], r"--save-interval must be >= 0"),
    ("train-micro-zero", TRAIN + ["--micro-batch-size", "0"], r"--micro-batch-size must be >= 1"),
    ("train-lr-negative", TRAIN + ["--lr", "-0.1"], r"--lr must be >= 0"),
    ("train-lr-nan", TRAIN + ["--lr", "nan"], r"--lr must be a finite number"),
    ("train-beta2-above-one", TRAIN + ["--beta2", "1.5"], r"--beta2 must be in \[0, 1\)"),
    ("train-min-lr-above-lr", TRAIN + ["--lr", "1e-4", "--min-lr", "1e-3"], r"--min-lr 0.001 is above --lr .* use"),
    ("train-keep-last-negative", TRAIN + ["--keep-last", "-1"], r"--keep-last must be >= 0"),
    ("train-skip-nonfinite-negative", TRAIN + ["--skip-nonfinite", "-2"], r"--skip-nonfinite must be >= 0"),
    ("train-exit-duration-negative", TRAIN + ["--exit-duration-in-mins", "-1"], r"--exit-duration-in-mins must be"),
    ("train-dist-timeout-zero", TRAIN + ["--dist-timeout-minutes", "0"], r"--dist-timeout-minutes must be > 0"),
    ("train-watchdog-negative", TRAIN + ["--watchdog-factor", "-1"], r"--watchdog-factor must be >= 0"),
    ("train-warmup-negative", TRAIN + ["--warmup-steps", "-1"], r"--warmup-steps must be >= 0"),
    ("train-grad-clip-negative", TRAIN + ["--grad-clip", "-1"], r"--grad-clip must be >= 0"),
    ("train-log-interval-zero", TRAIN + ["--log-interval", "0"], r"--log-interval must be >= 1"),
    ("train-adam-eps-zero", TRAIN + ["--adam-eps", "0"], r"--adam-eps must be > 0"),
    # --- threed train: flags argparse refuses
    ("train-dtype-choice", TRAIN + ["--dtype", "fp16"], r"argument --dtype: invalid choice: 'fp16' \(choose from"),
    ("train-steps-not-int", TRAIN + ["--steps", "abc"], r"argument --steps(/--train-iters)?: invalid int value: 'abc'"),
    ("train-bool", TRAIN + ["--auto-resume", "maybe"], r"argument --auto-resume: expected true/false"),
    # --- threed train: model, layout, batch arithmetic
    ("train-unknown-model", ["train", "--model", "nosuch"] + TRAIN[3:], r"unknown model 'nosuch': use one of"),
    ("train-tp-vs-world", TRAIN + ["--tp", "2"], r"world size 1 is not divisible by tp\*pp\*cp .* launch a multiple"),
    ("train-seq-too-long", TRAIN + ["--seq-length", "100000"], r"seq_length 100000 exceeds max_position_embeddings"),
    ("train-zero-stage", TRAIN + ["--zero-stage", "2"], r"zero_stage 2 is not allowed: .* ZeRO 0 or 1"),
    ("train-sequence-parallel-tp1", TRAIN + ["--sequence-parallel"], r"--sequence-parallel needs tp > 1"),
    ("train-zb-h1-pp1", TRAIN + ["--pipeline-schedule", "zb-h1"], r"--pipeline-schedule zb-h1 needs pp > 1"),
    (
        "check-schedule-choice",
        CHECK + ["--pipeline-schedule", "dualpipev"],
        r"argument --pipeline-schedule: invalid choice: 'dualpipev' \(choose from",
    ),
    (
        "check-sequence-parallel-seq",
        CHECK + ["--world", "2", "--tp", "2", "--sequence-parallel", "true", "--seq-length", "31"],
        r"seq_length 31 is not a multiple of 2; use a multiple of 2",
    ),
    (
        "train-recompute-selective-layers",
        TRAIN + ["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
        r"selective recomputes the core attention .* drop them",
    ),
    (
        "train-recompute-full-no-method",
        TRAIN + ["--recompute-granularity", "full"],
        r"full needs --recompute-method uniform\|block and --recompute-num-layers N",
    ),
    (
        "train-recompute-and-act-ckpt",
        TRAIN + ["--activation-checkpointing", "--recompute-granularity", "selective"],
        r"--activation-checkpointing is --recompute-granularity full .* not both",
    ),
    (
        "train-global-batch",
        TRAIN + ["--micro-batch-size", "2", "--global-batch-size", "3"],
        r"global_batch_size 3 is not divisible by micro_batch_size x dp",
    ),
    (
        "train-gas-global-disagree",
        TRAIN + ["--grad-accum-steps", "2", "--global-batch-size", "3"],
        r"must equal micro x gas x dp",
    ),
    ("train-data-missing", TRAIN[:4] + ["{w}/nothing"] + TRAIN[5:], r"nothing\.(idx|bin).* not found"),
    # --- threed train: SFT data (threed preprocess --sft pairs), refused before the model is built
    ("train-pack-pretraining", TRAIN + ["--pack", "true"], r"--pack true needs SFT data .* drop --pack"),
    (
        "train-sft-mixed",
        TRAIN[:4] + ["0.5", "{w}/sft/chat_text_document", "0.5", "{w}/data/corpus"] + TRAIN[5:],
        r"mixes SFT datasets .* separate runs",
    ),
    (
        "train-sft-too-long",
        SFT + ["--seq-length", "8"],
        r"example \d+ has \d+ tokens, more than one sample of seq_length 8 \+ 1 holds; re-run .*--drop-long",
    ),
    (
        "train-sft-mask-bin-missing",
        TRAIN[:4] + ["{w}/sft/nomask_text_document"] + TRAIN[5:],
        r"nomask_mask_document\.bin not found; re-make both with `threed preprocess --sft`",
    ),
    (
        "train-sft-mask-mismatch",
        TRAIN[:4] + ["{w}/sft/mismatch_text_document"] + TRAIN[5:],
        r"loss mask .* describes other examples",
    ),
    ("train-sft-eod-mask", SFT + ["--eod-mask-loss", "true"], r"SFT data carries its own loss mask .* drop"),
    ("train-sft-empty-valid", SFT + ["--split", "999,1,0"], r"valid split .* holds no example"),
    # --- threed train: checkpoints (refused before datasets or the model are built)
    (
        "train-load-and-init",
        TRAIN + ["--load", "{w}/ckpt1", "--init-from", "{w}/ckpt1"],
        r"either load \(full resume\) or init_from",
    ),
    ("train-load-missing", TRAIN + ["--load", "{w}/nothing"], r"load=.*nothing does not exist; check the path"),
    ("train-load-is-file", TRAIN + ["--load", "{w}/afile"], r"load=.*afile holds no DeepSpeed checkpoint"),
    ("train-init-missing", TRAIN + ["--init-from", "{w}/nothing"], r"init_from=.*nothing does not exist"),
    ("train-load-converted", TRAIN + ["--load", "{w}/ckpt1"], r"converted checkpoint .* use it with\s+--init-from"),
    (
        "train-auto-resume-false-on-run",
        TRAIN + ["--save", "{w}/run", "--auto-resume", "false"],
        r"already holds a checkpoint .* --overwrite true",
    ),
    (
        "train-broken-run",
        TRAIN + ["--save", "{w}/broken"],
        r"holds no complete checkpoint .*mp_rank_00_model_states.pt is missing.* --overwrite true",
    ),
    ("train-save-is-file", TRAIN + ["--save", "{w}/afile"], r"--save .*afile is a file, not a directory"),
    ("train-save-under-file", TRAIN + ["--save", "{w}/afile/ck"], r"afile is a file, not a directory; choose"),
    (
        "train-save-unwritable",
        TRAIN + ["--save", "/proc/threed-ckpt"],
        r"--save /proc/threed-ckpt (is not writable|has 0.0 B free; .* choose --save)",
    ),
    (
        "train-run-of-another-model",
        ["train", "--model", "tiny-tp8"] + TRAIN[3:] + ["--save", "{w}/run"],
        r"holds another model .* pass --model",
    ),
    # --- threed check-config (what the launcher runs): layouts at a world size
    ("check-world-zero", CHECK + ["--world", "0"], r"--world must be >= 1"),
    ("check-tp-heads", CHECK + ["--world", "6", "--tp", "3"], r"tp=3 does not divide num_heads=4"),
    ("check-pp-layers", CHECK + ["--world", "8", "--pp", "8"], r"pp=8 is larger than num_layers=4"),
    ("check-world-layout", CHECK + ["--world", "6", "--tp", "2", "--pp", "2"], r"world size 6 is not divisible"),
    ("check-seq", CHECK + ["--world", "1", "--seq-length", "9999"], r"exceeds max_position_embeddings 256"),
    (
        "check-paths-run",
        CHECK
        + ["--world", "1", "--paths", "--data-path", "{w}/data/corpus", "--save", "{w}/run", "--auto-resume", "false"],
        r"--overwrite true",
    ),
    # --- convert / export / reshard / verify
    (
        "convert-hf-missing",
        ["convert", "--hf", "{w}/nothing", "--tp", "1", "--pp", "1", "--out", "{w}/o"],
        r"no HF config at .*nothing: pass a HF model directory",
    ),
    (
        "convert-tp-zero",
        ["convert", "--hf", "{w}/hf", "--tp", "0", "--pp", "1", "--out", "{w}/o"],
        r"tp=0, pp=1 and cp=1 must all be >= 1",
    ),
    (
        "convert-tp-heads",
        ["convert", "--hf", "{w}/hf", "--tp", "3", "--pp", "1", "--out", "{w}/o"],
        r"tp=3 does not divide num_heads=4",
    ),
    (
        "convert-pp-layers",
        ["convert", "--hf", "{w}/hf", "--tp", "1", "--pp", "9", "--out", "{w}/o"],
        r"pp=9 is larger than num_layers=4",
    ),
    (
        "convert-out-exists",
        ["convert", "--hf", "{w}/hf", "--tp", "1", "--pp", "1", "--out", "{w}/ckpt1"],
        r"already exists; choose a new --out or pass --force",
    ),
    (
        "convert-dtype",
        ["convert", "--hf", "{w}/hf", "--tp", "1", "--pp", "1", "--out", "{w}/o", "--dtype", "fp8"],
        r"argument --dtype: invalid choice: 'fp8'",
    ),
    (
        "export-ckpt-missing",
        ["export", "--ckpt", "{w}/nothing", "--out", "{w}/o"],
        r"nothing holds no DeepSpeed checkpoint",
    ),
    ("export-out-exists", ["export", "--ckpt", "{w}/ckpt1", "--out", "{w}/ckpt2"], r"already exists; choose a new"),
    ("export-model-unknown", ["export", "--ckpt", "{w}/run", "--out", "{w}/o"], r"the model config is unknown"),
    (
        "reshard-tp-heads",
        ["reshard", "--ckpt", "{w}/ckpt1", "--tp", "3", "--pp", "1", "--out", "{w}/o"],
        r"tp=3 does not divide num_heads=4",
    ),
    (
        "reshard-tp-zero",
        ["reshard", "--ckpt", "{w}/ckpt1", "--tp", "0", "--pp", "1", "--out", "{w}/o"],
        r"must all be >= 1",
    ),
    (
        "reshard-ckpt-missing",
        ["reshard", "--ckpt", "{w}/nothing", "--tp", "1", "--pp", "1", "--out", "{w}/o"],
        r"holds no DeepSpeed checkpoint",
    ),
    (
        "reshard-out-exists",
        ["reshard", "--ckpt", "{w}/ckpt1", "--tp", "2", "--pp", "1", "--out", "{w}/ckpt2"],
        r"already exists",
    ),
    ("verify-hf-missing", ["verify", "--hf", "{w}/nothing", "--ckpt", "{w}/ckpt1"], r"no HF config at"),
    ("verify-ckpt-missing", ["verify", "--hf", "{w}/hf", "--ckpt", "{w}/nothing"], r"holds no DeepSpeed checkpoint"),
    # --- preprocess / make-tiny-hf
    (
        "preprocess-input-missing",
        ["preprocess", "--input", "{w}/nothing.jsonl", "--output-prefix", "{w}/p", "--tokenizer", "{w}/hf"],
        r"input not found: .*nothing.jsonl; check the --input",
    ),
    (
        "preprocess-format",
        ["preprocess", "--input", "{w}/afile", "--output-prefix", "{w}/p", "--tokenizer", "{w}/hf"],
        r"cannot tell the format .* --input-format",
    ),
    (
        "preprocess-workers",
        [
            "preprocess",
            "--input",
            "{w}/docs.jsonl",
            "--output-prefix",
            "{w}/p",
            "--tokenizer",
            "{w}/hf",
            "--workers",
            "0",
        ],
        r"--workers must be at least 1",
    ),
    (
        "preprocess-out-exists",
        ["preprocess", "--input", "{w}/docs.jsonl", "--output-prefix", "{w}/data/pre", "--tokenizer", "{w}/hf"],
        r"output exists: .*pass --force",
    ),
    ("tiny-hf-out-exists", ["make-tiny-hf", "--out", "{w}/hf"], r"already exists; choose a new --out"),
    ("tiny-hf-like", ["make-tiny-hf", "--out", "{w}/h2", "--like", "nosuch"], r"unknown preset 'nosuch': use one"),
]

SHELL = [
    # --- recipes/launch.sh (dry runs, and real starts stopped by the checks in front of torchrun)
    ("launch-recipe-missing", ("launch", "recipes/nosuch.sh", {}, True), r"recipe recipes/nosuch.sh not found"),
    ("launch-typo-var", ("launch", "{w}/typo.sh", {}, True), r"sets SAVE_INTERVL, .* did you mean SAVE_INTERVAL\?"),
    ("launch-typo-var-2", ("launch", "{w}/typo2.sh", {}, True), r"sets MICR0, .* did you mean MICRO\?"),
    ("launch-tp-world", ("launch", "recipes/tiny.sh", {"TP": "3"}, True), r"not divisible by\s+TP x PP = 3 x 2"),
    ("launch-steps", ("launch", "recipes/tiny.sh", {"STEPS": "-1"}, True), r"STEPS must be a positive integer"),
    ("launch-nnodes", ("launch", "recipes/tiny.sh", {"NNODES": "0"}, True), r"NNODES must be a positive integer"),
    (
        "launch-global",
        ("launch", "recipes/tiny.sh", {"GAS": "", "GLOBAL": "30"}, True),
        r"GLOBAL=30 is not divisible by MICRO x DP",
    ),
    ("launch-gas-global", ("launch", "recipes/tiny.sh", {"GAS": "4", "GLOBAL": "64"}, True), r"disagree"),
    ("launch-seq", ("launch", "recipes/tiny.sh", {"SEQ": "100000"}, True), r"exceeds max_position_embeddings"),
    ("launch-model", ("launch", "recipes/tiny.sh", {"MODEL": "nosuch"}, True), r"unknown model 'nosuch'"),
    ("launch-heads", ("launch", "recipes/tiny.sh", {"TP": "8", "PP": "1"}, True), r"tp=8 does not divide num_heads"),
    ("launch-lr", ("launch", "recipes/tiny.sh", {"LR": "-1"}, True), r"--lr must be >= 0"),
    ("launch-keep-last", ("launch", "recipes/tiny.sh", {"KEEP_LAST": "-1"}, True), r"--keep-last must be >= 0"),
    ("launch-device", ("launch", "recipes/tiny.sh", {"DEVICE": "tpu"}, False), r"DEVICE must be auto, cuda or cpu"),
    ("launch-device-dry", ("launch", "recipes/tiny.sh", {"DEVICE": "gpu"}, True), r"DEVICE must be auto, cuda or cpu"),
    ("launch-data", ("launch", "recipes/tiny.sh", {"DATA": "{w}/nothing"}, False), r"DATA=.*nothing not found"),
    (
        "launch-overwrite",
        (
            "launch",
            "recipes/tiny.sh",
            {"SAVE": "{w}/run", "THREED_ARGS": "--auto-resume false", "TP": "1", "PP": "1", "GPUS_PER_NODE": "1"},
            False,
        ),
        r"already holds a checkpoint .* --overwrite true",
    ),
    # --- slurm/ scripts (stand-in scontrol / squeue / srun; nothing may reach srun)
    (
        "slurm-not-sbatch",
        ("slurm", "slurm/train.sh", ["recipes/tiny.sh"], {"SLURM_JOB_ID": None}),
        r"run this with sbatch",
    ),
    (
        "slurm-no-recipe",
        ("slurm", "slurm/train.sh", [], {}),
        r"no recipe; usage: sbatch \[--nodes=N\] slurm/train.sh RECIPE",
    ),
    ("slurm-recipe-missing", ("slurm", "slurm/train.sh", ["recipes/nosuch.sh"], {}), r"recipe .*nosuch.sh not found"),
    ("slurm-typo", ("slurm", "slurm/train.sh", ["{w}/typo.sh"], {}), r"did you mean SAVE_INTERVAL\?"),
    ("slurm-70b-one-node", ("slurm", "slurm/llama70b_tp8_pp4.sh", [], {}), r"not divisible by\s+TP x PP = 8 x 4"),
    (
        "slurm-8b-seq",
        ("slurm", "slurm/llama8b_tp2_pp2.sh", [], {"SEQ": "200000"}),
        r"seq_length 200000 exceeds max_position_embeddings 131072",
    ),
    (
        "slurm-405b-tp16",
        ("slurm", "slurm/llama405b_tp8_pp16.sh", [], {"SLURM_NNODES": "32", "TP": "16"}),
        r"tp=16 does not divide num_kv_heads=8",
    ),
]


def run_shell(world: Path, spec) -> tuple[int, str]:
    kind, script, *rest = spec
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for var in (
        "MODEL",
        "TP",
        "PP",
        "MICRO",
        "GAS",
        "GLOBAL",
        "SEQ",
        "STEPS",
        "DATA",
        "SAVE",
        "NNODES",
        "GPUS_PER_NODE",
        "THREED_ARGS",
        "THREED_DRY_RUN",
        "EXIT_DURATION",
    ):
        env.pop(var, None)
    env.update(
        PATH=f"{world}/bin:{env['PATH']}",
        PYTHON=str(world / "bin" / "python"),
        LOG_DIR=str(world / "logs"),
        SAVE=str(world / "save"),
        DATA=str(world / "data" / "corpus"),
        TOKENIZER="",  # tiny.sh's demo tokenizer is not made here; a real start's checks (--paths) would refuse it
    )
    if kind == "launch":
        extra, dry = rest
        args = [script.replace("{w}", str(world))]
        if dry:
            env["THREED_DRY_RUN"] = "1"
        cmd = ["bash", str(REPO / "recipes" / "launch.sh"), *args]
    else:
        args, extra = rest
        env.update(
            SLURM_JOB_ID="4242",
            SLURM_NNODES="1",
            SLURM_JOB_NODELIST="localhost",
            SLURM_JOB_NAME="t",
            SLURM_SUBMIT_DIR=str(REPO),
        )
        cmd = ["bash", str(REPO / script), *[a.replace("{w}", str(world)) for a in args]]
    for k, v in extra.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v.replace("{w}", str(world))
    p = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def run_cli(world: Path, argv: list[str], capsys) -> tuple[int, str]:
    from threed.cli.main import main

    try:
        rc = main([a.replace("{w}", str(world)) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.mark.parametrize("case,command,expected", CLI + SHELL, ids=[c[0] for c in CLI + SHELL])
def test_bad_input_fails_cleanly(world, case, command, expected, capsys, monkeypatch):
    import re

    monkeypatch.setenv("RANK", "0")
    before = snapshot(world)
    rc, output = run_cli(world, command, capsys) if isinstance(command, list) else run_shell(world, command)
    assert rc not in (0, None), f"{case}: exit status {rc}\n{output[-3000:]}"
    assert "Traceback" not in output, f"{case}: a traceback\n{output[-3000:]}"
    assert "reached" not in output, f"{case}: got past the checks\n{output[-2000:]}"
    errors = [
        line for line in output.splitlines() if re.search(r"\berror\b", line, re.I) and "warn" not in line.lower()
    ]
    assert len(errors) == 1, f"{case}: expected one error line, got {errors}\n{output[-3000:]}"
    assert re.search(expected, errors[0]), f"{case}: {errors[0]!r} does not match {expected!r}"
    assert snapshot(world) == before, f"{case}: the sandbox changed"


def test_the_table_is_broad():
    commands = {c[1][0] if isinstance(c[1], list) else c[1][0] for c in CLI + SHELL}
    assert len(CLI + SHELL) >= 60
    assert {
        "train",
        "check-config",
        "convert",
        "export",
        "reshard",
        "verify",
        "preprocess",
        "launch",
        "slurm",
    } <= commands
