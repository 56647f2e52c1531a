#!/bin/bash
# Llama 3.1 8B LoRA fine-tuning (recipes/llama31_8b_lora_sft.sh: rank-16 adapters on every linear, the base frozen,
# INIT_FROM a converted HF checkpoint at tp1 pp1, packed SFT data) on 1 node x 8 GPUs (80 GB): one model replica per
# GPU, so DP = 8 x nodes (--nodes=2: DP=16, GAS halves, the global batch stays 64 rows).
#
#   sbatch slurm/llama8b_lora_sft_tp1_pp1.sh [extra threed train flags]
#   LORA_RANK=64 LORA_ALPHA=128 sbatch slurm/llama8b_lora_sft_tp1_pp1.sh
#
# What the job does (preemption, requeue, resume from SAVE/latest at this layout): slurm/common.sh.
#SBATCH --job-name=llama8b_lora_sft_tp1_pp1
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
RECIPE=${RECIPE:-recipes/llama31_8b_lora_sft.sh}
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
