"""Data that proves what it is (issue 29): `threed preprocess` writes a sidecar beside each `.bin/.idx` (tokenizer
identity, the `.bin`'s size and sampled-block fingerprint, the flags), and `threed train` refuses, in one line and
before any step, a `.bin` swapped for another of the same size and data tokenized with another tokenizer than
`--tokenizer`; Megatron-written data (no sidecar) still trains, with one line saying it cannot be checked.
`threed check-config --paths` runs the same checks (threed.train.preflight) and says the same line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import preprocess_cli, write_dataset
from test_bad_inputs import run_cli, snapshot
from threed.data import sidecar

# `threed train` runs in this process (a world of one): conftest.py's own_process_group undoes it after each test.
pytestmark = pytest.mark.usefixtures("own_process_group")

TRAIN = ["train", "--model", "tiny", "--seq-length", "32", "--steps", "2", "--split", "100,0,0", "--dtype", "fp32"]
CHECK = ["check-config", "--model", "tiny", "--seq-length", "32", "--steps", "2", "--split", "100,0,0"]


@pytest.fixture(scope="module")
def world(corpus, tmp_path_factory) -> Path:
    """A dataset made by `threed preprocess` (with its sidecar), a copy whose .bin is another of the same size, a
    second tokenizer, and a Megatron-written dataset (no sidecar)."""
    from threed.data.tokenizer import train_tokenizer

    w = tmp_path_factory.mktemp("sidecar")
    text = str(corpus["dir"] / "demo.txt")
    assert preprocess_cli(["--input", text, "--output-prefix", str(w / "a"), "--tokenizer", corpus["sp"]]) == 0
    a = w / "a_text_document"
    for suffix in (".idx", ".threed.json"):
        shutil.copy(f"{a}{suffix}", w / f"swapped{suffix}")
    tokens = np.fromfile(f"{a}.bin", dtype=np.uint16)
    tokens[::-1].tofile(w / "swapped.bin")  # another .bin, exactly the size the .idx describes
    train_tokenizer([text], 400, str(w / "other"))  # another tokenizer
    write_dataset(w / "megatron", np.random.default_rng(0).integers(0, 500, 4000), 512)
    return w


def one_error(rc: int, output: str) -> str:
    assert rc == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    errors = [line for line in output.splitlines() if "error" in line.lower() and "warn" not in line.lower()]
    assert len(errors) == 1, errors
    assert not re.search(r"\bstep \d+/", output), "a step ran"
    return errors[0]


def test_preprocess_writes_a_sidecar_that_names_the_tokenizer_the_bin_and_the_flags(world, corpus):
    record = json.loads((world / "a_text_document.threed.json").read_text())
    assert record["format"] == sidecar.FORMAT and record["version"] == sidecar.VERSION
    assert record["tokenizer"]["name"] == "sp.model" and record["tokenizer"]["vocab_size"] == 512
    assert re.fullmatch(r"[0-9a-f]{64}", record["tokenizer"]["vocab_sha256"])
    size = (world / "a_text_document.bin").stat().st_size
    assert record["bin"] == {
        "bytes": size,
        "fingerprint": sidecar.fingerprint(str(world / "a_text_document.bin")),
        "fingerprint_blocks": [sidecar.BLOCKS, sidecar.BLOCK_BYTES],
    }
    flags = record["preprocess"]
    assert flags["kind"] == "pretraining" and flags["key"] == "text" and flags["bos"] and not flags["append_eod"]
    # The data checks against its own tokenizer and content: nothing to say.
    assert sidecar.check_sidecar(str(world / "a_text_document"), corpus["sp"]) is None
    # No temporary file is left beside the outputs.
    assert sorted(p.name for p in world.glob("a_*")) == [
        "a_text_document.bin",
        "a_text_document.idx",
        "a_text_document.threed.json",
    ]


def test_a_bin_swapped_for_another_of_the_same_size_is_refused_before_any_step(world, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    before = snapshot(world)
    save = world / "save"
    line = one_error(*run_cli(world, TRAIN + ["--data-path", f"{world}/swapped", "--save", str(save)], capsys))
    assert re.search(r"swapped\.bin is not the file `threed preprocess` wrote \(same size, other content", line)
    assert not save.exists() and snapshot(world) == before
    # check-config --paths runs the same check (threed.train.preflight) and says the same line.
    line2 = one_error(*run_cli(world, CHECK + ["--world", "1", "--paths", "--data-path", f"{world}/swapped"], capsys))
    assert line2.split("error: ", 1)[1] == line.split("error: ", 1)[1]


def test_data_tokenized_with_another_tokenizer_is_refused(world, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    before = snapshot(world)
    argv = ["--data-path", f"{world}/a_text_document", "--tokenizer", str(world / "other.model")]
    line = one_error(*run_cli(world, TRAIN + argv, capsys))
    assert re.search(
        r"a_text_document was tokenized with sp\.model \(vocab 512, .*not --tokenizer .*other\.model "
        r"\(vocab 400",
        line,
    ), line
    assert snapshot(world) == before
    line2 = one_error(*run_cli(world, CHECK + ["--world", "1", "--paths"] + argv, capsys))
    assert "was tokenized with sp.model" in line2


def test_megatron_written_data_without_a_sidecar_still_trains_with_one_line(world, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    rc, output = run_cli(world, TRAIN + ["--data-path", f"{world}/megatron"], capsys)
    assert rc == 0, output[-3000:]
    notes = [line for line in output.splitlines() if "cannot be checked" in line]
    assert len(notes) == 1 and "megatron.threed.json" in notes[0], output[-3000:]
    rc, output = run_cli(world, CHECK + ["--world", "1", "--paths", "--data-path", f"{world}/megatron"], capsys)
    assert rc == 0 and "config ok" in output and "cannot be checked" in output, output[-3000:]


def test_a_sidecar_that_is_not_one_is_refused_in_one_line(world, tmp_path):
    for suffix in (".bin", ".idx"):
        shutil.copy(f"{world}/a_text_document{suffix}", tmp_path / f"d{suffix}")
    (tmp_path / "d.threed.json").write_text("{not json")
    with pytest.raises(sidecar.ConfigError, match=r"cannot read .*d\.threed\.json .*delete .* or re-run"):
        sidecar.check_sidecar(str(tmp_path / "d"), None)
    (tmp_path / "d.threed.json").write_text('{"format": "something else"}')
    with pytest.raises(sidecar.ConfigError, match="is not a threed dataset sidecar"):
        sidecar.check_sidecar(str(tmp_path / "d"), None)


def test_the_fingerprint_reads_sampled_blocks_of_a_big_file(tmp_path):
    """Cheap at TB scale: a file above BLOCKS x BLOCK_BYTES is hashed in BLOCKS blocks (first and last included)
    plus its size; a change inside a sampled block is seen, one between two blocks is not (by design)."""
    big = tmp_path / "big.bin"
    size = 64 * sidecar.BLOCKS * sidecar.BLOCK_BYTES  # 256 MiB, sparse: nothing written but the end
    with open(big, "wb") as f:
        f.truncate(size)
    first = sidecar.fingerprint(str(big))

    def poke(offset: int) -> str:
        with open(big, "r+b") as f:
            f.seek(offset)
            f.write(b"\1")
        out = sidecar.fingerprint(str(big))
        with open(big, "r+b") as f:
            f.seek(offset)
            f.write(b"\0")
        return out

    assert poke(size - 1) != first and poke(0) != first  # the last and the first block are sampled
    assert poke(sidecar.BLOCK_BYTES + 10) == first  # between block 0 and block 1: not read
    with open(big, "ab") as f:
        f.write(b"\0")
    assert sidecar.fingerprint(str(big)) != first  # the size is part of it
