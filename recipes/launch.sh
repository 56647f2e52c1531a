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
# The world:  WORLD = NNODES x GPUS_PER_NODE ranks;  DP = WORLD / (TP x PP x CP);
#             train_batch_size = MICRO x GAS x DP  (DP, never WORLD: TP, PP and CP ranks share a sample; CP, the
#             context-parallel size, splits each sequence over CP ranks).
#             A recipe sets GAS, or GLOBAL (then GAS = GLOBAL / (MICRO x DP)), or both when they agree.
# Environment (all optional):
#   NNODES         nodes (default: $SLURM_NNODES, else 1)
#   GPUS_PER_NODE  ranks per node (default 8); torchrun --nproc-per-node
#   NODE_RANK      this node (default: $SLURM_PROCID, else 0); node 0 hosts the rendezvous store
#   MASTER_ADDR, MASTER_PORT, RDZV_ID   c10d rendezvous when NNODES > 1 (the slurm scripts set them)
#   DEVICE         auto (cuda where visible, else cpu) | cpu (hides GPUs) | cuda
#   PYTHON         interpreter (default: the repo's .venv/bin/python if there, else python3)
#   THREED_DRY_RUN=1   print the numbers and the command, run nothing (after the same Python config checks
#                      as training: `threed check-config`)
#   HARNESS_TASKS, HARNESS_LIMIT   (recipe variables of the slurm job's: lm-eval scores of SAVE as a job of its own
#                  after training; see below and slurm/common.sh)
#   EXIT_DURATION  minutes after which the run saves and exits 0 (--exit-duration-in-mins; slurm/common.sh sets
#                  it from the job's time limit)
# Recipe variables: one table, src/threed/cli/recipe.py (`python -m threed.cli.recipe` prints it), maps each to the
# config field it sets and passes it as that field's training flag (MICRO -> --micro-batch-size, SEQ ->
# --seq-length, SEQUENCE_PARALLEL=true -> the bare --sequence-parallel, DATA -> --data-path WORDS...; the flags are
# Megatron-LM's names). `docs/flags.md` says what each flag does. The defaults below (DEFAULTS) hold what the recipes
# share; a recipe states only the values it does differently, each as VAR=${VAR-value}, so the environment
# overrides a recipe's value and a default alike, and an empty value clears either (e.g. GAS= GLOBAL=256; an empty
# variable passes no flag). A recipe that sets any other variable is refused (a typo would otherwise be ignored
# silently); a new variable is a row of that table.
# Before torchrun starts, `threed check-config --paths` runs training's checks once (config, data, checkpoint
# directories), so a bad recipe fails with one line instead of one traceback per rank.
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

if [ -z "${PYTHON:-}" ]; then
    if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi
# The table of recipe variables (threed.cli.recipe): NAME FORM FLAG per line, in the recipes' order.
table=$(PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m threed.cli.recipe) ||
    die "could not read the recipe variables with $PYTHON -m threed.cli.recipe: run \`make venv\` (or set PYTHON)"
declare -A FORM FLAG
ORDER=()        # every variable of the table, in its order
RECIPE_VARS=()  # those a recipe may set (not the environment's own, FORM env)
while read -r name form flag; do
    FORM[$name]=$form
    FLAG[$name]=$flag
    ORDER+=("$name")
    [ "$form" = env ] || RECIPE_VARS+=("$name")
done <<<"$table"
closest_var() {  # the known recipe variable with the smallest edit distance to $1
    awk -v w="$1" -v list="${RECIPE_VARS[*]}" '
        function lev(s, t,   i, j, m, n, d, c, a, b) {
            m = length(s); n = length(t)
            for (i = 0; i <= m; i++) d[i, 0] = i
            for (j = 0; j <= n; j++) d[0, j] = j
            for (i = 1; i <= m; i++) for (j = 1; j <= n; j++) {
                c = substr(s, i, 1) != substr(t, j, 1); a = d[i-1, j] + 1; b = d[i, j-1] + 1
                if (b < a) a = b
                if (d[i-1, j-1] + c < a) a = d[i-1, j-1] + c
                d[i, j] = a
            }
            return d[m, n]
        }
        BEGIN { n = split(list, v, " "); best = ""; bd = 1e9
                for (k = 1; k <= n; k++) { x = lev(w, v[k]); if (x < bd) { bd = x; best = v[k] } }
                print best }'
}
# The environment: a variable one edit (a letter inserted, deleted, changed, or two swapped) from a recipe variable
# (STEP=5, GOLBAL=64, steps=5) is most likely a typo that would be ignored silently. A warning, not a refusal: the
# environment also holds the site's and the user's own variables (a module system, a scheduler, a shell setup),
# which we do not own and cannot tell from typos, and a refusal would block every run of a user who happens to
# have one. Names under 3 letters are left out (TZ is one edit from TP). A recipe file is ours: a typo there is
# refused (below).
LAUNCHER_VARS=(NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT RDZV_ID DEVICE PYTHON THREED_DRY_RUN
               THREED_ARGS EXIT_DURATION)
