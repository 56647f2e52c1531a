"""The `--input` files of `threed preprocess`, plain and `--sft` alike: checked before any work, cut into chunks in
input order, read back as documents (plain, in the workers) or JSON records (`--sft`, in one process). What each
format is lives in `threed.data.formats`; this is what a run does with a list of files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Sequence

from threed.data.chunks import Chunk, PreprocessError, Source, cut_lines, line_of, read_chunk
from threed.data.formats import FORMATS, Document, TextUnit, detect, format_of, json_values

_SFT_CHUNK_BYTES = 4 << 20  # --sft reads in one process: the chunk size only bounds the memory held


def check_file(path: str) -> None:
    """An input that exists, is a file and is readable."""
    p = Path(path)
    if not p.exists():
        raise PreprocessError(f"input not found: {path}; check the --input path")
    if not p.is_file():
        raise PreprocessError(f"input is not a file: {path}; pass the files themselves (e.g. DIR/*.jsonl)")
    if not os.access(p, os.R_OK):
        raise PreprocessError(f"input not readable: {path}; check its permissions")


def check_sources(paths: Sequence[str], fmt: str, keys: Sequence[str]) -> list[Source]:
    """Everything that can be checked before any work: existence, format, and the format's own checks (Parquet
    columns and their types, one key for plain text)."""
    if not paths:
        raise PreprocessError("no input files; pass --input FILE [FILE ...]")
    sources = []
    for path in paths:
        check_file(path)
        src = detect(path, fmt)
        FORMATS[src.format].check(src.path, keys)
        sources.append(src)
    return sources


def input_chunks(sources: Sequence[Source], chunk_bytes: int, unit: TextUnit) -> Iterator[Chunk]:
    """The chunks of all inputs, numbered in order, lazily (gzip blocks are decompressed as they are asked for)."""
    index = 0
    for src in sources:
        for chunk in FORMATS[src.format].cut(src, chunk_bytes, unit):
            chunk.index = index
            index += 1
            yield chunk


def input_bytes(sources: Sequence[Source]) -> int:
    """The size of all inputs on disk: what the progress bar counts."""
    return sum(os.path.getsize(s.path) for s in sources)


def documents(chunk: Chunk, keys: Sequence[str], unit: TextUnit) -> Iterator[Document]:
    """(position in the chunk, [text per key]) for each document of the chunk. Runs in the worker process."""
    return FORMATS[chunk.source.format].documents(chunk, keys, unit)


def where(chunk: Chunk, local: int) -> str:
    """`PATH line N` (or `PATH row N (from 0)`) of position `local` of the chunk, for an error message."""
    if FORMATS[chunk.source.format].rows:
        return f"{chunk.source.path} row {local} (from 0)"
    return f"{chunk.source.path} line {line_of(chunk, local)}"


def check_jsonl(paths: Sequence[str], why: str) -> list[Source]:
    """JSONL inputs (optionally gzipped) only: `why` says who asks."""
    sources = []
    for path in paths:
        check_file(path)
        if format_of(path) != "jsonl":
            raise PreprocessError(f"{path}: {why} reads JSONL (.jsonl, optionally .gz)")
        sources.append(detect(path, "jsonl"))
    return sources


def json_records(sources: Sequence[Source]) -> Iterator[tuple[str, Any]]:
    """("PATH line N", parsed JSON) for each non-blank line of JSONL sources, in order, in this process."""
    for src in sources:
        line = 1  # of the chunk's first line: chunks cover a file in order, so a running count
        for chunk in cut_lines(src, _SFT_CHUNK_BYTES, paragraphs=False):
            data = read_chunk(chunk)
            for local, value in json_values(chunk, data):
                yield f"{src.path} line {line + local}", value
            line += data.count(b"\n")
