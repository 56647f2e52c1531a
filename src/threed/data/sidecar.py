"""Data that proves what it is: the small JSON file `threed preprocess` writes beside each `PREFIX.bin/.idx`
(`PREFIX.threed.json`), and the check `threed train` / `threed check-config` run against it before building.

    {"format": "threed-dataset-sidecar", "version": 1,
     "tokenizer": {"name": ..., "path": ..., "vocab_size": N, "vocab_sha256": ...},
     "bin": {"bytes": N, "fingerprint": "sha256:...", "fingerprint_blocks": [64, 65536]},
     "preprocess": {flags that made it}}

Why: an `.idx` describes only sizes and offsets, so another dataset's `.bin` cut to the size the index describes,
or a corpus tokenized with another tokenizer than `--tokenizer`, trains silently. The sidecar records what the
index cannot: the tokenizer's identity (a hash of its whole vocabulary, by id) and the `.bin`'s content.

The content fingerprint is cheap at TB scale on purpose: the file's size plus a SHA-256 of 64 blocks of 64 KiB at
evenly spaced offsets (the first and the last block included), so checking it reads 4 MiB whatever the size of the
`.bin` (a file up to 4 MiB is hashed whole). It catches a swapped or re-written file, not a single flipped byte
between two sampled blocks: that is a storage-integrity question (checksums of the copy), not a provenance one.

Data without a sidecar (written by Megatron-LM's tools/preprocess_data.py, or by threed before sidecars existed)
still trains; the check says in one line that it cannot be checked. The sidecar is written like the data: in the
temporary directory, then renamed into place (`threed.data.indexed_output`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from threed.errors import ConfigError

SUFFIX = ".threed.json"
FORMAT = "threed-dataset-sidecar"
VERSION = 1
BLOCKS = 64  # blocks hashed per .bin
BLOCK_BYTES = 1 << 16  # 64 KiB each: 4 MiB read per fingerprint, whatever the file's size


def sidecar_path(prefix: str) -> str:
    return prefix + SUFFIX


def fingerprint(path: str) -> str:
    """SHA-256 of the size and of BLOCKS evenly spaced blocks of BLOCK_BYTES (the whole file when it is small)."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"{size}\n".encode())
    with open(path, "rb") as f:
        if size <= BLOCKS * BLOCK_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        else:
            last = size - BLOCK_BYTES
            for i in range(BLOCKS):
                f.seek(last * i // (BLOCKS - 1))
                h.update(f.read(BLOCK_BYTES))
    return "sha256:" + h.hexdigest()


def vocabulary_sha256(pieces: Optional[list[str]]) -> Optional[str]:
    """A hash of the vocabulary, piece by id: two tokenizers share it only when every id means the same piece."""
    if pieces is None:
        return None
    return hashlib.sha256(json.dumps(pieces, ensure_ascii=False).encode()).hexdigest()


def tokenizer_pieces(tok: Any) -> Optional[list[str]]:
    """The vocabulary by id of a threed Tokenizer or an HF tokenizer; None for an object that cannot tell."""
    if hasattr(tok, "pieces"):
        return tok.pieces()
    if hasattr(tok, "get_vocab"):  # an HF tokenizer: ids 0 .. len(tok) - 1, as threed's Tokenizer counts them
        pieces = [""] * len(tok)
        for piece, i in tok.get_vocab().items():
            if 0 <= i < len(pieces):
                pieces[i] = piece
        return pieces
    return None


def tokenizer_identity(tok: Any, path: Optional[str]) -> dict[str, Any]:
    """What the sidecar says of the tokenizer: its name, where it was, its size and its vocabulary's hash."""
    pieces = tokenizer_pieces(tok)
    size = getattr(tok, "vocab_size", None) if not hasattr(tok, "get_vocab") else len(tok)
    name = Path(path).name if path else type(tok).__name__
    if path and Path(path).name == "tokenizer.json":
        name = Path(path).parent.name + "/tokenizer.json"
    return {
        "name": name,
        "path": str(Path(path).resolve()) if path else None,
        "vocab_size": int(size) if size is not None else None,
        "vocab_sha256": vocabulary_sha256(pieces),
    }


def sidecar_text(bin_path: str, tokenizer: dict[str, Any], flags: dict[str, Any]) -> str:
    """The sidecar of the finished (temporary) `.bin` at `bin_path`."""
    record = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer,
        "bin": {
            "bytes": os.path.getsize(bin_path),
            "fingerprint": fingerprint(bin_path),
            "fingerprint_blocks": [BLOCKS, BLOCK_BYTES],
        },
        "preprocess": flags,
    }
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def read_sidecar(prefix: str) -> Optional[dict[str, Any]]:
    """The sidecar of a dataset, None when it has none; ConfigError for one that is not ours or not readable."""
    path = sidecar_path(prefix)
    if not os.path.lexists(path):
        return None
    fix = f"delete {path} to train the data unchecked, or re-run `threed preprocess`"
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"dataset {prefix}: cannot read {path} ({type(e).__name__}: {e}); {fix}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("bin"), dict):
        raise ConfigError(f"dataset {prefix}: {path} is not a threed dataset sidecar; {fix}")
    bad = field_problem(record)
    if bad:
        raise ConfigError(f"dataset {prefix}: {path}: {bad} (edited by hand, or damaged); {fix}")
    if record["version"] > VERSION:
        raise ConfigError(
            f"dataset {prefix}: {path} is version {record['version']}, newer than this threed reads "
            f"({VERSION}); update threed, or {fix}"
        )
    return record


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def field_problem(record: dict[str, Any]) -> Optional[str]:
    """What is wrong with a field the checks read, by its name (a sidecar edited by hand: a missing `version`, a
    string `bytes`), or None. Before, the refusal's own f-string raised on them (a traceback, not a line)."""
    tok = record.get("tokenizer")
    sha = tok.get("vocab_sha256") if isinstance(tok, dict) else None
    checks = (
        ("version", record.get("version"), _whole(record.get("version")), "a whole number"),
        ("bin.bytes", record["bin"].get("bytes"), _whole(record["bin"].get("bytes")), "a whole number of bytes"),
        (
            "bin.fingerprint",
            record["bin"].get("fingerprint"),
            isinstance(record["bin"].get("fingerprint"), str),
            "text",
        ),
        ("tokenizer", tok, tok is None or isinstance(tok, dict), "an object"),
        ("tokenizer.vocab_sha256", sha, sha is None or isinstance(sha, str), "text"),
    )
    for name, value, ok, what in checks:
        if not ok:
            return f"{name} is missing" if value is None else f"{name} is {value!r}, not {what}"
    return None


