# Llama 2 70B (68.98B params): TP=8 x PP=4 on 4 nodes x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 8 x 4 = 32 GPUs hold one model replica; DP = WORLD / 32 grows with the nodes.
# Batch    at 4 nodes x 8 GPUs: DP = 32 / (8 x 4) = 1, GAS = GLOBAL / (MICRO x DP) = 1024 / (1 x 1) = 1024,
#          train_batch_size = MICRO x GAS x DP = 1 x 1024 x 1 = 1024 sequences x 4096 = 4.19M tokens per step.
#          At 8 nodes DP = 2 and GAS = 512: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 4 nodes (DP=1), heaviest pipeline stage, activation checkpointing on,
#          from `threed memory` (its docstring lists every term; tests/ranks/test_memory.py checks them):
#          ~45 GB/GPU = weights 4.3 + grads 8.7 + optimizer 26.1 + buffers 0.1 + activations 6.1
#          (stage 0 of 4, 2.17B params; plus CUDA/NCCL overhead)
#          At DP=2 the ZeRO-1 optimizer shard halves: ~32 GB/GPU. Other layouts, ranked by predicted step time:
#          threed plan --model llama2-70b --nodes 4 --gpu-memory 80 --seq-length 4096 --global-batch-size 1024
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2" 
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (Llama 2's sentencepiece model, 32000 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-2-70b-hf> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch --nodes=4 slurm/train.sh recipes/llama2_70b.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama2-70b}
TP=${TP-8}
PP=${PP-4}
GLOBAL=${GLOBAL-1024}
SEQ=${SEQ-4096}
LR=${LR-1.5e-4}
MIN_LR=${MIN_LR-1.5e-5}
ACT_CKPT=${ACT_CKPT-true}
DATA=${DATA-data/llama2/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-2-70b-hf/tokenizer.model}
SAVE=${SAVE-checkpoints/llama2_70b}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
