# Llama 3.1 405B (405.85B params): TP=8 x PP=16 on 32 nodes x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 8 x 16 = 128 GPUs hold one model replica; DP = WORLD / 128 grows with the nodes.
# Batch    at 32 nodes x 8 GPUs: DP = 256 / (8 x 16) = 2, GAS = GLOBAL / (MICRO x DP) = 1024 / (1 x 2) = 512,
#          train_batch_size = MICRO x GAS x DP = 1 x 512 x 2 = 1024 sequences x 4096 = 4.19M tokens per step.
#          At 64 nodes DP = 4 and GAS = 256: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 32 nodes (DP=2), heaviest pipeline stage, activation checkpointing on:
#          ~66 GB/GPU = weights 6.9 + grads 20.7 + optimizer 20.7 + activations 17.9
#          (3.45B params on the heaviest GPU; plus CUDA/NCCL overhead)
#          At DP=4 the ZeRO-1 optimizer shard halves: ~56 GB/GPU. (python -m threed.memory explains the model.)
#          SEQ=8192 doubles the checkpointed activations (~36 GB): run it at >= 128 nodes (DP >= 8).
# Data     DATA from `threed tokenize --tokenizer $TOKENIZER` (the HF Llama 3 tokenizer directory, 128256 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-3.1-405B> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at the same TP, PP and DP; at another node count start a new SAVE with INIT_FROM=<old SAVE>.
# Run      sbatch slurm/llama405b_tp8_pp16.sh
# Override any line from the environment (VAR=value sbatch ...; an empty value clears it): see recipes/launch.sh.
MODEL=${MODEL-llama3.1-405b}
TP=${TP-8}
PP=${PP-16}
MICRO=${MICRO-1}
GAS=${GAS-}
GLOBAL=${GLOBAL-1024}
SEQ=${SEQ-4096}
LR=${LR-8e-5}
MIN_LR=${MIN_LR-8e-7}
WARMUP=${WARMUP-200}
STEPS=${STEPS-5000}
DTYPE=${DTYPE-bf16}
ACT_CKPT=${ACT_CKPT-true}
DATA=${DATA-data/llama3/tokens.bin}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-405B}
INIT_FROM=${INIT_FROM-}
LOAD=${LOAD-}
SAVE=${SAVE-checkpoints/llama31_405b}
SAVE_INTERVAL=${SAVE_INTERVAL-50}
LOG_INTERVAL=${LOG_INTERVAL-1}
