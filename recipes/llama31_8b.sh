# Llama 3.1 8B (8.03B params): TP=2 x PP=2 on 1 node x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 2 x 2 = 4 GPUs hold one model replica; DP = WORLD / 4 grows with the nodes.
# Batch    at 1 node x 8 GPUs: DP = 8 / (2 x 2) = 2, GAS = GLOBAL / (MICRO x DP) = 512 / (1 x 2) = 256,
#          train_batch_size = MICRO x GAS x DP = 1 x 256 x 2 = 512 sequences x 8192 = 4.19M tokens per step.
#          At 2 nodes DP = 4 and GAS = 128: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=2), heaviest pipeline stage, activation checkpointing off,
#          from `threed memory` (its docstring lists every term; tests/ranks/test_memory.py checks them):
#          ~52 GB/GPU = weights 4.2 + grads 8.5 + optimizer 12.7 + buffers 0.1 + activations 26.7
#          (stage 0 of 2, 2.12B params; plus CUDA/NCCL overhead)
#          At DP=4 the ZeRO-1 optimizer shard halves: ~46 GB/GPU. Other layouts, ranked by predicted step time:
#          threed plan --model llama3.1-8b --nodes 1 --gpu-memory 80 --seq-length 8192 --global-batch-size 512
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2" 
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (the HF Llama 3 tokenizer directory, 128256 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-3.1-8B> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch slurm/llama8b_tp2_pp2.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.1-8b}
TP=${TP-2}
PP=${PP-2}
GLOBAL=${GLOBAL-512}
SEQ=${SEQ-8192}
LR=${LR-3e-4}
MIN_LR=${MIN_LR-3e-5}
DATA=${DATA-data/llama3/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-8B}
SAVE=${SAVE-checkpoints/llama31_8b}
SAVE_INTERVAL=${SAVE_INTERVAL-250}
