"""Data that does not belong together, refused before anything is built (issue 19): an .idx that does not describe
its .bin, a loss mask (or any 0/1 data) given as tokens, a prefix listed twice in a blend, flags that would be
ignored; `preprocess --sft` on non-UTF-8 input names the line; and a `kill -9` of `threed preprocess --workers 2`
leaves no worker behind, its temporary directory removed by the next run. Each refusal through `threed train` as
the table in test_bad_inputs.py checks it: exit 2, one error line naming the fix, no traceback, nothing changed."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import REPO, preprocess_cli, sft_examples, write_dataset, write_sft_dataset
from test_bad_inputs import TRAIN, run_cli, snapshot

# `threed train` runs in this process (a world of one): conftest.py's own_process_group undoes it after each test.
pytestmark = pytest.mark.usefixtures("own_process_group")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """Datasets that are fine alone and wrong together."""
    w = tmp_path_factory.mktemp("bad_data")
    d = w / "data"
    write_dataset(d / "corpus", np.random.default_rng(0).integers(0, 500, 20000), 512)
    write_dataset(d / "other", np.random.default_rng(1).integers(0, 500, 30000), 512, seed=1)
    write_dataset(d / "same_size", np.random.default_rng(2).integers(0, 500, 20000), 512, seed=2)
    # corpus's .idx beside a bigger .bin (another dataset's), and beside a truncated one
    shutil.copy(d / "corpus.idx", d / "bigger.idx")
    shutil.copy(d / "other.bin", d / "bigger.bin")
    shutil.copy(d / "corpus.idx", d / "short.idx")
    (d / "short.bin").write_bytes((d / "corpus.bin").read_bytes()[:-2])
    # same total size, another document layout: the sizes match, the pointers do not (a gap after sequence 3)
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(d / "corpus"))
    n, docs = len(ds.sequence_lengths), len(ds.index.document_indices)
    raw = bytearray((d / "corpus.idx").read_bytes())
    lengths = np.frombuffer(raw, np.int32, n, 34).copy()
    lengths[3] -= 1
    lengths[4] += 1
    raw[34 : 34 + 4 * n] = lengths.tobytes()
    (d / "gap.idx").write_bytes(bytes(raw))
    shutil.copy(d / "corpus.bin", d / "gap.bin")
    # trailing bytes after the index's arrays
    (d / "tail.idx").write_bytes((d / "corpus.idx").read_bytes() + b"\0" * 8)
    shutil.copy(d / "corpus.bin", d / "tail.bin")
    assert docs >= 2
    # an SFT pair, and its mask copied under a name that says nothing
    write_sft_dataset(w / "sft" / "chat", sft_examples(200, 512, length=(6, 30)), 512)
    for suffix in (".bin", ".idx"):
        shutil.copy(w / "sft" / f"chat_mask_document{suffix}", d / f"flags{suffix}")
    return w


C = TRAIN[:4]  # train --model tiny --data-path
REST = TRAIN[5:]
TABLE = [
    # an .idx that does not describe its .bin, whatever the sizes
    (
        "idx-of-another-bin-bigger",
        C + ["{w}/data/bigger"] + REST,
        r"bigger\.idx does not describe .*bigger\.bin \(\.bin is [\d,]+ bytes, the index describes [\d,]+: another "
        r"dataset's \.bin\?\); .*copy both files again, or rebuild them",
    ),
    ("idx-bin-truncated", C + ["{w}/data/short"] + REST, r"short\.idx does not describe .*truncated\?"),
    (
        "idx-pointers-not-contiguous",
        C + ["{w}/data/gap"] + REST,
        r"gap\.idx does not describe .*sequence 4 starts at byte [\d,]+, not [\d,]+ where the one before it ends",
    ),
    ("idx-trailing-bytes", C + ["{w}/data/tail"] + REST, r"tail\.idx does not describe .*its header says"),
    # a loss mask (or other 0/1 data) given as tokens
    (
        "mask-as-tokens",
        C + ["{w}/sft/chat_mask_document"] + REST,
        r"chat_mask_document is the loss mask `threed preprocess --sft` writes beside .*chat_text_document, not "
        r"tokens; pass .*chat_text_document",
    ),
    (
        "zero-one-data-as-tokens",
        C + ["{w}/data/flags"] + REST,
        r"flags holds only the values 0 and 1 .*: a loss mask or another non-token dataset, not tokens; pass the "
        r"token dataset",
    ),
    # the same prefix twice in one blend
    (
        "blend-twice-weighted",
        C + ["0.3", "{w}/data/corpus", "0.2", "{w}/data/other", "0.5", "{w}/data/corpus"] + REST,
        r"--data-path lists .*corpus twice: .*read twice over; list it once with the weights merged "
        r"\(--data-path \.\.\. 0\.8 .*corpus \.\.\.\)",
    ),
    (
        "blend-twice-plain",
        C + ["{w}/data/corpus", "{w}/data/corpus"] + REST,
        r"--data-path lists .*corpus twice: .* list it once \(or give weights",
    ),
    (
        "blend-twice-spelled-differently",
        C + ["{w}/data/corpus", "{w}/data/../data/corpus"] + REST,
        r"lists .*data/\.\./data/corpus twice \(as .*data/corpus\)",
    ),
    (
        "train-blend-twice",
        ["train", "--model", "tiny", "--train-data-path", "{w}/data/other", "{w}/data/other"] + REST,
        r"--train-data-path lists .*other twice",
    ),
    # flags that would be ignored
    (
        "split-with-train-data-path",
        ["train", "--model", "tiny", "--train-data-path", "{w}/data/corpus", "--split", "90,10,0"] + REST,
        r"--split 90,10,0 applies to --data-path only; .* drop --split",
    ),
    (
        "test-data-path",
        ["train", "--model", "tiny", "--train-data-path", "{w}/data/corpus", "--test-data-path", "{w}/data/other"]
        + REST,
        r"--test-data-path would be ignored: .* drop it, or pass",
    ),
]


@pytest.mark.parametrize("via", ["train", "check-config"])
@pytest.mark.parametrize("case,command,expected", TABLE, ids=[c[0] for c in TABLE])
def test_data_that_does_not_belong_together_is_refused(world, case, command, expected, via, capsys, monkeypatch):
    """Through `threed train`, and through `threed check-config --paths`, which runs the same checks (issue 29:
    its exit status means "the run would start")."""
    monkeypatch.setenv("RANK", "0")
    if via == "check-config":
        command = ["check-config", *command[1:], "--world", "1", "--paths"]
    before = snapshot(world)
    rc, output = run_cli(world, command, capsys)
    assert rc == 2, f"{case}: exit status {rc}\n{output[-3000:]}"
    assert "Traceback" not in output, f"{case}: a traceback\n{output[-3000:]}"
    errors = [
        line for line in output.splitlines() if re.search(r"\berror\b", line, re.I) and "warn" not in line.lower()
    ]
    assert len(errors) == 1, f"{case}: expected one error line, got {errors}\n{output[-3000:]}"
    assert re.search(expected, errors[0]), f"{case}: {errors[0]!r} does not match {expected!r}"
    assert snapshot(world) == before, f"{case}: the sandbox changed"


def test_the_good_pairs_pass_the_index_check(world):
    """The check reads what threed preprocess / Megatron-LM write as consistent, SFT masks included."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from threed.data.checks import check_index

    for prefix in ("data/corpus", "data/other", "sft/chat_text_document", "sft/chat_mask_document"):
        check_index(str(world / prefix), IndexedDataset(str(world / prefix)))