while IFS=' ' read -r name near; do
    echo "threed launch: warning: the environment sets $name, which is not a recipe variable: did you mean" \
         "$near? ($name is ignored)" >&2
done < <(compgen -e | awk -v list="${RECIPE_VARS[*]} ${LAUNCHER_VARS[*]}" -v recipe="${RECIPE_VARS[*]}" '
    function near(s, t,   m, n, i, j, d, x) {  # s and t differ by exactly one edit (or only by case: s is uppercased)
        m = length(s); n = length(t)
        if (m == n) {
            d = 0; for (i = 1; i <= m; i++) if (substr(s, i, 1) != substr(t, i, 1)) { d++; if (d == 1) j = i }
            if (d == 1) return 1
            return d == 2 && substr(s, j, 2) == substr(t, j + 1, 1) substr(t, j, 1) && \
                   substr(s, j + 2) == substr(t, j + 2)
        }
        if (m == n + 1) { x = s; s = t; t = x; m = n; n++ }
        if (n != m + 1) return 0
        for (i = 1; i <= m && substr(s, i, 1) == substr(t, i, 1); i++) ;
        return substr(s, i) == substr(t, i + 1)
    }
    BEGIN { split(list, all, " "); for (k in all) known[all[k]] = 1; nr = split(recipe, rv, " ") }
    length($0) >= 3 && !($0 in known) {
        u = toupper($0)
        for (k = 1; k <= nr; k++)
            if (length(rv[k]) >= 3 && (u == rv[k] || near(u, rv[k]))) { print $0, rv[k]; break }
    }')

# Every assignment in the recipe, wherever it is (a line of its own, after `;`, `&&`, `then`, `do`, inside `{ }` or
# `( )`, `export`/`local`/`declare` NAME=, `${NAME:=...}`, `for NAME in`): comments are dropped first, the line
# numbers kept.
while IFS=: read -r lineno match; do
    m=${match%=}; m=${m%[:+]}; m=${m%%\[*}  # NAME= NAME+= NAME[i]= ${NAME:= for NAME -> NAME
    [[ "$m" =~ ([A-Za-z_][A-Za-z0-9_]*)$ ]] || continue
    name=${BASH_REMATCH[1]}
    known=0
    for v in "${RECIPE_VARS[@]}"; do [ "$v" = "$name" ] && known=1 && break; done
    ((known)) || die "$RECIPE line $lineno sets $name, which is not a recipe variable: did you mean" \
        "$(closest_var "$name")? (known: ${RECIPE_VARS[*]})"
done < <(sed -E -e 's/^[[:space:]]*#.*$//' -e 's/[[:space:]]#.*$//' "$RECIPE" |
         grep -noE '(^|[][[:space:];&|(){}`])[A-Za-z_][A-Za-z0-9_]*(\[[^]]*\])?\+?=|\$\{[A-Za-z_][A-Za-z0-9_]*:?=|(^|[[:space:];&|(){}])for[[:space:]]+[A-Za-z_][A-Za-z0-9_]*' || true)

# shellcheck source=/dev/null
source "$RECIPE"

# DEFAULTS: what every recipe gets unless it (or the environment) says otherwise. MODEL TP PP SEQ have none (the
# recipe gives them); the other variables default to empty: no flag, training's own default.
CP=${CP-1}
MICRO=${MICRO-1}
WARMUP=${WARMUP-200}
STEPS=${STEPS-5000}
DTYPE=${DTYPE-bf16}
ACT_CKPT=${ACT_CKPT-false}
SEQUENCE_PARALLEL=${SEQUENCE_PARALLEL-false}
SPLIT=${SPLIT-969,30,1}
EVAL_INTERVAL=${EVAL_INTERVAL-1000}
EVAL_ITERS=${EVAL_ITERS-10}
LOG_INTERVAL=${LOG_INTERVAL-1}
# A 70B checkpoint is ~1 TB: the newest 3 stay (KEEP_LAST=0 keeps all; the dry run shows each one's size).
KEEP_LAST=${KEEP_LAST-3}
# ASYNC_SAVE=1: --async-save (training blocked only for a host copy of each save; off until measured on GPUs).
ASYNC_SAVE=${ASYNC_SAVE-false}

NNODES=${NNODES:-${SLURM_NNODES:-1}}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NODE_RANK=${NODE_RANK:-${SLURM_PROCID:-0}}
DEVICE=${DEVICE:-auto}
case "$DEVICE" in  # before any Python check: a typo is one line at once, and the dry run refuses it too
    auto | cuda | cpu) ;;
    *) die "DEVICE must be auto, cuda or cpu, got '$DEVICE'" ;;
