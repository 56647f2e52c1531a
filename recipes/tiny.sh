# Tiny Llama (hidden 64, 4 layers, 4 heads / 2 KV heads, vocab 512) for CPU: the demo and the tests.
#
# Layout   TP=2 x PP=2 = 4 ranks per model replica; DP = WORLD / 4.
# Batch    at 1 node x 8 ranks: DP = 8 / (2 x 2) = 2, train_batch_size = MICRO x GAS x DP = 4 x 4 x 2 = 32
#          sequences x 128 tokens = 4096 tokens per step. 2 nodes x 4 ranks is the same world (DP=2).
# Memory   ~0.5 GB of host memory per rank, almost all of it imports (torch, DeepSpeed, megatron-core).
# Data     `bash tools/demo.sh` (or `threed demo-text`, `threed tokenizer`, `threed preprocess`) makes runs/demo/.
# Run      recipes/launch.sh recipes/tiny.sh
#          sbatch --nodes=2 --gres=none slurm/train.sh recipes/tiny.sh   (with GPUS_PER_NODE=4 in the environment)
# Unset here: the launcher's defaults (recipes/launch.sh). The environment overrides any value (VAR=value ...;
# an empty value clears it).
MODEL=${MODEL-tiny}
TP=${TP-2}
PP=${PP-2}
MICRO=${MICRO-4}
GAS=${GAS-4}
SEQ=${SEQ-128}
LR=${LR-3e-3}
MIN_LR=${MIN_LR-3e-4}
WARMUP=${WARMUP-5}
STEPS=${STEPS-150}
DATA=${DATA-0.3 runs/demo/a_text_document 0.7 runs/demo/b_text_document}
SPLIT=${SPLIT-95,5,0}
EVAL_INTERVAL=${EVAL_INTERVAL-25}
EVAL_ITERS=${EVAL_ITERS-2}
TOKENIZER=${TOKENIZER-runs/demo/tok.model}
SAVE=${SAVE-runs/demo/ckpt}
SAVE_INTERVAL=${SAVE_INTERVAL-0}
