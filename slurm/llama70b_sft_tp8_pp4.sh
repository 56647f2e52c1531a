#!/bin/bash
# Llama 3.1 70B supervised fine-tuning (recipes/llama31_70b_sft.sh: INIT_FROM a converted HF checkpoint, packed SFT
# data, response-only loss) at TP=8 x PP=4 on 4 nodes x 8 GPUs (80 GB): one model replica per 32 GPUs, so
# DP = nodes / 4 (--nodes=8: DP=2, GAS halves, the global batch stays 64 rows).
#
#   sbatch slurm/llama70b_sft_tp8_pp4.sh [extra threed train flags]
#   INIT_FROM=checkpoints/my70b_tp8_pp4 DATA=data/sft/mine_text_document sbatch slurm/llama70b_sft_tp8_pp4.sh
#
# The same job as slurm/llama70b_tp8_pp4.sh with the SFT recipe (preemption, requeue and resume work alike; a
# requeued job resumes from SAVE/latest, not from INIT_FROM). What the job does: slurm/common.sh.
#SBATCH --job-name=llama70b_sft_tp8_pp4
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
RECIPE=${RECIPE:-recipes/llama31_70b_sft.sh}
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
