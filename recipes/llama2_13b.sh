# Llama 2 13B (13.02B params): TP=4 x PP=2 on 1 node x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 4 x 2 = 8 GPUs hold one model replica; DP = WORLD / 8 grows with the nodes.
# Batch    at 1 node x 8 GPUs: DP = 8 / (4 x 2) = 1, GAS = GLOBAL / (MICRO x DP) = 1024 / (1 x 1) = 1024,
#          train_batch_size = MICRO x GAS x DP = 1 x 1024 x 1 = 1024 sequences x 4096 = 4.19M tokens per step.
#          At 2 nodes DP = 2 and GAS = 512: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=1), heaviest pipeline stage, activation checkpointing off:
#          ~45 GB/GPU = weights 3.3 + grads 9.8 + optimizer 19.5 + activations 12.6
#          (1.63B params on the heaviest GPU; plus CUDA/NCCL overhead)
#          At DP=2 the ZeRO-1 optimizer shard halves: ~35 GB/GPU. (python -m threed.memory explains the model.)
# Data     DATA from `threed tokenize --tokenizer $TOKENIZER` (Llama 2's sentencepiece model, 32000 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-2-13b-hf> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at the same TP, PP and DP; at another node count start a new SAVE with INIT_FROM=<old SAVE>.
# Run      sbatch slurm/train.sh recipes/llama2_13b.sh
# Override any line from the environment (VAR=value sbatch ...; an empty value clears it): see recipes/launch.sh.
MODEL=${MODEL-llama2-13b}
TP=${TP-4}
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
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-2-13b-hf/tokenizer.model}
INIT_FROM=${INIT_FROM-}
LOAD=${LOAD-}
SAVE=${SAVE-checkpoints/llama2_13b}
SAVE_INTERVAL=${SAVE_INTERVAL-250}
LOG_INTERVAL=${LOG_INTERVAL-1}
