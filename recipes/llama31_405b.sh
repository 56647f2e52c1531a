# Llama 3.1 405B (405.85B params): TP=8 x PP=16 on 32 nodes x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 8 x 16 = 128 GPUs hold one model replica; DP = WORLD / 128 grows with the nodes.
# Batch    at 32 nodes x 8 GPUs: DP = 256 / (8 x 16) = 2, GAS = GLOBAL / (MICRO x DP) = 1024 / (1 x 2) = 512,
#          train_batch_size = MICRO x GAS x DP = 1 x 512 x 2 = 1024 sequences x 4096 = 4.19M tokens per step.
#          At 64 nodes DP = 4 and GAS = 256: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 32 nodes (DP=2), heaviest pipeline stage, Megatron's sequence parallelism and the first block
#          of each stage recomputed, from `threed memory --model llama3.1-405b --tp 8 --pp 16 --dp 2
#          --micro-batch-size 1 --grad-accum-steps 512 --seq-length 4096 --sequence-parallel --recompute-granularity full --recompute-method block
#          --recompute-num-layers 1` (its docstring lists every term; tests/ranks/test_memory*.py check them):
#          ~70 GB/GPU = weights 6.4 + grads 12.8 + optimizer 19.1 + buffers 0.2 + activations 31.8
#          (stage 1 of 16, 3.19B params; plus CUDA/NCCL overhead)
#          SP without recompute needs ~74 GB, over the 72 GB this recipe allows itself; recomputing every block
#          ~42 GB. At DP=4 the ZeRO-1 optimizer shard halves: ~61 GB/GPU.
# Speed    predicted by `threed plan --model llama3.1-405b --nodes 32 --gpu-memory 80 --seq-length 4096 --global-batch-size 1024
#          --tp 8 --pp 16 --micro-batch-size 1 --reserve 8` (a ranking model, threed.plan.steptime; it chooses this): 100 s/step,
#          against 123 s recomputing every block (ACT_CKPT=true, no SP) and 120 s recomputing 7 of 8 without SP.
#          SEQ=8192: the same command with --seq-length 8192 chooses RECOMPUTE_NUM_LAYERS=5 (~69 GB, 216 s/step
#          against 238 s recomputing every block).
#          No interleaving (VPP=1): Megatron's rule wants pp x vpp to divide the 126 blocks, which no vpp > 1 does at
#          PP=16 (the planner says so on its `interleaving:` line).
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2" 
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (the HF Llama 3 tokenizer directory, 128256 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-3.1-405B> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch slurm/llama405b_tp8_pp16.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.1-405b}
TP=${TP-8}
PP=${PP-16}
GLOBAL=${GLOBAL-1024}
SEQ=${SEQ-4096}
LR=${LR-8e-5}
MIN_LR=${MIN_LR-8e-7}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL-true}
RECOMPUTE_GRANULARITY=${RECOMPUTE_GRANULARITY-full}
RECOMPUTE_METHOD=${RECOMPUTE_METHOD-block}
RECOMPUTE_NUM_LAYERS=${RECOMPUTE_NUM_LAYERS-1}
DATA=${DATA-data/llama3/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-405B}
SAVE=${SAVE-checkpoints/llama31_405b}
SAVE_INTERVAL=${SAVE_INTERVAL-50}
