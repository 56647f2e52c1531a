#!/usr/bin/env bash
# make demo: starts from a tiny HF Llama saved locally (random weights, the `tiny` preset's shape, the demo
# tokenizer's 512 pieces), converts it to a tp=2 x pp=2 DeepSpeed pipeline checkpoint, trains it 3D-parallel
# (tp=2, pp=2, dp=2: 8 gloo processes) on CPU on a 2-source blend of Python's own reference docs (made with
# `threed preprocess`, megatron .bin/.idx) with validation every 25 steps, exports the result back to an HF
# folder, checks logits parity, and loads it with transformers. A few minutes on 2 cores. Nothing is downloaded.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=${OUT:-runs/demo}
STEPS=${STEPS:-150}
mkdir -p "$OUT"
[ -f "$OUT/corpus.txt" ] || $PY -m threed.cli demo-text --out "$OUT/corpus.txt"
[ -f "$OUT/tok.model" ] || $PY -m threed.cli tokenizer --text "$OUT/corpus.txt" --vocab-size 512 --out "$OUT/tok"
# Two sources for a blend: the first and the second half of the corpus, each a megatron .bin/.idx dataset.
if [ ! -f "$OUT/b_text_document.idx" ]; then
  half=$(($(wc -l <"$OUT/corpus.txt") / 2))
  head -n "$half" "$OUT/corpus.txt" >"$OUT/a.txt"
  tail -n +"$((half + 1))" "$OUT/corpus.txt" >"$OUT/b.txt"
  for src in a b; do
    $PY -m threed.cli preprocess --input "$OUT/$src.txt" --tokenizer "$OUT/tok.model" --append-eod --workers 2 \
      --output-prefix "$OUT/$src" --force --quiet
  done
fi
rm -rf "$OUT/ckpt" "$OUT/hf-init" "$OUT/init" "$OUT/hf"
# Runs a command, keeping its output but not library start-up noise; fails when the command fails (pipefail).
quiet() { "$@" 2>&1 | { grep --line-buffered -v -E 'real_accelerator|Writing model shards|Loading weights' || true; }; }

# 1. An HF Llama to start from, and its conversion (the vocab padding multiple of the `tiny` preset: 32).
quiet $PY -m threed.cli make-tiny-hf --out "$OUT/hf-init" --like tiny --tokenizer "$OUT/tok.model" >/dev/null
quiet $PY -m threed.cli convert --hf "$OUT/hf-init" --tp 2 --pp 2 --out "$OUT/init" --make-vocab-size-divisible-by 32 --quiet
echo "converted HF $OUT/hf-init -> $OUT/init: $(ls "$OUT/init/global_step0" | wc -l) DeepSpeed files for tp=2 x pp=2"

# 2. Train from the converted weights (DeepSpeed load_checkpoint, weights only). Unfiltered: a run prints only our
#    lines (threed.parallel.distributed quiets the libraries).
$PY -m threed.cli train --nproc-per-node 8 \
  --model "$OUT/init" --init-from "$OUT/init" --tp 2 --pp 2 \
  --micro-batch-size 4 --grad-accum-steps 4 --seq-length 128 --steps "$STEPS" --lr 3e-3 --min-lr 3e-4 --warmup-steps 5 --dtype bf16 \
  --data-path 0.3 "$OUT/a_text_document" 0.7 "$OUT/b_text_document" --split 95,5,0 --eval-interval 25 --eval-iters 2 \
  --tokenizer "$OUT/tok.model" --save "$OUT/ckpt" --log-interval 5
echo "checkpoint: $OUT/ckpt ($(cat "$OUT/ckpt/latest"))"

# 3. Back to HF: export, logits parity of the export with the checkpoint (4 ranks), and transformers loading it.
quiet $PY -m threed.cli export --ckpt "$OUT/ckpt" --out "$OUT/hf" --quiet
echo "exported $OUT/ckpt -> HF $OUT/hf: $(cd "$OUT/hf" && echo *)"
quiet $PY -m threed.cli verify --hf "$OUT/hf" --ckpt "$OUT/ckpt"
quiet $PY - "$OUT/hf" <<'EOF'
import sys

import sentencepiece as spm
import torch
from transformers import AutoModelForCausalLM

path = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(path).eval()
sp = spm.SentencePieceProcessor(model_file=f"{path}/tokenizer.model")
prompt = "The list"
ids = torch.tensor([[sp.bos_id()] + sp.encode(prompt)])
with torch.no_grad():
    out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=sp.eos_id())
params = sum(p.numel() for p in model.parameters()) / 1e6
print(f"transformers AutoModelForCausalLM.from_pretrained({path!r}): {type(model).__name__}, {params:.2f}M params")
print(f"greedy continuation: {sp.decode(out[0].tolist())!r}")
EOF
