# Llama 3.2 3B supervised fine-tuning (chat / instruction data, response-only loss, packed): TP=2 x PP=1 on 1 node
# x 8 GPUs (80 GB), bf16, ZeRO-1, starting from the HF weights.
#
# Layout   TP x PP = 2 x 1 = 2 GPUs hold one model replica; DP = WORLD / 2 grows with the nodes. One stage: the
#          tied embedding / LM head weight is held once, its vocabulary split over TP ([64128, 3072] per GPU).
#          No pipeline, so the small SFT batch has no bubble (PP=2 would idle (PP - 1) / (GAS + PP - 1) = 5.9%);
#          `threed plan` predicts TP=1 x PP=1 (DP=8, ~58 GB/GPU) 4% faster, TP=2 leaves room for MICRO=2.
# Batch    at 1 node x 8 GPUs: DP = 8 / (2 x 1) = 4, GAS = GLOBAL / (MICRO x DP) = 64 / (1 x 4) = 16,
#          train_batch_size = MICRO x GAS x DP = 1 x 16 x 4 = 64 sequences x 8192 = 0.52M positions per step, each
#          a packed row of whole examples. At 2 nodes DP = 8 and GAS = 8: the same batch. GLOBAL must stay a
#          multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=4), activation checkpointing off, from
#          `threed memory --model llama3.2-3b --tp 2 --pp 1 --dp 4 --micro-batch-size 1 --grad-accum-steps 16 --seq-length 8192`:
#          ~33 GB/GPU = weights 3.2 + grads 6.4 + optimizer 4.8 + buffers 0.1 + activations 18.0
#          (stage 0 of 1, 1.61B params; plus CUDA/NCCL overhead; packed attention on CUDA is varlen flash: no s x s
#          mask). At DP=8 the ZeRO-1 optimizer shard halves: ~30 GB/GPU. Other layouts:
#          threed plan --model llama3.2-3b --nodes 1 --gpu-memory 80 --seq-length 8192 --global-batch-size 64
# Loss     sum of the response tokens' losses / their count over the whole global batch (every answer token weighs
#          the same wherever it landed); validation on the SPLIT's held-out 2% reports the same masked loss.
# Data     DATA: an SFT prefix made by
#            threed preprocess --sft --input chat.jsonl --tokenizer $TOKENIZER --seq-length $SEQ --drop-long \
#                --output-prefix data/sft/chat
#          (the tokenizer's own chat template; writes data/sft/chat_text_document + chat_mask_document).
#          PACK=true fills each row with whole examples (attention never crosses one); PACK=false: one per row.
# Weights  INIT_FROM: `threed convert --hf Llama-3.2-3B-Instruct --tp 2 --pp 1 --out $INIT_FROM` (weights only;
#          the fine-tuning schedule below starts fresh). A requeued job resumes from SAVE/latest instead.
#          `threed export --ckpt $SAVE --out DIR` gives an HF folder whose chat template still applies.
# Run      sbatch slurm/train.sh recipes/llama32_3b_sft.sh     (one node: GPUS_PER_NODE=8 recipes/launch.sh ...)
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value ...; an empty value clears it).
MODEL=${MODEL-llama3.2-3b}
TP=${TP-2}
PP=${PP-1}
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
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.2-3B-Instruct}
INIT_FROM=${INIT_FROM-checkpoints/llama32_3b_instruct_tp2_pp1}
SAVE=${SAVE-checkpoints/llama32_3b_sft}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
