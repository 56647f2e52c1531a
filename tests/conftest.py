"""The fixtures tests in more than one file use, defined once here (pytest finds them for every folder below):
a process's own world of one undone after a test, the small random corpus `threed train` runs read, the demo corpus
and tokenizers `threed preprocess` reads, and saved chat tokenizers for `threed preprocess --sft`. What is shared
but is not a fixture lives in helpers.py, reference.py, convert_fixtures.py and chat_fixtures.py beside this file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from chat_fixtures import llama2_tokenizer, llama3_tokenizer
from helpers import TORCHRUN_ENV, write_dataset


@pytest.fixture
def own_process_group():
    """`threed train` in process makes a world of one (and sets torchrun's variables): undo both afterwards, so
    later tests that start ranks or a single-process run do not inherit this process's rendezvous port."""
    saved = {k: os.environ.get(k) for k in TORCHRUN_ENV}
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> str:
    """20,000 random token ids below 500 (vocabulary 512: the tiny preset's) as a megatron dataset; its prefix. Built
    once per test run (its users only read it, as the session-scoped fixtures below)."""
    d = tmp_path_factory.mktemp("tiny_corpus")
    return write_dataset(d / "corpus", np.random.default_rng(0).integers(0, 500, 20000), 512)


def _paragraphs(text: str) -> list[str]:
    """The demo corpus as documents: paragraphs with their blank (whitespace-only) lines dropped."""
    docs = []
    for para in text.split("\n\n"):
        lines = [line for line in para.split("\n") if line.strip()]
        if lines:
            docs.append("\n".join(lines))
    return docs


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Any]:
    """The demo text, a 512-piece sentencepiece model trained on it, a Llama-3-style tokenizer.json, and the text's
    first 700 paragraphs as documents (plus a non-ASCII one and two that tokenize to nothing)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    from threed.data.demo_text import write_demo_text
    from threed.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("preprocess")
    text = write_demo_text(str(d / "demo.txt"))
    sp_model = train_tokenizer([text], 512, str(d / "sp"))
    # Llama 3 style: a byte-level BPE tokenizer.json alone, its BOS/EOS named like Llama 3's special tokens.
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train(
        [text],
        trainers.BpeTrainer(
            vocab_size=700,
            special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    (d / "hf").mkdir()
    hf.save(str(d / "hf" / "tokenizer.json"))
    docs = _paragraphs(Path(text).read_text(encoding="utf-8"))[:700]
    docs[5:5] = ["héllo wörld ✓ 日本語 \t tabs", "", "   "]  # non-ASCII, and two that tokenize to nothing
    return {"dir": d, "sp": sp_model, "hf": str(d / "hf" / "tokenizer.json"), "docs": docs}


@pytest.fixture(scope="session")
def tok_dirs(tmp_path_factory) -> dict[str, str]:
    """chat_fixtures' tokenizers saved as HF directories: llama3, llama2 (both with a chat template) and plain
    (llama2's without one)."""
    root = tmp_path_factory.mktemp("tok")
    out = {}
    for name, make in [
        ("llama3", lambda: llama3_tokenizer()),
        ("llama2", lambda: llama2_tokenizer()),
        ("plain", lambda: llama2_tokenizer(template=False)),
    ]:
        make().save_pretrained(root / name)
        out[name] = str(root / name)
    return out