@functools.lru_cache(maxsize=8)
def run_tokenizer_identity(path: str) -> dict[str, Any]:
    """The identity of `--tokenizer` (loaded once per process; an HF tokenizer takes seconds)."""
    from threed.data.tokenizer import Tokenizer  # sentencepiece / transformers: heavy, only with --tokenizer

    try:
        tok = Tokenizer(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer: {e}") from None
    return tokenizer_identity(tok, path)


def check_sidecar(prefix: str, tokenizer: Optional[str]) -> Optional[str]:
    """Refuse a dataset whose `.bin` or tokenizer is not the one its sidecar records (ConfigError, one line).
    Returns a note for a dataset that cannot be checked (no sidecar; no --tokenizer), None when all is checked."""
    record = read_sidecar(prefix)
    if record is None:
        return (
            f"dataset {prefix}: no {Path(sidecar_path(prefix)).name} (Megatron-written data, or made before "
            f"threed wrote one): its tokenizer and content cannot be checked"
        )
    redo = "copy the dataset again (all of PREFIX.bin, .idx and .threed.json), or re-run `threed preprocess`"
    want, bin_path = record["bin"], prefix + ".bin"
    size = os.path.getsize(bin_path)
    if size != want.get("bytes"):
        raise ConfigError(
            f"dataset {prefix}: {bin_path} is {size:,} bytes, its sidecar records {want.get('bytes'):,}: not "
            f"the file `threed preprocess` wrote; {redo}"
        )
    if fingerprint(bin_path) != want.get("fingerprint"):
        raise ConfigError(
            f"dataset {prefix}: {bin_path} is not the file `threed preprocess` wrote (same size, other "
            f"content: its sampled-block fingerprint differs from the sidecar's); {redo}"
        )
    made = record.get("tokenizer") or {}
    if not tokenizer:
        return f"dataset {prefix}: made with tokenizer {made.get('name')}; no --tokenizer given, so it is not compared"
    run = run_tokenizer_identity(tokenizer)
    same_size = made.get("vocab_size") == run["vocab_size"]
    if made.get("vocab_sha256") and (not same_size or made["vocab_sha256"] != run["vocab_sha256"]):
        raise ConfigError(
            f"dataset {prefix} was tokenized with {made.get('name')} (vocab {made.get('vocab_size')}, "
            f"hash {made['vocab_sha256'][:12]}), not --tokenizer {tokenizer} (vocab {run['vocab_size']}, hash "
            f"{(run['vocab_sha256'] or '?')[:12]}): its ids would mean other tokens; pass the data's tokenizer, "
            f"or re-run `threed preprocess --tokenizer {tokenizer}`"
        )
    return None
