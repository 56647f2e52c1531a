#!/usr/bin/env bash
# tools/gpu_check.sh OUTDIR: the one call on the lent GPU machine (docs/gpu.md). Why one script: a task that draws a
# GPU gets 15 minutes of device time in all, starts included, so everything that needs the GPU runs in one command
# that ends by itself within 9 minutes on one H100 and leaves its results where the device tool brings them back
# (OUTDIR, at most 8 files: env.log, bench.log, profile.log, save.log, tests.log, one_gpu.log and gpu_check.json,
# which sums them up). The phases run in the order of what their results are worth, so a budget cut takes the least:
#
#   1. install  gpu-bundle/ (make gpu-bundle, carried with the tree) with pip --no-index --no-deps --target
#   2. env      python, torch, CUDA, the GPU, every version and where it is imported from, capability probes
#   3. bench    benchmarks/bench_gpu.py: threed against HF at Llama-3.2-1B's shape, seq 4096 and 8192, and threed
#               at micro-batch 2 (the planner's step-time model fitted to them: rates, cost per micro-batch);
#               MFU both ways; then threed's opt-in flags at 4096 (--lm-head-chunks 8, --torch-compile
#               rope-norm), each against the default run
#   4. profile  bench_gpu.py --profile: torch.profiler on 2 steps of threed at seq 4096: the top kernels by
#               device time, the device's idle holes between kernels (PROFILE_CAP_S, default 90 s)
#   5. save     benchmarks/bench_checkpoint.py --json at Llama-3.2-1B's shape, one rank, bf16 (issue 37): one
#               durable synchronous save against one --async-save save, the seconds each blocks training, and the
#               pinned host copy's GB/s (SAVE_CAP_S, default 120 s)
#   6. tests    every GPU test one GPU can run: `pytest -m gpu tests/gpu` with THREED_DEVICE=cuda (test_one_gpu.py
#               apart; only tests/gpu, whose imports the image has: tests/unit's need the dev extras, e.g. grimp)
#   7. one_gpu  with the time left: tests/gpu/test_one_gpu.py (training against HF, resume, recompute, ZB-H1, SFT)
#
# Each phase runs under `timeout` with what is left of GPU_CHECK_BUDGET_S (default 540 s), so the script ends in
# time whatever hangs; a phase that no longer fits is skipped and says so. DRY=1 runs the same phases on CPU at a
# tiny shape (no install: this python's own packages; the GPU tests skip): what tests/cli/test_gpu_check.py runs.
#
#   tools/gpu_check.sh "$OUT"            on the device machine: run(command="tools/gpu_check.sh $OUT",
#                                        carry=["gpu-bundle"])
#   DRY=1 tools/gpu_check.sh /tmp/dry    here
#
# A second call reruns only what the first missed (docs/gpu.md, "A second call"):
#   GPU_CHECK_PHASES  the phases after env (default "bench profile save tests one_gpu")
#   BENCH_RUNS        the benchmark's runs, impl:seq:on|off[:mb2][:VARIANT] comma-separated (default: its plan);
#                     BENCH_CAP_S its cap (390); PROFILE_CAP_S the profile phase's (90), PROFILE_STEPS its profiled
#                     steps (2); SAVE_CAP_S the save phase's cap (120)
#   ONE_GPU_ONLY      the one-GPU scenarios (tests/gpu/one_gpu_worker.py's names, or "universal"; default all)
set -uo pipefail
OUT=${1:?usage: tools/gpu_check.sh OUTDIR (DRY=1 for the CPU dry run)}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO" || exit 2
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
DRY=${DRY:-0}
# 540 s on the GPU: the call's 600 s limit less pip and Python start-up, and a second call's 4 minutes left in the
# 15. DRY: 2 loaded cores start a Python per bench run (~10-30 s each), so the same phases need longer.
BUDGET=${GPU_CHECK_BUDGET_S:-$([ "$DRY" = 1 ] && echo 720 || echo 540)}
RESERVE=10    # seconds kept for the summary
MIN_PHASE=20  # a phase with less than this left is skipped
START=$SECONDS
TMP=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
PHASES=$TMP/phases.tsv
: >"$PHASES"

