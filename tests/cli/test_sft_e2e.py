"""SFT the way a user runs it, on CPU (issue 11): an HF model whose tokenizer has a chat template -> `threed
preprocess --sft` -> `threed convert --tp 2 --pp 2` -> the 8B SFT recipe through `recipes/launch.sh` (the model and
sizes overridden from the environment, as a user edits a recipe) on 4 ranks, packed, bf16, with validation ->
`threed export` -> transformers loads the model, and the exported tokenizer renders chats exactly as the source's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

import numpy as np
import pytest

from chat_fixtures import CONVERSATIONS, llama3_tokenizer
from helpers import REPO


def _conversations(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        base = CONVERSATIONS[i % len(CONVERSATIONS)]
        extra = " ".join(str(x) for x in rng.integers(0, 100, rng.integers(0, 12)))
        if "messages" in base:
            msgs = [dict(m) for m in base["messages"]]
            msgs[-1]["content"] += " " + extra
            out.append({"messages": msgs})
        else:
            out.append(dict(base, response=base["response"] + " " + extra))
    return out


@pytest.mark.slow  # end to end (~75 s); its pieces: tests/ranks/test_sft_train.py
def test_sft_from_hf_to_hf_through_the_recipe(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from threed.cli.main import main

    hf, ckpt, run, exported = (tmp_path / n for n in ("hf", "ckpt", "run", "exported"))
    assert main(["make-tiny-hf", "--out", str(hf), "--like", "tiny", "--vocab-size", "400"]) == 0
    source_tok = llama3_tokenizer()
    source_tok.save_pretrained(hf)
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in _conversations(160)))
    assert (
        main(
            [
                "preprocess",
                "--sft",
                "--input",
                str(chats),
                "--output-prefix",
                str(tmp_path / "data" / "chat"),
                "--tokenizer",
                str(hf),
                "--seq-length",
                "64",
                "--drop-long",
            ]
        )
        == 0
    )
    assert main(["convert", "--hf", str(hf), "--tp", "2", "--pp", "2", "--out", str(ckpt), "--quiet"]) == 0

    env = dict(
        os.environ,
        MODEL=str(ckpt),
        INIT_FROM=str(ckpt),
        TP="2",
        PP="2",
        MICRO="2",
        GAS="",
        GLOBAL="4",
        SEQ="64",
        STEPS="4",
        WARMUP="1",
        DATA=str(tmp_path / "data" / "chat_text_document"),
        SPLIT="90,10,0",
        EVAL_INTERVAL="2",
        EVAL_ITERS="1",
        TOKENIZER=str(hf),
        SAVE=str(run),
        SAVE_INTERVAL="0",
        GPUS_PER_NODE="4",
        DEVICE="cpu",
        OMP_NUM_THREADS="1",
        ACT_CKPT="true",
    )
    proc = subprocess.run(
        ["bash", str(REPO / "recipes" / "launch.sh"), str(REPO / "recipes" / "llama31_8b_sft.sh")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "SFT data, response-only loss, packed sequence" in log, log[-3000:]
    counted = [int(n) for n in re.findall(r"\| (\d+) loss tokens \(\d+/s\) \|", log)]
    assert len(counted) == 4 and all(n > 0 for n in counted), log[-3000:]  # the response tokens of each step
    valid = [float(v) for v in re.findall(r"validation at step \d+ \| loss ([0-9.]+)", log)]
    assert len(valid) == 2 and all(np.isfinite(valid)), log[-3000:]

    assert main(["export", "--ckpt", str(run), "--out", str(exported), "--quiet"]) == 0
    model = AutoModelForCausalLM.from_pretrained(exported, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    messages = _conversations(3)[2]["messages"]
    assert tok.apply_chat_template(messages, tokenize=False) == source_tok.apply_chat_template(messages, tokenize=False)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        logits = model(ids["input_ids"]).logits
    assert torch.isfinite(logits).all()
