# Llama 3.2 3B (3.21B params; the LM head is the embedding, tied): TP=1 x PP=2 on 1 node x 8 GPUs (80 GB), bf16,
# ZeRO-1.
#
# Layout   TP x PP = 1 x 2 = 2 GPUs hold one model replica; DP = WORLD / 2 grows with the nodes. The first and the
#          last stage each hold a copy of the tied [128256, 3072] weight (0.39B params, with its fp32 gradient,
#          master and AdamW shard), and DeepSpeed all-reduces its gradient between them every step.
#          `threed plan` predicts TP=1 x PP=1 (DP=8, ~58 GB/GPU) 3% faster; PP=2 keeps 15 GB more headroom.
# Batch    at 1 node x 8 GPUs: DP = 8 / (1 x 2) = 4, GAS = GLOBAL / (MICRO x DP) = 512 / (1 x 4) = 128,
#          train_batch_size = MICRO x GAS x DP = 1 x 128 x 4 = 512 sequences x 8192 = 4.19M tokens per step.
#          At 2 nodes DP = 8 and GAS = 64: the same batch. GLOBAL must stay a multiple of MICRO x DP.
#          GAS 128 over PP 2 keeps the pipeline bubble at (PP - 1) / (GAS + PP - 1) = 0.8%.
# Memory   per GPU at 1 node (DP=4), heaviest pipeline stage, activation checkpointing off, from
#          `threed memory --model llama3.2-3b --tp 1 --pp 2 --dp 4 --micro-batch-size 1 --grad-accum-steps 128 --seq-length 8192`:
#          ~43 GB/GPU = weights 3.8 + grads 7.6 + optimizer 5.7 + buffers 0.1 + activations 25.8
#          (stage 0 of 2, 1.90B params; plus CUDA/NCCL overhead; stage 1: ~38 GB). At DP=8 the ZeRO-1 optimizer
#          shard halves: ~40 GB/GPU. Other layouts, ranked by predicted step time:
#          threed plan --model llama3.2-3b --nodes 1 --gpu-memory 80 --seq-length 8192 --global-batch-size 512
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2"
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (the HF Llama 3 tokenizer
#          directory, 128256 pieces; Llama 3.2 uses the same one).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-3.2-3B> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch slurm/train.sh recipes/llama32_3b.sh     (one node: GPUS_PER_NODE=8 recipes/launch.sh ...)
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.2-3b}
TP=${TP-1}
PP=${PP-2}
GLOBAL=${GLOBAL-512}
SEQ=${SEQ-8192}
LR=${LR-3e-4}
MIN_LR=${MIN_LR-3e-5}
DATA=${DATA-data/llama3/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.2-3B}
SAVE=${SAVE-checkpoints/llama32_3b}
SAVE_INTERVAL=${SAVE_INTERVAL-250}
