#!/bin/bash
# Llama 3.1 405B (recipes/llama31_405b.sh) at TP=8 x PP=16 on 32 nodes x 8 GPUs (80 GB): one model replica per
# 128 GPUs, so DP = nodes / 16 (32 nodes: DP=2; 64 nodes: DP=4).
#
#   sbatch slurm/llama405b_tp8_pp16.sh [extra threed train flags]
#   sbatch --nodes=64 slurm/llama405b_tp8_pp16.sh
#
# The warning signal comes 15 minutes before the time limit: the step in flight plus writing ~6 TB of weights
# and optimizer state. Submit from the repository root (or set THREED_ROOT). What the job does: slurm/common.sh.
#SBATCH --job-name=llama405b_tp8_pp16
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@900
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm/logs/%x-%j.out

ROOT=${THREED_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}  # outside Slurm: common.sh says to use sbatch
[ -f "$ROOT/slurm/common.sh" ] || { echo "submit from the threed checkout, or set THREED_ROOT" >&2; exit 2; }
RECIPE=${RECIPE:-recipes/llama31_405b.sh}
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
