# Llama 2 70B (68.98B params): TP=8 x PP=4 on 4 nodes x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 8 x 4 = 32 GPUs hold one model replica; DP = WORLD / 32 grows with the nodes.
# Batch    at 4 nodes x 8 GPUs: DP = 32 / (8 x 4) = 1, GAS = GLOBAL / (MICRO x DP) = 1024 / (1 x 1) = 1024,
#          train_batch_size = MICRO x GAS x DP = 1 x 1024 x 1 = 1024 sequences x 4096 = 4.19M tokens per step.
#          At 8 nodes DP = 2 and GAS = 512: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 4 nodes (DP=1), heaviest pipeline stage, activation checkpointing on:
#          ~49 GB/GPU = weights 4.3 + grads 13.0 + optimizer 26.1 + activations 5.8
#          (2.17B params on the heaviest GPU; plus CUDA/NCCL overhead)
#          At DP=2 the ZeRO-1 optimizer shard halves: ~36 GB/GPU. (python -m threed.memory explains the model.)
# Data     DATA from `threed tokenize --tokenizer $TOKENIZER` (Llama 2's sentencepiece model, 32000 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-2-70b-hf> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at the same TP, PP and DP; at another node count start a new SAVE with INIT_FROM=<old SAVE>.
# Run      sbatch --nodes=4 slurm/train.sh recipes/llama2_70b.sh
# Override any line from the environment (VAR=value sbatch ...; an empty value clears it): see recipes/launch.sh.
MODEL=${MODEL-llama2-70b}
TP=${TP-8}
PP=${PP-4}
MICRO=${MICRO-1}
GAS=${GAS-}
GLOBAL=${GLOBAL-1024}
SEQ=${SEQ-4096}
LR=${LR-1.5e-4}
MIN_LR=${MIN_LR-1.5e-5}
WARMUP=${WARMUP-200}
STEPS=${STEPS-5000}
DTYPE=${DTYPE-bf16}
ACT_CKPT=${ACT_CKPT-true}
DATA=${DATA-data/llama2/tokens.bin}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-2-70b-hf/tokenizer.model}
INIT_FROM=${INIT_FROM-}
LOAD=${LOAD-}
SAVE=${SAVE-checkpoints/llama2_70b}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
LOG_INTERVAL=${LOG_INTERVAL-1}