esac

for var in MODEL TP PP MICRO SEQ STEPS; do
    [ -n "${!var:-}" ] || die "$var is not set: the recipe $RECIPE (or the environment) must give it"
done

# Numbers are decimal everywhere: bash arithmetic reads GPUS_PER_NODE=010 as octal 8 (and 08 as an error) while
# torchrun and Python read 10 and 8, so each numeric variable is checked to be digits and rewritten in plain
# decimal (010 -> 10) before any arithmetic or command line uses it.
decimal() {  # decimal NAME MIN: NAME must hold a whole number >= MIN (MIN '-': any sign; Python checks the range)
    local v=${!1} sign="" digits
    if [[ "$v" =~ ^([-+]?)0*([0-9]+)$ ]] && ((${#BASH_REMATCH[2]} <= 15)); then
        [ "${BASH_REMATCH[1]}" != - ] || sign=-
        digits=$((10#${BASH_REMATCH[2]}))
        printf -v "$1" '%s' "$([ "$digits" = 0 ] && echo 0 || echo "$sign$digits")"
        if [ "$2" = - ] || ((${!1} >= $2)); then return 0; fi
    fi
    if [ "$2" = 1 ]; then
        die "$1 must be a positive integer, got '$v': set $1 to a whole number >= 1 in decimal digits (e.g. $1=4)"
    elif [ "$2" = 0 ]; then
        die "$1 must be a whole number >= 0, got '$v': set it in decimal digits (e.g. $1=0)"
    fi
    die "$1 must be a whole number, got '$v': set it in decimal digits (e.g. $1=10), or empty for no flag"
}
for var in NNODES GPUS_PER_NODE TP PP CP MICRO SEQ STEPS; do decimal "$var" 1; done
for var in GAS GLOBAL; do [ -z "${!var:-}" ] || decimal "$var" 1; done
decimal NODE_RANK 0
for var in MASTER_PORT; do [ -z "${!var:-}" ] || decimal "$var" 0; done
for var in WARMUP EVAL_INTERVAL EVAL_ITERS SAVE_INTERVAL LOG_INTERVAL KEEP_LAST; do  # ranges: Python's checks
    [ -z "${!var:-}" ] || decimal "$var" -
done

WORLD=$((NNODES * GPUS_PER_NODE))
MP=$((TP * PP * CP))  # the ranks that share one sample: one model replica, times CP
if ((CP == 1)); then SHAPE="TP x PP = $TP x $PP"; else SHAPE="TP x PP x CP = $TP x $PP x $CP"; fi
if ((WORLD % MP)); then
    die "WORLD = NNODES x GPUS_PER_NODE = $NNODES x $GPUS_PER_NODE = $WORLD ranks is not divisible by" \
        "$SHAPE = $MP. One model replica (times CP) needs $MP GPUs: use a multiple of $MP GPUs" \
        "(nodes x GPUs per node), or change TP/PP/CP."
fi
DP=$((WORLD / MP))

if [ -n "${GLOBAL:-}" ]; then
    if ((GLOBAL % (MICRO * DP))); then
        die "GLOBAL=$GLOBAL is not divisible by MICRO x DP = $MICRO x $DP = $((MICRO * DP))" \
            "(train_batch_size = MICRO x GAS x DP, DP = $WORLD / (${SHAPE#* = }) = $DP). Use a GLOBAL that is a" \
            "multiple of $((MICRO * DP)), or change MICRO or the number of nodes."
    fi
    DERIVED=$((GLOBAL / (MICRO * DP)))
    if [ -n "${GAS:-}" ] && [ "$GAS" != "$DERIVED" ]; then
        die "GAS=$GAS and GLOBAL=$GLOBAL disagree: train_batch_size = MICRO x GAS x DP =" \
            "$MICRO x $GAS x $DP = $((MICRO * GAS * DP)), not $GLOBAL (DP = $WORLD / (${SHAPE#* = }) = $DP)." \
            "Set only one of them (e.g. GAS= GLOBAL=$GLOBAL, which gives GAS=$DERIVED), or make them agree."
    fi
    GAS=$DERIVED
fi
GAS=${GAS:-1}
TRAIN_BATCH=$((MICRO * GAS * DP))

GLOBAL=$TRAIN_BATCH  # what --global-batch-size gets: the one the arithmetic above settled on

# Every value by its flag's type and choices (threed.cli.recipe --check): a bad one is one line naming the variable
# (PIPELINE_SCHEDULE=zb-h2, RECOMPUTE_NUM_LAYERS=abc), not argparse's usage dump about a flag.
values=()
for name in "${ORDER[@]}"; do values+=("$name=${!name:-}"); done
PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m threed.cli.recipe --check "${values[@]}" || exit 2

# Each variable of the table as its field's flag (threed.cli.recipe: FORM says how).
args=()
for name in "${ORDER[@]}"; do
    flag=${FLAG[$name]}
    case ${FORM[$name]} in
        layout) args+=("$flag" "${!name}") ;;
        value | env) if [ -n "${!name:-}" ]; then args+=("$flag" "${!name}"); fi ;;
        job) ;; # the slurm job's own: the harness job below, not a training flag
        bare) # Megatron's store_true flag: bare when on, absent when off
            case "${!name:-false}" in
                true | 1) args+=("$flag") ;;
                false | 0) ;;
                *) die "$name must be true or false (or 1 or 0), got '${!name}'" ;;
            esac ;;
        words) # a prefix, or a blend "WEIGHT PREFIX WEIGHT PREFIX ..." (Megatron's --data-path); a whole value
            # that names a dataset is one word, so a path with spaces works (threed.cli.recipe.data_words)
            if [ -f "${!name:-}.bin" ] || [ -f "${!name:-}.idx" ]; then
                args+=("$flag" "${!name}")
            elif [ -n "${!name:-}" ]; then
                read -ra words <<<"${!name}"
                args+=("$flag" "${words[@]}")
            fi ;;
        *) die "threed.cli.recipe: $name has an unknown form ${FORM[$name]}" ;;
    esac
