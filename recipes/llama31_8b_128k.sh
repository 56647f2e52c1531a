# Llama 3.1 8B (8.03B params) at 128K tokens: TP=4 x CP=2 on 1 node x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP x CP = 4 x 1 x 2 = 8 GPUs share one sample; DP = WORLD / 8 grows with the nodes. CP (context
#          parallelism, threed.model.context) cuts each 131072-token row into 4 chunks; CP rank i holds chunks i
#          and 3-i and all-gathers the row's K and V in every block. CP ranks hold the same weights; gradients
#          reduce and ZeRO-1 shards over DP x CP. Megatron's sequence parallelism splits each rank's share over TP.
# Batch    at 1 node x 8 GPUs: DP = 8 / (4 x 1 x 2) = 1, GAS = GLOBAL / (MICRO x DP) = 16 / (1 x 1) = 16,
#          train_batch_size = MICRO x GAS x DP = 1 x 16 x 1 = 16 sequences x 131072 = 2.10M tokens per step.
#          At 2 nodes DP = 2 and GAS = 8: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 1 node (DP=1), sequence parallelism, the first 24 of 32 blocks recomputed, from
#          `threed memory --model llama3.1-8b --tp 4 --pp 1 --cp 2 --dp 1 --micro-batch-size 1 --grad-accum-steps 16
#          --seq-length 131072 --sequence-parallel --recompute-granularity full --recompute-method block
#          --recompute-num-layers 24` (its docstring lists every term, the gathered K/V included):
#          ~63 GB/GPU = weights 4.0 + grads 8.0 + optimizer 12.0 + buffers 1.6 + activations 37.1
#          (stage 0 of 1, 2.01B params; plus CUDA/NCCL overhead)
#          (The last stage keeps no logits between micro-batches: threed.parallel.lean_engine.) The CP memory terms are the
#          model's count of threed.model.context's tensors, checked against CP engines on CPU ranks
#          (tests/ranks/test_memory_cp.py); not yet measured on GPUs.
# Speed    predicted by `threed plan --model llama3.1-8b --nodes 1 --gpu-memory 80 --seq-length 131072
#          --global-batch-size 16 --reserve 8` (a ranking model, threed.plan.steptime; it chooses this): 138 s/step,
#          against 143 s for the best layout without CP (tp8, 22 of 32 blocks recomputed). On one node tp x cp <= 8
#          either way, so each rank holds 1/8 of the activations both ways: CP's gain here is smaller TP
#          collectives, not less recompute. More nodes (DP) or 16 GPUs per sample (cp 4 x tp 4) recompute less.
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2" of long documents
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (the HF Llama 3 tokenizer directory, 128256 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-3.1-8B> starts from the HF weights (long-
#          context continued pretraining: CP does not change the weights, so a checkpoint converted at cp 1 loads).
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP, CP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch slurm/llama8b_128k_tp4_cp2.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.1-8b}
TP=${TP-4}
PP=${PP-1}
CP=${CP-2}
GLOBAL=${GLOBAL-16}
SEQ=${SEQ-131072}
LR=${LR-3e-4}
MIN_LR=${MIN_LR-3e-5}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL-true}
RECOMPUTE_GRANULARITY=${RECOMPUTE_GRANULARITY-full}
RECOMPUTE_METHOD=${RECOMPUTE_METHOD-block}
RECOMPUTE_NUM_LAYERS=${RECOMPUTE_NUM_LAYERS-24}
DATA=${DATA-data/llama3/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-8B}
SAVE=${SAVE-checkpoints/llama31_8b_128k}
SAVE_INTERVAL=${SAVE_INTERVAL-250}
