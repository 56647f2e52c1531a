"""`--async-save` (issue 37): a checkpoint save that blocks training only while every state DeepSpeed would write is
copied into host memory; a background thread writes, flushes and renames each file, and the manifest and `latest`
are published once every rank's writer has finished, found by a collective check at a later step boundary.

    saver = AsyncSaver(cfg, rank, device, say)     # every rank, before the first step (a gloo group of its own)
    published = saver.poll()                       # every rank, at every step boundary: publishes when all are done
    published = saver.finish("the next save")      # every rank: waits for a pending save and publishes it
    blocked = saver.save(engine, client_state)     # every rank: the copy; the write goes on in the background

The copy: DeepSpeed writes every file of a checkpoint (the layer files, the mp_rank model states holding the
client state: the data position and the guard's state; the ZeRO optimizer shards) through
`engine.checkpoint_engine.save(state_dict, path)`. During an asynchronous save that call copies `state_dict` into
host memory and queues it instead (`host_copy`: pickle's traversal of it, the one torch.save makes, with each
tensor storage copied once, views and shared storages kept as they were). The background thread hands each copy
to the checkpoint engine's own save in a hidden staging folder beside its file, fsyncs it and renames it into
place, then fsyncs the directories. The files are those a synchronous save writes: byte for byte on CPU; on CUDA
their storages are recorded as `cpu` where a synchronous save records `cuda:N`, which every load maps to host
memory anyway.

Host memory: pinned on CUDA (threed.parallel.device_policy), plain on CPU, kept from one save to the next (the
states have the same sizes each time, and pinning gigabytes anew costs seconds). `AsyncSaver` refuses, before the
first step, a run whose copies cannot fit in the memory its node has available: each rank's copy is what it writes
(threed.checkpoint.format.node_checkpoint_bytes, the figure `threed memory` and `threed check-config` report).

Anything the background thread raises that is not a failed write (a bug) ends the run as a failed write does: at
the next step boundary every rank exits 5 and rank 0 says one line naming the rank, the file, the exception and
where it was raised; `latest` keeps naming the previous checkpoint (not a traceback on one rank while the others
wait for it in a collective).

Why not DeepSpeed's own asynchronous writers: under PipelineEngine its decoupled engine never writes `latest` and
tore the fp32 master weights, and its fast writer's config fails under torchrun (KeyError CROSS_SIZE). The crash
safety here is the synchronous save's (threed.checkpoint.save): nothing names a checkpoint before its manifest,
which rank 0 writes only once every rank's files were flushed, and `latest` comes after the manifest.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from threed.atomic import fsync_file
from threed.checkpoint.format import adapter_only_lora, node_checkpoint_bytes
from threed.checkpoint.save import (
    begin_save,
    describe,
    fsync_dirs,
    settle,
    swapped_save,
    write_error,
    write_files,
)
from threed.config import ConfigError, RunConfig
from threed.errors import torch_write_failed
from threed.model.spec import pipeline_layers
from threed.parallel.device_policy import cuda_only
from threed.parallel.dims import resolve_dims
from threed.parallel.distributed import is_multi_rank
from threed.units import human_bytes


class HostBuffers:
    """Host memory for the copies, kept from one save to the next: the n-th storage a save copies reuses the n-th
    buffer of the save before when the sizes match (the same states each save). Only one save is ever in flight,
    so a buffer is free again when the next save starts."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.pool: list[torch.Tensor] = []
        self.used = 0
        # the last save's figures (benchmarks/bench_checkpoint.py reports them): bytes copied, seconds copying,
        # seconds allocating (pinning) new buffers
        self.copied, self.copy_s, self.alloc_s = 0, 0.0, 0.0

    def start(self) -> None:
        self.used = 0
        self.copied, self.copy_s, self.alloc_s = 0, 0.0, 0.0

    def take(self, nbytes: int) -> torch.Tensor:
        i, self.used = self.used, self.used + 1
        if i < len(self.pool) and self.pool[i].numel() == nbytes:
            return self.pool[i]
        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.alloc_s += time.perf_counter() - t0
        if i < len(self.pool):
            self.pool[i] = buf
        else:
            self.pool.append(buf)
        return buf

    def end(self) -> None:
        """The save copied all it will: buffers it did not use are let go."""
        del self.pool[self.used :]

    def nbytes(self) -> int:
        return sum(b.numel() for b in self.pool)


