"""`threed preprocess --workers 2` vs a single-process loop doing the same work, measured in one run.

    .venv/bin/python benchmarks/bench_preprocess.py [--mb 32] [--workers 2] [--repeat 2]

Generates a synthetic JSONL corpus (Zipf-distributed made-up words, documents of 30-600 words) and trains a
sentencepiece tokenizer on a sample of it, both in a temporary directory. The baseline is the obvious loop: read
each line, json.loads, [BOS] + Tokenizer.encode(text), IndexedDatasetBuilder.add_document, finalize. Both write
the same bytes (checked). Times are wall clock of the whole call, imports done beforehand; best of --repeat.
Goal: >= 1.7x on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from threed.data.indexed_output import indexed_dataset
from threed.data.preprocess import preprocess
from threed.data.tokenizer import Tokenizer, train_tokenizer


def make_corpus(path: Path, megabytes: float, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    lengths = rng.integers(2, 11, size=20_000)
    words = np.array(["".join(rng.choice(letters, n)) for n in lengths])
    weights = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    weights /= weights.sum()
    target, written, docs = int(megabytes * 2**20), 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            picks = words[rng.choice(len(words), size=int(rng.integers(30, 600)), p=weights)]
            text = " ".join(picks)
            # Sentences and paragraphs, so the tokenizer sees punctuation and newlines too.
            text = text.replace(" e ", ". E").replace(" a ", ", a ").replace(" the ", "\n\nThe ")
            line = json.dumps({"id": docs, "text": text}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def baseline(src: str, prefix: str, tokenizer: str) -> int:
    """A single process: the same tokenizer on the same documents, written with IndexedDatasetBuilder."""
    idx = indexed_dataset()
    tok = Tokenizer(tokenizer)
    builder = idx.IndexedDatasetBuilder(prefix + ".bin", dtype=idx.DType.optimal_dtype(tok.vocab_size))
    tokens = 0
    with open(src, encoding="utf-8") as f:
        for line in f:
            ids = [tok.bos_id] + tok.encode(json.loads(line)["text"])
            builder.add_document(ids, [len(ids)])
            tokens += len(ids)
    builder.finalize(prefix + ".idx")
    return tokens


def _cpu() -> float:
    """CPU seconds of this process and its (finished) worker processes."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=32.0, help="corpus size in MiB of JSONL")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_preprocess_") as tmp:
        d = Path(tmp)
        t = time.perf_counter()
        docs = make_corpus(d / "corpus.jsonl", args.mb)
        sample = d / "sample.txt"
        with open(d / "corpus.jsonl", encoding="utf-8") as f, open(sample, "w", encoding="utf-8") as out:
            for _, line in zip(range(2000), f):
                out.write(json.loads(line)["text"] + "\n")
        model = train_tokenizer([str(sample)], args.vocab, str(d / "sp"))
        src = str(d / "corpus.jsonl")
        indexed_dataset()  # import megatron-core (seconds) before anything is timed
        print(
            f"corpus: {os.path.getsize(src) / 2**20:.1f} MiB JSONL, {docs:,} documents; sentencepiece BPE vocab "
            f"{args.vocab}; set-up {time.perf_counter() - t:.1f}s; {os.cpu_count()} cores",
            flush=True,
        )

        # Interleaved rounds, best of each: a burst of load from elsewhere then hurts every contender alike.
        kinds = ["baseline"] + [f"w{w}" for w in sorted({1, args.workers})]
        times: dict[str, list[float]] = {k: [] for k in kinds}
        cpu: dict[str, list[float]] = {k: [] for k in kinds}
        tokens = 0
        load = os.getloadavg()[0]
        for _ in range(args.repeat):
            for kind in kinds:
                t, c = time.perf_counter(), _cpu()
                if kind == "baseline":
                    tokens = baseline(src, str(d / "base"), model)
                else:
                    out = preprocess([src], str(d / kind), model, workers=int(kind[1:]), force=True)
                    assert out.tokens == tokens
                times[kind].append(time.perf_counter() - t)
                cpu[kind].append(_cpu() - c)
        for kind in kinds[1:]:
            for suffix in (".bin", ".idx"):
                same = Path(d / f"{kind}_text_document{suffix}").read_bytes() == (d / f"base{suffix}").read_bytes()
                assert same, f"--workers {kind[1:]} wrote a different {suffix} than the baseline"
        base_s = min(times["baseline"])
        runs = {int(k[1:]): min(times[k]) for k in kinds[1:]}
        # CPU seconds show the work is the same; wall clock (the ratio) needs idle cores to mean anything, hence
        # the load average (1 min, before and after) next to it.
        print(
            f"baseline (1 process loop)      : {base_s:6.2f}s  {tokens / base_s:12,.0f} tokens/s  "
            f"cpu {min(cpu['baseline']):.2f}s"
        )
        for workers, secs in runs.items():
            print(
                f"threed preprocess --workers {workers:<3}: {secs:6.2f}s  {tokens / secs:12,.0f} tokens/s  "
                f"cpu {min(cpu[f'w{workers}']):.2f}s  ({base_s / secs:.2f}x the baseline)"
            )
        print(f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}; {tokens:,} tokens each run")
        ratio = base_s / runs[args.workers]
        print(f"ratio --workers {args.workers} / baseline: {ratio:.2f}x (goal >= 1.7x on 2 cores); outputs identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
