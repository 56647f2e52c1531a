"""Plain preprocessing (`threed preprocess` without --sft): input files -> one Megatron indexed dataset
(PREFIX_{key}_document.bin/.idx) per --json-keys key, the library call behind the command line.

Each document is [BOS] + tokens (+ [EOS] with append_eod, the end-of-document token for Llama); bos=False drops the
BOS. Documents that tokenize to nothing are skipped (counted in the summary). Token dtype is megatron's
`DType.optimal_dtype(vocab)`: uint16 below 65,500, else int32. With workers > 1 each worker process writes one
partial .bin/.idx per chunk (`threed.data.encode`), and the parent appends them in input order, so any number of
workers gives byte-identical files. The inputs (`threed.data.inputs`) and the output (`threed.data.indexed_output`)
are checked before any work; bad input raises PreprocessError with nothing left on disk.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

from tqdm import tqdm

from threed.data.chunks import Chunk, PreprocessError
from threed.data.encode import ChunkStats, Options, TokenizerLike, encode_chunk, run_parallel
from threed.data.formats import FORMAT_CHOICES, TEXT_UNITS
from threed.data.indexed_output import IndexedOutput, check_output, indexed_dataset, indexed_output
from threed.data.inputs import check_sources, input_bytes, input_chunks
from threed.data.prefixes import dataset_prefix
from threed.data.sidecar import tokenizer_identity
from threed.data.tokenizer import Tokenizer


@dataclasses.dataclass
class PreprocessSummary:
    outputs: dict[str, str]  # json key -> output prefix (PREFIX_{key}_document)
    documents: int  # summed over keys
    tokens: int
    skipped: int  # documents with no tokens
    dtype: str
    vocab_size: int
    workers: int
    seconds: float  # reading, tokenizing, writing and renaming; the rates use this
    setup_seconds: float  # checks, imports (megatron-core: seconds), loading the tokenizer

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    def line(self) -> str:
        skipped = f", {self.skipped:,} empty skipped" if self.skipped else ""
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens ({self.dtype}){skipped} in "
            f"{self.seconds:.1f}s + {self.setup_seconds:.1f}s setup ({self.tokens_per_s:,.0f} tokens/s, "
            f"{self.workers} worker{'s' if self.workers > 1 else ''}) -> "
            + ", ".join(f"{p}.bin/.idx" for p in self.outputs.values())
        )


def _load_tokenizer(spec: Union[str, os.PathLike, TokenizerLike]) -> TokenizerLike:
    if not isinstance(spec, (str, os.PathLike)):
        return spec  # an object with encode / vocab_size / bos_id / eos_id (tests, other tokenizers)
    path, fix = str(spec), "pass a sentencepiece .model, a tokenizer.json or a local HF tokenizer directory"
    if not Path(path).exists():
        raise PreprocessError(f"tokenizer not found: {path}; {fix}")
    try:
        return Tokenizer(path)
    except Exception as e:  # sentencepiece / transformers raise many kinds for a wrong or corrupt file
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PreprocessError(f"cannot load tokenizer {path} ({msg}); {fix}") from None


def _provenance(
    tok: TokenizerLike, spec: object, inputs: Sequence[str], keys: tuple[str, ...], opts: Options, text_unit: str
) -> dict:
    """What the sidecars record (threed.data.sidecar): the tokenizer and the flags that change the bytes (the number
    of workers does not)."""
    return {
        "tokenizer": tokenizer_identity(tok, str(spec) if isinstance(spec, (str, os.PathLike)) else None),
        "flags": {
            "kind": "pretraining",
            "inputs": [str(i) for i in inputs],
            "json_keys": list(keys),
            "append_eod": opts.eod is not None,
            "bos": opts.bos is not None,
            "text_unit": text_unit,
            "dtype": opts.dtype.__name__,
        },
    }


def _check_keys(keys: Sequence[str]) -> tuple[str, ...]:
    keys = tuple(keys)
    if not keys or len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys must name distinct keys, got {list(keys)}")
    for k in keys:
        if not k or "/" in k or os.sep in k or "\n" in k:
            raise PreprocessError(f"--json-keys {k!r} cannot be part of a file name; rename the field")
    return keys


class _Progress:
    """The running counts of the finished chunks (the summary's numbers, and the empty-key check's per key), and the
    progress bar when asked for: called once per chunk, as its result comes in."""

    def __init__(self, keys: tuple[str, ...], total: int, show: bool):
        self.keys, self.total, self.show = keys, total, show
        self.counts = {"documents": 0, "tokens": 0, "skipped": 0}
        self.per_key = {k: 0 for k in keys}
        self.start = time.perf_counter()  # the work's clock: the rates leave the setup out
        self.bar: Optional[tqdm] = None

    def __call__(self, s: ChunkStats) -> None:
        for k in self.keys:
            self.per_key[k] += s.documents[k]
        self.counts["documents"] += sum(s.documents.values())
        self.counts["tokens"] += sum(s.tokens.values())
        self.counts["skipped"] += sum(s.skipped.values())
        if self.show and self.bar is None:
            # Made at the first result, after the workers are forked: tqdm starts a monitor thread, and a process
            # should not fork while it has threads.
            self.bar = tqdm(
                total=self.total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="preprocess",
                file=sys.stderr,
                dynamic_ncols=True,
            )
        if self.bar is not None:
            el = max(time.perf_counter() - self.start, 1e-9)
            self.bar.set_postfix_str(
                f"{self.counts['documents'] / el:,.0f} docs/s, {self.counts['tokens'] / el:,.0f} tokens/s",
                refresh=False,
            )
            self.bar.update(s.weight)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_flags(json_keys: Sequence[str], workers: int, input_format: str, text_unit: str) -> tuple[str, ...]:
    """The flags that need no file, checked before any is opened; the json keys, as a tuple."""
    keys = _check_keys(json_keys)
    if workers < 1:
        raise PreprocessError(f"--workers must be at least 1, got {workers}")
    if input_format not in FORMAT_CHOICES or text_unit not in TEXT_UNITS:
        raise PreprocessError(
            f"input format {input_format!r} / text unit {text_unit!r}: choose from {FORMAT_CHOICES} / {TEXT_UNITS}"
        )
    return keys


def _chunk_bytes(total: int, workers: int) -> int:
    """>= 8 chunks per worker balance the load; <= 4 MiB keeps the bar moving and Ctrl-C quick; >= 64 KiB bounds
    the per-chunk overhead."""
    return min(4 << 20, max(64 << 10, total // (8 * workers)))


def _encode_all(
    chunks: Iterator[Chunk], workers: int, tok: TokenizerLike, opts: Options, out: IndexedOutput, progress: _Progress
) -> None:
    """Every chunk into the output's builders, in input order: straight in with one worker (no pool, no partial
    files), through a pool of worker processes otherwise."""
    if workers == 1:
        for chunk in chunks:
            progress(encode_chunk(chunk, tok, opts, out.builders))
    else:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # processes fill the cores already
        run_parallel(chunks, workers, tok, opts, out.tmpdir, out.builders, progress)


def _check_every_key_has_documents(per_key: dict[str, int], inputs: Sequence[str]) -> None:
    for k, n in per_key.items():
        if n == 0:  # an empty .bin cannot even be memory-mapped by IndexedDataset
            raise PreprocessError(
                f"no documents for key {k!r} in {', '.join(inputs)} (all empty); check "
                f"the inputs and --json-keys / --text-unit"
            )


def preprocess(
    inputs: Sequence[str],
    output_prefix: str,
    tokenizer: Union[str, os.PathLike, TokenizerLike],
    *,
    json_keys: Sequence[str] = ("text",),
    workers: int = 1,
    append_eod: bool = False,
    bos: bool = True,
    input_format: str = "auto",
    text_unit: str = "paragraph",
    force: bool = False,
    show_progress: bool = False,
    chunk_bytes: Optional[int] = None,
) -> PreprocessSummary:
    """Tokenize `inputs` into PREFIX_{key}_document.bin/.idx for each json key. Raises PreprocessError (one-line
    message) for bad input or output, with nothing left on disk. `tokenizer` is a path (see Tokenizer) or an
    object with `encode`, `vocab_size`, `bos_id`, `eos_id` (and optionally `encode_batch`)."""
    start = time.perf_counter()
    keys = _check_flags(json_keys, workers, input_format, text_unit)
    sources = check_sources(inputs, input_format, keys)
    outputs = {k: dataset_prefix(output_prefix, k) for k in keys}
    check_output(output_prefix, outputs, force)
    tok = _load_tokenizer(tokenizer)
    dtype = indexed_dataset().DType.optimal_dtype(tok.vocab_size)
    opts = Options(keys, text_unit, tok.bos_id if bos else None, tok.eos_id if append_eod else None, dtype)
    total = input_bytes(sources)
    if chunk_bytes is None:
        chunk_bytes = _chunk_bytes(total, workers)
    setup = time.perf_counter() - start
    progress = _Progress(keys, total, show_progress)
    try:
        with indexed_output(
            output_prefix, outputs, {k: dtype for k in keys}, _provenance(tok, tokenizer, inputs, keys, opts, text_unit)
        ) as out:
            chunks = input_chunks(sources, chunk_bytes, text_unit)  # type: ignore[arg-type]
            _encode_all(chunks, workers, tok, opts, out, progress)
            _check_every_key_has_documents(progress.per_key, inputs)
    finally:
        progress.close()
    counts = progress.counts
    return PreprocessSummary(
        outputs,
        counts["documents"],
        counts["tokens"],
        counts["skipped"],
        dtype.__name__,
        tok.vocab_size,
        workers,
        time.perf_counter() - progress.start,
        setup,
    )