done
# shellcheck disable=SC2206
args+=(${THREED_ARGS:-} "$@")

# torchrun, through threed.parallel.launch (torchrun_main): a refusal in the ranks ends with rank 0's one line and the ranks'
# exit status (2 for bad input), not torchrun's ChildFailedError traceback and exit 1.
run=("$PYTHON" -m threed.parallel.launch --nnodes="$NNODES" --nproc-per-node="$GPUS_PER_NODE" --max-restarts=0)
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

# HARNESS_TASKS: lm-eval scores of the saved checkpoint as a job of its own (slurm/eval_harness.sh), which
# slurm/common.sh submits after training stops (each end, preemption or time limit) with this command, so training
# never waits for them. One node, in the run's DTYPE: at the checkpoint's own layout with DP filling the node when
# TP x PP fits one, else at the largest divisor of TP that fits the node (it divides the heads as TP does) x as many
# stages as the rest of the node holds (eval-harness reads a checkpoint at any layout and builds no optimizer: 2
# B/param in bf16 where training holds ~16, so a layout sized for training fits on fewer GPUs; whether it fits that
# node is not checked here). Checked here, so the dry run refuses a recipe whose harness job could not run.
harness=()
if [ -z "${HARNESS_TASKS:-}" ] && [ -n "${HARNESS_LIMIT:-}" ]; then
    echo "threed launch: warning: HARNESS_LIMIT=$HARNESS_LIMIT without HARNESS_TASKS does nothing (no harness job" \
         "is submitted); set HARNESS_TASKS=a,b to score SAVE after training, or unset HARNESS_LIMIT" >&2