def test_sft_preprocess_names_the_line_of_non_utf8_input(tmp_path, tok_dirs, capsys):
    good = '{"prompt": "hi", "response": "hello"}\n'
    src = tmp_path / "in.jsonl"
    src.write_bytes((good * 4).encode() + b'{"prompt": "caf\xe9", "response": "x"}\n' + good.encode())
    (tmp_path / "out").mkdir()
    rc = preprocess_cli(
        [
            "--sft",
            "--input",
            str(src),
            "--tokenizer",
            tok_dirs["llama3"],
            "--seq-length",
            "64",
            "--output-prefix",
            str(tmp_path / "out" / "x"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert "in.jsonl line 5: not UTF-8 (byte 0xe9" in err and "re-encode the file as UTF-8" in err, err
    assert os.listdir(tmp_path / "out") == []


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_kill_9_of_preprocess_leaves_no_worker_and_the_next_run_cleans_up(corpus, tmp_path):
    docs = [d for d in corpus["docs"] if d.strip()]
    big = tmp_path / "big.txt"
    big.write_text("\n\n".join(docs * 40) + "\n")  # tens of seconds of tokenizing at 2 workers
    out = tmp_path / "out" / "corpus"
    cmd = [
        sys.executable,
        "-m",
        "threed.cli",
        "preprocess",
        "--input",
        str(big),
        "--output-prefix",
        str(out),
        "--tokenizer",
        corpus["sp"],
        "--workers",
        "2",
        "--quiet",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline, workers = time.monotonic() + 120, []
    while time.monotonic() < deadline and p.poll() is None:
        workers = [c for c in _children(p.pid) if _running(c)]
        if len(workers) >= 2 and list((tmp_path / "out").glob(".corpus.*.preprocess-tmp/part*")):
            break
        time.sleep(0.1)
    assert p.poll() is None and len(workers) >= 2, f"the run ended or never started its workers: {workers}"
    tmp = list((tmp_path / "out").glob(".corpus.*.preprocess-tmp"))
    assert len(tmp) == 1, tmp
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_running(w) for w in workers):
        time.sleep(0.1)
    orphans = [w for w in workers if _running(w)]
    for w in orphans:  # do not leave them behind for the rest of the suite
        os.kill(w, signal.SIGKILL)
    assert not orphans, f"orphan workers {orphans} still run after kill -9 of the parent"
    assert tmp[0].is_dir()  # kill -9 runs no cleanup: the partial directory stays, for the next run

    small = tmp_path / "small.txt"
    small.write_text("\n\n".join(docs[:50]) + "\n")
    again = subprocess.run(cmd[:5] + [str(small)] + cmd[6:], env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert f"removed {tmp[0]}, left by a run that was killed" in again.stderr
    assert sorted(x.name for x in (tmp_path / "out").iterdir()) == [
        "corpus_text_document.bin",
        "corpus_text_document.idx",
        "corpus_text_document.threed.json",
    ]


def test_a_live_runs_temp_directory_is_left_alone(tmp_path):
    """Only a dead pid's directory is stale: one of a live process (or another host's) is not ours to remove."""
    import socket

    from threed.data.indexed_output import remove_stale_tmpdirs

    host = socket.gethostname()
    live = tmp_path / f".c.{host}.{os.getpid()}.abc.preprocess-tmp"
    dead_pid = _dead_pid()
    dead = tmp_path / f".c.{host}.{dead_pid}.abc.preprocess-tmp"
    other_host = tmp_path / f".c.not-{host}.{dead_pid}.abc.preprocess-tmp"
    other_prefix = tmp_path / f".d.{host}.{dead_pid}.abc.preprocess-tmp"
    for d in (live, dead, other_host, other_prefix):
        d.mkdir()
        (d / "part0000000_text.bin").write_bytes(b"x")
    assert remove_stale_tmpdirs(str(tmp_path / "c")) == [str(dead)]
    assert live.is_dir() and other_host.is_dir() and other_prefix.is_dir() and not dead.exists()


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid
