# Llama 3.1 8B supervised fine-tuning (chat / instruction data, response-only loss, packed): TP=2 x PP=2 on 1 node
# x 8 GPUs (80 GB), bf16, ZeRO-1, starting from the HF weights.
#
# Layout   TP x PP = 2 x 2 = 4 GPUs hold one model replica; DP = WORLD / 4 grows with the nodes.
# Batch    at 1 node x 8 GPUs: DP = 8 / (2 x 2) = 2, GAS = GLOBAL / (MICRO x DP) = 64 / (1 x 2) = 32,
#          train_batch_size = MICRO x GAS x DP = 1 x 32 x 2 = 64 sequences x 8192 = 0.52M positions per step, each
#          a packed row of whole examples (~90% real tokens with chat-length examples: benchmarks/bench_packing.py). At 2 nodes DP = 4 and
#          GAS = 16: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=2), heaviest pipeline stage, activation checkpointing off, from
#          `threed memory --model llama3.1-8b --tp 2 --pp 2 --dp 2 --micro-batch-size 1 --grad-accum-steps 32 --seq-length 8192`:
#          ~52 GB/GPU = weights 4.2 + grads 8.5 + optimizer 12.7 + buffers 0.1 + activations 26.7
#          (stage 0 of 2; plus CUDA/NCCL overhead; packed attention on CUDA is varlen flash: no s x s mask).
# Loss     sum of the response tokens' losses / their count over the whole global batch (every answer token weighs
#          the same wherever it landed); validation on the SPLIT's held-out 2% reports the same masked loss.
# Data     DATA: an SFT prefix made by
#            threed preprocess --sft --input chat.jsonl --tokenizer $TOKENIZER --seq-length $SEQ --drop-long \
#                --output-prefix data/sft/chat
#          (the tokenizer's own chat template; writes data/sft/chat_text_document + chat_mask_document).
#          PACK=true fills each row with whole examples (attention never crosses one); PACK=false: one per row.
# Weights  INIT_FROM: `threed convert --hf Llama-3.1-8B-Instruct --tp 2 --pp 2 --out $INIT_FROM` (weights only;
#          the fine-tuning schedule below starts fresh). A requeued job resumes from SAVE/latest instead.
#          `threed export --ckpt $SAVE --out DIR` gives an HF folder whose chat template still applies.
# Run      sbatch slurm/train.sh recipes/llama31_8b_sft.sh     (one node: GPUS_PER_NODE=8 recipes/launch.sh ...)
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value ...; an empty value clears it).
MODEL=${MODEL-llama3.1-8b}
TP=${TP-2}
PP=${PP-2}
GLOBAL=${GLOBAL-64}
SEQ=${SEQ-8192}
LR=${LR-2e-5}
MIN_LR=${MIN_LR-2e-6}
WARMUP=${WARMUP-30}
STEPS=${STEPS-1000}
DATA=${DATA-data/sft/chat_text_document}
SPLIT=${SPLIT-98,2,0}
PACK=${PACK-true}
EVAL_INTERVAL=${EVAL_INTERVAL-100}
EVAL_ITERS=${EVAL_ITERS-5}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-8B-Instruct}
INIT_FROM=${INIT_FROM-checkpoints/llama31_8b_instruct_tp2_pp2}
SAVE=${SAVE-checkpoints/llama31_8b_sft}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
