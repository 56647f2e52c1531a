"""The README's "Train Llama 3.1 8B on your cluster" walkthrough runs, command by command, as the README spells it.

A front page whose first commands fail loses the reader at the door, and a hand-kept copy of them in a test drifts
from the README as easily as the code does. So the commands are read from the README's first bash block and run, in
order, in one bash session in a scratch copy of the repository (its scripts linked, recipes/ and slurm/ copied), with
tiny stand-ins where the walkthrough needs what CI has not got:

- the HF weights and the corpus: a tiny random HF Llama with a 512-piece tokenizer at the path the README converts
  from, and a small JSONL corpus at the path it tokenizes;
- the venv: make never reinstalls it (`make -o .venv/.installed`);
- the cluster: `sbatch` checks its script with `bash -n` and runs the job's recipe through recipes/launch.sh on one
  CPU rank at the tiny scale (the recipe's lines overridden from the environment, as the README says they can be),
  writing the log where slurm/common.sh would; `tail -f` prints that log instead of following it.

The only rewrite of a command is `--workers N` -> `--workers 1` (2 shared cores). A command the session cannot run
fails the test with its line; a step that goes missing from the README fails it too.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADING = "## Train Llama 3.1 8B on your cluster"
# What the walkthrough must do (the brief of the front page); each is the start of one of its commands.
STEPS = ("make venv", "threed preprocess", "make convert", "cp recipes/", "THREED_DRY_RUN=1", "threed report")
# The stand-in job: the copied recipe on one CPU rank, tiny (INIT_FROM= clears the 8B init: another model's weights).
JOB_ENV = (
    "NNODES=1 GPUS_PER_NODE=1 DEVICE=cpu MODEL=tiny TP=1 PP=1 SEQ=64 GLOBAL=2 STEPS=2 WARMUP=1 SPLIT=98,2,0 "
    "EVAL_ITERS=2 SAVE_INTERVAL= INIT_FROM="
)
SHIMS = f"""
make() {{ command make -o .venv/.installed "$@"; }}  # the test's venv as it is: never reinstalled
sbatch() {{  # the script must parse; the job: its recipe on one CPU rank, tiny, logged where slurm/common.sh logs
    local script="" recipe="" a name
    for a in "$@"; do
        case "$a" in --*) ;; *) if [ -z "$script" ]; then script=$a; elif [ -z "$recipe" ]; then recipe=$a; fi ;; esac
    done
    bash -n "$script" || return 1
    [ -f "$recipe" ] || {{ echo "sbatch stand-in: no recipe '$recipe'" >&2; return 1; }}
    name=$(sed -n 's/^#SBATCH --job-name=//p' "$script")
    mkdir -p "slurm/logs/$name-4242"
    env {JOB_ENV} recipes/launch.sh "$recipe" >"slurm/logs/$name-4242/train.log" 2>&1 ||
        {{ cat "slurm/logs/$name-4242/train.log" >&2; return 1; }}
    echo 4242
}}
tail() {{ if [ "${{1:-}}" = -f ]; then shift; command tail -n 20 "$@"; else command tail "$@"; fi; }}
"""


def walkthrough(readme: str) -> list[str]:
    """The commands of the first bash block under the walkthrough's heading: comments dropped, `\\` lines joined."""
    assert HEADING in readme, f"README.md lost its heading {HEADING!r}"
    block = re.search(r"```bash\n(.*?)```", readme[readme.index(HEADING) :], re.S)
    assert block, "no ```bash block under the walkthrough's heading"
    commands, pending = [], ""
    for line in block.group(1).splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        commands.append(" ".join((pending + line.strip()).split()))
        pending = ""
    return commands


def option(commands: list[str], start: str, name: str) -> str:
    """The value of `name` (`--input` or `HF=`) in the first command starting with `start`."""
    words = shlex.split(next(c for c in commands if c.startswith(start)), comments=True)
    if name.endswith("="):
        return next(w[len(name) :] for w in words if w.startswith(name))
    return words[words.index(name) + 1]


def scratch_repo(tmp: Path) -> Path:
    """A copy of the repository to run in: code, Makefile and venv linked; recipes/ and slurm/ (written to) copied."""
    root = tmp / "repo"
    root.mkdir()
    for name in ("Makefile", "pyproject.toml", "src", "tools"):
        (root / name).symlink_to(ROOT / name)
    venv = ROOT / ".venv" if (ROOT / ".venv").exists() else Path(sys.prefix)
    (root / ".venv").symlink_to(venv)
    for name in ("recipes", "slurm"):
        (root / name).mkdir()
        for f in (ROOT / name).glob("*.sh"):
            (root / name / f.name).write_bytes(f.read_bytes())
            (root / name / f.name).chmod(f.stat().st_mode)
    return root


