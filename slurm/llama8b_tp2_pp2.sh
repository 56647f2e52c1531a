#!/bin/bash
# Llama 3.1 8B (recipes/llama31_8b.sh) at TP=2 x PP=2 on 1 node x 8 GPUs (80 GB): one model replica per 4 GPUs,
# so DP = 2 x nodes (--nodes=4: DP=8, GAS drops to 32, the global batch stays 512).
#
#   sbatch slurm/llama8b_tp2_pp2.sh [extra threed train flags]
#   sbatch --nodes=4 slurm/llama8b_tp2_pp2.sh
#
# The warning signal comes 5 minutes before the time limit: enough for the step in flight (~1 min) and writing
# the checkpoint (~150 GB). Submit from the repository root (or set THREED_ROOT). What the job does:
# slurm/common.sh.
#SBATCH --job-name=llama8b_tp2_pp2
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
RECIPE=${RECIPE:-recipes/llama31_8b.sh}
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
