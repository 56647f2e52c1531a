"""`threed generate` end to end on a converted checkpoint (tp2, `--nproc-per-node 2`, the tokenizer the checkpoint
carried from its HF source) against HF's `generate` on the model exported back to HF; and its refusals, each one
line before any engine is built.

    .venv/bin/python -m pytest -q tests/cli/test_generate_cli.py
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from convert_fixtures import GQA4, save_hf
from helpers import SRC_ENV, own_world_env
from lora_fixtures import greedy_rows
from threed.cli.main import main

CONFIG = dict(GQA4, vocab_size=320)  # room for the 300-piece test tokenizer
PROMPTS = ["hello world", "the quick brown fox jumps over", "a"]
MAX_NEW = 6


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tok_dirs):
    """An HF Llama with a tokenizer, converted at tp2 pp1 (the tokenizer travels into the checkpoint's hf/), and
    exported back to HF."""
    root = tmp_path_factory.mktemp("gen_cli")
    hf = save_hf(root / "hf", CONFIG)
    for f in Path(tok_dirs["plain"]).iterdir():  # the HF source's tokenizer files, as a real model has them
        shutil.copy(f, hf / f.name)
    argv = ["convert", "--hf", str(hf), "--tp", "2", "--pp", "1", "--out", str(root / "ck"), "--quiet"]
    assert main(argv + ["--make-vocab-size-divisible-by", "16"]) == 0
    assert main(["export", "--ckpt", str(root / "ck"), "--out", str(root / "exported"), "--quiet"]) == 0
    return root


def hf_reference(exported, texts: list[str]) -> list[list[int]]:
    """HF's greedy continuation of each prompt alone, stopping at the tokenizer's EOS (included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(exported))
    model = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    return greedy_rows(model, tok, texts, MAX_NEW)


# the checkpoint's own layout, and another one (its shards' slices read by each rank: threed.convert.into_stage)
LAYOUTS = {"tp2_pp1": [], "tp1_pp2": ["--tp", "1", "--pp", "2"]}


@pytest.mark.slow  # a 2-rank launch each (~1 min); the decode parity itself is tests/ranks/test_generate.py
@pytest.mark.parametrize("layout", LAYOUTS)
def test_generate_on_two_ranks_equals_hf(converted, layout):
    prompts = converted / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS))
    out = converted / f"out_{layout}.jsonl"
    cmd = [sys.executable, "-m", "threed.cli", "generate", "--load", str(converted / "ck"), "--prompts", str(prompts)]
    cmd += ["--max-new-tokens", str(MAX_NEW), "--greedy", "--output", str(out), "--nproc-per-node", "2"]
    proc = subprocess.run(
        cmd + LAYOUTS[layout], env={**own_world_env(), **SRC_ENV}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tp, pp = layout.replace("_", " ").replace("tp", "tp=").replace("pp", "pp=").split()
    assert f"tokens/s ({tp} {pp} dp=1, KV cache)" in proc.stdout, proc.stdout[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    assert [r["tokens"] for r in rows] == hf_reference(converted / "exported", PROMPTS)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(converted / "exported"))
    assert [r["text"] for r in rows] == [tok.decode(r["tokens"], skip_special_tokens=True) for r in rows]


REFUSALS = [
    (["--prompt", "x", "--prompts", "p.jsonl"], r"exactly one of --prompt TEXT and --prompts"),
    ([], r"exactly one of --prompt TEXT and --prompts"),
    (["--prompt", "x", "--load", "{root}/nothing"], r"--load .*nothing: no such directory"),
    (["--prompt", "x", "--max-new-tokens", "500"], r"past the model's context of 128: use --max-new-tokens <= 12\d"),
    (["--prompt", "x", "--greedy", "--temperature", "0.5"], r"--greedy takes no --temperature"),
    (["--prompt", "x", "--temperature", "0"], r"--temperature must be > 0"),
    (["--prompt", "x", "--temperature", "1", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["--prompts", "{root}/bad.jsonl"], r"bad.jsonl:1: no \"prompt\" string"),
    (["--prompt", "x", "--tokenizer", "{root}/nothing"], r"--tokenizer .*nothing: no such file"),
    (["--prompt", "x", "--nproc-per-node", "3"], r"world size 3 is not divisible by tp\*pp\*cp = 2\*1\*1"),
    (["--prompt", "x", "--tp", "3", "--nproc-per-node", "6"], r"tp=3 does not divide num_heads=8"),
    (["--prompt", "x", "--pp", "9", "--nproc-per-node", "18"], r"pp=9 is larger than num_layers=\d"),
]


@pytest.mark.parametrize("flags,line", REFUSALS)
def test_bad_input_is_one_line_before_any_engine(converted, capsys, flags, line):
    (converted / "bad.jsonl").write_text('{"text": "no prompt key"}\n')
    flags = [f.format(root=converted) for f in flags]
    argv = ["generate", "--load", str(converted / "ck"), "--max-new-tokens", "4"]
    if "--load" in flags:
        argv = argv[:1] + argv[3:]
    if "--max-new-tokens" in flags:
        argv = argv[:-2]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("threed generate: "), err
    assert re.search(line, err[0]), err[0]
    assert not torch.distributed.is_initialized()  # refused before any process group or engine
