# Llama 3 8B (8.03B params): TP=2 x PP=2 on 1 node x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 2 x 2 = 4 GPUs hold one model replica; DP = WORLD / 4 grows with the nodes.
# Batch    at 1 node x 8 GPUs: DP = 8 / (2 x 2) = 2, GAS = GLOBAL / (MICRO x DP) = 512 / (1 x 2) = 256,
#          train_batch_size = MICRO x GAS x DP = 1 x 256 x 2 = 512 sequences x 8192 = 4.19M tokens per step.
#          At 2 nodes DP = 4 and GAS = 128: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=2), heaviest pipeline stage, activation checkpointing off:
#          ~52 GB/GPU = weights 4.0 + grads 12.0 + optimizer 12.0 + activations 23.9
#          (2.01B params on the heaviest GPU; plus CUDA/NCCL overhead)
#          At DP=4 the ZeRO-1 optimizer shard halves: ~46 GB/GPU. (python -m threed.memory explains the model.)
# Data     DATA from `threed tokenize --tokenizer $TOKENIZER` (the HF Llama 3 tokenizer directory, 128256 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Meta-Llama-3-8B> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at the same TP, PP and DP; at another node count start a new SAVE with INIT_FROM=<old SAVE>.
# Run      sbatch slurm/train.sh recipes/llama3_8b.sh
# Override any line from the environment (VAR=value sbatch ...; an empty value clears it): see recipes/launch.sh.
MODEL=${MODEL-llama3-8b}
TP=${TP-2}
PP=${PP-2}
MICRO=${MICRO-1}
GAS=${GAS-}
GLOBAL=${GLOBAL-512}
SEQ=${SEQ-8192}
LR=${LR-3e-4}
MIN_LR=${MIN_LR-3e-5}
WARMUP=${WARMUP-200}
STEPS=${STEPS-5000}
DTYPE=${DTYPE-bf16}
ACT_CKPT=${ACT_CKPT-false}
DATA=${DATA-data/llama3/tokens.bin}
TOKENIZER=${TOKENIZER-checkpoints/hf/Meta-Llama-3-8B}
INIT_FROM=${INIT_FROM-}
LOAD=${LOAD-}
SAVE=${SAVE-checkpoints/llama3_8b}
SAVE_INTERVAL=${SAVE_INTERVAL-250}
LOG_INTERVAL=${LOG_INTERVAL-1}
