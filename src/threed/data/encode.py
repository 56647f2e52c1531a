"""Encoding chunks for `threed preprocess`: in the calling process (one worker) or in a pool of worker processes
that each write one partial .bin/.idx per chunk, appended by the parent in input order."""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import multiprocessing
import os
import signal
import sys
import threading
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterator, Optional, Protocol, Union

from threed.data.chunks import Chunk, PreprocessError
from threed.data.formats import TextUnit
from threed.data.indexed_output import indexed_dataset
from threed.data.inputs import documents, where

_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 20  # per native encode call: amortises Python overhead, bounds memory


class TokenizerLike(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclasses.dataclass(frozen=True)
class Options:
    """What every worker needs to turn a chunk into documents (sent once, at pool start)."""

    keys: tuple[str, ...]
    unit: TextUnit
    bos: Optional[int]
    eod: Optional[int]
    dtype: Any  # numpy scalar type


@dataclasses.dataclass
class ChunkStats:
    index: int
    weight: int
    documents: dict[str, int]
    tokens: dict[str, int]
    skipped: dict[str, int]
    parts: Optional[dict[str, str]] = None  # key -> partial prefix written by a worker


def _encode(tok: TokenizerLike, texts: list[str], chunk: Chunk, positions: list[int]) -> list[list[int]]:
    try:
        batch = getattr(tok, "encode_batch", None)
        return batch(texts) if batch is not None else [tok.encode(t) for t in texts]
    except Exception:  # find the document that broke it, to name its line
        for text, local in zip(texts, positions):
            try:
                tok.encode(text)
            except Exception as e:
                msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise PreprocessError(
                    f"{where(chunk, local)}: the tokenizer failed ({msg}); fix or drop that document"
                ) from None
        raise


def encode_chunk(chunk: Chunk, tok: TokenizerLike, opts: Options, builders: dict[str, Any]) -> ChunkStats:
    """The documents of one chunk into `builders` (key -> IndexedDatasetBuilder), in order; in a worker process
    or, with one worker, straight into the output."""
    stats = ChunkStats(chunk.index, chunk.weight, *({k: 0 for k in opts.keys} for _ in range(3)))
    head = [opts.bos] if opts.bos is not None else []
    tail = [opts.eod] if opts.eod is not None else []

    def flush(batch: list[tuple[int, list[str]]]) -> None:
        positions = [local for local, _ in batch]
        for ki, key in enumerate(opts.keys):
            builder = builders[key]
            for ids in _encode(tok, [texts[ki] for _, texts in batch], chunk, positions):
                if not ids:
                    stats.skipped[key] += 1
                    continue
                doc = [*head, *ids, *tail]
                builder.add_document(doc, [len(doc)])  # one sequence per document, as Megatron-LM writes
                stats.documents[key] += 1
                stats.tokens[key] += len(doc)

    batch: list[tuple[int, list[str]]] = []
    chars = 0
    for record in documents(chunk, opts.keys, opts.unit):
        batch.append(record)
        chars += sum(len(t) for t in record[1])
        if len(batch) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
            flush(batch)
            batch, chars = [], 0
    if batch:
        flush(batch)
    return stats


_WORKER: dict[str, Any] = {}


def die_with_parent(owner: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG): a `kill -9` of
    `threed preprocess` (pid `owner`) takes its workers along instead of leaving them asleep on a queue forever.
    Under forkserver the parent is the fork server, which itself exits when `owner` dies."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return  # no prctl (another libc): the worker still ends when its queue breaks on the next submit
    try:
        os.kill(owner, 0)  # `owner` died before the prctl above: nobody is left to signal us
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:
        pass


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _init_worker(tok: TokenizerLike, opts: Options, tmpdir: str, owner: int) -> None:
    die_with_parent(owner)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the pool and cleans up
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the parent's SIGTERM handler (CLI) must not be inherited
    _WORKER.update(tok=tok, opts=opts, tmpdir=tmpdir)


def _work(chunk: Chunk) -> ChunkStats:
    """One chunk -> one partial .bin/.idx per key, in the worker process."""
    IndexedDatasetBuilder = indexed_dataset().IndexedDatasetBuilder

    opts: Options = _WORKER["opts"]
    parts = {k: os.path.join(_WORKER["tmpdir"], f"part{chunk.index:07d}_{k}") for k in opts.keys}
    builders = {k: IndexedDatasetBuilder(p + ".bin", dtype=opts.dtype) for k, p in parts.items()}
    try:
        stats = encode_chunk(chunk, _WORKER["tok"], opts, builders)
    finally:
        for b in builders.values():
            b.data_file.close()  # idempotent; finalize() below closes it again
    for k, b in builders.items():
        b.finalize(parts[k] + ".idx")
    stats.parts = parts
    return stats


def _start_method() -> str:
    """fork: workers inherit the loaded tokenizer and megatron-core (a 5 s import) instead of redoing both. Only
    from a single-threaded parent (the CLI): forking a process with other threads (a library caller's, a test
    runner's with a live gloo group) can copy a lock one of them holds and hang the child; then forkserver."""
    if not sys.platform.startswith("linux"):
        return "spawn"
    return "fork" if threading.active_count() == 1 else "forkserver"


def _submit(
    ex: ProcessPoolExecutor,
    chunks: Iterator[Chunk],
    workers: int,
    inflight: dict[Future, int],
    done: dict[int, Union[ChunkStats, BaseException]],
    submitted: int,
) -> tuple[int, bool]:
    """Top the pool up to 2 chunks per worker in flight (which bounds the gzip blocks held in memory). Returns the
    count submitted so far and whether planning the next chunk failed (its error then waits in `done` at its
    place in input order)."""
    while len(inflight) < 2 * workers:
        try:
            chunk = next(chunks, None)
        except PreprocessError as e:  # a corrupt gzip stream is found by the parent, while planning
            done[submitted] = e
            return submitted, True
        if chunk is None:
            break
        inflight[ex.submit(_work, chunk)] = chunk.index
        submitted += 1
    return submitted, False


def _collect(
    inflight: dict[Future, int],
    done: dict[int, Union[ChunkStats, BaseException]],
    progress: Callable[[ChunkStats], None],
) -> bool:
    """Wait for at least one chunk in flight and file each finished one's result (or error) in `done`; True when
    one failed."""
    failed = False
    finished, _ = wait(inflight, return_when=FIRST_COMPLETED)
    for fut in finished:
        index = inflight.pop(fut)
        err = fut.exception()
        done[index] = err if err is not None else fut.result()
        failed = failed or err is not None
        if err is None:
            progress(done[index])  # type: ignore[arg-type]  # on completion: a smooth bar
    return failed


def _merge_ready(done: dict[int, Union[ChunkStats, BaseException]], next_merge: int, builders: dict[str, Any]) -> int:
    """Append the finished partials that come next in chunk order to the output, deleting them; raise the first
    error in input order when its turn comes. Returns the next chunk to merge."""
    while next_merge in done:
        result = done.pop(next_merge)
        if isinstance(result, BrokenProcessPool):
            raise PreprocessError("a worker process died (out of memory?); retry with fewer --workers")
        if isinstance(result, BaseException):
            raise result
        for key, part in (result.parts or {}).items():
            if result.documents[key]:
                builders[key].add_index(part)
            os.remove(part + ".bin")
            os.remove(part + ".idx")
        next_merge += 1
    return next_merge


def run_parallel(
    chunks: Iterator[Chunk],
    workers: int,
    tok: TokenizerLike,
    opts: Options,
    tmpdir: str,
    builders: dict[str, Any],
    progress: Callable[[ChunkStats], None],
) -> None:
    """Chunks go to a pool as workers free up (at most 2 per worker in flight, which bounds the gzip blocks held
    in memory); finished partials are appended in chunk order. A failing chunk stops new submissions and its
    error is raised once every earlier chunk is done, so the error reported is the first in input order, as
    with one worker."""
    method = _start_method()
    # add_index() calls gc.collect() per partial; with torch and megatron loaded that is ~0.2 s each. Freezing
    # the long-lived objects makes it ~free (and keeps forked workers from copying pages on write).
    gc.freeze()
    ex = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context(method),
        initializer=_init_worker,
        initargs=(tok, opts, tmpdir, os.getpid()),
    )
    clean = False
    try:
        inflight: dict[Future, int] = {}
        done: dict[int, Union[ChunkStats, BaseException]] = {}
        next_merge, submitted, failed = 0, 0, False
        while True:
            if not failed:
                submitted, failed = _submit(ex, chunks, workers, inflight, done, submitted)
            if not inflight and next_merge not in done:
                clean = True
                return
            if inflight:
                failed = _collect(inflight, done, progress) or failed
            next_merge = _merge_ready(done, next_merge, builders)
    finally:
        if not clean:
            # Error or Ctrl-C: stop the workers now rather than let the chunks already queued run to the end
            # (seconds each). ProcessPoolExecutor has no public terminate before Python 3.14. SIGKILL, not SIGTERM:
            # an error at the first chunk reaches a worker forked a moment ago, before `_init_worker` reset the
            # SIGTERM handler it inherited (the CLI's): it survived, blocked on the call queue's lock that a killed
            # sibling held, and the shutdown below waited for it forever (a test hung so, 2026-11-29).
            for proc in list(getattr(ex, "_processes", {}).values()):
                proc.kill()
        ex.shutdown(wait=True, cancel_futures=True)
        gc.unfreeze()
