#!/usr/bin/env bash
# The one launcher: sources a recipe, works out the data-parallel size and the batch, checks them, and starts
# `threed train` on this node's ranks with torchrun. The slurm/ scripts run it once per node (srun, one task per
# node); on a single machine run it directly:
#
#   recipes/launch.sh recipes/tiny.sh                       # 1 node x 8 ranks (CPU here, GPUs where there are)
#   GPUS_PER_NODE=4 STEPS=20 recipes/launch.sh recipes/tiny.sh --log-interval 5
#   THREED_DRY_RUN=1 NNODES=8 recipes/launch.sh recipes/llama31_70b.sh   # print DP, batch, memory, command
#
# Arguments after the recipe (and the words of $THREED_ARGS) are passed on to `threed train` as extra flags.
#
# The world:  WORLD = NNODES x GPUS_PER_NODE ranks;  DP = WORLD / (TP x PP);
#             train_batch_size = MICRO x GAS x DP  (DP, never WORLD: TP and PP ranks share a sample).
#             A recipe sets GAS, or GLOBAL (then GAS = GLOBAL / (MICRO x DP)), or both when they agree.
# Environment (all optional):
#   NNODES         nodes (default: $SLURM_NNODES, else 1)
#   GPUS_PER_NODE  ranks per node (default 8); torchrun --nproc-per-node
#   NODE_RANK      this node (default: $SLURM_PROCID, else 0); node 0 hosts the rendezvous store
#   MASTER_ADDR, MASTER_PORT, RDZV_ID   c10d rendezvous when NNODES > 1 (the slurm scripts set them)
#   DEVICE         auto (cuda where visible, else cpu) | cpu (hides GPUs) | cuda
#   PYTHON         interpreter (default: the repo's .venv/bin/python if there, else python3)
#   THREED_DRY_RUN=1   print the numbers and the command, run nothing
# Recipe variables (set in the recipe as VAR=${VAR-default}, so the environment overrides each one; an empty
# value clears it, e.g. GAS= GLOBAL=256): MODEL TP PP MICRO GAS GLOBAL SEQ LR MIN_LR WARMUP STEPS DTYPE ACT_CKPT
# DATA TOKENIZER INIT_FROM LOAD SAVE SAVE_INTERVAL LOG_INTERVAL.
set -euo pipefail

die() {
    echo "threed launch: error: $*" >&2
    exit 2
}

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")

