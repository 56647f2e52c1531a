#!/bin/bash
# Llama 3.1 70B (recipes/llama31_70b.sh) at TP=8 x PP=4 on 4 nodes x 8 GPUs (80 GB): one model replica per
# 32 GPUs, so DP = nodes / 4 (--nodes=8: DP=2, GAS halves, the global batch stays 512).
# Sequence parallel without recompute (`threed plan`'s choice at this layout: ~66 GB/GPU, 146 s/step predicted
# against 191 s recomputing every block; the recipe's header has the command).
#
#   sbatch slurm/llama70b_tp8_pp4.sh [extra threed train flags]
#   sbatch --nodes=8 slurm/llama70b_tp8_pp4.sh
#   MODEL=tiny-tp8 SEQ=64 GLOBAL=8 GPUS_PER_NODE=8 DEVICE=cpu ... sbatch --gres=none slurm/llama70b_tp8_pp4.sh
#
# The warning signal comes 10 minutes before the time limit: enough for the step in flight (~2-3 min at this
# layout) and writing the checkpoint (~1 TB of weights and optimizer state for 70B). Submit from the
# repository root (or set THREED_ROOT). What the job does: slurm/common.sh.
#SBATCH --job-name=llama70b_tp8_pp4
#SBATCH --nodes=4
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
RECIPE=${RECIPE:-recipes/llama31_70b.sh}
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
