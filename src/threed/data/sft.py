"""`threed preprocess --sft`: instruction / chat JSONL (also .jsonl.gz) -> token and loss-mask indexed datasets.

    threed preprocess --sft --input chat.jsonl --output-prefix data/sft --tokenizer llama31-dir --seq-length 8192 \\
        [--chat-format llama2] [--drop-long | --truncate-long]
    # -> data/sft_text_document.bin/.idx (tokens) and data/sft_mask_document.bin/.idx (loss mask, uint8)

Each record is rendered with the tokenizer's chat template into token ids and a response-only loss mask
(`threed.data.chat`). One example is one document in both outputs, so the two datasets have the same document
boundaries and lengths (what `threed.data.sft_dataset` reads back, and `threed train`'s checks verify).

Examples longer than --seq-length tokens are refused (exit 2) unless --drop-long (skip them) or --truncate-long
(keep the first --seq-length tokens; an example left with no response token is skipped); the summary counts both.
The inputs are read through the same format registry as plain preprocessing (`threed.data.inputs`), and written
the same way (`threed.data.indexed_output`): in a temporary directory beside the output, renamed when complete
(.bin files first, .idx last), nothing left behind on bad input.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Optional, Sequence

import numpy as np

from threed.data.chat import ChatRenderer, load_hf_tokenizer, to_messages
from threed.data.chunks import PreprocessError
from threed.data.indexed_output import IndexedOutput, check_output, indexed_dataset, indexed_output
from threed.data.inputs import Source, check_jsonl, json_records
from threed.data.prefixes import MASK_KEY, TEXT_KEY, dataset_prefix
from threed.data.sidecar import tokenizer_identity

LONG = ("error", "drop", "truncate")  # what to do with an example longer than --seq-length


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
        extra = "".join(
            f", {n:,} {what}" for n, what in ((self.truncated, "truncated"), (self.dropped, "dropped")) if n
        )
        return (
            f"{self.examples:,} examples, {self.tokens:,} tokens ({self.response_tokens:,} in responses)"
            f"{extra} in {self.seconds:.1f}s -> " + ", ".join(f"{p}.bin/.idx" for p in self.outputs.values())
        )


def _check_flags(seq_length: int, long: str) -> None:
    if seq_length is None or seq_length < 2:
        raise PreprocessError(f"--sft needs --seq-length of at least 2, got {seq_length}")
    if long not in LONG:
        raise PreprocessError(f"long examples: choose error, drop or truncate, got {long!r}")


def _provenance(
    tok: Any, tokenizer: Any, inputs: Sequence[str], seq_length: int, chat_format: Optional[str], long: str
) -> dict:
    """What the sidecars record (threed.data.sidecar): the tokenizer and the flags that made the data."""
    return {
        "tokenizer": tokenizer_identity(tok, str(tokenizer) if isinstance(tokenizer, (str, os.PathLike)) else None),
        "flags": {
            "kind": "sft",
            "inputs": [str(i) for i in inputs],
            "seq_length": seq_length,
            "chat_format": chat_format,
            "long": long,
        },
    }


def _write_examples(
    out: IndexedOutput, sources: Sequence[Source], render: ChatRenderer, seq_length: int, long: str, counts: dict
) -> None:
    """Every example rendered into the text and mask builders, one document each, with a long one refused, dropped
    or truncated as `long` says; `counts` (the summary's) adds up as it goes."""
    text, loss_mask = out.builders[TEXT_KEY], out.builders[MASK_KEY]
    for where, record in json_records(sources):
        ids, mask = render(to_messages(record, where), where)
        if len(ids) > seq_length:
            if long == "error":
                raise PreprocessError(
                    f"{where}: example has {len(ids):,} tokens, more than --seq-length "
                    f"{seq_length:,}; pass --drop-long or --truncate-long"
                )
            if long == "drop" or not any(mask[:seq_length]):
                counts["dropped"] += 1
                continue
            ids, mask = ids[:seq_length], mask[:seq_length]
            counts["truncated"] += 1
        text.add_document(ids, [len(ids)])  # one sequence per example, as Megatron-LM writes a document
        loss_mask.add_document(mask, [len(mask)])
        counts["examples"] += 1
        counts["tokens"] += len(ids)
        counts["response_tokens"] += sum(mask)


def preprocess_sft(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer: Any,
    *,
    seq_length: int,
    chat_format: Optional[str] = None,
    long: str = "error",
    force: bool = False,
) -> SFTSummary:
    """Render, tokenize and mask every example of `inputs` into PREFIX_text_document and PREFIX_mask_document.
    `tokenizer`: a path (see load_hf_tokenizer) or an HF fast tokenizer object. `long`: "error", "drop" or
    "truncate". PreprocessError (one line) for bad input, with nothing left on disk."""
    start = time.perf_counter()
    _check_flags(seq_length, long)
    sources = check_jsonl(inputs, "--sft")
    outputs = {k: dataset_prefix(output_prefix, k) for k in (TEXT_KEY, MASK_KEY)}
    check_output(output_prefix, outputs, force)
    tok = load_hf_tokenizer(str(tokenizer)) if isinstance(tokenizer, (str, os.PathLike)) else tokenizer
    render = ChatRenderer(tok, chat_format)
    dtypes = {TEXT_KEY: indexed_dataset().DType.optimal_dtype(len(tok)), MASK_KEY: np.uint8}
    counts = dict(examples=0, tokens=0, response_tokens=0, truncated=0, dropped=0)
    provenance = _provenance(tok, tokenizer, inputs, seq_length, chat_format, long)
    with indexed_output(output_prefix, outputs, dtypes, provenance) as out:
        _write_examples(out, sources, render, seq_length, long, counts)
        if counts["examples"] == 0:
            raise PreprocessError(
                f"no examples left in {', '.join(inputs)} (empty inputs, or all dropped as longer "
                f"than --seq-length {seq_length})"
            )
    return SFTSummary(outputs, seconds=time.perf_counter() - start, **counts)