class _Copier(pickle.Pickler):
    """Pickles a state dict with every tensor storage left out (a persistent id), each copied once into a host
    buffer: the structure comes back from `_Restorer` around the copies."""

    def __init__(self, file, buffers: HostBuffers) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.buffers = buffers
        self.copies: dict[tuple, torch.UntypedStorage] = {}

    def persistent_id(self, obj):
        if isinstance(obj, torch.storage.TypedStorage):
            return ("typed", self._copy(obj._untyped_storage), obj.dtype)
        if isinstance(obj, torch.UntypedStorage):
            return ("untyped", self._copy(obj), None)
        return None

    def _copy(self, storage: torch.UntypedStorage) -> tuple:
        key = (str(storage.device), storage.data_ptr(), storage.nbytes())
        if key not in self.copies:
            host = self.buffers.take(storage.nbytes())
            t0 = time.perf_counter()  # a copy into host memory returns once it is done (not non_blocking)
            host.copy_(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
            self.buffers.copy_s += time.perf_counter() - t0
            self.buffers.copied += storage.nbytes()
            self.copies[key] = host.untyped_storage()
        return key


class _Restorer(pickle.Unpickler):
    """Unpickles `_Copier`'s structure around its host copies: a state dict like the original, on host memory."""

    def __init__(self, file, copies: dict) -> None:
        super().__init__(file)
        self.copies = copies

    def persistent_load(self, pid):
        kind, key, dtype = pid
        storage = self.copies[key]
        return (
            torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
            if kind == "typed"
            else storage
        )


def host_copy(state, buffers: HostBuffers):
    """`state` (anything torch.save takes) with every tensor's storage copied into host memory from `buffers`; the
    rest rebuilt from its pickle, so nothing the training goes on to change is shared with the copy."""
    structure = io.BytesIO()
    copier = _Copier(structure, buffers)
    copier.dump(state)
    structure.seek(0)
    return _Restorer(structure, copier.copies).load()


@contextlib.contextmanager
def capturing(engine, buffers: HostBuffers) -> Iterator[list]:
    """During the block DeepSpeed's checkpoint engine copies what it is handed into host memory and queues it
    instead of writing it: yields the queue of (path, host copy). threed.checkpoint.save.write_files runs
    DeepSpeed's save inside it, as the synchronous save runs it inside `recording_writes`."""
    queued: list = []
    buffers.start()

    def copy(state_dict, path, *args, **kwargs):
        queued.append((str(path), host_copy(state_dict, buffers)))

    with swapped_save(engine.checkpoint_engine, copy):
        yield queued
    buffers.end()


@dataclass
class Pending:
    """A save whose files this rank's background thread is writing (or has written)."""

    step_dir: Path
    meta: dict  # the manifest's account of the save (threed.checkpoint.save.describe), read when it began
    t0: float  # when the save began
    blocked: float  # seconds training waited for the copy
    done: threading.Event = field(default_factory=threading.Event)
    written: dict[str, int] = field(default_factory=dict)  # file name -> size, as this rank wrote them
    # a failed write, or anything else the thread raised (`writer_bug`): (what, the fix), said by rank 0 at the next
    # step boundary (threed.checkpoint.save.settle), where every rank ends with exit 5
    failure: Optional[tuple[str, str]] = None


@dataclass(frozen=True)
class Published:
    step: int
    path: str  # the save directory
    blocked: float  # seconds training waited for the copy
    seconds: float  # from the save's start until `latest` named it


def write_queued(queued: list, writer: Callable, rank: int, pending: Pending) -> None:
    """The background thread: each copy written through the checkpoint engine's own save into a hidden staging
    folder beside its file (under its own name: torch.save names the archive inside after the file), fsynced and
    renamed into place; then the directories fsynced. A failed write stops it, and so does any other exception (a
    bug: `writer_bug`): reported, not raised, so that every rank, not only this one, ends at the next step
    boundary with one line naming the file, instead of one rank's traceback and the others waiting for it."""
    staged = set()
    current = str(pending.step_dir)  # what the thread was writing when it failed
    yield_cpu()
    try:
        for path, state in queued:
            current = path
            tmp = staging(path)
            staged.add(tmp.parent)
            try:
                writer(state, str(tmp))
                fsync_file(tmp)
                os.replace(tmp, path)
            except (OSError, RuntimeError) as e:
                if isinstance(e, RuntimeError) and not torch_write_failed(e):
                    raise
                pending.failure = named(write_error(e, pending.step_dir, rank), tmp, path)
                return
            pending.written[Path(path).name] = Path(path).stat().st_size
        current = str(pending.step_dir)
        fsync_dirs([p for p, _ in queued], pending.step_dir)
    except OSError as e:  # flushing the directories
        pending.failure = write_error(e, pending.step_dir, rank)
    except BaseException as e:  # a bug (the run ends as after a failed write; its innermost frame named)
        pending.failure = writer_bug(e, current, rank)
    finally:
        for folder in staged:
            shutil.rmtree(folder, ignore_errors=True)
        queued.clear()  # the copies' structures go; their buffers stay in the pool for the next save
        pending.done.set()


WRITER_NICE = 10  # how much lower the background writer's CPU priority is than training's


def yield_cpu() -> None:
    """The calling thread (the background writer) yields the CPU to training where both want it: its own nice
    value raised (Linux keeps one per thread); elsewhere, or when refused, nothing changes."""
    try:
        me = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, me, os.getpriority(os.PRIO_PROCESS, me) + WRITER_NICE)
    except (AttributeError, OSError):
        pass


