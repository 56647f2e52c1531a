#!/bin/bash
# Llama 3.1 8B at 128K tokens (recipes/llama31_8b_128k.sh) at TP=4 x CP=2 on 1 node x 8 GPUs (80 GB): each
# 131072-token sequence is split over 2 context-parallel ranks of 4 TP ranks, so DP = nodes (--nodes=2: DP=2,
# GAS halves, the global batch stays 16 sequences).
#
#   sbatch slurm/llama8b_128k_tp4_cp2.sh [extra threed train flags]
#   sbatch --nodes=2 slurm/llama8b_128k_tp4_cp2.sh
#
# The warning signal comes 10 minutes before the time limit: enough for the step in flight (~3.5 min predicted
# at this layout) and writing the checkpoint (~150 GB). Submit from the repository root (or set THREED_ROOT).
# What the job does: slurm/common.sh.
#SBATCH --job-name=llama8b_128k_tp4_cp2
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm/logs/%x-%j.out

ROOT=${THREED_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}  # outside Slurm: common.sh says to use sbatch
[ -f "$ROOT/slurm/common.sh" ] || { echo "submit from the threed checkout, or set THREED_ROOT" >&2; exit 2; }
RECIPE=${RECIPE:-recipes/llama31_8b_128k.sh}
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
