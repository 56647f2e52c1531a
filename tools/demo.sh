#!/usr/bin/env bash
# make demo: trains a tiny Llama 3D-parallel (tp=2, pp=2, dp=2: 8 gloo processes) on CPU, on Python's own
# reference docs, with a sentencepiece tokenizer trained here. A few minutes on 2 cores. Nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-runs/demo}
STEPS=${STEPS:-150}
mkdir -p "$OUT"
[ -f "$OUT/corpus.txt" ] || $PY -m threed.cli demo-text --out "$OUT/corpus.txt"
[ -f "$OUT/tok.model" ] || $PY -m threed.cli tokenizer --text "$OUT/corpus.txt" --vocab-size 512 --out "$OUT/tok"
[ -f "$OUT/tokens.bin" ] || $PY -m threed.cli tokenize --text "$OUT/corpus.txt" --tokenizer "$OUT/tok.model" --out "$OUT/tokens.bin"
rm -rf "$OUT/ckpt"
$PY -m torch.distributed.run --standalone --nproc-per-node 8 -m threed.train \
  --model tiny --tp 2 --pp 2 --micro-batch-size 4 --grad-accum-steps 4 --seq-length 128 \
  --steps "$STEPS" --lr 3e-3 --min-lr 3e-4 --warmup-steps 5 --dtype bf16 \
  --data "$OUT/tokens.bin" --tokenizer "$OUT/tok.model" --save "$OUT/ckpt" --log-interval 1 \
  2>&1 | grep --line-buffered -E '^(threed|step|saved|stop)|Error|error' 
echo "checkpoint: $OUT/ckpt ($(cat "$OUT/ckpt/latest"))"
