"""The launcher, the recipes and the ways ranks are started (issue 19, item 4, 5 and the Makefile): numbers read as
decimal everywhere, environment variables one edit from a recipe variable named as likely typos, the recipe typo
check on every assignment, checkpoints kept and their size shown, `make convert` / `make export` naming what is
missing, and a refusal under torchrun ending with our one line and our exit status."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_recipes import LAUNCH, REPO, dry_numbers, launch, train_argv

SRC_ENV = {"PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def one_error(out: str) -> str:
    errors = [line for line in out.splitlines() if re.search(r"\berror\b", line, re.I)]
    assert len(errors) == 1, out
    assert "Traceback" not in out and "ChildFailedError" not in out, out
    return errors[0]


# --- numbers: decimal everywhere ------------------------------------------------------------------------------
def test_leading_zero_is_decimal_not_octal() -> None:
    """GPUS_PER_NODE=010 was octal 8 to bash and 10 to torchrun: now 10 to both (so tp2 x pp2 does not divide)."""
    out = launch("tiny", {"GPUS_PER_NODE": "010"})
    assert out.returncode == 2
    assert "WORLD = NNODES x GPUS_PER_NODE = 1 x 10 = 10 ranks" in one_error(out.stderr)
    out = launch("tiny", {"GPUS_PER_NODE": "012"})
    assert out.returncode == 0, out.stderr
    assert dry_numbers(out.stdout)["DP"] == 3 and "--nproc-per-node=12" in out.stdout


@pytest.mark.parametrize(
    "env,flag,value",
    [
        ({"GPUS_PER_NODE": "08"}, None, None),  # bash: "value too great"
        ({"WARMUP": "007"}, "--warmup-steps", "7"),
        ({"MICRO": "+4", "GAS": "04"}, "--grad-accum-steps", "4"),
        ({"KEEP_LAST": "02"}, "--keep-last", "2"),
    ],
)
def test_numbers_are_rewritten_in_decimal(env, flag, value) -> None:
    out = launch("tiny", env)
    assert out.returncode == 0, out.stderr
    assert not out.stderr.strip(), out.stderr
    argv = train_argv(out.stdout)
    if flag:
        assert argv[argv.index(flag) + 1] == value
    assert dry_numbers(out.stdout) == {"DP": 2, "GAS": 4, "TRAIN_BATCH_SIZE": 32}


@pytest.mark.parametrize(
    "var,value,expected",
    [
        ("GPUS_PER_NODE", "8x", r"GPUS_PER_NODE must be a positive integer, got '8x': .*decimal digits"),
        ("GPUS_PER_NODE", "0x10", r"GPUS_PER_NODE must be a positive integer, got '0x10'"),
        ("NNODES", "1.5", r"NNODES must be a positive integer, got '1.5'"),
        ("NODE_RANK", "one", r"NODE_RANK must be a whole number >= 0, got 'one'"),
        ("MASTER_PORT", "29500a", r"MASTER_PORT must be a whole number >= 0"),
        ("KEEP_LAST", "three", r"KEEP_LAST must be a whole number, got 'three'"),
        ("SAVE_INTERVAL", "1e3", r"SAVE_INTERVAL must be a whole number, got '1e3'"),
        ("GLOBAL", "64k", r"GLOBAL must be a positive integer, got '64k'"),
    ],
)
def test_non_numbers_are_refused(var, value, expected) -> None:
    out = launch("tiny", {var: value})
    assert out.returncode == 2, out.stdout + out.stderr
    line = one_error(out.stderr)
    assert line.startswith("threed launch: error: ") and re.search(expected, line), line
    assert "command:" not in out.stdout


# --- typos in the environment and in recipes ------------------------------------------------------------------
def test_environment_typos_are_named() -> None:
    out = launch("tiny", {"STEP": "5", "GOLBAL": "64", "steps": "9", "TZ": "UTC", "SEQQ": "64", "PDW": "x"})
    assert out.returncode == 0, out.stderr
    warnings = out.stderr.strip().splitlines()
    assert sorted(w.split()[6] for w in warnings) == ["GOLBAL,", "SEQQ,", "STEP,", "steps,"], warnings
    for w in warnings:
        assert re.fullmatch(
            r"threed launch: warning: the environment sets (\w+), which is not a recipe variable: "
            r"did you mean [A-Z_]+\? \(\1 is ignored\)",
            w,
        ), w
    assert "did you mean GLOBAL?" in out.stderr and "did you mean STEPS?" in out.stderr
    assert train_argv(out.stdout)[train_argv(out.stdout).index("--steps") + 1] == "150"  # ignored, as it says


def test_no_warning_for_the_launchers_own_variables() -> None:
    out = launch("tiny", {"GPUS_PER_NODE": "8", "NODE_RANK": "0", "DEVICE": "cpu", "EXIT_DURATION": "5"})
    assert out.returncode == 0 and not out.stderr.strip(), out.stderr


@pytest.mark.parametrize(
    "snippet,name,near",
    [
        ("if true; then\n    MICR0=4\nfi\n", "MICR0", "MICRO"),
        ("if true; then SAVE_INTERVL=5; fi\n", "SAVE_INTERVL", "SAVE_INTERVAL"),
        ('[ -n "${X:-}" ] && GOLBAL=64\n', "GOLBAL", "GLOBAL"),
        ("case $TP in 2) STEP=5 ;; esac\n", "STEP", "STEPS"),
        ("{ SEQQ=64; }\n", "SEQQ", "SEQ"),
        (': "${WARMPU:=5}"\n', "WARMPU", "WARMUP"),
        ("export MIN_RL=1e-5\n", "MIN_RL", "MIN_LR"),
    ],
)
def test_recipe_typo_anywhere_is_refused(tmp_path: Path, snippet, name, near) -> None:
    tiny = (REPO / "recipes" / "tiny.sh").read_text()
    recipe = tmp_path / "r.sh"
    recipe.write_text(tiny + "# a comment that sets NOTHING=1 is not an assignment\n" + snippet)
    out = subprocess.run(
        ["bash", str(LAUNCH), str(recipe)],
        env={**os.environ, "THREED_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    line = one_error(out.stderr)
    lineno = len(tiny.splitlines()) + 2 + snippet.count("\n", 0, snippet.index(name))
    assert f"line {lineno} sets {name}, which is not a recipe variable: did you mean {near}?" in line, line


@pytest.mark.slow  # every shipped recipe through the launcher (~25 s); the typo check itself is tested above
def test_shipped_recipes_pass_the_typo_check() -> None:
    for recipe in sorted((REPO / "recipes").glob("*.sh")):
        if recipe.name != "launch.sh":
            out = launch(recipe.stem, {"NNODES": "32", "GPUS_PER_NODE": "8"})
            assert "not a recipe variable" not in out.stderr, (recipe, out.stderr)


# --- checkpoints kept, and their size -------------------------------------------------------------------------
def test_recipes_keep_the_last_checkpoints_and_show_their_size() -> None:
    out = launch("llama31_70b", {"NNODES": "4", "GPUS_PER_NODE": "8"})
    assert out.returncode == 0, out.stderr
    argv = train_argv(out.stdout)
    assert argv[argv.index("--keep-last") + 1] == "3"
    line = re.search(r"^threed check-config: config ok: .*$", out.stdout, re.M)[0]
    assert re.search(r"checkpoints ~[\d.]+ GiB each, the newest 3 kept \(--keep-last\): ~[\d.]+ TiB in", line), line
    out = launch("llama31_70b", {"NNODES": "4", "GPUS_PER_NODE": "8", "KEEP_LAST": "0"})
    assert "all kept (--keep-last 0)" in out.stdout and "--keep-last 0" in out.stdout


def test_checkpoint_size_needs_no_torch() -> None:
    """check-config prints the checkpoint size with the save checks' own formula (threed.checkpoint.format) without
    importing torch: the launcher's dry run stays a second."""
    code = (
        "import sys, threed.cli.check_config as c; from threed.checkpoint.format import checkpoint_bytes; "
        "assert c.checkpoint_bytes is checkpoint_bytes; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})


# --- make convert / make export -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "goal,given,missing",
    [("convert", [], "HF TP PP OUT"), ("convert", ["TP=2", "HF=x"], "PP OUT"), ("export", ["CKPT=a"], "OUT")],
)
def test_make_names_the_missing_variable(goal, given, missing) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("HF", "TP", "PP", "OUT", "CKPT", "ARGS", "MAKEFLAGS")}
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", goal, *given],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"make {goal}: {missing} not set; usage: make {goal} " in lines[0], lines
    assert "expected one argument" not in out.stderr and not out.stdout.strip()


# --- under torchrun: our line, our status ---------------------------------------------------------------------
RANK_SCRIPT = textwrap.dedent("""\
    import os, signal, sys
    how = sys.argv[1]
    if how == "refuse":
        if os.environ["RANK"] == "0":
            print("threed: configuration error: a refusal, from rank 0 only", file=sys.stderr, flush=True)
        sys.exit(2)
    if how == "kill" and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "kill":
        import time; time.sleep(30)
    # One write of the whole line: print's separate pieces interleave between the ranks on an unbuffered stdout
    # (seen: "rankrank 1  ok0").
    sys.stdout.write("rank " + os.environ["RANK"] + " ok\\n")
    sys.stdout.flush()
""")


@pytest.mark.parametrize("how,status", [("refuse", 2), ("kill", 137), ("ok", 0)])
def test_torchrun_main_ends_with_the_ranks_status(tmp_path: Path, how, status) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "threed.parallel.launch",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            str(script),
            how,
        ],
        env={**os.environ, **SRC_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    both = out.stdout + out.stderr
    assert out.returncode == status, both
    assert "Traceback" not in both and "ChildFailedError" not in both, both
    if how == "refuse":
        assert out.stderr.strip().splitlines() == ["threed: configuration error: a refusal, from rank 0 only"], both
    elif how == "kill":
        assert re.search(r"^threed: rank 1 was killed by SIGKILL \(exit 137\)", out.stderr, re.M), both
    else:
        assert sorted(out.stdout.split("\n")[:2]) == ["rank 0 ok", "rank 1 ok"], both


def test_train_nproc_refuses_a_bad_layout_before_starting_ranks() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "threed.cli",
            "train",
            "--nproc-per-node",
            "3",
            "--model",
            "tiny",
            "--tp",
            "2",
            "--seq-length",
            "32",
            "--steps",
            "2",
        ],
        env={**os.environ, **SRC_ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.fullmatch(r"threed: configuration error: world size 3 is not divisible by tp\*pp.*\n", out.stderr)


def test_train_nproc_under_torchrun_is_refused(monkeypatch) -> None:
    from threed.cli.main import main

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--nproc-per-node", "2", "--model", "tiny"]) == 2


def test_train_nproc_refusal_in_the_ranks_is_one_line(tmp_path: Path) -> None:
    """A refusal that only the ranks find (the dataset is checked once the world is up), under 2 ranks through
    `threed train --nproc-per-node 2`: exactly one `threed: configuration error:` line, no traceback, exit 2."""
    out = subprocess.run(
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
            "32",
            "--steps",
            "2",
            "--data-path",
            str(tmp_path / "nothing"),
        ],
        env={**os.environ, **SRC_ENV, "THREED_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    both = out.stdout + out.stderr
    assert out.returncode == 2, both[-3000:]
    errors = [line for line in both.splitlines() if "threed: configuration error:" in line]
    assert len(errors) == 1 and "nothing" in errors[0], both[-3000:]
    assert "Traceback" not in both and "ChildFailedError" not in both and "exitcode" not in both, both[-3000:]


# --- a JIT build lock left by a killed build ----------------------------------------------------------------------
def _old_lock(root: Path, minutes: float) -> Path:
    lock = root / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    then = time.time() - minutes * 60
    os.utime(lock, (then, then))
    return lock


def test_stale_build_lock_is_named_with_its_fix(tmp_path: Path) -> None:
    """Stale: older than STALE_LOCK_MINUTES and no process here holds it open. A fresh lock (a build going on,
    maybe on another node) or an old one a process holds open (torch's builder keeps its lock open) is waited for,
    as torch does; under torch's default root the lock lies one folder deeper (`py311_cpu/<name>/lock`)."""
    from threed.parallel.build_lock import STALE_LOCK_MINUTES, lock_candidates, stale_lock

    for root in (tmp_path / "set", tmp_path / "default" / "py311_cpu"):
        lock = _old_lock(root, STALE_LOCK_MINUTES + 5)
        top = tmp_path / "set" if root.name == "set" else tmp_path / "default"
        line = stale_lock(lock_candidates(top, "deepspeed_shm_comm"))
        assert line is not None and "\n" not in line and line.endswith(f"Remove it: rm {lock}"), line
    lock = _old_lock(tmp_path / "fresh", 1)
    assert stale_lock(lock_candidates(tmp_path / "fresh", "deepspeed_shm_comm")) is None
    lock = _old_lock(tmp_path / "held", STALE_LOCK_MINUTES + 5)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time; os.open(sys.argv[1], os.O_RDONLY); print(1, flush=True); "
         "time.sleep(120)", str(lock)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "1"
        assert stale_lock(lock_candidates(tmp_path / "held", "deepspeed_shm_comm")) is None
    finally:
        holder.kill()
        holder.wait()
    assert stale_lock(lock_candidates(tmp_path / "held", "deepspeed_shm_comm")) is not None  # its holder is gone


def test_stale_build_lock_stops_the_ranks_in_one_line(tmp_path: Path) -> None:
    """`threed train --nproc-per-node 2` with a stale lock of DeepSpeed's CPU comm op in TORCH_EXTENSIONS_DIR: one
    line naming the file and its `rm`, exit 2, instead of ranks that wait at start-up forever."""
    from threed.parallel.build_lock import STALE_LOCK_MINUTES

    lock = _old_lock(tmp_path / "ext", STALE_LOCK_MINUTES + 60)
    out = subprocess.run(
        [sys.executable, "-m", "threed.cli", "train", "--nproc-per-node", "2", "--model", "tiny", "--pp", "2",
         "--seq-length", "32", "--steps", "1"],
        env={**os.environ, **SRC_ENV, "THREED_DEVICE": "cpu", "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    both = out.stdout + out.stderr
    assert out.returncode == 2, both[-3000:]
    errors = [line for line in both.splitlines() if str(lock) in line]
    assert len(errors) == 1 and f"rm {lock}" in errors[0], both[-3000:]
    assert "Traceback" not in both and "ChildFailedError" not in both, both[-3000:]