def staging(path: str) -> Path:
    """Where the background thread writes `path` before renaming it into place: a hidden folder beside it, never
    listed as a checkpoint file (a kill leaves it in a directory no manifest names)."""
    folder = Path(path).parent / f".threed-writing-{os.getpid()}"
    folder.mkdir(exist_ok=True)
    return folder / Path(path).name


def named(failure: tuple[str, str], tmp: Path, path: str) -> tuple[str, str]:
    """A failed write's line names the checkpoint's file, not the temporary name it was written under."""
    what, fix = failure
    what = what.replace(str(tmp), path)
    return (what if path in what else f"{what} writing {path}"), fix


def writer_bug(e: BaseException, path: str, rank: int) -> tuple[str, str]:
    """A failure of the background writer that is not a failed write (a bug, or an exception from the checkpoint
    engine's writer): (one clause naming the rank, the file, the exception and where it was raised, the fix), the
    shape of threed.checkpoint.save.write_error's."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    what = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return (
        f"rank {rank}: the background writer failed writing {path}: {what}{where}",
        "This is a fault of the writer, not of the disk (report it with this line); drop --async-save",
    )


def available_memory() -> Optional[int]:
    """Bytes of memory this node can still give without swapping (MemAvailable: free plus reclaimable cache)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def copy_bytes(cfg: RunConfig, world: int, ranks: range) -> int:
    """Bytes of host memory the copies of `ranks` take: what each writes of a checkpoint
    (threed.checkpoint.format.node_checkpoint_bytes, the figure threed.memory.model reports per node)."""
    p = cfg.parallel
    d = resolve_dims(cfg, max(world, p.tp * p.pp * p.cp))  # a process standing in for a whole layout: one replica
    layers = pipeline_layers(cfg.model)
    kinds = [[layers[i].kind for lo, hi in d.chunks(s) for i in range(lo, hi)] for s in range(d.pp)]
    return node_checkpoint_bytes(cfg.model, cfg.train.dtype, (d.tp, d.dp, d.cp), kinds, ranks, adapter_only_lora(cfg))


def host_memory_problem(cfg: RunConfig, world: int, node: range, available: Optional[int]) -> Optional[str]:
    """Why this node, whose memory the ranks `node` share, cannot hold their copies of a checkpoint, or None."""
    need = copy_bytes(cfg, world, node)
    if available is None or need <= available:
        return None
    return (
        f"--async-save keeps a host copy of each rank's share of a checkpoint: about {human_bytes(need)} for the "
        f"{len(node)} rank(s) of this node, which has {human_bytes(available)} of memory available; turn "
        f"--async-save off (saves block training while they write) or run on more nodes"
    )


