# Llama 2 13B (13.02B params): TP=4 x PP=2 on 1 node x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 4 x 2 = 8 GPUs hold one model replica; DP = WORLD / 8 grows with the nodes.
# Batch    at 1 node x 8 GPUs: DP = 8 / (4 x 2) = 1, GAS = GLOBAL / (MICRO x DP) = 1024 / (1 x 1) = 1024,
#          train_batch_size = MICRO x GAS x DP = 1 x 1024 x 1 = 1024 sequences x 4096 = 4.19M tokens per step.
#          At 2 nodes DP = 2 and GAS = 512: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=1), heaviest pipeline stage, activation checkpointing off,
#          from `threed memory` (its docstring lists every term; tests/ranks/test_memory.py checks them):
#          ~42 GB/GPU = weights 3.3 + grads 6.5 + optimizer 19.5 + buffers 0.1 + activations 13.0
#          (stage 0 of 2, 1.63B params; plus CUDA/NCCL overhead)
#          At DP=2 the ZeRO-1 optimizer shard halves: ~33 GB/GPU. Other layouts, ranked by predicted step time:
#          threed plan --model llama2-13b --nodes 1 --gpu-memory 80 --seq-length 4096 --global-batch-size 1024
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2" 
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (Llama 2's sentencepiece model, 32000 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-2-13b-hf> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch slurm/train.sh recipes/llama2_13b.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama2-13b}
TP=${TP-4}
PP=${PP-2}
GLOBAL=${GLOBAL-1024}
SEQ=${SEQ-4096}
LR=${LR-3e-4}
MIN_LR=${MIN_LR-3e-5}
DATA=${DATA-data/llama2/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-2-13b-hf/tokenizer.model}
SAVE=${SAVE-checkpoints/llama2_13b}
SAVE_INTERVAL=${SAVE_INTERVAL-250}
