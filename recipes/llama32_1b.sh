# Llama 3.2 1B (1.24B params; the LM head is the embedding, tied): TP=1 x PP=1 on 1 node x 8 GPUs (80 GB), bf16,
# ZeRO-1. Pure data parallel: `threed plan` ranks it first on one node.
#
# Layout   TP x PP = 1 x 1: every GPU holds the whole model, the tied [128256, 2048] weight once (one stage serves
#          as embedding and LM head); DP = WORLD grows with the nodes.
# Batch    at 1 node x 8 GPUs: DP = 8 / (1 x 1) = 8, GAS = GLOBAL / (MICRO x DP) = 512 / (1 x 8) = 64,
#          train_batch_size = MICRO x GAS x DP = 1 x 64 x 8 = 512 sequences x 8192 = 4.19M tokens per step.
#          At 2 nodes DP = 16 and GAS = 32: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=8), activation checkpointing off, from
#          `threed memory --model llama3.2-1b --tp 1 --pp 1 --dp 8 --micro-batch-size 1 --grad-accum-steps 64 --seq-length 8192`:
#          ~27 GB/GPU = weights 2.5 + grads 4.9 + optimizer 1.9 + buffers 0.0 + activations 17.6
#          (stage 0 of 1, 1.24B params; plus CUDA/NCCL overhead; the last stage keeps no logits between
#          micro-batches: threed.parallel.lean_engine). At DP=16 the ZeRO-1 optimizer shard halves: ~26 GB/GPU.
#          Other layouts, ranked by predicted step time:
#          threed plan --model llama3.2-1b --nodes 1 --gpu-memory 80 --seq-length 8192 --global-batch-size 512
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2"
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (the HF Llama 3 tokenizer
#          directory, 128256 pieces; Llama 3.2 uses the same one).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-3.2-1B> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch slurm/train.sh recipes/llama32_1b.sh     (one node: GPUS_PER_NODE=8 recipes/launch.sh ...)
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.2-1b}
TP=${TP-1}
PP=${PP-1}
GLOBAL=${GLOBAL-512}
SEQ=${SEQ-8192}
LR=${LR-3e-4}
MIN_LR=${MIN_LR-3e-5}
DATA=${DATA-data/llama3/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.2-1B}
SAVE=${SAVE-checkpoints/llama32_1b}
SAVE_INTERVAL=${SAVE_INTERVAL-250}
