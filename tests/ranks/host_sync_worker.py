"""2-rank (pp 2) runs of `threed.train.loop.train` that count host synchronisations inside micro-batches, for
tests/ranks/test_host_sync.py.

    python -m torch.distributed.run --nproc-per-node 2 tests/ranks/host_sync_worker.py --out DIR --data PREFIX

What would make the host wait for a GPU, seen on CPU (where nothing waits, so the calls themselves are counted):
- reads of a tensor's value on the host: `.item()`, `float()` / `int()` / `bool()` of a tensor (all dispatch
  `aten::_local_scalar_dense`), `.tolist()`, `.numpy()`, `.cpu()`;
- ops whose output shape depends on the data (`nonzero`, `masked_select`, `unique`, boolean indexing,
  `repeat_interleave` without `output_size`), which CUDA must finish before the host knows the shape (not
  `x[mask] = scalar`: aten's index_put_ runs that as a masked_fill, which needs no count of the mask's trues);
- `torch.cuda.synchronize` and DeepSpeed's accelerator `synchronize`.
The aten ops are seen by a TorchDispatchMode, the Python-level reads by counting wrappers; both count only while a
micro-batch instruction of DeepSpeed's 1F1B schedule runs (load, forward, backward, send, receive). The step
boundary (gradient reduction, optimizer step, loss averaging, logging) may wait and is not counted. Blocking copies
to the device cannot be seen on CPU (the host is the device); what DeepSpeed loads is checked instead: every tensor
is already a view of the step's one staged copy, so its `.to(device)` is a no-op on a GPU too.

One launch runs four trainings: bf16 and fp32, each on today's path and on the path before staging and the step
collector (`unstaged-<dtype>`: micro-batches handed over one by one, the automatic collector on), whose losses,
gradient norms and validation losses must be bit-identical.
"""

from __future__ import annotations

import argparse
import contextlib
import traceback
from typing import Any, Callable
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import rank_json, run_worker, train
from helpers import model_config
from threed.config import DataConfig, ParallelConfig, RunConfig, TrainConfig
from threed.parallel.distributed import Runtime
import threed.train.evaluate as evaluate
import threed.train.loop as loop

GAS = 4
# aten ops that make a CUDA host wait: a value read, or an output shape only the data decides.
SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
    "aten.equal",
}
PYTHON_READS = ("tolist", "numpy", "cpu")  # `.item()` is seen as aten._local_scalar_dense


