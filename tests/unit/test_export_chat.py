"""`threed export` keeps a chat model's tokenizer whole (issue 11): tokenizer_config.json (special tokens) and
chat_template.jinja travel with tokenizer.json, so the exported folder renders chats exactly as the source did.
The tokenizer comes from --tokenizer, else the run's own data tokenizer (an HF directory or a tokenizer.json),
else the HF files `threed convert` carried into the checkpoint's hf/.

    .venv/bin/python -m pytest -q tests/unit/test_export_chat.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from convert_fixtures import GQA8, save_hf
from chat_fixtures import CONVERSATIONS, llama2_tokenizer, llama3_tokenizer
from threed.cli.main import main

MESSAGES = CONVERSATIONS[2]["messages"]  # system, then two user / assistant turns


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Llama-3-style chat tokenizer beside a tiny random HF Llama, converted at tp 2 x pp 2; and a Llama-2-style
    chat tokenizer directory (another vocabulary and template) that is not part of that checkpoint."""
    root = tmp_path_factory.mktemp("export_chat")
    hf = save_hf(root / "hf", dict(GQA8, vocab_size=400))
    llama3_tokenizer().save_pretrained(hf)
    llama2_tokenizer().save_pretrained(root / "llama2_tok")
    ckpt = root / "ckpt"
    assert main(["convert", "--hf", str(hf), "--tp", "2", "--pp", "2", "--out", str(ckpt), "--quiet"]) == 0
    return {"hf": hf, "ckpt": ckpt, "llama2_tok": root / "llama2_tok"}


def _export(ckpt: Path, out: Path, *flags: str) -> Path:
    assert main(["export", "--ckpt", str(ckpt), "--out", str(out), "--quiet", *flags]) == 0
    return out


def _assert_same_chat(exported: Path, source: Path) -> None:
    """The exported tokenizer and the source tokenizer render (and tokenize) the same chat identically."""
    from transformers import AutoTokenizer

    assert (exported / "tokenizer_config.json").is_file() and (exported / "chat_template.jinja").is_file()
    got = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    want = AutoTokenizer.from_pretrained(source, local_files_only=True)
    assert got.chat_template == want.chat_template
    assert (got.bos_token, got.eos_token) == (want.bos_token, want.eos_token)
    for gen in (False, True):
        ids = got.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert list(ids) == list(
            want.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=gen, return_dict=False)
        )
    assert got.apply_chat_template(MESSAGES, tokenize=False) == want.apply_chat_template(MESSAGES, tokenize=False)


def test_template_carried_from_the_converted_checkpoint(converted, tmp_path):
    """No --tokenizer and no run tokenizer: the files convert put in ckpt/hf/ come back out, template included."""
    assert (converted["ckpt"] / "hf" / "chat_template.jinja").is_file()
    exported = _export(converted["ckpt"], tmp_path / "out")
    _assert_same_chat(exported, converted["hf"])


def _trained_run(converted, root: Path, tokenizer: str) -> Path:
    """A checkpoint directory laid out as `threed train --init-from CKPT --tokenizer TOK --save RUN` leaves it:
    the weights, and a threed_run.json recording the data tokenizer and where the run started from (no hf/ of
    its own, so the converted checkpoint's hf/ is only reachable through init_from)."""
    run = root / "run"
    shutil.copytree(converted["ckpt"], run, ignore=shutil.ignore_patterns("hf"))
    cfg = json.loads((run / "threed_run.json").read_text())
    cfg["data"] = {"tokenizer": tokenizer}
    cfg["checkpoint"] = {"init_from": str(converted["ckpt"])}
    (run / "threed_run.json").write_text(json.dumps(cfg))
    return run


@pytest.mark.parametrize("form", ["directory", "tokenizer.json"])
def test_run_tokenizer_hf_dir_is_exported(converted, tmp_path, form):
    """The run's data tokenizer (an HF directory, or its tokenizer.json) wins over the init_from chain's hf/ files,
    and its tokenizer_config.json / chat_template.jinja come with it; --tokenizer wins over both."""
    tok = converted["llama2_tok"]
    run = _trained_run(converted, tmp_path, str(tok if form == "directory" else tok / "tokenizer.json"))
    _assert_same_chat(_export(run, tmp_path / "out"), tok)
    _assert_same_chat(_export(run, tmp_path / "flag", "--tokenizer", str(converted["hf"])), converted["hf"])


def test_missing_run_tokenizer_falls_back_to_the_checkpoint_chain(converted, tmp_path):
    """A run tokenizer that is gone (another machine, a relative path) leaves the HF files of the init_from chain."""
    run = _trained_run(converted, tmp_path, str(tmp_path / "moved_away"))
    _assert_same_chat(_export(run, tmp_path / "out"), converted["hf"])