def stand_ins(root: Path, commands: list[str], env: dict[str, str]) -> None:
    """The HF model and the corpus, where the README's commands look for them."""
    hf = root / option(commands, "make convert", "HF=")
    corpus = root / option(commands, "threed preprocess", "--input")
    tok = root.parent / "tok"
    cli = [sys.executable, "-m", "threed.cli"]
    run = dict(cwd=root, env=env, check=True, capture_output=True, text=True)
    subprocess.run([*cli, "demo-text", "--out", f"{tok}.txt"], **run)
    subprocess.run([*cli, "tokenizer", "--text", f"{tok}.txt", "--vocab-size", "512", "--out", str(tok)], **run)
    subprocess.run([*cli, "make-tiny-hf", "--out", str(hf), "--like", "tiny", "--tokenizer", f"{tok}.model"], **run)
    paragraphs = [p for p in Path(f"{tok}.txt").read_text().split("\n\n") if p.strip()][:300]
    corpus.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
    corpus.write_bytes(gzip.compress(text.encode()) if corpus.suffix == ".gz" else text.encode())


def session(commands: list[str]) -> str:
    """One bash script: the stand-ins' shims, then each command followed by a check naming it when it fails."""
    lines = [SHIMS]
    for cmd in commands:
        cmd = re.sub(r"--workers \d+", "--workers 1", cmd)
        lines += [f"echo {shlex.quote('+ ' + cmd)}", cmd, "rc=$?"]
        lines.append(f'[ $rc = 0 ] || {{ echo "README command failed (exit $rc): "{shlex.quote(cmd)} >&2; exit 1; }}')
    return "\n".join(lines) + "\n"


def test_walkthrough_has_every_step():
    commands = walkthrough((ROOT / "README.md").read_text())
    for step in STEPS:
        assert any(c.startswith(step) for c in commands), f"the walkthrough lost its `{step} ...` step"
    assert any("sbatch " in c and "slurm/" in c for c in commands), "the walkthrough lost its sbatch step"
    assert any(c.startswith("make export") for c in commands), "the walkthrough lost its export step"


@pytest.mark.slow  # the whole walkthrough (~90 s); its steps are each tested where they live
def test_walkthrough_runs(tmp_path):
    commands = walkthrough((ROOT / "README.md").read_text())
    root = scratch_repo(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env.update(
        PYTHONPATH=str(ROOT / "src"),  # this checkout's code, whatever the venv's editable install points at
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    stand_ins(root, commands, env)
    proc = subprocess.run(
        ["bash", "-c", session(commands)], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    check_outcomes(root, commands, out)


def check_outcomes(root: Path, commands: list[str], out: str) -> None:
    """What each step promises is there: tokens, a converted checkpoint, the dry run's numbers, a job's log lines,
    the report's plots, an HF export."""
    prefix = root / option(commands, "threed preprocess", "--output-prefix")
    assert Path(f"{prefix}_text_document.bin").exists() and Path(f"{prefix}_text_document.idx").exists()
    assert (root / option(commands, "make convert", "OUT=") / "latest").exists()
    for key in ("DP=", "GAS=", "TRAIN_BATCH_SIZE=", "memory: ~", "command:"):
        assert key in out, f"the dry run printed no {key!r}:\n{out[-4000:]}"
    for key in ("tokens/s", "TFLOP/s", "MFU"):
        assert key in out, f"the job's log lines (tail) show no {key!r}:\n{out[-4000:]}"
    report = root / option(commands, "threed report", "report") / "report"
    assert any(report.glob("*.png")), f"threed report wrote no plots in {report}"
    exported = root / option(commands, "make export", "OUT=")
    assert (exported / "config.json").exists() and any(exported.glob("*.safetensors")), sorted(exported.iterdir())


@pytest.mark.parametrize("script", sorted((ROOT / "slurm").glob("*.sh")), ids=lambda p: p.name)
def test_slurm_scripts_parse(script):
    """`sbatch` cannot run here; every script it could be given at least parses."""
    subprocess.run(["bash", "-n", str(script)], check=True)