if [ "$DRY" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; fi
PY=${PYTHON:-python3}
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"  # threed itself is not installed on the image
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$DRY" = 1 ]; then
  unset THREED_DEVICE  # auto: CPU here; the GPU tests skip
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  BENCH_ARGS=(--tiny --seqs 64)
  SAVE_ARGS=(--hidden 128 --layers 2 --vocab 512)
else
  export THREED_DEVICE=cuda  # a missing GPU is an error, not a silent CPU run
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
  BENCH_ARGS=()
  SAVE_ARGS=(--model llama3.2-1b)
fi

left() { echo $((BUDGET - (SECONDS - START) - RESERVE)); }
limit_for() { # limit_for CAP: the seconds a phase may take, CAP or what is left
  local l
  l=$(left)
  echo $(($1 < l ? $1 : l))
}

PICK=" ${GPU_CHECK_PHASES:-bench profile save tests one_gpu} "
export ONE_GPU_ONLY=${ONE_GPU_ONLY:-}
BENCH_RUNS=${BENCH_RUNS:-}

phase() { # phase NAME LIMIT LOG CMD...: CMD under timeout, its output appended to LOG, a row in phases.tsv
  local name=$1 limit=$2 log=$3 t0 rc=0
  shift 3
  if [[ $name =~ ^(tests|bench|profile|save|one_gpu)$ && $PICK != *" $name "* ]]; then
    echo "gpu_check: $name skipped: not in GPU_CHECK_PHASES=${PICK# }" | tee -a "$log"
    printf '%s\tskipped\t0\t%s\t%s\n' "$name" "$limit" "$(basename "$log")" >>"$PHASES"
    return 0
  fi
  if ((limit < MIN_PHASE)); then
    echo "gpu_check: $name skipped: $(left) s of the ${BUDGET} s budget left" | tee -a "$log"
    printf '%s\tskipped\t0\t%s\t%s\n' "$name" "$limit" "$(basename "$log")" >>"$PHASES"
    return 0
  fi
  echo "gpu_check: $name (at most $limit s) at $((SECONDS - START)) s" | tee -a "$log"
  t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$limit" "$(basename "$log")" >>"$PHASES"
  echo "gpu_check: $name exit $rc$( ((rc == 124 || rc == 137)) && echo ' (timed out)') after $((SECONDS - t0)) s" |
    tee -a "$log"
}

summarize() {
  "$PY" tools/gpu_check_report.py summary --tmp "$TMP" --out "$OUT" --budget "$BUDGET" \
    --elapsed $((SECONDS - START)) $([ "$DRY" = 1 ] && echo --dry)
  rm -rf "$TMP"
}
trap summarize EXIT

# 1. install
ENV_LOG=$OUT/env.log
if [ "$DRY" = 1 ]; then
  echo "gpu_check: install skipped (DRY=1: $PY's own deepspeed and megatron-core are used)" | tee -a "$ENV_LOG"
elif [ -d gpu-bundle ]; then
  SITE=${GPU_CHECK_SITE:-/tmp/threed-site}
  phase check "$(limit_for 30)" "$ENV_LOG" "$PY" tools/gpu_bundle.py --check gpu-bundle
  phase install "$(limit_for 90)" "$ENV_LOG" "$PY" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target "$SITE" gpu-bundle/*.whl
  export PYTHONPATH="$SITE:$PYTHONPATH"
elif "$PY" -c "import deepspeed, megatron.core" >/dev/null 2>&1; then
  echo "gpu_check: no gpu-bundle/; deepspeed and megatron-core import already, installing nothing" | tee -a "$ENV_LOG"
else
  echo "gpu_check: no gpu-bundle/ and no deepspeed here: run make gpu-bundle where PyPI answers and carry" \
    "gpu-bundle (docs/gpu.md)" | tee -a "$ENV_LOG"
  exit 2
fi

# 2. the environment (also to stdout: the device tool's output tail shows it)
phase env "$(limit_for 60)" "$ENV_LOG" "$PY" tools/gpu_check_report.py env --json "$TMP/env.json"
grep -E '"(python|torch|deepspeed|megatron-core|transformers|name|cuda_build|threed_imports|varlen_attn_enable_gqa)"' \
  "$ENV_LOG" | tr -s ' ' | head -20

# 3. the benchmark; it starts no run that would end past its own budget. 390 s: 5 runs without recompute (threed
# and HF at 4096 and 8192, threed at micro-batch 2) took 45-51 s each on the H100 and the H200 (process start,
# build, compile, 6 steps), then the two flags' runs at 4096: --lm-head-chunks 8 as long, --torch-compile
# rope-norm ~30 s more (inductor compiles the norms and RoPE in its first step; never timed on a GPU). DRY: each
# of the 7 tiny runs starts its own python (imports: ~10 s on an idle core; rope-norm compiles ~15 s on CPU)
BENCH_LIMIT=$(limit_for "${BENCH_CAP_S:-$([ "$DRY" = 1 ] && echo 420 || echo 390)}")
phase bench "$BENCH_LIMIT" "$OUT/bench.log" "$PY" benchmarks/bench_gpu.py --json "$TMP/bench.json" \
  --budget-s $((BENCH_LIMIT - 25)) --runs "$BENCH_RUNS" "${BENCH_ARGS[@]}"

# 4. where a step's time goes: torch.profiler over 2 steps of threed at seq 4096 (DRY: the tiny shape, seq 64).
# 90 s: python and the imports ~15 s (the env phase took 15 s on the H200), the build and the first step's compile
# ~20-30 s as in a bench run, 2 warm-up and 2 profiled steps ~5 s, the trace's ~150K events read back ~10-20 s.
# DRY: 34 s on 2 cores under a load of ~40 (2026-11-29), so 150 s leaves the tests and one_gpu their turn.
PROFILE_LIMIT=$(limit_for "${PROFILE_CAP_S:-$([ "$DRY" = 1 ] && echo 150 || echo 90)}")
phase profile "$PROFILE_LIMIT" "$OUT/profile.log" "$PY" benchmarks/bench_gpu.py --profile --json "$TMP/profile.json" \
  --profile-steps "${PROFILE_STEPS:-2}" "${BENCH_ARGS[@]}"

# 5. what a checkpoint save blocks (issue 37): at the 1B shape (bf16, tp1 pp1, one rank) a durable save writes ~17 GB
# (2.5 GB of weights, 14.8 GB of fp32 master weights and AdamW moments). 120 s: python and the imports ~15 s, the
# build ~15 s, the synchronous save 10-35 s (the disk's write and flush), the asynchronous save's copy 2-8 s (pinning
# 17 GB of host memory, then the copy), its background write 10-35 s until published. One save of each kind: the
# JSON is rewritten after each figure, so a cut keeps what finished. Checkpoints go under the temporary folder
# (removed at the end), never to OUTDIR.
# DRY: a tiny model on CPU (~20 s).
phase save "$(limit_for "${SAVE_CAP_S:-120}")" "$OUT/save.log" "$PY" benchmarks/bench_checkpoint.py --dtype bf16 \
  --json "$TMP/save.json" --dir "$TMP" "${SAVE_ARGS[@]}"

# 6. every GPU test one GPU can run, test_one_gpu.py apart (phase 7)
phase tests "$(limit_for 150)" "$OUT/tests.log" "$PY" -m pytest -q -s -ra --durations=10 -p no:cacheprovider \
  -m gpu tests/gpu --ignore-glob='*test_one_gpu.py' --junitxml="$TMP/tests.xml"

# 7. the one-GPU checks, with the time left
ONE_GPU=$(find tests -name test_one_gpu.py | head -1)
phase one_gpu "$(limit_for 600)" "$OUT/one_gpu.log" "$PY" -m pytest -q -s -ra --durations=10 -p no:cacheprovider \
  -m gpu "${ONE_GPU:-tests/gpu/test_one_gpu.py}" --junitxml="$TMP/one_gpu.xml"
# Exit 0 only when every phase that ran exited 0 (a skipped phase is said in the summary, not failed).
! cut -f2 "$PHASES" | grep -qvE '^(0|skipped)$'