fi
if [ -n "${HARNESS_TASKS:-}" ]; then
    [ -n "${SAVE:-}" ] || die "HARNESS_TASKS=$HARNESS_TASKS needs SAVE: the harness job scores the saved checkpoint"
    # The job reads the tokenizer the checkpoint records (TOKENIZER): `threed eval-harness` refuses a sentencepiece
    # .model (lm-eval needs an HF tokenizer), so every job would fail after every save.
    [[ "${TOKENIZER:-}" != *.model ]] || die "HARNESS_TASKS=$HARNESS_TASKS with TOKENIZER=$TOKENIZER, a" \
        "sentencepiece .model: every harness job would refuse it (lm-eval needs an HF tokenizer, a directory or" \
        "tokenizer.json); set TOKENIZER to the HF tokenizer of the same vocabulary, or drop HARNESS_TASKS and" \
        "score with \`threed eval-harness --load SAVE --tokenizer HF_DIR\`"
    htp=$TP hpp=$PP
    if ((TP * PP > GPUS_PER_NODE)); then
        htp=$GPUS_PER_NODE
        while ((TP % htp)); do htp=$((htp - 1)); done
        hpp=$((GPUS_PER_NODE / htp))
    fi
    nproc=$((GPUS_PER_NODE - GPUS_PER_NODE % (htp * hpp)))
    gres=gpu:$nproc
    [ "$DEVICE" != cpu ] || gres=none
    harness=(sbatch --parsable --nodes=1 --gres="$gres" slurm/eval_harness.sh --load "$SAVE"
             --tasks "$HARNESS_TASKS" --nproc-per-node "$nproc" --tp "$htp" --pp "$hpp" --dtype "${DTYPE:-bf16}")
    [ -z "${HARNESS_LIMIT:-}" ] || harness+=(--limit "$HARNESS_LIMIT")
fi

# Before a real start each dataset prefix of DATA must exist, said by the variable's name (the checks below name
# the flag); the dry run needs no data.
if [ "${THREED_DRY_RUN:-0}" = 0 ]; then
    data_words=()
    if [ -f "${DATA:-}.bin" ] || [ -f "${DATA:-}.idx" ]; then data_words=("$DATA"); else read -ra data_words <<<"${DATA:-}"; fi
    for word in "${data_words[@]}"; do  # each dataset prefix of DATA (numbers are blend weights) must exist
        [[ "$word" =~ ^[0-9.eE+-]+$ ]] && continue
        [ -f "$word" ] || [ -f "$word.bin" ] || die "DATA=$DATA not found ($word: no $word.bin): make it with" \
            "\`threed preprocess --input ... --tokenizer TOK --output-prefix PREFIX\`, or point DATA at your dataset"
    done
fi

# Training's own Python checks, once, in one process (a second, no torch): the model, tp/pp against heads and
# layers, seq against positions, every numeric range, the batch at this world size; before a real start also
# every check train runs on disk (--paths: the data, its sidecars, --tensorboard-dir, wandb; the checkpoint
# directories: resume, refusal to overwrite a run, free space). Exit 2 with one line if not.
check=("$PYTHON" -m threed.cli check-config --world "$WORLD" "${args[@]}")
[ "${THREED_DRY_RUN:-0}" != 0 ] || check+=(--paths)
summary=$(PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}" "${check[@]}") || exit 2
memory=$(grep '^memory: ' <<<"$summary" || true)  # the memory model's estimate for the heaviest stage
summary=$(grep -v '^memory: ' <<<"$summary")

where=""
[ "${THREED_DRY_RUN:-0}" != 0 ] || where=" on node $NODE_RANK of $NNODES"
echo "threed launch: $RECIPE$where: world $WORLD = $NNODES x $GPUS_PER_NODE (nodes x ranks);" \
     "tp $TP x pp $PP$( ((CP == 1)) || echo " x cp $CP") x dp $DP; train_batch_size $TRAIN_BATCH = micro $MICRO x gas $GAS x dp $DP"
echo "threed check-config: $summary"  # ... start: random init | resume ...; checkpoints ~N GiB each, ...
[ -z "$memory" ] || echo "$memory"

if [ "${THREED_DRY_RUN:-0}" != 0 ]; then
    echo "DP=$DP"
    echo "GAS=$GAS"
    echo "TRAIN_BATCH_SIZE=$TRAIN_BATCH"
    printf 'command:'
    printf ' %q' "${run[@]}"
    echo
    if ((${#harness[@]})); then
        printf 'harness job:'
        printf ' %q' "${harness[@]}"
        echo
    fi
    exit 0
fi

case "$DEVICE" in
    auto | cuda) export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1} ;;
    cpu) export CUDA_VISIBLE_DEVICES="" ;;
esac
export THREED_DEVICE=$DEVICE # threed.parallel.distributed.device_and_backend: cuda without a usable GPU is an error
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONUNBUFFERED=1
exec "${run[@]}"
