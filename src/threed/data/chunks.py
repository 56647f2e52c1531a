"""What `threed preprocess` reads, cut into chunks that worker processes read on their own, and the error every
bad input becomes.

A chunk is a contiguous piece of one input: a byte range of a plain file (cut at a line end, or after a blank
line for paragraph text, so no document straddles two chunks), a block of a gzip stream (decompressed by the
parent, which is the only way to split one), or one Parquet row group (`threed.data.formats`). Documents come out
of the chunks in input order, so the output does not depend on how many workers there are or how big the chunks
are. Line numbers for error messages are counted only when an error needs one.
"""

from __future__ import annotations

import dataclasses
import gzip
import os
import zlib
from typing import Iterator, Optional

from threed.errors import ThreedError


class PreprocessError(ThreedError):
    """Bad input or output: the message is one line naming the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One input file and its format (a name in `threed.data.formats.FORMATS`)."""

    path: str
    format: str
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


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (third-party errors can run to pages)."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def cut_lines(src: Source, chunk_bytes: int, paragraphs: bool) -> Iterator[Chunk]:
    """Chunks of a line-based file (plain or gzipped), each ending at a line end (after a blank line for
    `paragraphs`). `index` is left 0: the caller numbers the chunks of all inputs."""
    if src.gzipped:
        return _cut_gzip(src, chunk_bytes, paragraphs)
    return _cut_plain(src, chunk_bytes, paragraphs)


def _cut_plain(src: Source, chunk_bytes: int, paragraphs: bool) -> Iterator[Chunk]:
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


def _cut_gzip(src: Source, chunk_bytes: int, paragraphs: bool) -> Iterator[Chunk]:
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
                raise PreprocessError(
                    f"{src.path}: corrupt or truncated gzip ({first_line(e)}); re-create or re-download it"
                ) from None
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


def read_chunk(chunk: Chunk) -> bytes:
    """The bytes of a line-based chunk: carried (gzip blocks) or read from the file (plain byte ranges)."""
    if chunk.data is not None:
        return chunk.data
    with open(chunk.source.path, "rb") as f:
        f.seek(chunk.start)
        return f.read(chunk.end - chunk.start)


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
