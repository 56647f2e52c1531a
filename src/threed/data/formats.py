"""The input formats `threed preprocess` reads, in one registry (`FORMATS`) that plain and `--sft` preprocessing
share: JSONL (`.jsonl`, `.json`, `.ndjson`, optionally gzipped), Parquet and plain text.

A format says which file names it is recognised by, whether it may be gzipped, what it checks before any work
(Parquet: the columns), how a file is cut into chunks (`threed.data.chunks`), and how a worker turns one chunk
into documents: `(position in the chunk, [text per --json-keys key])`. A new input format is one reader here and
one entry in `FORMATS`; `--input-format`, detection by name, the checks and the workers pick it up from there.

Plain text: one document per paragraph (a maximal run of non-blank lines, joined with "\\n" as written; blank =
whitespace only) by default, the way the demo corpus treats text, or one per non-blank line. Line endings are
normalised like Python's universal newlines. Input must be UTF-8.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterator, Literal, Optional, Sequence

from threed.data.chunks import Chunk, PreprocessError, Source, cut_lines, first_line, line_of, read_chunk

TextUnit = Literal["paragraph", "line"]
TEXT_UNITS = ("paragraph", "line")
Document = tuple[int, list[str]]  # (line or row of the chunk, from 0; [text per key])

_PARQUET_BATCH_ROWS = 1024  # rows per Arrow batch: bounds memory inside a (possibly large) row group


@dataclasses.dataclass(frozen=True)
class InputFormat:
    name: str  # the --input-format value
    suffixes: tuple[str, ...]  # lower-case file name endings it is recognised by (before a .gz)
    cut: Callable[[Source, int, TextUnit], Iterator[Chunk]]  # (source, chunk bytes, unit) -> chunks, in order
    documents: Callable[[Chunk, Sequence[str], TextUnit], Iterator[Document]]  # runs in the worker
    check: Callable[[str, Sequence[str]], None] = lambda path, keys: None  # (path, keys) -> None, before any work
    no_gzip: str = ""  # why a gzipped file of this format is refused ("": gzip is fine)
    rows: bool = False  # errors name rows (from 0) instead of lines


# ------------------------------------------------------------------------------------------------- JSONL


def json_values(chunk: Chunk, data: bytes) -> Iterator[tuple[int, Any]]:
    """(line of the chunk from 0, parsed JSON) for each non-blank line of `data`, the chunk's bytes."""
    path = chunk.source.path
    for i, raw in enumerate(data.split(b"\n")):
        if not raw.strip():
            continue
        try:
            yield i, json.loads(raw)
        except UnicodeDecodeError as e:
            raise PreprocessError(
                f"{path} line {line_of(chunk, i)}: not UTF-8 (byte {raw[e.start]:#04x} at byte "
                f"{e.start + 1}); re-encode the file as UTF-8"
            ) from None
        except json.JSONDecodeError as e:
            raise PreprocessError(
                f"{path} line {line_of(chunk, i)}: not valid JSON ({e.msg} at column {e.colno});"
                f" fix or remove that line (one JSON object per line)"
            ) from None


def _jsonl_documents(chunk: Chunk, keys: Sequence[str], unit: TextUnit) -> Iterator[Document]:
    path = chunk.source.path
    for i, obj in json_values(chunk, read_chunk(chunk)):
        if not isinstance(obj, dict):
            raise PreprocessError(
                f"{path} line {line_of(chunk, i)}: a JSON {type(obj).__name__}, not an object; "
                f'each line must be one object like {{"{keys[0]}": "..."}}'
            )
        texts = []
        for key in keys:
            if key not in obj:
                raise PreprocessError(
                    f"{path} line {line_of(chunk, i)}: no key {key!r} (keys: {_names(list(obj))});"
                    f" pass --json-keys with the field that holds the text"
                )
            value = obj[key]
            if not isinstance(value, str):
                kind = "null" if value is None else type(value).__name__
                raise PreprocessError(
                    f"{path} line {line_of(chunk, i)}: {key!r} is {kind}, not a string; fix the line or drop it"
                )
            texts.append(value)
        yield i, texts


def _cut_jsonl(src: Source, chunk_bytes: int, unit: TextUnit) -> Iterator[Chunk]:
    return cut_lines(src, chunk_bytes, paragraphs=False)


# ------------------------------------------------------------------------------------------------- text


def _check_text(path: str, keys: Sequence[str]) -> None:
    if len(keys) != 1:
        raise PreprocessError(
            f"{path} is plain text, one field per document, but --json-keys names "
            f"{len(keys)}; pass a single key (it names the output)"
        )


def _cut_text(src: Source, chunk_bytes: int, unit: TextUnit) -> Iterator[Chunk]:
    return cut_lines(src, chunk_bytes, paragraphs=unit == "paragraph")


