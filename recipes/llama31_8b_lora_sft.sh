# Llama 3.1 8B LoRA fine-tuning (chat / instruction data, response-only loss, packed): rank-16 adapters on every
# linear (q k v o gate up down), the base frozen; one model replica per GPU (TP=1 x PP=1) on 1 node x 8 GPUs (80 GB),
# bf16, ZeRO-1 over the adapters, starting from the HF weights. The layout is the one
#   threed plan --model llama3.1-8b --nodes 1 --gpu-memory 80 --seq-length 8192 --global-batch-size 64 --lora-rank 16
# picks (docs/finetuning.md: LoRA against the full fine-tune of recipes/llama31_8b_sft.sh).
#
# Layout   TP x PP = 1 x 1: every GPU holds the whole frozen base (16 GB in bf16) and its adapters; DP = WORLD.
# Batch    at 1 node x 8 GPUs: DP = 8 / (1 x 1) = 8, GAS = GLOBAL / (MICRO x DP) = 64 / (1 x 8) = 8,
#          train_batch_size = MICRO x GAS x DP = 1 x 8 x 8 = 64 sequences x 8192 = 0.52M positions per step, each
#          a packed row of whole examples. At 2 nodes DP = 16 and GAS = 4: the same batch.
# Memory   per GPU at 1 node (DP=8), activation checkpointing off, from
#          `threed memory --model llama3.1-8b --tp 1 --pp 1 --dp 8 --micro-batch-size 1 --grad-accum-steps 8 --seq-length 8192 --lora-rank 16`:
#          ~63 GB/GPU = weights 16.1 + grads 0.2 + optimizer 0.1 + buffers 0.1 + activations 46.0
#          (stage 0 of 1, 8.03B frozen + 41.94M LoRA params; plus CUDA/NCCL overhead). The full fine-tune at this
#          layout would need ~107 GB/GPU (grads 32.1 + optimizer 12.0 of them).
# LoRA     LORA_RANK 16, LORA_ALPHA 32 (adapters add alpha / rank x B A x), LORA_TARGETS unset: all seven. A learning
#          rate ten times a full fine-tune's, as LoRA usually takes.
# Data     DATA: an SFT prefix made by
#            threed preprocess --sft --input chat.jsonl --tokenizer $TOKENIZER --seq-length $SEQ --drop-long \
#                --output-prefix data/sft/chat
#          PACK=true fills each row with whole examples (attention never crosses one).
# Weights  INIT_FROM: `threed convert --hf Llama-3.1-8B-Instruct --tp 1 --pp 1 --out $INIT_FROM`. A requeued job
#          resumes from SAVE/latest instead, at this layout (a LoRA run resumes only at the tp/pp it was saved at).
#          `threed export --lora --ckpt $SAVE --out DIR` writes the adapters as an HF PEFT folder.
# Run      sbatch slurm/llama8b_lora_sft_tp1_pp1.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value ...; an empty value clears it).
MODEL=${MODEL-llama3.1-8b}
TP=${TP-1}
PP=${PP-1}
GLOBAL=${GLOBAL-64}
SEQ=${SEQ-8192}
LR=${LR-2e-4}
MIN_LR=${MIN_LR-2e-5}
WARMUP=${WARMUP-30}
STEPS=${STEPS-1000}
DATA=${DATA-data/sft/chat_text_document}
SPLIT=${SPLIT-98,2,0}
PACK=${PACK-true}
EVAL_INTERVAL=${EVAL_INTERVAL-100}
EVAL_ITERS=${EVAL_ITERS-5}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-8B-Instruct}
INIT_FROM=${INIT_FROM-checkpoints/llama31_8b_instruct_tp1_pp1}
SAVE=${SAVE-checkpoints/llama31_8b_lora_sft}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
LORA_RANK=${LORA_RANK-16}
LORA_ALPHA=${LORA_ALPHA-32}
