# Llama 3.1 70B supervised fine-tuning (chat / instruction data, response-only loss, packed): TP=8 x PP=4 on
# 4 nodes x 8 GPUs (80 GB), bf16, ZeRO-1, activation checkpointing, starting from the HF weights.
#
# Layout   TP x PP = 8 x 4 = 32 GPUs hold one model replica; DP = WORLD / 32 grows with the nodes.
# Batch    at 4 nodes x 8 GPUs: DP = 32 / (8 x 4) = 1, GAS = GLOBAL / (MICRO x DP) = 64 / (1 x 1) = 64,
#          train_batch_size = MICRO x GAS x DP = 1 x 64 x 1 = 64 sequences x 8192 = 0.52M positions per step, each
#          a packed row of whole examples.
#          At 8 nodes DP = 2 and GAS = 32: the same batch. GLOBAL must stay a multiple of MICRO x DP.
#          GAS 64 over PP 4 keeps the pipeline bubble at (PP - 1) / (GAS + PP - 1) = 4.5%.
# Memory   per GPU at 4 nodes (DP=1), heaviest pipeline stage, activation checkpointing on, from
#          `threed memory --model llama3.1-70b --tp 8 --pp 4 --dp 1 --micro-batch-size 1 --grad-accum-steps 64 --seq-length 8192 --activation-checkpointing 1`:
#          ~53 GB/GPU = weights 4.5 + grads 9.1 + optimizer 27.3 + buffers 0.1 + activations 12.2
#          (stage 0 of 4; plus CUDA/NCCL overhead). At DP=2 the ZeRO-1 optimizer shard halves: ~40 GB/GPU.
# Loss     sum of the response tokens' losses / their count over the whole global batch; validation on the SPLIT's
#          held-out 2% reports the same masked loss.
# Data     DATA: an SFT prefix made by
#            threed preprocess --sft --input chat.jsonl --tokenizer $TOKENIZER --seq-length $SEQ --drop-long \
#                --output-prefix data/sft/chat
#          (the tokenizer's own chat template; writes data/sft/chat_text_document + chat_mask_document).
#          PACK=true fills each row with whole examples (attention never crosses one); PACK=false: one per row.
# Weights  INIT_FROM: `threed convert --hf Llama-3.1-70B-Instruct --tp 8 --pp 4 --out $INIT_FROM` (weights only;
#          the fine-tuning schedule below starts fresh). A requeued job resumes from SAVE/latest instead, at any
#          layout. `threed export --ckpt $SAVE --out DIR` gives an HF folder whose chat template still applies.
# Run      sbatch slurm/llama70b_sft_tp8_pp4.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.1-70b}
TP=${TP-8}
PP=${PP-4}
GLOBAL=${GLOBAL-64}
SEQ=${SEQ-8192}
LR=${LR-1e-5}
MIN_LR=${MIN_LR-1e-6}
WARMUP=${WARMUP-30}
STEPS=${STEPS-1000}
ACT_CKPT=${ACT_CKPT-true}
DATA=${DATA-data/sft/chat_text_document}
SPLIT=${SPLIT-98,2,0}
PACK=${PACK-true}
EVAL_INTERVAL=${EVAL_INTERVAL-100}
EVAL_ITERS=${EVAL_ITERS-5}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-70B-Instruct}
INIT_FROM=${INIT_FROM-checkpoints/llama31_70b_instruct_tp8_pp4}
SAVE=${SAVE-checkpoints/llama31_70b_sft}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