def _text_documents(chunk: Chunk, keys: Sequence[str], unit: TextUnit) -> Iterator[Document]:
    data = read_chunk(chunk)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = line_of(chunk, data.count(b"\n", 0, e.start))
        raise PreprocessError(
            f"{chunk.source.path} line {line}: not UTF-8 (byte {data[e.start]:#04x}); re-encode the file as UTF-8"
        ) from None
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


# ------------------------------------------------------------------------------------------------- Parquet


def _check_parquet(path: str, keys: Sequence[str]) -> None:
    # pyarrow: heavy, only for Parquet inputs
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.ParquetFile(path).schema_arrow
    except (OSError, pa.ArrowException) as e:
        raise PreprocessError(f"{path}: not a readable Parquet file ({first_line(e)}); check the file") from None
    for key in keys:
        if key not in schema.names:
            raise PreprocessError(
                f"{path}: no column {key!r} (columns: {_names(schema.names)}); pass --json-keys "
                f"with the column that holds the text"
            )
        t = schema.field(key).type
        if not (
            pa.types.is_string(t)
            or pa.types.is_large_string(t)
            or getattr(pa.types, "is_string_view", lambda _: False)(t)
        ):
            raise PreprocessError(f"{path}: column {key!r} is {t}, not text; pass --json-keys with a string column")


def _cut_parquet(src: Source, chunk_bytes: int, unit: TextUnit) -> Iterator[Chunk]:
    """One chunk per row group, whatever `chunk_bytes` says: a row group is the smallest piece Parquet reads."""
    import pyarrow.parquet as pq  # pyarrow: heavy, only for Parquet inputs

    meta = pq.ParquetFile(src.path).metadata
    size, rows = os.path.getsize(src.path), max(meta.num_rows, 1)
    first = 0
    for rg in range(meta.num_row_groups):
        n = meta.row_group(rg).num_rows
        yield Chunk(0, src, start=rg, first_line=first, weight=size * n // rows)
        first += n


def _parquet_documents(chunk: Chunk, keys: Sequence[str], unit: TextUnit) -> Iterator[Document]:
    import pyarrow.parquet as pq  # pyarrow: heavy, only for Parquet inputs

    path = chunk.source.path
    row = chunk.first_line
    # One row group, in bounded batches, single-threaded (the parallelism is the worker processes).
    for batch in pq.ParquetFile(path).iter_batches(
        batch_size=_PARQUET_BATCH_ROWS, row_groups=[chunk.start], columns=list(keys), use_threads=False
    ):
        columns = [batch.column(k).to_pylist() for k in keys]
        for j, texts in enumerate(zip(*columns)):
            for key, value in zip(keys, texts):
                if value is None:
                    raise PreprocessError(
                        f"{path} row {row + j} (from 0): column {key!r} is null; drop or fill the null rows"
                    )
            yield row + j, list(texts)
        row += batch.num_rows


# ------------------------------------------------------------------------------------------------- registry


FORMATS: dict[str, InputFormat] = {
    f.name: f
    for f in (
        InputFormat("jsonl", (".jsonl", ".json", ".ndjson"), _cut_jsonl, _jsonl_documents),
        InputFormat(
            "parquet",
            (".parquet",),
            _cut_parquet,
            _parquet_documents,
            check=_check_parquet,
            rows=True,
            no_gzip="a gzipped Parquet file is not readable in row groups; gunzip it first (Parquet compresses "
            "its pages itself)",
        ),
        InputFormat("text", (".txt", ".text", ".md"), _cut_text, _text_documents, check=_check_text),
    )
}
FORMAT_CHOICES = ("auto", *FORMATS)  # --input-format


def format_of(path: str) -> Optional[str]:
    """The format a file's name says (a .gz ending aside), or None."""
    name = path.lower()
    base = name[:-3] if name.endswith(".gz") else name
    return next((f.name for f in FORMATS.values() if base.endswith(f.suffixes)), None)


def detect(path: str, fmt: str = "auto") -> Source:
    """`path` as a Source of format `fmt` ("auto": from its name)."""
    if fmt == "auto":
        found = format_of(path)
        if found is None:
            names = ", ".join(
                f"{f.suffixes[0]}, {f.suffixes[0]}.gz" if not f.no_gzip else f.suffixes[0] for f in FORMATS.values()
            )
            raise PreprocessError(
                f"cannot tell the format of {path} from its name; name it {names}, or pass "
                f"--input-format {'|'.join(FORMATS)}"
            )
        fmt = found
    gzipped = path.lower().endswith(".gz")
    if gzipped and FORMATS[fmt].no_gzip:
        raise PreprocessError(f"{path}: {FORMATS[fmt].no_gzip}")
    return Source(path, fmt, gzipped)


def _names(names: Sequence[str], limit: int = 10) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "") if names else "none"
