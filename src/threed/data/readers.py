"""Input readers for `threed preprocess`: JSONL (`.jsonl`, `.json`, `.ndjson`, optionally gzipped), Parquet and
plain text, cut into chunks that worker processes read on their own.

A chunk is a contiguous piece of one input: a byte range of a plain file (cut at a line end, or after a blank
line for paragraph text, so no document straddles two chunks), a block of a gzip stream (decompressed by the
parent, which is the only way to split one), or one Parquet row group. Documents come out of the chunks in input
order, so the output does not depend on how many workers there are or how big the chunks are.

Plain text: one document per paragraph (a maximal run of non-blank lines, joined with "\\n" as written; blank =
whitespace only) by default, the way the demo corpus and `threed tokenize` treat text, or one per non-blank line.
Line endings are normalised like Python's universal newlines. Input must be UTF-8.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Iterator, Literal, Optional, Sequence

from threed.errors import ThreedError

Format = Literal["jsonl", "parquet", "text"]
TextUnit = Literal["paragraph", "line"]
FORMATS = ("auto", "jsonl", "parquet", "text")
TEXT_UNITS = ("paragraph", "line")

_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_TEXT_SUFFIXES = (".txt", ".text", ".md")
_PARQUET_BATCH_ROWS = 1024  # rows per Arrow batch: bounds memory inside a (possibly large) row group


class PreprocessError(ThreedError):
    """Bad input or output: the message is one line naming the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    format: Format
    gzipped: bool


@dataclasses.dataclass
class Chunk:
    """One unit of work. `index` is its place in the output; `weight` is the input bytes it stands for (progress)."""
    index: int
    source: Source
    start: int = 0  # byte offset (plain files) or row group (parquet)
    end: int = 0  # byte offset (plain files, exclusive)
    first_line: int = 0  # 1-based line (gzip blocks) or first row (parquet) when known; 0: count it on error
    data: Optional[bytes] = None  # gzip blocks carry their decompressed bytes
    weight: int = 0


def detect(path: str, fmt: str = "auto") -> Source:
    name = path.lower()
    gzipped = name.endswith(".gz")
    base = name[:-3] if gzipped else name
    if fmt == "auto":
        if base.endswith(_JSONL_SUFFIXES):
            fmt = "jsonl"
        elif base.endswith(".parquet"):
            fmt = "parquet"
        elif base.endswith(_TEXT_SUFFIXES):
            fmt = "text"
        else:
            raise PreprocessError(f"cannot tell the format of {path} from its name; name it .jsonl, .jsonl.gz, "
                                  f".parquet or .txt, or pass --input-format jsonl|parquet|text")
    if fmt == "parquet" and gzipped:
        raise PreprocessError(f"{path}: a gzipped Parquet file is not readable in row groups; gunzip it first "
                              f"(Parquet compresses its pages itself)")
    return Source(path, fmt, gzipped)  # type: ignore[arg-type]


def check_sources(paths: Sequence[str], fmt: str, keys: Sequence[str]) -> list[Source]:
    """Everything that can be checked before any work: existence, format, Parquet columns and their types."""
    if not paths:
        raise PreprocessError("no input files; pass --input FILE [FILE ...]")
    sources = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise PreprocessError(f"input not found: {path}; check the --input path")
        if not p.is_file():
            raise PreprocessError(f"input is not a file: {path}; pass the files themselves (e.g. DIR/*.jsonl)")
        if not os.access(p, os.R_OK):
            raise PreprocessError(f"input not readable: {path}; check its permissions")
        src = detect(path, fmt)
        if src.format == "text" and len(keys) != 1:
            raise PreprocessError(f"{path} is plain text, one field per document, but --json-keys names "
                                  f"{len(keys)}; pass a single key (it names the output)")
        if src.format == "parquet":
            _check_parquet(src.path, keys)
        sources.append(src)
    return sources


