# Llama 3.1 70B LoRA fine-tuning (chat / instruction data, response-only loss, packed): rank-16 adapters on every
# linear (q k v o gate up down), the base frozen; TP=8 x PP=1 with sequence parallelism on 4 nodes x 8 GPUs (80 GB),
# bf16, ZeRO-1 over the adapters, starting from the HF weights. The layout is the one
#   threed plan --model llama3.1-70b --nodes 4 --gpus-per-node 8 --gpu-memory 80 --seq-length 8192 \
#       --global-batch-size 64 --lora-rank 16
# picks (12.9 s/step predicted, against 18.5 for the full fine-tune's best on the same nodes; docs/finetuning.md).
#
# Layout   TP x PP = 8 x 1 = 8 GPUs (one node) hold one frozen replica; DP = WORLD / 8 = the nodes. No pipeline: with
#          no weight gradients, fp32 master or Adam state for the base, a node holds 70B in bf16 (17.7 GB per GPU),
#          and only the adapters' gradients cross nodes.
# Batch    at 4 nodes x 8 GPUs: DP = 32 / (8 x 1) = 4, GAS = GLOBAL / (MICRO x DP) = 64 / (1 x 4) = 16,
#          train_batch_size = MICRO x GAS x DP = 1 x 16 x 4 = 64 sequences x 8192 = 0.52M positions per step, each
#          a packed row of whole examples. At 8 nodes DP = 8 and GAS = 8: the same batch.
# Memory   per GPU at 4 nodes (DP=4), no recompute, from
#          `threed memory --model llama3.1-70b --tp 8 --pp 1 --dp 4 --micro-batch-size 1 --grad-accum-steps 16 --seq-length 8192 --sequence-parallel --lora-rank 16`:
#          ~65 GB/GPU = weights 17.7 + grads 0.1 + optimizer 0.1 + buffers 0.5 + activations 47.1
#          (stage 0 of 1, 8.82B frozen + 25.89M LoRA params; plus CUDA/NCCL overhead). The full fine-tune needs 4
#          stages and recompute on these nodes (recipes/llama31_70b_sft.sh, ~53 GB/GPU).
# LoRA     LORA_RANK 16 (a multiple of TP 8: q k v gate up shard their rank over TP), LORA_ALPHA 32, LORA_TARGETS
#          unset: all seven.
# Data     DATA: an SFT prefix made by
#            threed preprocess --sft --input chat.jsonl --tokenizer $TOKENIZER --seq-length $SEQ --drop-long \
#                --output-prefix data/sft/chat
#          PACK=true fills each row with whole examples (attention never crosses one).
# Weights  INIT_FROM: `threed convert --hf Llama-3.1-70B-Instruct --tp 8 --pp 1 --out $INIT_FROM`. A requeued job
#          resumes from SAVE/latest instead, at this layout (a LoRA run resumes only at the tp/pp it was saved at).
#          `threed export --lora --ckpt $SAVE --out DIR` writes the adapters as an HF PEFT folder.
# Run      sbatch slurm/llama70b_lora_sft_tp8_pp1.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.1-70b}
TP=${TP-8}
PP=${PP-1}
GLOBAL=${GLOBAL-64}
SEQ=${SEQ-8192}
LR=${LR-1e-4}
MIN_LR=${MIN_LR-1e-5}
WARMUP=${WARMUP-30}
STEPS=${STEPS-1000}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL-true}
DATA=${DATA-data/sft/chat_text_document}
SPLIT=${SPLIT-98,2,0}
PACK=${PACK-true}
EVAL_INTERVAL=${EVAL_INTERVAL-100}
EVAL_ITERS=${EVAL_ITERS-5}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-70B-Instruct}
INIT_FROM=${INIT_FROM-checkpoints/llama31_70b_instruct_tp8_pp1}
SAVE=${SAVE-checkpoints/llama31_70b_lora_sft}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
LORA_RANK=${LORA_RANK-16}
LORA_ALPHA=${LORA_ALPHA-32}
