# Llama 2 7B (6.74B params): TP=2 x PP=2 on 1 node x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 2 x 2 = 4 GPUs hold one model replica; DP = WORLD / 4 grows with the nodes.
# Batch    at 1 node x 8 GPUs: DP = 8 / (2 x 2) = 2, GAS = GLOBAL / (MICRO x DP) = 1024 / (1 x 2) = 512,
#          train_batch_size = MICRO x GAS x DP = 1 x 512 x 2 = 1024 sequences x 4096 = 4.19M tokens per step.
#          At 2 nodes DP = 4 and GAS = 256: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=2), heaviest pipeline stage, activation checkpointing off:
#          ~35 GB/GPU = weights 3.4 + grads 10.1 + optimizer 10.1 + activations 11.8
#          (1.68B params on the heaviest GPU; plus CUDA/NCCL overhead)
#          At DP=4 the ZeRO-1 optimizer shard halves: ~30 GB/GPU. (python -m threed.memory explains the model.)
# Data     DATA from `threed tokenize --tokenizer $TOKENIZER` (Llama 2's sentencepiece model, 32000 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-2-7b-hf> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at the same TP, PP and DP; at another node count start a new SAVE with INIT_FROM=<old SAVE>.
# Run      sbatch slurm/train.sh recipes/llama2_7b.sh
# Override any line from the environment (VAR=value sbatch ...; an empty value clears it): see recipes/launch.sh.
MODEL=${MODEL-llama2-7b}
TP=${TP-2}
PP=${PP-2}
MICRO=${MICRO-1}
GAS=${GAS-}
GLOBAL=${GLOBAL-1024}
SEQ=${SEQ-4096}
LR=${LR-3e-4}
MIN_LR=${MIN_LR-3e-5}
WARMUP=${WARMUP-200}
STEPS=${STEPS-5000}
DTYPE=${DTYPE-bf16}
ACT_CKPT=${ACT_CKPT-false}
DATA=${DATA-data/llama2/tokens.bin}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-2-7b-hf/tokenizer.model}
INIT_FROM=${INIT_FROM-}
LOAD=${LOAD-}
SAVE=${SAVE-checkpoints/llama2_7b}
SAVE_INTERVAL=${SAVE_INTERVAL-250}
LOG_INTERVAL=${LOG_INTERVAL-1}
