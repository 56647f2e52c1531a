# Llama 3.1 70B (70.55B params): TP=8 x PP=4 on 4 nodes x 8 GPUs (80 GB), bf16, ZeRO-1.
#
# Layout   TP x PP = 8 x 4 = 32 GPUs hold one model replica; DP = WORLD / 32 grows with the nodes.
# Batch    at 4 nodes x 8 GPUs: DP = 32 / (8 x 4) = 1, GAS = GLOBAL / (MICRO x DP) = 512 / (1 x 1) = 512,
#          train_batch_size = MICRO x GAS x DP = 1 x 512 x 1 = 512 sequences x 8192 = 4.19M tokens per step.
#          At 8 nodes DP = 2 and GAS = 256: the same batch. GLOBAL must stay a multiple of MICRO x DP.
# Memory   per GPU at 4 nodes (DP=1), heaviest pipeline stage, Megatron's sequence parallelism, no recompute,
#          from `threed memory --model llama3.1-70b --tp 8 --pp 4 --dp 1 --micro-batch-size 1 --grad-accum-steps 512 --seq-length 8192
#          --sequence-parallel` (its docstring lists every term; tests/ranks/test_memory*.py check them):
#          ~66 GB/GPU = weights 4.5 + grads 9.1 + optimizer 27.3 + buffers 0.2 + activations 25.3
#          (stage 0 of 4, 2.27B params; plus CUDA/NCCL overhead)
#          Without SP (no recompute) stage 0 needs ~104 GB (activations 62.9): it would have to recompute 12 of its
#          21 blocks (73 GB) or all of them (53 GB). At DP=2 the ZeRO-1 optimizer shard halves: ~53 GB/GPU.
# Speed    predicted by `threed plan --model llama3.1-70b --nodes 4 --gpu-memory 80 --seq-length 8192 --global-batch-size 512
#          --tp 8 --pp 4 --micro-batch-size 1` (a ranking model, threed.plan.steptime, its rates fitted to one H200):
#          146 s/step with SP and no recompute, against 191 s recomputing every block (ACT_CKPT=true, no SP) and 170 s
#          recomputing 12 blocks per stage without SP. Without --tp/--pp/--micro-batch-size it ranks every layout;
#          tp8 pp2 dp2 recomputing 10 of 41 blocks comes first by 0.3% (145.5 s: half the micro-batches per step,
#          each paying the fitted 36 ms), well inside the model's error; this one recomputes nothing.
#          Interleaving (VPP, --vpp): at 4 nodes (GAS 512, bubble 0.6%) the planner keeps VPP=1 (VPP=4: 146.4 s, VPP=2
#          does not fit: 76 GB). At 64 nodes (DP 16, GAS 32) the same command with --nodes 64 picks VPP=4 (5 blocks per
#          virtual stage): 9.8 s/step against 10.4 at VPP=1 (bubble 8.6% -> 2.3%), ~46 GB/GPU against 41:
#          VPP=4 sbatch --nodes=64 slurm/llama70b_tp8_pp4.sh
# Data     DATA: a megatron .bin/.idx prefix or a blend "W1 PREFIX1 W2 PREFIX2" 
#          made by `threed preprocess --append-eod --tokenizer $TOKENIZER` or Megatron-LM (the HF Llama 3 tokenizer directory, 128256 pieces).
# Weights  random init; INIT_FROM=<`threed convert` output of HF Llama-3.1-70B> starts from the HF weights.
#          A requeued or resubmitted job resumes from SAVE/latest instead (weights, optimizer, step, data order)
#          at any TP, PP or DP (another layout or node count goes through a DeepSpeed universal checkpoint).
# Run      sbatch slurm/llama70b_tp8_pp4.sh
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value
# (VAR=value sbatch ...; an empty value clears it).
MODEL=${MODEL-llama3.1-70b}
TP=${TP-8}
PP=${PP-4}
GLOBAL=${GLOBAL-512}
SEQ=${SEQ-8192}
LR=${LR-1.5e-4}
MIN_LR=${MIN_LR-1.5e-5}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL-true}
DATA=${DATA-data/llama3/corpus_text_document}
TOKENIZER=${TOKENIZER-checkpoints/hf/Llama-3.1-70B}
SAVE=${SAVE-checkpoints/llama31_70b}
SAVE_INTERVAL=${SAVE_INTERVAL-100}
