#!/bin/bash
# Any recipe on any number of nodes: the script to submit a recipe you copied and edited.
#
#   sbatch --nodes=2 slurm/train.sh recipes/my_llama.sh [extra threed train flags]
#
# DP grows with --nodes: DP = nodes x GPUS_PER_NODE / (TP x PP x CP). The recipe's variables, GPUS_PER_NODE
# (default 8) and DEVICE can be overridden from the environment (sbatch passes it on). Submit from the
# repository root (or set THREED_ROOT). What the job does: slurm/common.sh.
#SBATCH --job-name=threed
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm/logs/%x-%j.out

ROOT=${THREED_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}  # outside Slurm: common.sh says to use sbatch
[ -f "$ROOT/slurm/common.sh" ] || { echo "submit from the threed checkout, or set THREED_ROOT" >&2; exit 2; }
[ $# -ge 1 ] || { echo "threed slurm: error: no recipe; usage: sbatch [--nodes=N] slurm/train.sh RECIPE" \
    "[extra threed train flags]" >&2; exit 2; }
RECIPE=$1
shift
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
