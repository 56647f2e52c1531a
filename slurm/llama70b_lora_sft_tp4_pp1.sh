#!/bin/bash
# Llama 3.1 70B LoRA fine-tuning (recipes/llama31_70b_lora_sft.sh: rank-16 adapters on every linear, the base frozen,
# INIT_FROM a converted HF checkpoint at tp4 pp1, packed SFT data) at TP=4 x PP=1 on 4 nodes x 8 GPUs (80 GB): two
# frozen replicas per node, so DP = 2 x nodes (--nodes=8: DP=16, GAS halves, the global batch stays 64 rows). The
# layout is what `threed plan --model llama3.1-70b --nodes 4 --gpu-memory 80 --seq-length 8192 --global-batch-size 64
# --reserve 8 --vpp 1 --lora-rank 16` picks (the recipe's header says why those two flags).
#
#   sbatch slurm/llama70b_lora_sft_tp4_pp1.sh [extra threed train flags]
#   INIT_FROM=checkpoints/my70b_tp4_pp1 DATA=data/sft/mine_text_document sbatch slurm/llama70b_lora_sft_tp4_pp1.sh
#
# The same job as slurm/llama70b_sft_tp8_pp4.sh with the LoRA recipe (preemption, requeue and resume work alike; a
# requeued job resumes from SAVE/latest at this layout). What the job does: slurm/common.sh.
#SBATCH --job-name=llama70b_lora_sft_tp4_pp1
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
RECIPE=${RECIPE:-recipes/llama31_70b_lora_sft.sh}
# shellcheck source=slurm/common.sh
source "$ROOT/slurm/common.sh" "$@"
