#!/bin/bash
# Llama 3.1 70B at 64K tokens (recipes/llama31_70b_64k.sh) at TP=8 x PP=2 x CP=4 on 8 nodes x 8 GPUs (80 GB):
# one sample per 64 GPUs (each 65536-token sequence split over 4 context-parallel ranks), so DP = nodes / 8
# (--nodes=16: DP=2, GAS halves, the global batch stays 64 sequences).
#
#   sbatch slurm/llama70b_64k_tp8_pp2_cp4.sh [extra threed train flags]
#   sbatch --nodes=16 slurm/llama70b_64k_tp8_pp2_cp4.sh
#
# The warning signal comes 10 minutes before the time limit: enough for the step in flight (~3.3 min predicted
# at this layout) and writing the checkpoint (~1 TB of weights and optimizer state for 70B). Submit from the
# repository root (or set THREED_ROOT). What the job does: slurm/common.sh.
#SBATCH --job-name=llama70b_64k_tp8_pp2_cp4
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm/logs/%x-%j.out

ROOT=${THREED_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}  # outside Slurm: common.sh says to use sbatch
[ -f "$ROOT/slurm/common.sh" ] || { echo "submit from the threed checkout, or set THREED_ROOT" >&2; exit 2; }
RECIPE=${RECIPE:-recipes/llama31_70b_64k.sh}
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
