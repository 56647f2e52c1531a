"""`threed preprocess`: JSONL (also .jsonl.gz), Parquet and plain text -> Megatron indexed datasets (.bin/.idx),
written by megatron-core's own `IndexedDatasetBuilder`, so Megatron-LM reads ours and we read theirs.

    threed preprocess --input a.jsonl b.jsonl.gz c.parquet --output-prefix data/corpus \\
        --tokenizer tok.model --append-eod --workers 8
    # -> data/corpus_text_document.bin/.idx (Megatron-LM's naming: PREFIX_{key}_document, one per --json-keys)

With --sft (threed.data.sft): chat / instruction JSONL rendered with the tokenizer's chat template, written as
PREFIX_text_document plus a loss mask PREFIX_mask_document (1 on response tokens), examples up to --seq-length.

Each document is [BOS] + tokens (+ [EOS] with --append-eod, the end-of-document token for Llama); --no-bos drops
the BOS. Documents that tokenize to nothing are skipped (counted in the summary). Token dtype is megatron's
`DType.optimal_dtype(vocab)`: uint16 below 65,500, else int32. Inputs are cut into chunks (threed.data.chunks);
with --workers N each worker process writes one partial .bin/.idx per chunk, and the parent appends them in input
order with `IndexedDatasetBuilder.add_index`, so any N gives byte-identical files. Everything is written in a
temporary directory beside the output and renamed when complete (.bin first, .idx last); an existing output is
refused without --force. Bad input is one line naming the file (and line) and exit status 2, nothing left on disk.
"""

from __future__ import annotations

import argparse
import signal

from threed.data.chat import CHAT_FORMATS
from threed.data.chunks import PreprocessError
from threed.data.formats import FORMAT_CHOICES, TEXT_UNITS
from threed.data.preprocess import preprocess
from threed.data.sft import preprocess_sft
from threed.errors import guarded, os_error_line

PROG = "threed preprocess"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM (kill, Slurm time limit) cleans up like Ctrl-C


def _main(ns: argparse.Namespace) -> int:
    try:
        if ns.sft:
            long = "drop" if ns.drop_long else "truncate" if ns.truncate_long else "error"
            summary = preprocess_sft(
                ns.input,
                ns.output_prefix,
                ns.tokenizer,
                seq_length=ns.seq_length,
                chat_format=ns.chat_format,
                long=long,
                force=ns.force,
            )
        else:
            if ns.chat_format or ns.drop_long or ns.truncate_long:
                raise PreprocessError("--chat-format, --drop-long and --truncate-long apply to --sft only")
            summary = preprocess(
                ns.input,
                ns.output_prefix,
                ns.tokenizer,
                json_keys=ns.json_keys,
                workers=ns.workers,
                append_eod=ns.append_eod,
                bos=not ns.no_bos,
                input_format=ns.input_format,
                text_unit=ns.text_unit,
                force=ns.force,
                show_progress=not ns.quiet,
            )
    except OSError as e:  # disk full, a file-size limit, permissions: bad input here, not a bug
        raise PreprocessError(os_error_line(e)) from None
    if not ns.quiet:
        print(summary.line())
    return 0


def run(ns: argparse.Namespace) -> int:
    """The parser's `run`: the exit policy of every threed command (`threed.errors.guarded`)."""
    signal.signal(signal.SIGTERM, _interrupt)
    return guarded(PROG, lambda: _main(ns), interrupted="interrupted; no output was left behind")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess",
        help="JSONL / Parquet / text -> Megatron .bin/.idx token datasets",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        help=".jsonl/.json/.ndjson (optionally .gz), .parquet, .txt (optionally .gz) files, read in this order",
    )
    p.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx per json key")
    p.add_argument("--tokenizer", required=True, help="sentencepiece .model, tokenizer.json or HF tokenizer dir")
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="JSON fields / Parquet columns to tokenize, one output each (default: text)",
    )
    p.add_argument("--append-eod", action="store_true", help="end each document with the EOS token")
    p.add_argument("--no-bos", action="store_true", help="do not start each document with BOS (Llama wants it)")
    p.add_argument("--input-format", choices=FORMAT_CHOICES, default="auto", help="default: from the file names")
    p.add_argument(
        "--text-unit",
        choices=TEXT_UNITS,
        default="paragraph",
        help="plain text: a document per blank-line-separated paragraph (default) or per line",
    )
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    sft = p.add_argument_group("fine-tuning data (--sft; see threed.data.sft)")
    sft.add_argument(
        "--sft",
        action="store_true",
        help="chat / instruction JSONL -> PREFIX_text_document and PREFIX_mask_document (loss mask on the responses)",
    )
    sft.add_argument("--seq-length", type=int, help="--sft: longest example in tokens")
    sft.add_argument(
        "--chat-format",
        choices=CHAT_FORMATS,
        help="--sft: render with Llama 2's [INST] template (default: the tokenizer's own chat template)",
    )
    long = sft.add_mutually_exclusive_group()
    long.add_argument("--drop-long", action="store_true", help="--sft: skip examples longer than --seq-length")
    long.add_argument(
        "--truncate-long",
        action="store_true",
        help="--sft: cut examples longer than --seq-length (default: refuse them)",
    )
    p.add_argument("--force", action="store_true", help="replace existing output files")
    p.add_argument("--quiet", action="store_true", help="no progress bar or summary line")
    p.set_defaults(run=run)
