"""`threed preprocess`: JSONL / .jsonl.gz / Parquet / text -> megatron .bin/.idx, read back with megatron-core's own
IndexedDataset and compared with the tokenizer document for document; workers 1 and 2 give identical files;
BOS / EOD placement; dtype choice; one-line refusals (exit 2, nothing written); atomic output."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import pytest

from helpers import preprocess_cli
from threed.data.chunks import PreprocessError
from threed.data.prefixes import dataset_prefix
from threed.data.preprocess import preprocess
from threed.data.tokenizer import Tokenizer


def _expected(tok: Tokenizer, docs: Sequence[str], bos: bool = True, eod: bool = False) -> list[list[int]]:
    out = []
    for doc in docs:
        ids = tok.encode(doc)
        if ids:
            out.append(([tok.bos_id] if bos else []) + ids + ([tok.eos_id] if eod else []))
    return out


def _read(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    # One sequence per document, as Megatron-LM's preprocess_data.py writes without --split-sentences.
    assert ds.document_indices.tolist() == list(range(len(ds) + 1))
    return [ds[i].tolist() for i in range(len(ds))]


def _write_jsonl(path: Path, docs: Sequence[str], key: str = "text") -> str:
    lines = "".join(json.dumps({"id": i, key: doc}) + "\n" for i, doc in enumerate(docs))
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(lines)
    else:
        path.write_text(lines, encoding="utf-8")
    return str(path)


def _files(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


def test_jsonl_matches_the_tokenizer_and_workers_1_and_2_write_identical_files(corpus, tmp_path):
    tok = Tokenizer(corpus["sp"])
    src = _write_jsonl(tmp_path / "c.jsonl", corpus["docs"])
    one = preprocess([src], str(tmp_path / "w1"), corpus["sp"], workers=1)
    two = preprocess([src], str(tmp_path / "w2"), corpus["sp"], workers=2, chunk_bytes=20_000)  # ~25 chunks
    expected = _expected(tok, corpus["docs"])
    assert one.outputs == {"text": str(tmp_path / "w1_text_document")}
    assert _read(one.outputs["text"]) == expected
    assert (one.documents, one.tokens, one.dtype) == (len(expected), sum(map(len, expected)), "uint16")
    assert one.skipped == len(corpus["docs"]) - len(expected) == 2
    # The sidecars too: the number of workers is not recorded (it changes no byte), the fingerprints agree.
    for suffix in (".bin", ".idx", ".threed.json"):
        assert Path(one.outputs["text"] + suffix).read_bytes() == Path(two.outputs["text"] + suffix).read_bytes()
    assert _files(tmp_path) == {
        "c.jsonl",
        "w1_text_document.bin",
        "w1_text_document.idx",
        "w1_text_document.threed.json",
        "w2_text_document.bin",
        "w2_text_document.idx",
        "w2_text_document.threed.json",
    }  # no temporary files left


def test_workers_started_by_forkserver_write_the_same_files(corpus, tmp_path, monkeypatch):
    """A caller with threads of its own (a library user's, a test runner's) gets forkserver workers, which import
    what they need themselves (threed.data.encode._start_method); the CLI, single-threaded, forks. The tests take the
    CLI's path (tests/unit/conftest.py stops tqdm's monitor thread), so this one takes the other."""
    import threed.data.encode

    monkeypatch.setattr(threed.data.encode, "_start_method", lambda: "forkserver")
    src = _write_jsonl(tmp_path / "c.jsonl", corpus["docs"])
    one = preprocess([src], str(tmp_path / "w1"), corpus["sp"], workers=1)
    two = preprocess([src], str(tmp_path / "w2"), corpus["sp"], workers=2, chunk_bytes=20_000)
    for suffix in (".bin", ".idx", ".threed.json"):
        assert Path(one.outputs["text"] + suffix).read_bytes() == Path(two.outputs["text"] + suffix).read_bytes()


@pytest.mark.parametrize("fmt", ["jsonl.gz", "parquet", "text", "text-lines", "text.gz"])
def test_every_input_format_matches_the_tokenizer(corpus, tmp_path, fmt):
    tok = Tokenizer(corpus["sp"])
    docs = [d for d in corpus["docs"] if d.strip()]
    unit = "paragraph"
    if fmt == "jsonl.gz":
        src = _write_jsonl(tmp_path / "c.jsonl.gz", docs)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        src = str(tmp_path / "c.parquet")
        pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), src, row_group_size=64)
        assert pq.ParquetFile(src).metadata.num_row_groups > 5
    elif fmt == "text-lines":
        unit, src = "line", str(tmp_path / "c.txt")
        Path(src).write_text("\n".join(docs) + "\n", encoding="utf-8")
        docs = [line for d in docs for line in d.split("\n")]
    else:
        src = str(tmp_path / ("c." + fmt))
        with (gzip.open if fmt.endswith(".gz") else open)(src, "wt", encoding="utf-8") as f:
            f.write("\n\n".join(docs))
    out = preprocess([src], str(tmp_path / "out"), corpus["sp"], workers=2, chunk_bytes=16_000, text_unit=unit)
    assert _read(out.outputs["text"]) == _expected(tok, docs)
    again = preprocess([src], str(tmp_path / "one"), corpus["sp"], workers=1, text_unit=unit)
    assert Path(again.outputs["text"] + ".bin").read_bytes() == Path(out.outputs["text"] + ".bin").read_bytes()


def test_text_chunk_boundaries_never_split_a_paragraph(corpus, tmp_path):
    """Whitespace-only separator lines, CRLF, a paragraph longer than a chunk, no final newline."""
    long = " ".join(["long paragraph"] * 40)
    raw = "first para\r\nline two\r\n  \r\n\n\nsecond\n \t \n" + long + "\nstill long\n\n  indented start\nend"
    (tmp_path / "t.txt").write_bytes(raw.encode("utf-8"))
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress(raw.encode("utf-8")))  # cut by the parent, not by seeking
    expected = {
        "paragraph": ["first para\nline two", "second", long + "\nstill long", "  indented start\nend"],
        "line": ["first para", "line two", "second", long, "still long", "  indented start", "end"],
    }
    tok = Tokenizer(corpus["sp"])
    for name in ("t.txt", "t.txt.gz"):
        for unit, docs in expected.items():
            for chunk in (1, 7, 40, 1 << 20):
                out = preprocess(
                    [str(tmp_path / name)],
                    str(tmp_path / f"o{unit}{chunk}"),
                    tok,
                    chunk_bytes=chunk,
                    text_unit=unit,
                    force=True,
                )
                assert _read(out.outputs["text"]) == _expected(tok, docs), (name, unit, chunk)


def test_bos_and_eod_placement_with_a_llama3_style_tokenizer_json(corpus, tmp_path):
    tok = Tokenizer(corpus["hf"])  # a bare tokenizer.json: BOS/EOS found by Llama 3's token names
    assert (tok.bos_id, tok.eos_id) == (0, 1) and tok.vocab_size == 700
    docs = [d for d in corpus["docs"] if d.strip()][:200]
    src = _write_jsonl(tmp_path / "c.jsonl", docs)
    for bos, eod in [(True, True), (False, True), (False, False)]:
        out = preprocess(
            [src], str(tmp_path / f"o{bos}{eod}"), corpus["hf"], bos=bos, append_eod=eod, workers=2, chunk_bytes=10_000
        )
        got = _read(out.outputs["text"])
        assert got == _expected(tok, docs, bos=bos, eod=eod)
        flat = np.concatenate([np.asarray(g) for g in got])
        assert (flat == tok.bos_id).sum() == (len(docs) if bos else 0)  # exactly one per document, at its start
        assert (flat == tok.eos_id).sum() == (len(docs) if eod else 0)
        assert all((g[0] == tok.bos_id) == bos and (g[-1] == tok.eos_id) == eod for g in got)


def test_several_json_keys_give_one_dataset_each(corpus, tmp_path):
    tok = Tokenizer(corpus["sp"])
    docs = [d for d in corpus["docs"] if d.strip()][:50]
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d, "title": d[:20]}) + "\n" for d in docs))
    out = preprocess([str(src)], str(tmp_path / "o"), tok, json_keys=["text", "title"])
    assert out.outputs == {k: dataset_prefix(str(tmp_path / "o"), k) for k in ("text", "title")}
    assert _read(out.outputs["title"]) == _expected(tok, [d[:20] for d in docs])
    assert _read(out.outputs["text"]) == _expected(tok, docs)


class FakeTokenizer:
    """A tokenizer of any vocabulary size: ids near the top of it, so a wrong dtype would wrap them."""

    def __init__(self, vocab_size: int, fail_on: Optional[str] = None, hook: Any = None):
        self.vocab_size, self.bos_id, self.eos_id = vocab_size, vocab_size - 2, vocab_size - 1
        self.fail_on, self.hook = fail_on, hook

    def encode(self, text: str) -> list[int]:
        if self.hook is not None:
            self.hook(text)
        if text == self.fail_on:
            raise ValueError("cannot encode this")
        return [self.vocab_size - 3 - len(word) % 7 for word in text.split()]


@pytest.mark.parametrize("vocab,dtype", [(512, "uint16"), (65_499, "uint16"), (65_500, "int32"), (128_256, "int32")])
def test_dtype_is_megatrons_optimal_dtype(tmp_path, vocab, dtype):
    tok = FakeTokenizer(vocab)
    docs = ["alpha beta", "gamma", "delta epsilon zeta"]
    src = _write_jsonl(tmp_path / "c.jsonl", docs)
    out = preprocess([src], str(tmp_path / "o"), tok, append_eod=True)
    assert out.dtype == dtype
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert IndexedDataset(out.outputs["text"]).index.dtype == getattr(np, dtype)
    assert _read(out.outputs["text"]) == _expected(tok, docs, eod=True)  # type: ignore[arg-type]


REFUSALS = {
    "missing input": (lambda d, c: ["--input", str(d / "nope.jsonl")], "input not found: "),
    "malformed json": (lambda d, c: ["--input", c["bad_json"]], "bad.jsonl line 600: not valid JSON"),
    "not utf-8": (lambda d, c: ["--input", c["bad_utf8"]], "bad8.jsonl line 3: not UTF-8"),
    "missing key": (lambda d, c: ["--input", c["good"], "--json-keys", "body"], "line 1: no key 'body'"),
    "not a string": (lambda d, c: ["--input", c["null"]], "line 2: 'text' is null, not a string"),
    "parquet column": (lambda d, c: ["--input", c["parquet"], "--json-keys", "body"], "no column 'body'"),
    "unknown format": (lambda d, c: ["--input", c["csv"]], "cannot tell the format"),
    "corrupt gzip": (lambda d, c: ["--input", c["good"], c["gz"]], "x.jsonl.gz: corrupt or truncated gzip"),
    "missing tokenizer": (
        lambda d, c: ["--input", c["good"], "--tokenizer", str(d / "tok.model")],
        "tokenizer not found: ",
    ),
    "unwritable output": (
        lambda d, c: ["--input", c["good"], "--output-prefix", str(d / "afile" / "o")],
        "cannot write to ",
    ),
    "existing output": (
        lambda d, c: ["--input", c["good"], "--output-prefix", str(d / "exists")],
        "exists_text_document.bin; pass --force",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_bad_input_is_one_line_exit_2_and_nothing_written(corpus, tmp_path, capsys, case):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d for d in corpus["docs"] if d.strip()]
    lines = [json.dumps({"text": d}) for d in docs]
    inputs = tmp_path / "in"
    inputs.mkdir()
    c = {
        "good": _write_jsonl(inputs / "good.jsonl", docs[:3]),
        "bad_json": str(inputs / "bad.jsonl"),
        "bad_utf8": str(inputs / "bad8.jsonl"),
        "null": str(inputs / "null.jsonl"),
        "csv": str(inputs / "x.csv"),
        "parquet": str(inputs / "p.parquet"),
    }
    # Line 600 is in a late chunk, so with 2 workers partial files exist when the error is found.
    Path(c["bad_json"]).write_text("\n".join(lines[:599] + ['{"text": "unterminated'] + lines[600:]) + "\n")
    Path(c["bad_utf8"]).write_bytes(("\n".join(lines[:2]) + "\n").encode() + b'{"text": "caf\xe9"}\n')
    Path(c["null"]).write_text(lines[0] + '\n{"text": null}\n')
    Path(c["csv"]).write_text("text\nhello\n")
    c["gz"] = str(inputs / "x.jsonl.gz")
    Path(c["gz"]).write_bytes(gzip.compress("\n".join(lines).encode())[:-200])  # truncated
    pq.write_table(pa.table({"text": docs[:3]}), c["parquet"])
    (tmp_path / "afile").write_text("a file, not a directory")
    for suffix in (".bin", ".idx"):
        (tmp_path / f"exists_text_document{suffix}").write_bytes(b"old")
    before = _files(tmp_path)
    args, message = REFUSALS[case]
    argv = list(args(tmp_path, c))
    if "--tokenizer" not in argv:
        argv += ["--tokenizer", corpus["sp"]]
    if "--output-prefix" not in argv:
        argv += ["--output-prefix", str(tmp_path / "new" / "sub" / "out")]  # directories it would create
    assert preprocess_cli(argv + ["--workers", "2", "--quiet"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("threed preprocess: error: "), err
    assert message in err and "Traceback" not in err
    assert _files(tmp_path) == before  # no output, no temporary directory, no created directories
    assert (tmp_path / "exists_text_document.bin").read_bytes() == b"old"


def test_output_is_renamed_into_place_only_when_complete(corpus, tmp_path, capsys):
    docs = [d for d in corpus["docs"] if d.strip()][:300]
    src = _write_jsonl(tmp_path / "c.jsonl", docs)
    prefix = str(tmp_path / "o")
    final = [dataset_prefix(prefix) + s for s in (".bin", ".idx")]
    seen: list[bool] = []
    # While documents are being encoded, nothing exists under the final names.
    out = preprocess([src], prefix, FakeTokenizer(512, hook=lambda t: seen.append(any(map(os.path.exists, final)))))
    assert seen and not any(seen) and all(map(os.path.exists, final))
    old = [Path(f).read_bytes() for f in final]
    # A failure or an interrupt half-way (even with --force) leaves the previous output intact and no debris.
    with pytest.raises(PreprocessError, match=r"c.jsonl line 201: the tokenizer failed \(cannot encode this\)"):
        preprocess([src], prefix, FakeTokenizer(512, fail_on=docs[200]), force=True)
    with pytest.raises(KeyboardInterrupt):
        preprocess([src], prefix, FakeTokenizer(512, hook=_interrupt_at(docs[150])), force=True)
    assert [Path(f).read_bytes() for f in final] == old
    sidecar = Path(dataset_prefix(prefix) + ".threed.json")
    old_sidecar = sidecar.read_bytes()  # FakeTokenizer: no path, no vocabulary to hash
    assert json.loads(old_sidecar)["tokenizer"] == {
        "name": "FakeTokenizer",
        "path": None,
        "vocab_size": 512,
        "vocab_sha256": None,
    }
    assert _files(tmp_path) == {"c.jsonl", "o_text_document.bin", "o_text_document.idx", "o_text_document.threed.json"}
    assert sidecar.read_bytes() == old_sidecar
    # --force replaces it once the new one is complete, and its sidecar with it.
    new = preprocess([src], prefix, corpus["sp"], force=True)
    assert _read(new.outputs["text"]) == _expected(Tokenizer(corpus["sp"]), docs) and out.documents == 300
    assert json.loads(sidecar.read_text())["tokenizer"]["name"] == "sp.model"


def _interrupt_at(doc: str) -> Any:
    def hook(text: str) -> None:
        if text == doc:
            raise KeyboardInterrupt

    return hook


def test_tokenizer_pickles_by_path_and_batch_encoding_matches(corpus):
    texts = corpus["docs"][:50]
    for path in (corpus["sp"], corpus["hf"]):
        tok = Tokenizer(path)
        again = pickle.loads(pickle.dumps(tok))
        assert again.path == tok.path and again.vocab_size == tok.vocab_size
        assert tok.encode_batch(texts) == [again.encode(t) for t in texts]


def test_cli_prints_progress_with_rates_and_a_summary(corpus, tmp_path, capsys):
    src = _write_jsonl(tmp_path / "c.jsonl", [d for d in corpus["docs"] if d.strip()][:100])
    assert (
        preprocess_cli(
            [
                "--input",
                src,
                "--output-prefix",
                str(tmp_path / "o"),
                "--tokenizer",
                corpus["sp"],
                "--workers",
                "2",
                "--append-eod",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert "docs/s" in err and "tokens/s" in err and "100%" in err
    assert out.startswith("100 documents, ") and out.rstrip().endswith("o_text_document.bin/.idx")
