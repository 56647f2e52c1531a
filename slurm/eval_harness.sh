#!/bin/bash
# The harness job: `threed eval-harness` on a saved checkpoint, on one node, as a job of its own, so that training
# never waits for lm-eval scores. slurm/common.sh submits it after training stops when the recipe sets
# HARNESS_TASKS (the launcher's dry run prints the exact sbatch line); by hand:
#
#   sbatch slurm/eval_harness.sh --load runs/llama/ckpt --tasks arc_easy,hellaswag --limit 200 --nproc-per-node 8
#
# The arguments are `threed eval-harness`'s. It scores the checkpoint `latest` names when the job starts and
# writes lm-eval's results to CKPT/harness/<tag>_<time>.json. DEVICE (auto|cpu|cuda) and PYTHON come from the
# environment (sbatch passes it on). Submit from the repository root (or set THREED_ROOT).
#SBATCH --job-name=threed-harness
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=4:00:00
#SBATCH --output=slurm/logs/%x-%j.out

set -euo pipefail
# Outside Slurm its own line, not bash's "SLURM_SUBMIT_DIR: unbound variable" from `set -u`.
[ -n "${THREED_ROOT:-${SLURM_SUBMIT_DIR:-}}" ] || { echo "threed harness: error: not under Slurm" \
    "(SLURM_SUBMIT_DIR is not set): submit it with \`sbatch slurm/eval_harness.sh --load CKPT --tasks a,b\`," \
    "or run it here with THREED_ROOT=<the threed checkout> (or \`threed eval-harness\` directly)" >&2; exit 2; }
ROOT=${THREED_ROOT:-$SLURM_SUBMIT_DIR}
[ -d "$ROOT/src/threed" ] || { echo "submit from the threed checkout, or set THREED_ROOT" >&2; exit 2; }
cd "$ROOT"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
export THREED_DEVICE=${DEVICE:-auto} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONUNBUFFERED=1
[ "${DEVICE:-auto}" != cpu ] || export CUDA_VISIBLE_DEVICES=""
echo "threed harness: job ${SLURM_JOB_ID:-?} at $(date '+%F %T'): threed eval-harness $*"
PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" -m threed.cli eval-harness "$@"
