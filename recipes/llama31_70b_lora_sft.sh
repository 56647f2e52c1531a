# Llama 3.1 70B LoRA fine-tuning (chat / instruction data, response-only loss, packed): rank-16 adapters on every
# linear (q k v o gate up down), the base frozen; TP=4 x PP=1 with sequence parallelism and the first 43 of 80 blocks
# recomputed, on 4 nodes x 8 GPUs (80 GB), bf16, ZeRO-1 over the adapters, starting from the HF weights. The layout is
# the one
#   threed plan --model llama3.1-70b --nodes 4 --gpus-per-node 8 --gpu-memory 80 --seq-length 8192 \
#       --global-batch-size 64 --reserve 8 --vpp 1 --lora-rank 16
# picks (15.1 s/step predicted, against 18.5 for the full fine-tune's best on the same nodes; docs/finetuning.md):
# --reserve 8 keeps the estimate at 72 GB or less, as every recipe here; --vpp 1 because LoRA has not been run
# interleaved yet (without it: tp2 pp2 vpp4, 14.9 s/step).
#
# Layout   TP x PP = 4 x 1 = 4 GPUs hold one frozen replica (35.4 GB of bf16 weights per GPU); DP = WORLD / 4. No
#          pipeline: with no weight gradients, fp32 master or Adam state for the base, half a node holds 70B, and only
#          the adapters' gradients cross nodes.
# Batch    at 4 nodes x 8 GPUs: DP = 32 / (4 x 1) = 8, GAS = GLOBAL / (MICRO x DP) = 64 / (1 x 8) = 8,
#          train_batch_size = MICRO x GAS x DP = 1 x 8 x 8 = 64 sequences x 8192 = 0.52M positions per step, each
#          a packed row of whole examples. At 8 nodes DP = 16 and GAS = 4: the same batch.
# Memory   per GPU at 4 nodes (DP=8), from
#          `threed memory --model llama3.1-70b --tp 4 --pp 1 --dp 8 --micro-batch-size 1 --grad-accum-steps 8 --seq-length 8192 --sequence-parallel --recompute-granularity full --recompute-method block --recompute-num-layers 43 --lora-rank 16`:
#          ~72 GB/GPU = weights 35.4 + grads 0.2 + optimizer 0.1 + buffers 0.5 + activations 35.6
#          (stage 0 of 1, 17.64B frozen + 51.77M LoRA params; plus CUDA/NCCL overhead). The full fine-tune at this
#          layout would need ~159 GB/GPU; it needs 4 stages and recompute on these nodes (recipes/llama31_70b_sft.sh).
# LoRA     LORA_RANK 16 (a multiple of TP 4: q k v gate up shard their rank over TP), LORA_ALPHA 32, LORA_TARGETS
#          unset: all seven. Recompute needs LORA_DROPOUT 0 (the default; training refuses both).
# Data     DATA: an SFT prefix made by
#            threed preprocess --sft --input chat.jsonl --tokenizer $TOKENIZER --seq-length $SEQ --drop-long \
#                --output-prefix data/sft/chat
#          PACK=true fills each row with whole examples (attention never crosses one).
# Weights  INIT_FROM: `threed convert --hf Llama-3.1-70B-Instruct --tp 4 --pp 1 --out $INIT_FROM`. A requeued job
#          resumes from SAVE/latest instead, at this layout (a LoRA run resumes only at the tp/pp it was saved at).
#          `threed export --lora --ckpt $SAVE --out DIR` writes the adapters as an HF PEFT folder.
# Run      sbatch slurm/llama70b_lora_sft_tp4_pp1.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.1-70b}
TP=${TP-4}
PP=${PP-1}
GLOBAL=${GLOBAL-64}
SEQ=${SEQ-8192}
LR=${LR-1e-4}
MIN_LR=${MIN_LR-1e-5}
WARMUP=${WARMUP-30}
STEPS=${STEPS-1000}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL-true}
RECOMPUTE_GRANULARITY=${RECOMPUTE_GRANULARITY-full}
RECOMPUTE_METHOD=${RECOMPUTE_METHOD-block}
RECOMPUTE_NUM_LAYERS=${RECOMPUTE_NUM_LAYERS-43}
DATA=${DATA-data/sft/chat_text_document}
SPLIT=${SPLIT-98,2,0}
PACK=${PACK-true}
EVAL_INTERVAL=${EVAL_INTERVAL-100}
EVAL_ITERS=${EVAL_ITERS-5}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-70B-Instruct}
INIT_FROM=${INIT_FROM-checkpoints/llama31_70b_instruct_tp4_pp1}
SAVE=${SAVE-checkpoints/llama31_70b_lora_sft}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
LORA_RANK=${LORA_RANK-16}
LORA_ALPHA=${LORA_ALPHA-32}
