"""`threed preprocess --sft` (issue 11): chat rendering equals transformers' `apply_chat_template` for a
Llama-3-style and a Llama-2-style tokenizer built here (no hub), the loss mask covers exactly the assistant turns
(with their end-of-turn / EOS token), tokens and mask land in megatron-core indexed datasets with the same document
boundaries, and bad inputs are refused with one line, exit 2, nothing written."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import numpy as np
import pytest

from chat_fixtures import CONVERSATIONS, CORPUS, llama2_tokenizer, llama3_tokenizer
from helpers import preprocess_cli
from threed.data.chat import ChatRenderer, to_messages

TOKENIZERS = {"llama3": llama3_tokenizer, "llama2": llama2_tokenizer}


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.parametrize("kind", ["llama3", "llama2"])
def test_rendering_equals_apply_chat_template_and_mask_is_the_responses(kind):
    tok = TOKENIZERS[kind]()
    render = ChatRenderer(tok)
    end = {"llama3": "<|eot_id|>", "llama2": "</s>"}[kind]
    for record in CONVERSATIONS:
        messages = to_messages(record, "test")
        ids, mask = render(messages, "test")
        assert ids == _ids(tok.apply_chat_template(messages, tokenize=True))
        assert len(mask) == len(ids) and set(mask) <= {0, 1}
        # One contiguous run of 1s per assistant turn, each ending with the end-of-turn token and decoding to
        # exactly the turn's text, and nothing else masked.
        runs, i = [], 0
        while i < len(mask):
            if mask[i]:
                j = i
                while j < len(mask) and mask[j]:
                    j += 1
                runs.append(ids[i:j])
                i = j
            else:
                i += 1
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        assert len(runs) == len(answers)
        for run, answer in zip(runs, answers):
            assert run[-1] == tok.convert_tokens_to_ids(end)
            assert tok.decode(run[:-1]).strip() == answer
        assert sum(mask) == sum(len(r) for r in runs)
    if kind == "llama2":  # the template itself, literally (guards LLAMA2_CHAT_TEMPLATE against typos)
        text = tok.apply_chat_template(to_messages(CONVERSATIONS[1], "t"), tokenize=False)
        assert text == "<s>[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\n  hello world [/INST] Paris! </s>"


def test_chat_format_llama2_without_template_equals_llama2_template():
    plain, templated = ChatRenderer(llama2_tokenizer(template=False), "llama2"), ChatRenderer(llama2_tokenizer())
    for record in CONVERSATIONS:
        messages = to_messages(record, "t")
        assert plain(messages, "t") == templated(messages, "t")


# ------------------------------------------------------------------------------------------------- CLI


def _write_jsonl(path: Path, records) -> str:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return str(path)


def _read(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds


def test_cli_writes_tokens_and_mask_with_same_documents(tmp_path, tok_dirs, capsys):
    from transformers import AutoTokenizer

    a = _write_jsonl(tmp_path / "a.jsonl", CONVERSATIONS[:2])
    b = _write_jsonl(tmp_path / "b.jsonl.gz", CONVERSATIONS[2:])
    out = tmp_path / "out" / "sft"
    assert (
        preprocess_cli(
            [
                "--sft",
                "--input",
                a,
                b,
                "--output-prefix",
                str(out),
                "--tokenizer",
                tok_dirs["llama3"],
                "--seq-length",
                "512",
            ]
        )
        == 0
    )
    assert "3 examples" in capsys.readouterr().out
    tokens, tds = _read(f"{out}_text_document")
    mask, mds = _read(f"{out}_mask_document")
    assert mds.index.dtype == np.uint8
    assert list(tds.document_indices) == list(mds.document_indices) == [0, 1, 2, 3]
    tok = AutoTokenizer.from_pretrained(tok_dirs["llama3"], local_files_only=True)
    render = ChatRenderer(tok)
    for record, t, m in zip(CONVERSATIONS, tokens, mask):
        assert (t, m) == render(to_messages(record, "t"), "t")
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(
        f"sft_{k}_document.{e}" for k in ("text", "mask") for e in ("bin", "idx", "threed.json")
    )  # no temporary left
    # The sidecar names the HF tokenizer as training loads it (threed's Tokenizer): the same vocabulary hash.
    from threed.data.sidecar import check_sidecar

    assert check_sidecar(f"{out}_text_document", tok_dirs["llama3"]) is None


def test_long_examples_dropped_or_truncated_and_counted(tmp_path, tok_dirs, capsys):
    tok = ChatRenderer(llama3_tokenizer())
    lengths = [len(tok(to_messages(r, "t"), "t")[0]) for r in CONVERSATIONS]
    limit = sorted(lengths)[1]  # one example fits... at least one is longer
    longer = sum(n > limit for n in lengths)
    assert longer >= 1
    src = _write_jsonl(tmp_path / "a.jsonl", CONVERSATIONS)
    base = ["--sft", "--input", src, "--tokenizer", tok_dirs["llama3"], "--seq-length", str(limit)]
    assert preprocess_cli([*base, "--output-prefix", str(tmp_path / "d"), "--drop-long"]) == 0
    assert f"{longer:,} dropped" in capsys.readouterr().out
    assert len(_read(str(tmp_path / "d_text_document"))[0]) == len(CONVERSATIONS) - longer
    # Truncation keeps the first --seq-length tokens; an example left without any response token is dropped.
    ids, mask = tok(to_messages(CONVERSATIONS[2], "t"), "t")
    limit = mask.index(1) + 3
    no_answer_left = {"prompt": " ".join(CORPUS[:12]), "response": "Paris."}
    src = _write_jsonl(tmp_path / "b.jsonl", [CONVERSATIONS[2], no_answer_left])
    assert (
        preprocess_cli(
            [
                "--sft",
                "--input",
                src,
                "--tokenizer",
                tok_dirs["llama3"],
                "--seq-length",
                str(limit),
                "--output-prefix",
                str(tmp_path / "t"),
                "--truncate-long",
            ]
        )
        == 0
    )
    assert "1 truncated, 1 dropped" in capsys.readouterr().out
    assert _read(str(tmp_path / "t_text_document"))[0] == [ids[:limit]]
    assert _read(str(tmp_path / "t_mask_document"))[0] == [mask[:limit]] and sum(mask[:limit]) == 3


REFUSALS = {
    "neither shape": ([{"text": "hi"}], "llama3", [], "line 1: record has neither shape"),
    "empty response": ([CONVERSATIONS[0], {"prompt": "hi", "response": "  "}], "llama3", [], "line 2: empty response"),
    "unknown role": (
        [{"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}],
        "llama3",
        [],
        "line 1: role 'narrator' is not one the chat template knows",
    ),
    "roles not alternating": (
        [{"messages": [{"role": "assistant", "content": "y"}]}],
        "llama2",
        [],
        "the chat template rejects this conversation (Conversation roles must alternate",
    ),
    "no chat template": ([CONVERSATIONS[0]], "plain", [], "the tokenizer has no chat template; pass --chat-format"),
    "too long": ([CONVERSATIONS[0], CONVERSATIONS[2]], "llama3", ["--seq-length", "40"], "line 2: example has"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_inputs_refused(case, tmp_path, tok_dirs, capsys):
    records, tok, extra, message = REFUSALS[case]
    src = _write_jsonl(tmp_path / "in.jsonl", records)
    (tmp_path / "out").mkdir()
    args = ["--sft", "--input", src, "--tokenizer", tok_dirs[tok], "--output-prefix", str(tmp_path / "out" / "x")]
    assert preprocess_cli([*args, *(extra or ["--seq-length", "4096"])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert os.listdir(tmp_path / "out") == []


def test_chat_format_llama2_through_cli(tmp_path, tok_dirs):
    src = _write_jsonl(tmp_path / "a.jsonl", CONVERSATIONS)
    for name, extra in (("plain", ["--chat-format", "llama2"]), ("llama2", [])):
        assert (
            preprocess_cli(
                [
                    "--sft",
                    "--quiet",
                    "--input",
                    src,
                    "--tokenizer",
                    tok_dirs[name],
                    "--seq-length",
                    "512",
                    "--output-prefix",
                    str(tmp_path / name),
                    *extra,
                ]
            )
            == 0
        )
    assert _read(str(tmp_path / "plain_text_document"))[0] == _read(str(tmp_path / "llama2_text_document"))[0]
    assert _read(str(tmp_path / "plain_mask_document"))[0] == _read(str(tmp_path / "llama2_mask_document"))[0]
