# Llama 3.1 70B (70.55B params) at 64K tokens: TP=8 x PP=2 x CP=4 on 8 nodes x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP x CP = 8 x 2 x 4 = 64 GPUs share one sample; DP = WORLD / 64 grows with the nodes. CP (context
#          parallelism, threed.model.context) cuts each 65536-token row into 8 chunks; CP rank i holds chunks i
#          and 7-i and all-gathers the row's K and V in every block. CP ranks hold the same weights; gradients
#          reduce and ZeRO-1 shards over DP x CP. Megatron's sequence parallelism splits each rank's share over TP.
#          In megatron-core's rank order (tp-cp-dp-pp) a CP group spans tp x cp = 32 ranks: 4 nodes, so its
#          all-gathers cross the network (the step-time model counts them there).
# Batch    at 8 nodes x 8 GPUs: DP = 64 / (8 x 2 x 4) = 1, GAS = GLOBAL / (MICRO x DP) = 64 / (1 x 1) = 64,
#          train_batch_size = MICRO x GAS x DP = 1 x 64 x 1 = 64 sequences x 65536 = 4.19M tokens per step.
#          At 16 nodes DP = 2 and GAS = 32: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 8 nodes (DP=1), heaviest pipeline stage, sequence parallelism, the first 18 of each stage's 40
#          blocks recomputed, from `threed memory --model llama3.1-70b --tp 8 --pp 2 --cp 4 --dp 1
#          --micro-batch-size 1 --grad-accum-steps 64 --seq-length 65536 --sequence-parallel
#          --recompute-granularity full --recompute-method block --recompute-num-layers 18` (its docstring lists
#          every term, the gathered K/V included):
#          ~71 GB/GPU = weights 8.8 + grads 17.6 + optimizer 13.2 + buffers 0.6 + activations 30.5
#          (stage 0 of 2, 4.41B params; plus CUDA/NCCL overhead)
#          The CP memory terms are the model's count of threed.model.context's tensors, checked against CP
#          engines on CPU ranks (tests/ranks/test_memory_cp.py); not yet measured on GPUs.
# Speed    predicted by `threed plan --model llama3.1-70b --nodes 8 --gpu-memory 80 --seq-length 65536
#          --global-batch-size 64 --reserve 8` (a ranking model, threed.plan.steptime; it chooses this): 135 s/step,
#          against 156 s for the best layout without CP (tp8 pp2 dp4, gas 16, 37 of 40 blocks recomputed): with
#          a quarter of each sequence per rank it recomputes 18 blocks instead of 37, and gas 64 leaves a 1.5%
#          bubble instead of 5.9%.
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2" of long documents
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (the HF Llama 3 tokenizer directory, 128256 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-3.1-70B> starts from the HF weights (long-
#          context continued pretraining: CP does not change the weights, so a checkpoint converted at cp 1 loads).
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP, CP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch slurm/llama70b_64k_tp8_pp2_cp4.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.1-70b}
TP=${TP-8}
PP=${PP-2}
CP=${CP-4}
GLOBAL=${GLOBAL-64}
SEQ=${SEQ-65536}
LR=${LR-1.5e-4}
MIN_LR=${MIN_LR-1.5e-5}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL-true}
RECOMPUTE_GRANULARITY=${RECOMPUTE_GRANULARITY-full}
RECOMPUTE_METHOD=${RECOMPUTE_METHOD-block}
RECOMPUTE_NUM_LAYERS=${RECOMPUTE_NUM_LAYERS-18}
DATA=${DATA-data/llama3/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-70B}
SAVE=${SAVE-checkpoints/llama31_70b_64k}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
