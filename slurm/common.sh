# shellcheck shell=bash disable=SC1090,SC2317
# The body of every slurm/*.sh batch script; they set RECIPE and source this file with the extra `threed train`
# flags in "$@". Not submitted by itself.
#
# - One srun task per node runs recipes/launch.sh, which starts torchrun for that node's GPUs (not the
#   deepspeed launcher: it needs passwordless ssh between nodes and fails under Slurm, DeepSpeed #2025).
# - MASTER_ADDR is the job's first node; torchrun's c10d rendezvous runs there on MASTER_PORT (derived from the
#   job id, so two jobs sharing a node do not collide); node rank = SLURM_PROCID.
# - The batch shell checks the recipe's arithmetic first (launch.sh dry run), so a bad layout fails in seconds
#   with the numbers, before any node starts.
# - Preemption: --signal=B:USR1@N sends USR1 to this shell N seconds before the time limit; the trap below
#   writes $SAVE/STOP, every rank saves a checkpoint at the next step boundary and exits 0, and the job requeues
#   itself (--requeue). The next run resumes from $SAVE/latest (`threed train` resumes from --save by itself).
#   scancel/TERM also writes STOP (best effort: Slurm kills after KillWait), but does not requeue.
# - Second line of defence: EXIT_DURATION (minutes; default: the job's time left at start minus
#   THREED_EXIT_MARGIN_MIN, 10) is passed as --exit-duration-in-mins, so the run saves and exits on its own clock
#   even if the signal is lost; the job then requeues itself the same way.
# - Logs: slurm/logs/<job name>-<job id>/ holds start<R>-node<N>.log (R counts requeues), train.log (a link to
#   the node log of global rank 0, which logs the training), launch.txt (the numbers and the command of every
#   start) and batch.out (this shell's output, a link to --output).
# - Scores: a recipe with HARNESS_TASKS (and HARNESS_LIMIT) gets, each time training stops with a new checkpoint
#   (the end, a preemption, the time limit), slurm/eval_harness.sh submitted as a job of its own for that
#   checkpoint (the sbatch line the launcher's dry run prints); training never waits for it.
#
# Environment: GPUS_PER_NODE (default 8), DEVICE (auto|cpu|cuda), LOG_DIR, MASTER_PORT, any recipe variable
# (MODEL, TP, PP, MICRO, GAS, GLOBAL, SEQ, STEPS, DATA, SAVE, ...), NCCL_* (defaults below).

set -euo pipefail

fail() {
    echo "threed slurm: error: $*" >&2
    exit 2
}

[ -n "${SLURM_JOB_ID:-}" ] || fail "run this with sbatch (SLURM_JOB_ID is not set)"
[ -n "${RECIPE:-}" ] || fail "no recipe: the batch script sets RECIPE"
cd "$ROOT"
[ -f "$RECIPE" ] || fail "recipe $RECIPE not found under $ROOT"

export NNODES=$SLURM_NNODES  # GPUS_PER_NODE, DEVICE: the launcher's defaults unless the environment sets them
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((15000 + SLURM_JOB_ID % 15000))}
export RDZV_ID=${RDZV_ID:-$SLURM_JOB_ID}

# NCCL: a failed or stuck collective raises (instead of hanging until the time limit), so the rank exits non-zero
# and srun --kill-on-bad-exit ends the job (Megatron's one CUDA connection per device: recipes/launch.sh sets it).
# Set NCCL_SOCKET_IFNAME / NCCL_IB_HCA here if your cluster needs them.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}