def where() -> str:
    """The innermost frame of threed, DeepSpeed or megatron-core that made the call: `package/file.py:line func`."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        for package in ("threed", "deepspeed", "megatron"):
            if f"/{package}/" in frame.filename:
                tail = frame.filename.split(f"/{package}/", 1)[1]
                return f"{package}/{tail}:{frame.lineno} {frame.name}"
    return "?"


class SyncLog:
    """The syncs seen inside micro-batch instructions: (step, instruction, what, where); `step` counts the optimizer
    steps before it (0: the run's first step)."""

    def __init__(self) -> None:
        self.inside: str = ""
        self.step = 0
        self.seen: list[tuple[int, str, str, str]] = []

    def note(self, what: str) -> None:
        if self.inside:
            self.seen.append((self.step, self.inside, what, where()))


class SyncOps(TorchDispatchMode):
    """Counts the aten ops of SYNC_OPS (and boolean indexing, `repeat_interleave` without `output_size`)."""

    def __init__(self, log: SyncLog):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        name = name if name.startswith("aten.") else f"aten.{name}"
        if name in SYNC_OPS:
            self.log.note(name)
        elif name in ("aten.index", "aten.index_put", "aten.index_put_") and boolean_index(name, args):
            self.log.note(f"{name} with a boolean index")
        elif name == "aten.repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3:
            self.log.note("aten.repeat_interleave without output_size")
        return func(*args, **kwargs)


def boolean_index(name: str, args: tuple) -> bool:
    """Indexing with a boolean mask, except `x[mask] = scalar` (one mask, a one-element host value), which aten's
    index_put_ hands to masked_fill_ (`can_dispatch_to_masked_fill`): no nonzero, no wait."""
    masks = [i for i in (args[1] or ()) if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
    if not masks:
        return False
    if name != "aten.index" and len(args[1]) == 1 and args[2].numel() == 1 and args[2].device.type == "cpu":
        return False
    return True


def counted(fn: Callable, log: SyncLog, what: str) -> Callable:
    def run(*args: Any, **kwargs: Any) -> Any:
        log.note(what)
        return fn(*args, **kwargs)

    return run


def micro_batch_instructions() -> list[type]:
    from deepspeed.runtime.pipe import schedule as s  # deepspeed: heavy, as in every worker that trains

    return [s.LoadMicroBatch, s.ForwardPass, s.BackwardPass, s.SendActivation, s.RecvActivation, s.SendGrad, s.RecvGrad]


def stepped(fn: Callable, log: SyncLog) -> Callable:
    """DeepSpeed's OptimizerStep handler, counting the steps."""

    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(engine, *args, **kwargs)
        finally:
            log.step += 1

    return run


def watched(fn: Callable, name: str, log: SyncLog) -> Callable:
    """DeepSpeed's handler of one micro-batch instruction, run with the log open and the dispatch mode on."""

    def run(engine: Any, *args: Any, **kwargs: Any) -> Any:
        log.inside = name
        try:
            with SyncOps(log):
                return fn(engine, *args, **kwargs)
        finally:
            log.inside = ""

    return run


class Loads:
    """What DeepSpeed's `_exec_load_micro_batch` was handed: micro-batches, and those whose every tensor was on the
    engine's device as a view of a staged step buffer."""

    def __init__(self, next_batch: Callable):
        self.next_batch = next_batch
        self.batches = 0
        self.staged = 0

    def method(self) -> Callable:
        """A function to set on the class (an instance of Loads would not be bound to the engine)."""

        def next_batch(engine: Any) -> Any:
            return self(engine)

        return next_batch

    def __call__(self, engine: Any) -> Any:
        batch = self.next_batch(engine)
        leaves = [t for part in batch for t in (part if isinstance(part, (tuple, list)) else [part])]
        self.batches += 1
        self.staged += all(t.device == engine.device and t._base is not None for t in leaves)
        return batch


class NoCollector:
    """The training loop before threed.train.host_gc: Python's collector left automatic."""

    def __init__(self, *args: Any) -> None:
        pass

    def __enter__(self) -> "NoCollector":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def after_step(self, step: int, metrics: Any) -> None:
        return None


def unstaged(step: list, device: torch.device, pin: bool) -> list:
    """threed.data.loader.on_device's stand-in: the micro-batches as the loader made them, one by one on the host."""
    return step


def config(data: str, dtype: str) -> RunConfig:
    return RunConfig(
        model=model_config("gqa31"),
        parallel=ParallelConfig(pp=2),
        train=TrainConfig(
            dtype=dtype,
            micro_batch_size=2,
            grad_accum_steps=GAS,
            seq_length=32,
            steps=3,
            lr=1e-3,
            min_lr=1e-4,
            eval_interval=2,
            eval_iters=1,
            log_interval=1,
        ),
        data=DataConfig(data_path=(data,), split="90,10,0"),
    )


def counted_run(cfg: RunConfig) -> dict[str, Any]:
    """`train(cfg)` with the syncs inside micro-batches logged and DeepSpeed's loads inspected."""
    from deepspeed.accelerator import get_accelerator  # deepspeed: heavy, as above
    from deepspeed.runtime.pipe.engine import PipelineEngine  # deepspeed: heavy, as above

    log = SyncLog()
    loads = Loads(PipelineEngine._next_batch)
    reads = {name: counted(getattr(torch.Tensor, name), log, f"Tensor.{name}") for name in PYTHON_READS}
    accelerator = get_accelerator()
    with contextlib.ExitStack() as maps:
        # threed's engines (threed.parallel.lean_engine, zero_bubble) dispatch through maps of their own
        for engine_class in engine_classes(PipelineEngine):
            maps.enter_context(mock.patch.dict(engine_class._INSTRUCTION_MAP, watched_map(engine_class, log)))
        r = _counted_train(cfg, log, loads, reads, accelerator)
    return {
        "syncs": log.seen,
        "loaded": loads.batches,
        "staged": loads.staged,
        "losses": r.losses,
        "grad_norms": r.grad_norms,
        "evals": r.evals,
    }


def engine_classes(base: type) -> list[type]:
    """`base` and its subclasses that hold an instruction map of their own."""
    found, todo = [], [base]
    while todo:
        cls = todo.pop()
        found += [cls] if "_INSTRUCTION_MAP" in vars(cls) else []
        todo += cls.__subclasses__()
    return found


def watched_map(engine_class: type, log: SyncLog) -> dict:
    """`engine_class`'s micro-batch instructions logged, and its optimizer step marking the step boundary."""
    from deepspeed.runtime.pipe.schedule import OptimizerStep  # deepspeed: heavy, as above

    table = engine_class._INSTRUCTION_MAP
    handlers = {cmd: watched(table[cmd], cmd.__name__, log) for cmd in micro_batch_instructions()}
    handlers[OptimizerStep] = stepped(table[OptimizerStep], log)
    return handlers


def _counted_train(cfg: RunConfig, log: SyncLog, loads: "Loads", reads: dict, accelerator: Any) -> Any:
    from deepspeed.runtime.pipe.engine import PipelineEngine  # deepspeed: heavy, as above

    with (
        mock.patch.object(PipelineEngine, "_next_batch", loads.method()),
        mock.patch.multiple(torch.Tensor, **reads),
        mock.patch.object(torch.cuda, "synchronize", counted(torch.cuda.synchronize, log, "torch.cuda.synchronize")),
        mock.patch.object(accelerator, "synchronize", counted(accelerator.synchronize, log, "accelerator.synchronize")),
    ):
        return train(cfg)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)


def main(args: argparse.Namespace, rt: Runtime) -> None:
    results = {dtype: counted_run(config(args.data, dtype)) for dtype in ("bf16", "fp32")}
    with (
        mock.patch.object(loop, "on_device", unstaged),
        mock.patch.object(evaluate, "on_device", unstaged),
        mock.patch.object(loop, "StepCollector", NoCollector),
    ):
        results.update({f"unstaged-{dtype}": counted_run(config(args.data, dtype)) for dtype in ("bf16", "fp32")})
    rank_json(args.out, "", results)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