def node_ranks(rank: int) -> range:
    """The ranks sharing this rank's node: torchrun numbers a node's LOCAL_WORLD_SIZE ranks consecutively."""
    local, local_rank = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("LOCAL_RANK", "0"))
    return range(rank - local_rank, rank - local_rank + local)


class AsyncSaver:
    """Every rank holds one in a run with --save and --async-save (the calls: this module's docstring). At most one
    save is pending; each call that settles it is collective, made by every rank at the same step boundary."""

    def __init__(self, cfg: RunConfig, rank: int, device, say: Callable[[str], None]) -> None:
        self.cfg, self.rank, self.say = cfg, rank, say
        self.buffers = HostBuffers(cuda_only(device).pinned_saves)
        # The completion checks run on a gloo group of their own, so they never share NCCL's streams or wait behind
        # its collectives (torchtitan does the same; Megatron all-reduces the same flag every step).
        self.group = dist.new_group(backend="gloo") if is_multi_rank() else None
        self.pending: Optional[Pending] = None
        self.thread: Optional[threading.Thread] = None
        world = dist.get_world_size() if is_multi_rank() else 1
        problems = [host_memory_problem(cfg, world, node_ranks(rank), available_memory())]
        if self.group is not None:  # every rank refuses, with the line of a node that cannot hold its copies
            mine, problems = problems[0], [None] * world
            dist.all_gather_object(problems, mine, group=self.group)
        first = next((p for p in problems if p), None)
        if first:
            raise ConfigError(first)

    def save(self, engine, client_state: Optional[dict]) -> float:
        """Every rank, at a step boundary with no save pending (`finish` the last one first): the weights checked
        (exit 3 when diverged, nothing written), every state DeepSpeed would write copied to host memory, the
        background write started. Returns the seconds training was blocked."""
        assert self.pending is None, "finish the pending save first"
        step_dir, t0 = begin_save(engine, self.cfg, self.rank)
        meta = describe(engine, self.cfg, client_state)
        writer = engine.checkpoint_engine.save  # the engine's own writer, which the copies go through

        def copies(e):
            return capturing(e, self.buffers)

        queued, failed = write_files(engine, self.cfg, self.rank, step_dir, client_state, copies)
        if self._any(failed is not None):  # the copy failed somewhere (a directory DeepSpeed makes): every rank
            settle(self.cfg, self.rank, step_dir, {}, failed, meta, t0, self.group)  # ends as a synchronous save
        blocked = time.time() - t0
        self.pending = Pending(step_dir, {**meta, "blocked_seconds": round(blocked, 2)}, t0, blocked)
        self.thread = threading.Thread(
            target=write_queued, args=(queued, writer, self.rank, self.pending), name="threed-async-save", daemon=True
        )
        self.thread.start()
        return blocked

    def running(self) -> bool:
        """Whether any rank's writer is still writing (collective)."""
        assert self.pending is not None
        return self._any(not self.pending.done.is_set())

    def _any(self, mine: bool) -> bool:
        """Whether `mine` holds on any rank (collective: a flag all-reduced on the gloo group)."""
        flag = torch.tensor([int(mine)], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def poll(self) -> Optional[Published]:
        """Every rank, at every step boundary: once every rank's writer has finished, the save is published (or,
        when a write failed, the run ends: exit 5, one line naming the file, `latest` unchanged)."""
        if self.pending is None or self.running():
            return None
        return self._settle()

    def finish(self, why: str) -> Optional[Published]:
        """Every rank: wait for the pending save, if any, and publish it. `why` completes the line said while
        waiting: "waiting for the checkpoint of step N to be written before {why}"."""
        if self.pending is None:
            return None
        if self.running():
            self.say(f"waiting for the checkpoint of step {self.pending.meta['step']} to be written before {why}")
        return self._settle()

    def _settle(self) -> Published:
        pending, self.pending = self.pending, None
        assert pending is not None and self.thread is not None
        self.thread.join()
        self.thread = None
        settle(
            self.cfg,
            self.rank,
            pending.step_dir,
            pending.written,
            pending.failure,
            pending.meta,
            pending.t0,
            self.group,
        )
        return Published(pending.meta["step"], str(pending.step_dir.parent), pending.blocked, time.time() - pending.t0)