[ $# -ge 1 ] || die "usage: recipes/launch.sh RECIPE [extra threed train flags...]"
RECIPE=$1
shift
[ -f "$RECIPE" ] || die "recipe $RECIPE not found"

# shellcheck source=/dev/null
source "$RECIPE"

NNODES=${NNODES:-${SLURM_NNODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODE_RANK=${NODE_RANK:-${SLURM_PROCID:-0}}
DEVICE=${DEVICE:-auto}
if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi

for var in MODEL TP PP MICRO SEQ STEPS; do
    [ -n "${!var:-}" ] || die "$var is not set: the recipe $RECIPE (or the environment) must give it"
done

int() {  # int NAME: the variable NAME must hold a positive integer
    if ! [[ "${!1}" =~ ^[0-9]+$ ]] || [ "${!1}" -lt 1 ]; then die "$1 must be a positive integer, got '${!1}'"; fi
}
for var in NNODES GPUS_PER_NODE TP PP MICRO SEQ STEPS; do int "$var"; done
[ -n "${GAS:-}" ] && int GAS
[ -n "${GLOBAL:-}" ] && int GLOBAL

WORLD=$((NNODES * GPUS_PER_NODE))
MP=$((TP * PP))
if ((WORLD % MP)); then
    die "WORLD = NNODES x GPUS_PER_NODE = $NNODES x $GPUS_PER_NODE = $WORLD ranks is not divisible by" \
        "TP x PP = $TP x $PP = $MP. One model replica needs $MP GPUs: use a multiple of $MP GPUs" \
        "(nodes x GPUs per node), or change TP/PP."
fi
DP=$((WORLD / MP))

if [ -n "${GLOBAL:-}" ]; then
    if ((GLOBAL % (MICRO * DP))); then
        die "GLOBAL=$GLOBAL is not divisible by MICRO x DP = $MICRO x $DP = $((MICRO * DP))" \
            "(train_batch_size = MICRO x GAS x DP, DP = $WORLD / ($TP x $PP) = $DP). Use a GLOBAL that is a" \
            "multiple of $((MICRO * DP)), or change MICRO or the number of nodes."
    fi
    DERIVED=$((GLOBAL / (MICRO * DP)))
    if [ -n "${GAS:-}" ] && [ "$GAS" != "$DERIVED" ]; then
        die "GAS=$GAS and GLOBAL=$GLOBAL disagree: train_batch_size = MICRO x GAS x DP =" \
            "$MICRO x $GAS x $DP = $((MICRO * GAS * DP)), not $GLOBAL (DP = $WORLD / ($TP x $PP) = $DP)." \
            "Set only one of them (e.g. GAS= GLOBAL=$GLOBAL, which gives GAS=$DERIVED), or make them agree."
    fi
    GAS=$DERIVED
fi
GAS=${GAS:-1}
TRAIN_BATCH=$((MICRO * GAS * DP))

args=(--model "$MODEL" --tp "$TP" --pp "$PP" --micro-batch-size "$MICRO" --grad-accum-steps "$GAS"
      --global-batch-size "$TRAIN_BATCH" --seq-length "$SEQ" --steps "$STEPS")
opt() {  # opt FLAG VAR: pass --FLAG value when VAR is set and not empty
    if [ -n "${!2:-}" ]; then args+=("$1" "${!2}"); fi
}
opt --lr LR
opt --min-lr MIN_LR
opt --warmup-steps WARMUP
opt --dtype DTYPE
opt --activation-checkpointing ACT_CKPT
opt --data DATA
opt --tokenizer TOKENIZER
opt --init-from INIT_FROM
opt --load LOAD
opt --save SAVE
opt --save-interval SAVE_INTERVAL
opt --log-interval LOG_INTERVAL
# shellcheck disable=SC2206
args+=(${THREED_ARGS:-} "$@")

run=("$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" --max-restarts=0)
if ((NNODES == 1)); then
    run+=(--standalone)
else
    if [ -z "${MASTER_ADDR:-}" ]; then
        [ "${THREED_DRY_RUN:-0}" != 0 ] || die "NNODES=$NNODES needs MASTER_ADDR (the first node; slurm/common.sh sets it)"
        # shellcheck disable=SC2016 # a placeholder in the printed command
        MASTER_ADDR='$MASTER_ADDR'
    fi
    MASTER_PORT=${MASTER_PORT:-29500}
    # c10d assigns the global ranks itself (torchrun's --node-rank only applies to the static backend); the node
    # rank decides which torchrun hosts the rendezvous store, so several nodes on one host cannot race for it.
    run+=(--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="${RDZV_ID:-threed}"
          --rdzv-conf="is_host=$([ "$NODE_RANK" = 0 ] && echo 1 || echo 0)")
fi
run+=(-m threed.cli train "${args[@]}")

where=""
[ "${THREED_DRY_RUN:-0}" != 0 ] || where=" on node $NODE_RANK of $NNODES"
echo "threed launch: $RECIPE$where: world $WORLD = $NNODES x $GPUS_PER_NODE (nodes x ranks);" \
     "tp $TP x pp $PP x dp $DP; train_batch_size $TRAIN_BATCH = micro $MICRO x gas $GAS x dp $DP"

if [ "${THREED_DRY_RUN:-0}" != 0 ]; then
    echo "DP=$DP"
    echo "GAS=$GAS"
    echo "TRAIN_BATCH_SIZE=$TRAIN_BATCH"
    ckpt=${ACT_CKPT:-0}
    if mem=$(PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m threed.memory --model "$MODEL" \
            --tp "$TP" --pp "$PP" --dp "$DP" --micro "$MICRO" --gas "$GAS" --seq "$SEQ" --act-ckpt "$ckpt" \
            2>/dev/null); then
        echo "memory: $mem"
    fi
    printf 'command:'
    printf ' %q' "${run[@]}"
    echo
    exit 0
fi

[ -z "${DATA:-}" ] || [ -f "$DATA" ] || die "DATA=$DATA not found: make it with \`threed tokenize --text ..." \
    "--tokenizer TOK.model --out $DATA\`, or point DATA at your token file"

case "$DEVICE" in
    auto | cuda) export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1} ;;
    cpu) export CUDA_VISIBLE_DEVICES="" ;;
    *) die "DEVICE must be auto, cuda or cpu, got '$DEVICE'" ;;
esac
export THREED_DEVICE=$DEVICE # threed.distributed.device_and_backend: cuda without a usable GPU is an error
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
exec "${run[@]}"
