"""`threed preprocess --sft`: instruction / chat JSONL (also .jsonl.gz) -> token and loss-mask indexed datasets.

    threed preprocess --sft --input chat.jsonl --output-prefix data/sft --tokenizer llama31-dir --seq-length 8192 \\
        [--chat-format llama2] [--drop-long | --truncate-long]
    # -> data/sft_text_document.bin/.idx (tokens) and data/sft_mask_document.bin/.idx (loss mask, uint8)

A record is `{"prompt": ..., "response": ...}` (one user turn, one assistant turn; an optional "system") or
`{"messages": [{"role": ..., "content": ...}, ...]}`. It is rendered with the tokenizer's own chat template
(`tokenizer_config.json`'s `chat_template`, as Llama 3 / 3.1 ship it): the token ids equal transformers'
`tokenizer.apply_chat_template(messages)`. A tokenizer without one needs `--chat-format llama2` (Llama 2 chat's
`[INST]` template, the one Meta's HF tokenizer ships). One example is one document in both outputs; the mask has
the tokens' length and is 1 exactly on the assistant turns' tokens, their end-of-turn / EOS token included (found
from the rendered text of each assistant turn and the tokenizer's character offsets; a token that straddles the
turn's first character counts as the turn's). mask[t] says whether token t is a target: the loss of the
prediction made at t-1 counts iff mask[t] is 1.

Examples longer than --seq-length tokens are refused (exit 2) unless --drop-long (skip them) or --truncate-long
(keep the first --seq-length tokens; an example left with no response token is skipped); the summary counts both.
Refused with one line naming the file and line, exit 2, nothing written: a record of neither shape, an empty
response, a role the template does not know, a template that rejects the conversation, a tokenizer with no chat
template and no --chat-format. Written like the rest of `threed preprocess`: in a temporary directory beside the
output, renamed when complete (.bin files first, .idx last).
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from threed.data.readers import PreprocessError

CHAT_FORMATS = ("llama2",)
BASE_ROLES = ("system", "user", "assistant")
EXTRA_ROLES = ("tool", "ipython")  # Llama 3.1's tool roles: known when the template names them

# Llama 2 chat's template, as in meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json.
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)


@dataclasses.dataclass
class SFTSummary:
    outputs: dict[str, str]  # "text" / "mask" -> output prefix
    examples: int
    tokens: int
    response_tokens: int
    truncated: int
    dropped: int  # too long with --drop-long, or nothing of the response left after --truncate-long
    seconds: float

    def line(self) -> str:
        extra = "".join(f", {n:,} {what}" for n, what in ((self.truncated, "truncated"), (self.dropped, "dropped"))
                        if n)
        return (f"{self.examples:,} examples, {self.tokens:,} tokens ({self.response_tokens:,} in responses)"
                f"{extra} in {self.seconds:.1f}s -> " + ", ".join(f"{p}.bin/.idx" for p in self.outputs.values()))


# ------------------------------------------------------------------------------------------------- records


def read_records(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line of a .jsonl / .jsonl.gz file."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:  # type: ignore[operator]
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise PreprocessError(f"{path} line {n}: not valid JSON ({e.msg}); --sft reads one JSON object "
                                          f"per line") from None
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise PreprocessError(f"cannot read {path} ({getattr(e, 'strerror', None) or e})") from None


def to_messages(record: Any, where: str) -> list[dict[str, str]]:
    """A record in either shape -> a list of {"role", "content"}; PreprocessError for anything else."""
    shapes = 'give {"prompt": ..., "response": ...} or {"messages": [{"role": ..., "content": ...}, ...]}'
    if isinstance(record, dict) and "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise PreprocessError(f"{where}: \"messages\" must be a non-empty list of objects with string "
                                  f"\"role\" and \"content\"; {shapes}")
        messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
    elif isinstance(record, dict) and "prompt" in record and "response" in record:
        if not isinstance(record["prompt"], str) or not isinstance(record["response"], str):
            raise PreprocessError(f"{where}: \"prompt\" and \"response\" must be strings")
        messages = [{"role": "user", "content": record["prompt"]},
                    {"role": "assistant", "content": record["response"]}]
        if isinstance(record.get("system"), str):
            messages.insert(0, {"role": "system", "content": record["system"]})
    else:
        got = sorted(record)[:6] if isinstance(record, dict) else type(record).__name__
        raise PreprocessError(f"{where}: record has neither shape (got {got}); {shapes}")
    if not any(m["role"] == "assistant" for m in messages):
        raise PreprocessError(f"{where}: no assistant turn, so nothing to train on")
    for m in messages:
        if m["role"] == "assistant" and not m["content"].strip():
            raise PreprocessError(f"{where}: empty response (an assistant turn with no text)")
    return messages


# ------------------------------------------------------------------------------------------------- rendering


class ChatRenderer:
    """Renders conversations to token ids and a loss mask with an HF fast tokenizer and a chat template."""

    def __init__(self, tokenizer: Any, chat_format: Optional[str] = None):
        self.tok = tokenizer
        if chat_format is not None and chat_format not in CHAT_FORMATS:
            raise PreprocessError(f"--chat-format {chat_format!r}: choose from {CHAT_FORMATS}")
        own = getattr(tokenizer, "chat_template", None)
        if chat_format == "llama2":
            self.template = LLAMA2_CHAT_TEMPLATE
        elif isinstance(own, str) and own:
            self.template = own
        elif isinstance(own, dict) and "default" in own:
            self.template = own["default"]
        else:
            raise PreprocessError("the tokenizer has no chat template; pass --chat-format llama2 (Llama 2's [INST] "
                                  "format) or use a tokenizer whose tokenizer_config.json has a chat_template")
        if not getattr(tokenizer, "is_fast", False):
            raise PreprocessError("--sft needs a fast HF tokenizer (tokenizer.json) for the response mask's "
                                  "character offsets")
        self.roles = BASE_ROLES + tuple(r for r in EXTRA_ROLES if re.search(rf"['\"]{r}['\"]", self.template))

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                            add_generation_prompt=generation_prompt)

    def __call__(self, messages: list[dict[str, str]], where: str) -> tuple[list[int], list[int]]:
        for m in messages:
            if m["role"] not in self.roles:
                raise PreprocessError(f"{where}: role {m['role']!r} is not one the chat template knows "
                                      f"({', '.join(self.roles)})")
        try:
            text = self._render(messages, False)
            spans = []  # character ranges of the assistant turns in `text`
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before, through = self._render(messages[:i], True), self._render(messages[:i + 1], False)
                if not text.startswith(through) or not through.startswith(before) or len(through) <= len(before):
                    raise PreprocessError(f"{where}: the chat template does not render conversations "
                                          f"incrementally, so the response span cannot be found")
                spans.append((len(before), len(through)))
        except PreprocessError:
            raise
        except Exception as e:  # jinja2 errors, raise_exception() of the template (e.g. roles not alternating)
            msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise PreprocessError(f"{where}: the chat template rejects this conversation ({msg})") from None
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        mask = [int(any(a < end and b > start for start, end in spans)) for a, b in offsets]
        return ids, mask


def load_hf_tokenizer(path: str) -> Any:
    if not Path(path).exists():
        raise PreprocessError(f"tokenizer not found: {path}; --sft needs a local HF tokenizer directory or "
                              f"tokenizer.json")
    if Path(path).is_file() and path.endswith(".model"):
        raise PreprocessError(f"{path} is a sentencepiece model; --sft needs an HF fast tokenizer (a directory with "
                              f"tokenizer.json, or a tokenizer.json)")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return (PreTrainedTokenizerFast(tokenizer_file=path) if Path(path).is_file()
                else AutoTokenizer.from_pretrained(path, local_files_only=True))
    except Exception as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PreprocessError(f"cannot load tokenizer {path} ({msg})") from None


# ------------------------------------------------------------------------------------------------- driver


def preprocess_sft(inputs: Sequence[str], output_prefix: str, tokenizer: Any, *, seq_length: int,
                   chat_format: Optional[str] = None, long: str = "error", force: bool = False) -> SFTSummary:
    """Render, tokenize and mask every example of `inputs` into PREFIX_text_document and PREFIX_mask_document.
    `tokenizer`: a path (see load_hf_tokenizer) or an HF fast tokenizer object. `long`: "error", "drop" or
    "truncate". PreprocessError (one line) for bad input, with nothing left on disk."""
    from threed.data.encode import indexed_dataset
    from threed.data.preprocess import _check_output, _make_tmpdir, _publish, _remove_dirs, dataset_prefix

    start = time.perf_counter()
    if seq_length is None or seq_length < 2:
        raise PreprocessError(f"--sft needs --seq-length of at least 2, got {seq_length}")
    if long not in ("error", "drop", "truncate"):
        raise PreprocessError(f"long examples: choose error, drop or truncate, got {long!r}")
    for path in inputs:
        if not Path(path).is_file():
            raise PreprocessError(f"input not found: {path}")
        if not path.endswith((".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")):
            raise PreprocessError(f"{path}: --sft reads JSONL (.jsonl, optionally .gz)")
    outputs = {k: dataset_prefix(output_prefix, k) for k in ("text", "mask")}
    _check_output(output_prefix, outputs, force)
    tok = load_hf_tokenizer(str(tokenizer)) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    render = ChatRenderer(tok, chat_format)
    idx = indexed_dataset()
    import numpy as np
    import torch

    dtypes = {"text": idx.DType.optimal_dtype(len(tok)), "mask": np.uint8}
    tmpdir, created = _make_tmpdir(output_prefix)
    counts = dict(examples=0, tokens=0, response_tokens=0, truncated=0, dropped=0)
    try:
        tmp = {k: os.path.join(tmpdir, Path(p).name) for k, p in outputs.items()}
        builders = {k: idx.IndexedDatasetBuilder(tmp[k] + ".bin", dtype=dtypes[k]) for k in outputs}
        for path in inputs:
            for line, record in read_records(path):
                where = f"{path} line {line}"
                ids, mask = render(to_messages(record, where), where)
                if len(ids) > seq_length:
                    if long == "error":
                        raise PreprocessError(f"{where}: example has {len(ids):,} tokens, more than --seq-length "
                                              f"{seq_length:,}; pass --drop-long or --truncate-long")
                    if long == "drop" or not any(mask[:seq_length]):
                        counts["dropped"] += 1
                        continue
                    ids, mask = ids[:seq_length], mask[:seq_length]
                    counts["truncated"] += 1
                builders["text"].add_item(torch.tensor(ids, dtype=torch.int64))
                builders["mask"].add_item(torch.tensor(mask, dtype=torch.int64))
                for b in builders.values():
                    b.end_document()
                counts["examples"] += 1
                counts["tokens"] += len(ids)
                counts["response_tokens"] += sum(mask)
        if counts["examples"] == 0:
            raise PreprocessError(f"no examples left in {', '.join(inputs)} (empty inputs, or all dropped as longer "
                                  f"than --seq-length {seq_length})")
        _publish(builders, tmp, outputs)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        _remove_dirs(created)
        raise
    shutil.rmtree(tmpdir, ignore_errors=True)
    return SFTSummary(outputs, seconds=time.perf_counter() - start, **counts)