def _check_parquet(path: str, keys: Sequence[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.ParquetFile(path).schema_arrow
    except (OSError, pa.ArrowException) as e:
        raise PreprocessError(f"{path}: not a readable Parquet file ({_first_line(e)}); check the file") from None
    for key in keys:
        if key not in schema.names:
            raise PreprocessError(f"{path}: no column {key!r} (columns: {_names(schema.names)}); pass --json-keys "
                                  f"with the column that holds the text")
        t = schema.field(key).type
        if not (pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view",
                                                                                 lambda _: False)(t)):
            raise PreprocessError(f"{path}: column {key!r} is {t}, not text; pass --json-keys with a string column")


def _names(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "") if names else "none"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def plan(sources: Sequence[Source], chunk_bytes: int, unit: TextUnit) -> Iterator[Chunk]:
    """The chunks of all inputs, in order, lazily (gzip blocks are decompressed as they are asked for)."""
    index = 0
    for src in sources:
        if src.format == "parquet":
            pieces: Iterator[Chunk] = _plan_parquet(src)
        elif src.gzipped:
            pieces = _plan_gzip(src, chunk_bytes, src.format == "text" and unit == "paragraph")
        else:
            pieces = _plan_plain(src, chunk_bytes, src.format == "text" and unit == "paragraph")
        for chunk in pieces:
            chunk.index = index
            index += 1
            yield chunk


def total_weight(sources: Sequence[Source]) -> int:
    return sum(os.path.getsize(s.path) for s in sources)


def _plan_plain(src: Source, chunk_bytes: int, paragraphs: bool) -> Iterator[Chunk]:
    size = os.path.getsize(src.path)
    with open(src.path, "rb") as f:
        start = 0
        while start < size:
            end = size
            if start + chunk_bytes < size:
                f.seek(start + chunk_bytes)
                f.readline()  # finish the line the target offset fell into
                if paragraphs:
                    # Cut only after a blank line, and only among complete lines: the line finished above may be
                    # the whitespace tail of a non-blank line.
                    while (line := f.readline()) and line.strip():
                        pass
                end = f.tell()
            yield Chunk(0, src, start=start, end=end, weight=end - start)
            start = end


def _plan_gzip(src: Source, chunk_bytes: int, paragraphs: bool) -> Iterator[Chunk]:
    """A gzip stream cannot be seeked: the parent decompresses it block by block (cheap next to tokenizing) and
    hands out whole lines (whole paragraphs for paragraph text)."""
    line, consumed = 1, 0
    pending: list[bytes] = []  # blocks with no boundary yet (a long line or paragraph), joined once one comes
    with open(src.path, "rb") as raw:
        gz = gzip.GzipFile(fileobj=raw)
        while True:
            try:
                block = gz.read(chunk_bytes)
            except (OSError, EOFError, zlib.error) as e:
                raise PreprocessError(f"{src.path}: corrupt or truncated gzip ({_first_line(e)}); "
                                      f"re-create or re-download it") from None
            if not block:
                if pending:
                    yield Chunk(0, src, first_line=line, data=b"".join(pending), weight=raw.tell() - consumed)
                return
            # A blank line may straddle the previous block and this one: look from the previous block's last two
            # bytes. The boundary ends inside this block (one inside those bytes would have been cut already).
            tail = pending[-1][-2:] if pending else b""
            cut = _last_boundary(tail + block, paragraphs) - len(tail)
            if cut <= 0:
                pending.append(block)
                continue
            data = b"".join(pending) + block[:cut]
            pending = [block[cut:]] if cut < len(block) else []
            yield Chunk(0, src, first_line=line, data=data, weight=raw.tell() - consumed)
            line, consumed = line + data.count(b"\n"), raw.tell()


def _last_boundary(data: bytes, paragraphs: bool) -> int:
    """Offset just after the last line end (after the last blank line for paragraphs: the second newline of
    "\n\n" or "\n\r\n" ends an empty line wherever `data` starts); 0 if there is none."""
    if not paragraphs:
        return data.rfind(b"\n") + 1
    found = [p + len(pat) for pat in (b"\n\n", b"\n\r\n") if (p := data.rfind(pat)) >= 0]
    return max(found, default=0)


def _plan_parquet(src: Source) -> Iterator[Chunk]:
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(src.path).metadata
    size, rows = os.path.getsize(src.path), max(meta.num_rows, 1)
    first = 0
    for rg in range(meta.num_row_groups):
        n = meta.row_group(rg).num_rows
        yield Chunk(0, src, start=rg, first_line=first, weight=size * n // rows)
        first += n


# ----------------------------------------------------------------------------------------------- worker side


def read_records(chunk: Chunk, keys: Sequence[str], unit: TextUnit) -> Iterator[tuple[int, list[str]]]:
    """(line or row number, [text per key]) for each document of the chunk. Runs in the worker process."""
    src = chunk.source
    if src.format == "parquet":
        yield from _parquet_records(chunk, keys)
        return
    data = chunk.data if chunk.data is not None else _read_range(src.path, chunk.start, chunk.end)
    if src.format == "jsonl":
        yield from _jsonl_records(chunk, data, keys)
    else:
        yield from _text_records(chunk, data, unit)


def _read_range(path: str, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def line_of(chunk: Chunk, local_line: int) -> int:
    """1-based line number in the input file of line `local_line` (0-based) of the chunk; counted only when an
    error needs it, so plain-file chunks need not know where they start."""
    if chunk.data is not None or chunk.start == 0:
        return (chunk.first_line or 1) + local_line
    count = 0
    with open(chunk.source.path, "rb") as f:
        remaining = chunk.start
        while remaining > 0:
            block = f.read(min(remaining, 1 << 20))
            count += block.count(b"\n")
            remaining -= len(block)
    return count + 1 + local_line


def _jsonl_records(chunk: Chunk, data: bytes, keys: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    path = chunk.source.path
    for i, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError as e:
            raise PreprocessError(f"{path} line {line_of(chunk, i)}: not UTF-8 (byte {raw[e.start]:#04x} at byte "
                                  f"{e.start + 1}); re-encode the file as UTF-8") from None
        except json.JSONDecodeError as e:
            raise PreprocessError(f"{path} line {line_of(chunk, i)}: not valid JSON ({e.msg} at column {e.colno});"
                                  f" fix or remove that line (one JSON object per line)") from None
        if not isinstance(obj, dict):
            raise PreprocessError(f"{path} line {line_of(chunk, i)}: a JSON {type(obj).__name__}, not an object; "
                                  f"each line must be one object like {{\"{keys[0]}\": \"...\"}}")
        texts = []
        for key in keys:
            if key not in obj:
                raise PreprocessError(f"{path} line {line_of(chunk, i)}: no key {key!r} (keys: {_names(list(obj))});"
                                      f" pass --json-keys with the field that holds the text")
            value = obj[key]
            if not isinstance(value, str):
                kind = "null" if value is None else type(value).__name__
                raise PreprocessError(f"{path} line {line_of(chunk, i)}: {key!r} is {kind}, not a string; fix the "
                                      f"line or drop it")
            texts.append(value)
        yield i, texts


def _text_records(chunk: Chunk, data: bytes, unit: TextUnit) -> Iterator[tuple[int, list[str]]]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_of(chunk, data.count(b"\n", 0, e.start))
        raise PreprocessError(f"{chunk.source.path} line {line}: not UTF-8 (byte {data[e.start]:#04x}); re-encode "
                              f"the file as UTF-8") from None
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = text.split("\n")
    if unit == "line":
        for i, line in enumerate(lines):
            if line.strip():
                yield i, [line]
        return
    para: list[str] = []
    first = 0
    for i, line in enumerate(lines):
        if line.strip():
            if not para:
                first = i
            para.append(line)
        elif para:
            yield first, ["\n".join(para)]
            para = []
    if para:
        yield first, ["\n".join(para)]


def _parquet_records(chunk: Chunk, keys: Sequence[str]) -> Iterator[tuple[int, list[str]]]:
    import pyarrow.parquet as pq

    path = chunk.source.path
    row = chunk.first_line
    # One row group, in bounded batches, single-threaded (the parallelism is the worker processes).
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS, row_groups=[chunk.start],
                                                   columns=list(keys), use_threads=False):
        columns = [batch.column(k).to_pylist() for k in keys]
        for j, texts in enumerate(zip(*columns)):
            for key, value in zip(keys, texts):
                if value is None:
                    raise PreprocessError(f"{path} row {row + j} (from 0): column {key!r} is null; drop or fill "
                                          f"the null rows")
            yield row + j, list(texts)
        row += batch.num_rows