# The run's own wall-clock budget, from the job's time left (squeue %L: [D-]HH:MM:SS, MM:SS or UNLIMITED).
minutes_left() {
    local left d=0 h=0 m=0 sec=0
    left=$(squeue -h -j "$SLURM_JOB_ID" -o %L 2>/dev/null | head -n 1) || return 1
    [[ "$left" =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]] || return 1
    d=${BASH_REMATCH[2]:-0} h=${BASH_REMATCH[4]:-0} m=${BASH_REMATCH[5]} sec=${BASH_REMATCH[6]}
    echo $(((10#$d * 1440) + (10#$h * 60) + 10#$m + (10#$sec > 0)))
}
if [ -z "${EXIT_DURATION:-}" ] && left=$(minutes_left); then
    margin=${THREED_EXIT_MARGIN_MIN:-10}
    [[ "$margin" =~ ^[0-9]+$ ]] || fail "THREED_EXIT_MARGIN_MIN must be a whole number of minutes, got '$margin'"
    margin=$((10#$margin))  # decimal, as the launcher reads its numbers (bash reads 010 as octal 8)
    if ((left > margin)); then
        export EXIT_DURATION=$((left - margin))
    fi
fi
[ -z "${EXIT_DURATION:-}" ] || echo "threed slurm: the run saves and exits after $EXIT_DURATION min" \
    "(--exit-duration-in-mins; the job has ${left:-?} min left)"

# The numbers and training's Python config checks, once, before any node starts and before anything is written
# (logs, SAVE): a bad recipe exits 2 with one line and leaves no trace.
numbers=$(THREED_DRY_RUN=1 bash recipes/launch.sh "$RECIPE" "$@") || exit 2

export LOG_DIR=${LOG_DIR:-$ROOT/slurm/logs/$SLURM_JOB_NAME-$SLURM_JOB_ID}
mkdir -p "$LOG_DIR"
batch_out=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | grep -o 'StdOut=[^ ]*' | cut -d= -f2- || true)
[ -z "$batch_out" ] || ln -sfn "$batch_out" "$LOG_DIR/batch.out"

RESTART=${SLURM_RESTART_COUNT:-0}
echo "threed slurm: job $SLURM_JOB_ID ($SLURM_JOB_NAME) start $RESTART at $(date '+%F %T') on $SLURM_JOB_NODELIST;" \
     "recipe $RECIPE; master $MASTER_ADDR:$MASTER_PORT; logs in $LOG_DIR (training log: train.log)"

# The run's --save and --steps as the nodes will see them (same environment, same recipe, the launcher's defaults):
# read from the dry run's command line, whose words printf %q quoted, so eval gives them back as they are.
eval "dry_command=($(sed -n 's/^command: //p' <<<"$numbers"))"
SAVE_DIR="" STEPS_WANTED=""
for ((i = 1; i < ${#dry_command[@]}; i++)); do
    case ${dry_command[i - 1]} in
        --save) SAVE_DIR=${dry_command[i]} ;;
        --steps) STEPS_WANTED=${dry_command[i]} ;;
    esac
done
if [ -z "$SAVE_DIR" ]; then
    echo "threed slurm: warning: SAVE is empty: a preemption warning cannot save, and a requeue starts over"
else
    mkdir -p "$SAVE_DIR"
    rm -f "$SAVE_DIR/STOP"  # left by the run that was preempted
fi

echo "--- start $RESTART, $(date '+%F %T')" >>"$LOG_DIR/launch.txt"
echo "$numbers" | tee -a "$LOG_DIR/launch.txt"

# HARNESS_TASKS: the dry run's `harness job:` line, the sbatch command of slurm/eval_harness.sh for SAVE. Submitted
# once per saved step (a requeue that saved nothing new submits nothing): LOG_DIR/harness_submitted holds the step.
harness_line=$(sed -n 's/^harness job: //p' <<<"$numbers")
submit_harness() {
    [ -n "$harness_line" ] && [ -n "$saved" ] || return 0
    [ "$(cat "$LOG_DIR/harness_submitted" 2>/dev/null || true)" != "$saved" ] || return 0
    local cmd id
    eval "cmd=($harness_line)"
    if id=$("${cmd[@]}"); then
        echo "$saved" >"$LOG_DIR/harness_submitted"
        echo "threed slurm: submitted harness job ${id%%;*} (threed eval-harness of step $saved): ${cmd[*]}"
    else  # the scores are extra: training's own exit status and requeue stand
        echo "threed slurm: warning: could not submit the harness job (${cmd[*]}); run it by hand"
    fi
}

stop_signal=""
request_stop() {
    stop_signal=$1
    echo "threed slurm: SIG$1 at $(date '+%F %T'): asking every rank to save a checkpoint and exit"
    [ -z "$SAVE_DIR" ] || touch "$SAVE_DIR/STOP"
}
trap 'request_stop USR1' USR1
trap 'request_stop TERM' TERM

# One task per node; its CPUs are all of the node's (srun does not inherit sbatch's --cpus-per-task since 22.05).
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_ON_NODE:-1}" \
    --kill-on-bad-exit=1 --wait=60 --output="$LOG_DIR/start$RESTART-node%n.log" \
    bash recipes/launch.sh "$RECIPE" "$@" &
srun_pid=$!

# c10d numbers the nodes in its own order, so the rank that prints the step lines (threed.parallel.distributed.loss_rank:
# the last pipeline stage's first rank) can be on any node: point train.log at the node log that has them; until
# the first step, at the one with global rank 0's start-up line. Succeeds once step lines are found.
link_train_log() {
    local f
    f=$(grep -lE '^step [0-9]+/' "$LOG_DIR"/start"$RESTART"-node*.log 2>/dev/null | head -n 1) || true
    if [ -n "$f" ]; then ln -sfn "$(basename "$f")" "$LOG_DIR/train.log"; return 0; fi
    f=$(grep -l '^threed: world' "$LOG_DIR"/start"$RESTART"-node*.log 2>/dev/null | head -n 1) || true
    [ -z "$f" ] || ln -sfn "$(basename "$f")" "$LOG_DIR/train.log"
    return 1
}
(while ! link_train_log; do sleep 2; done) &
watch_pid=$!
# A trapped signal interrupts `wait`; keep waiting until srun itself has exited.
while :; do
    if wait "$srun_pid"; then rc=0; else rc=$?; fi
    kill -0 "$srun_pid" 2>/dev/null || break
done
if ((rc > 128)); then  # the signal may have come just as srun exited: ask bash for srun's own status
    if wait "$srun_pid" 2>/dev/null; then rc=0; else r=$?; [ "$r" = 127 ] || rc=$r; fi
fi
trap - USR1 TERM
kill "$watch_pid" 2>/dev/null || true
link_train_log || true
[ -z "$SAVE_DIR" ] || rm -f "$SAVE_DIR/STOP"

saved=$(sed -n 's/^global_step//p' "$SAVE_DIR/latest" 2>/dev/null || true)
echo "threed slurm: srun exited $rc at $(date '+%F %T'); latest checkpoint: step ${saved:-none} of $STEPS_WANTED"
submit_harness  # before a requeue: the scores of this start's last checkpoint, in a job of their own
# The run stopped itself before the time limit (--exit-duration-in-mins): requeue as after the warning signal.
if [ -z "$stop_signal" ] && grep -qs -- '--exit-duration-in-mins .* saving and exiting' \
        "$LOG_DIR"/start"$RESTART"-node*.log; then
    stop_signal=USR1
fi
if [ "$stop_signal" = USR1 ] && [ "$rc" = 0 ] && [ -n "$saved" ] && [ "$saved" -lt "$STEPS_WANTED" ]; then
    echo "threed slurm: requeueing job $SLURM_JOB_ID; it resumes from step $saved"
    scontrol requeue "$SLURM_JOB_ID" || fail "scontrol requeue failed; resubmit the same script to resume"
fi
exit "$rc"
