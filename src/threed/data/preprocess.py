"""`threed preprocess`: JSONL (also .jsonl.gz), Parquet and plain text -> Megatron indexed datasets (.bin/.idx),
written by megatron-core's own `IndexedDatasetBuilder`, so Megatron-LM reads ours and we read theirs.

    threed preprocess --input a.jsonl b.jsonl.gz c.parquet --output-prefix data/corpus \\
        --tokenizer tok.model --append-eod --workers 8
    # -> data/corpus_text_document.bin/.idx (Megatron-LM's naming: PREFIX_{key}_document, one per --json-keys)

With --sft (threed.data.sft): chat / instruction JSONL rendered with the tokenizer's chat template, written as
PREFIX_text_document plus a loss mask PREFIX_mask_document (1 on response tokens), examples up to --seq-length.

Each document is [BOS] + tokens (+ [EOS] with --append-eod, the end-of-document token for Llama); --no-bos drops
the BOS. Documents that tokenize to nothing are skipped (counted in the summary). Token dtype is megatron's
`DType.optimal_dtype(vocab)`: uint16 below 65,500, else int32. Inputs are cut into chunks (see readers.py);
with --workers N each worker process writes one partial .bin/.idx per chunk, and the parent appends them in input
order with `IndexedDatasetBuilder.add_index`, so any N gives byte-identical files. Everything is written in a
temporary directory beside the output and renamed when complete (.bin first, .idx last); an existing output is
refused without --force. Bad input is one line naming the file (and line) and exit status 2, nothing left on disk.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence, Union

from threed.data.encode import ChunkStats, Options, TokenizerLike, encode_chunk, indexed_dataset, run_parallel
from threed.data.readers import FORMATS, TEXT_UNITS, PreprocessError, check_sources, plan, total_weight

__all__ = ["PreprocessError", "PreprocessSummary", "dataset_prefix", "preprocess", "register"]

LEVEL = "document"  # Megatron-LM's name for unsplit documents ("sentence" with --split-sentences, not supported)


def dataset_prefix(prefix: str, key: str = "text") -> str:
    """What `IndexedDataset` / a GPTDataset blend takes for one json key: PREFIX_{key}_document."""
    return f"{prefix}_{key}_{LEVEL}"


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
        return (f"{self.documents:,} documents, {self.tokens:,} tokens ({self.dtype}){skipped} in "
                f"{self.seconds:.1f}s + {self.setup_seconds:.1f}s setup ({self.tokens_per_s:,.0f} tokens/s, "
                f"{self.workers} worker{'s' if self.workers > 1 else ''}) -> "
                + ", ".join(f"{p}.bin/.idx" for p in self.outputs.values()))


# ------------------------------------------------------------------------------------------------- driver


def _load_tokenizer(spec: Union[str, os.PathLike, TokenizerLike]) -> TokenizerLike:
    if not isinstance(spec, (str, os.PathLike)):
        return spec  # an object with encode / vocab_size / bos_id / eos_id (tests, other tokenizers)
    from threed.data.tokenizer import Tokenizer

    path, fix = str(spec), "pass a sentencepiece .model, a tokenizer.json or a local HF tokenizer directory"
    if not Path(path).exists():
        raise PreprocessError(f"tokenizer not found: {path}; {fix}")
    try:
        return Tokenizer(path)
    except Exception as e:  # sentencepiece / transformers raise many kinds for a wrong or corrupt file
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PreprocessError(f"cannot load tokenizer {path} ({msg}); {fix}") from None


def _check_keys(keys: Sequence[str]) -> tuple[str, ...]:
    keys = tuple(keys)
    if not keys or len(set(keys)) != len(keys):
        raise PreprocessError(f"--json-keys must name distinct keys, got {list(keys)}")
    for k in keys:
        if not k or "/" in k or os.sep in k or "\n" in k:
            raise PreprocessError(f"--json-keys {k!r} cannot be part of a file name; rename the field")
    return keys


def _check_output(prefix: str, outputs: dict[str, str], force: bool) -> None:
    if prefix.endswith(("/", os.sep)) or Path(prefix).is_dir() or not Path(prefix).name:
        raise PreprocessError(f"--output-prefix {prefix} is a directory; give a file prefix like "
                              f"{prefix.rstrip('/')}/corpus")
    for out in outputs.values():
        for path in (out + ".bin", out + ".idx"):
            if os.path.lexists(path) and not force:
                raise PreprocessError(f"output exists: {path}; pass --force to replace it or choose another "
                                      f"--output-prefix")


def _make_tmpdir(prefix: str) -> tuple[str, list[Path]]:
    """The output's parent directory and a temporary directory in it (same file system: renames are atomic).
    Returns the temporary directory and the directories created here (removed again on failure)."""
    parent = Path(prefix).absolute().parent
    created: list[Path] = []
    d = parent
    while not os.path.lexists(d) and d != d.parent:
        created.append(d)
        d = d.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(prefix=f".{Path(prefix).name}.", suffix=".preprocess-tmp", dir=parent), created
    except OSError as e:
        _remove_dirs(created)
        raise PreprocessError(f"cannot write to {parent} ({e.strerror or e}); choose a writable "
                              f"--output-prefix") from None


def _publish(builders: dict, tmp: dict[str, str], outputs: dict[str, str]) -> None:
    """Finalize each builder's temporary .idx and move the datasets into place. Old .idx files go first (--force),
    then the .bin files, then the new .idx files that make each dataset readable: a reader finds the old pair, no
    .idx, or the new pair, never a mixed or partial one."""
    for k, b in builders.items():
        b.finalize(tmp[k] + ".idx")
    for k in outputs:
        if os.path.lexists(outputs[k] + ".idx"):
            os.remove(outputs[k] + ".idx")
    for suffix in (".bin", ".idx"):
        for k in outputs:
            os.replace(tmp[k] + suffix, outputs[k] + suffix)


def _remove_dirs(dirs: list[Path]) -> None:
    for d in dirs:  # deepest first
        try:
            d.rmdir()
        except OSError:
            pass


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer: Union[str, os.PathLike, TokenizerLike], *,
               json_keys: Sequence[str] = ("text",), workers: int = 1, append_eod: bool = False, bos: bool = True,
               input_format: str = "auto", text_unit: str = "paragraph", force: bool = False,
               show_progress: bool = False, chunk_bytes: Optional[int] = None) -> PreprocessSummary:
    """Tokenize `inputs` into PREFIX_{key}_document.bin/.idx for each json key. Raises PreprocessError (one-line
    message) for bad input or output, with nothing left on disk. `tokenizer` is a path (see Tokenizer) or an
    object with `encode`, `vocab_size`, `bos_id`, `eos_id` (and optionally `encode_batch`)."""
    start = time.perf_counter()
    keys = _check_keys(json_keys)
    if workers < 1:
        raise PreprocessError(f"--workers must be at least 1, got {workers}")
    if input_format not in FORMATS or text_unit not in TEXT_UNITS:
        raise PreprocessError(f"input format {input_format!r} / text unit {text_unit!r}: choose from {FORMATS} / "
                              f"{TEXT_UNITS}")
    sources = check_sources(inputs, input_format, keys)
    outputs = {k: dataset_prefix(output_prefix, k) for k in keys}
    _check_output(output_prefix, outputs, force)
    tok = _load_tokenizer(tokenizer)
    idx = indexed_dataset()
    dtype = idx.DType.optimal_dtype(tok.vocab_size)
    tmpdir, created = _make_tmpdir(output_prefix)
    opts = Options(keys, text_unit, tok.bos_id if bos else None, tok.eos_id if append_eod else None, dtype)
    total = total_weight(sources)
    if chunk_bytes is None:  # >= 8 chunks per worker balance the load; <= 4 MiB keeps the bar moving and Ctrl-C
        chunk_bytes = min(4 << 20, max(64 << 10, total // (8 * workers)))  # quick; >= 64 KiB bounds the overhead
    counts = {"documents": 0, "tokens": 0, "skipped": 0}
    per_key = {k: 0 for k in keys}
    setup, start = time.perf_counter() - start, time.perf_counter()
    bar = None
    try:
        tmp = {k: os.path.join(tmpdir, Path(p).name) for k, p in outputs.items()}
        builders = {k: idx.IndexedDatasetBuilder(p + ".bin", dtype=dtype) for k, p in tmp.items()}

        def progress(s: ChunkStats) -> None:
            nonlocal bar
            for k in keys:
                per_key[k] += s.documents[k]
            counts["documents"] += sum(s.documents.values())
            counts["tokens"] += sum(s.tokens.values())
            counts["skipped"] += sum(s.skipped.values())
            if show_progress and bar is None:
                from tqdm import tqdm

                # Made at the first result, after the workers are forked: tqdm starts a monitor thread, and a
                # process should not fork while it has threads.
                bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="preprocess",
                           file=sys.stderr, dynamic_ncols=True)
            if bar is not None:
                el = max(time.perf_counter() - start, 1e-9)
                bar.set_postfix_str(f"{counts['documents'] / el:,.0f} docs/s, {counts['tokens'] / el:,.0f} tokens/s",
                                    refresh=False)
                bar.update(s.weight)

        chunks = plan(sources, chunk_bytes, text_unit)  # type: ignore[arg-type]
        if workers == 1:  # no pool, no partial files: straight into the output builders
            for chunk in chunks:
                progress(encode_chunk(chunk, tok, opts, builders))
        else:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # processes fill the cores already
            run_parallel(chunks, workers, tok, opts, tmpdir, builders, progress)
        for k, n in per_key.items():
            if n == 0:  # an empty .bin cannot even be memory-mapped by IndexedDataset
                raise PreprocessError(f"no documents for key {k!r} in {', '.join(inputs)} (all empty); check the "
                                      f"inputs and --json-keys / --text-unit")
        _publish(builders, tmp, outputs)
    except BaseException:
        shutil.rmtree(tmpdir, ignore_errors=True)
        _remove_dirs(created)
        raise
    finally:
        if bar is not None:
            bar.close()
    shutil.rmtree(tmpdir, ignore_errors=True)
    return PreprocessSummary(outputs, counts["documents"], counts["tokens"], counts["skipped"],
                             dtype.__name__, tok.vocab_size, workers, time.perf_counter() - start, setup)


# ------------------------------------------------------------------------------------------------- CLI


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (kill, Slurm time limit) cleans up like Ctrl-C


def _run(ns: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if ns.sft:
            from threed.data.sft import preprocess_sft

            long = "drop" if ns.drop_long else "truncate" if ns.truncate_long else "error"
            summary = preprocess_sft(ns.input, ns.output_prefix, ns.tokenizer, seq_length=ns.seq_length,
                                     chat_format=ns.chat_format, long=long, force=ns.force)
        else:
            if ns.chat_format or ns.drop_long or ns.truncate_long:
                raise PreprocessError("--chat-format, --drop-long and --truncate-long apply to --sft only")
            summary = preprocess(ns.input, ns.output_prefix, ns.tokenizer, json_keys=ns.json_keys,
                                 workers=ns.workers, append_eod=ns.append_eod, bos=not ns.no_bos,
                                 input_format=ns.input_format, text_unit=ns.text_unit, force=ns.force,
                                 show_progress=not ns.quiet)
    except (PreprocessError, OSError) as e:  # OSError: disk full, permissions, a file vanishing meanwhile
        print(f"threed preprocess: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("threed preprocess: interrupted; no output was left behind", file=sys.stderr)
        return 130
    if not ns.quiet:
        print(summary.line())
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("preprocess", help="JSONL / Parquet / text -> Megatron .bin/.idx token datasets",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help=".jsonl/.json/.ndjson (optionally .gz), .parquet, "
                                                               ".txt (optionally .gz) files, read in this order")
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx per json key")
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model, tokenizer.json or HF tokenizer dir")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields / Parquet columns to tokenize, "
                                                                    "one output each (default: text)")
    p.add_argument("--append-eod", action="store_true", help="end each document with the EOS token")
    p.add_argument("--no-bos", action="store_true", help="do not start each document with BOS (Llama wants it)")
    p.add_argument("--input-format", choices=FORMATS, default="auto", help="default: from the file names")
    p.add_argument("--text-unit", choices=TEXT_UNITS, default="paragraph",
                   help="plain text: a document per blank-line-separated paragraph (default) or per line")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    sft = p.add_argument_group("fine-tuning data (--sft; see threed.data.sft)")
    sft.add_argument("--sft", action="store_true", help="chat / instruction JSONL -> PREFIX_text_document and "
                                                        "PREFIX_mask_document (loss mask on the responses)")
    sft.add_argument("--seq-length", type=int, help="--sft: longest example in tokens")
    sft.add_argument("--chat-format", choices=["llama2"], help="--sft: render with Llama 2's [INST] template "
                                                                "(default: the tokenizer's own chat template)")
    long = sft.add_mutually_exclusive_group()
    long.add_argument("--drop-long", action="store_true", help="--sft: skip examples longer than --seq-length")
    long.add_argument("--truncate-long", action="store_true",
                      help="--sft: cut examples longer than --seq-length (default: refuse them)")
    p.add_argument("--force", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary line")
    p.set_defaults(run=_run)
