"""Process groups: the one place that picks the device and backend, and that ties DeepSpeed's grid to
megatron-core's parallel state.

Both libraries build their own process groups. They must agree rank for rank (a TP all-reduce inside a megatron
layer and DeepSpeed's gradient all-reduce over DP must see the same partners), so `check_groups_agree` compares
them on every rank at start-up.

It is also the one place that quiets the libraries' start-up noise (`quiet_libraries`, run when this module is
imported: threed.engine.build, threed.train and every rank's entry point import it before deepspeed or megatron-core),
that keeps megatron-core's fusers uncompiled where the device policy says CPU (`megatron_device.skip_fuser_compile`,
also at import: no fused kernel runs there, and torch's compiler stays unimported) and that sets every process
group's collective timeout (`init_distributed`).
"""

from __future__ import annotations

import atexit
import contextlib
import io
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from threed.parallel import megatron_device
from threed.parallel.build_lock import lock_candidates, stale_lock
from threed.parallel.device_policy import CudaOnly, cuda_only
from threed.config import ConfigError


# The oldest torch threed runs on: the lent GPU machine's 2.11.0 passed the CPU suite and a bf16 `threed train`; the pin
# (pyproject.toml) is 2.13.0. What differs between releases is asked of torch itself where it is used (capabilities,
# not versions: docs/torch-versions.md); only this floor is a version, checked once as a rank starts.
MIN_TORCH = (2, 11)


def torch_too_old(version: Optional[str] = None) -> Optional[str]:
    """The one line refusing a torch below MIN_TORCH (`version`: torch.__version__ by default), or None. A version
    string that names no major.minor (a custom build) is not refused."""
    version = str(torch.__version__ if version is None else version)
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= MIN_TORCH:
        return None
    floor = ".".join(map(str, MIN_TORCH))
    return (
        f"torch {version} is older than threed supports (torch >= {floor}, docs/torch-versions.md); install torch "
        f"{floor} or newer in this environment (the tested pin is 2.13.0)"
    )


@dataclass(frozen=True)
class Runtime:
    device: torch.device
    backend: str
    rank: int
    world_size: int
    local_rank: int

    @property
    def cuda_only(self) -> CudaOnly:
        return cuda_only(self.device)


class DeviceError(ConfigError):
    """The requested device cannot be used; the message names the fix."""


def _wanted_device() -> str:
    want = os.environ.get("THREED_DEVICE", "auto")
    if want not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"THREED_DEVICE must be auto, cpu or cuda, got {want!r}")
    return want


def device_type() -> str:
    """'cuda' or 'cpu': what `device_and_backend` will pick, without raising (a bad THREED_DEVICE or a missing GPU
    is reported by `device_and_backend`, which names the fix). Also DeepSpeed's accelerator (`quiet_libraries`)."""
    try:
        want = _wanted_device()
    except DeviceError:
        return "cpu"
    return "cuda" if want != "cpu" and torch.cuda.is_available() else "cpu"


def device_and_backend() -> tuple[torch.device, str]:
    """nccl + cuda where a GPU is visible, gloo + cpu otherwise. Nothing else in the repo picks either (DeepSpeed's
    accelerator follows it: `quiet_libraries` sets DS_ACCELERATOR from `device_type`).

    THREED_DEVICE (set by recipes/launch.sh from DEVICE): `auto` (default), `cpu`, or `cuda` (then a missing GPU
    or a CPU-only torch is an error instead of a silent CPU run)."""
    want = _wanted_device()
    if want == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else f"torch built for CUDA {torch.version.cuda}"
        raise DeviceError(
            f"DEVICE=cuda, but no GPU is usable ({build}, {torch.cuda.device_count()} visible "
            f"devices); install the CUDA build of torch 2.13.0 in the venv, or use DEVICE=cpu"
        )
    if want != "cpu" and torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise DeviceError(
                f"local rank {local_rank} has no GPU: this node shows {count} GPUs "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); start at "
                f"most {count} ranks per node (GPUS_PER_NODE={count})"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def set_cuda_environment() -> None:
    """Environment a CUDA rank needs before its CUDA context exists. Harmless (unused) on CPU; set wherever ranks
    start: recipes/launch.sh, slurm/common.sh, `threed.parallel.launch`, and here for ranks started any other way.
    - CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue, so a TP collective is not overtaken by a later
      kernel (megatron-core requires it for comm/compute overlap to be ordered).
    - expandable_segments: fewer fragmentation OOMs with pipeline micro-batches of changing lifetimes."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


# ----------------------------------------------------------------------------------- the libraries' start-up noise
# Each pattern says nothing a user of threed can act on. Real errors and every other warning still print.
QUIET_WARNINGS = (
    # megatron-core, 4 per rank: we use neither (torch's own AdamW and kernels, by design)
    r"Transformer Engine and Apex are not installed",
    # megatron-core's TransformerConfig default (cuda_graph_scope="full"); we capture no CUDA graphs
    r"full scope is deprecated",
    # torch, on CUDA, at the first barrier of a group made without device_id (DeepSpeed's and megatron-core's
    # groups; generate's and eval-harness's barriers): the device is the rank's own, set by device_and_backend
    r"barrier\(\): using the device under current context",
)
# FutureWarnings from inside a library, about its own calls: DeepSpeed's comm layer at dp > 1 (twice per rank),
# megatron-core's sequence-parallel reduce-scatter (--sequence-parallel, every rank)
QUIET_FUTURE_WARNINGS = (
    r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
    r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
)
# What DeepSpeed print()s on start-up (rank 0 or every rank), dropped by `library_prints`: its process groups and
# PipelineModule, and BF16_Optimizer's memory reports (`see_memory_usage(..., force=True)`, on rank 0: a message,
# then "MA ... GB  Max_MA ..." and "CPU Virtual Memory: ...", around each parameter group; no config turns them off).
QUIET_PRINTS = re.compile(
    r"^(SEED_LAYERS=\S+ BASE_SEED=|Using topology: |DeepSpeed deepspeed\.ops\.comm\.\S+ built successfully"
    r"|RANK=\d+ .*tied_comms"
    r"|(begin|end) bf16_ ?optimizer$|(before|after) initializing group \d+$|MA [\d.]+ GB +Max_MA "
    r"|CPU Virtual Memory: +used = "
    # BF16_Optimizer's load prints this on every rank at every resume, before threed's own start-up lines
    r"|_load_legacy_checkpoint current_rank_sd\[BASE_OPTIMIZER_STATE\]$)"
)
# A progress bar's lines as tqdm draws them (`desc: 40%|####      | 4/10 [00:01<00:02, 3.1it/s]`), dropped by
# `library_bars` around lm-eval during training (--harness-interval): the training log holds threed's lines.
QUIET_BARS = re.compile(r"^.*\d+%\|.*\| *[\d.]+[kMG]?/[\d.?]+[kMG]? \[")
# What megatron-core logs at WARNING that is expected here, by logger: the blend and dataset indexes are built in
# memory when no cache path is given (we give none: they take seconds). Other warnings of these loggers still print.
QUIET_LOGS = {
    "megatron.core.datasets.blended_dataset": re.compile(r"Cannot save the \w+ indexes because path_to_cache is None"),
    "megatron.core.datasets.gpt_dataset": re.compile(r"Unable to save \w+ indexes because path_to_cache is None"),
}


class _DropRecords(logging.Filter):
    """A logger filter that drops the records whose message matches `pattern`."""

    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def quiet_libraries() -> None:
    """Run once per process before deepspeed and megatron-core are imported (at the import of this module):
    - DS_ACCELERATOR from the device policy (`device_type`), so DeepSpeed does not pick its accelerator by itself
      and does not warn "Setting accelerator to CPU" on every rank;
    - warnings filters for the QUIET_WARNINGS and QUIET_FUTURE_WARNINGS (each says nothing to the user);
    - DeepSpeed's own logger at WARNING (its default; stated so that INFO chatter stays off);
    - a filter on each of the QUIET_LOGS loggers for its expected message (the logger's other records pass)."""
    os.environ["DS_ACCELERATOR"] = device_type()
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for message in QUIET_FUTURE_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    for name, pattern in QUIET_LOGS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) for f in logger.filters):
            logger.addFilter(_DropRecords(pattern))


class _DropLines(io.TextIOBase):
    """A stdout that forwards every line except those matching `pattern`."""

    def __init__(self, target, pattern: re.Pattern):
        self.target, self.pattern, self.pending = target, pattern, ""

    def write(self, s: str) -> int:
        self.pending += s
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not self.pattern.match(line):
                self.target.write(line + "\n")
        return len(s)

    def flush(self) -> None:
        # A line not yet ended stays pending: tqdm flushes after each redraw, before the bar's line ends, and the
        # whole line is what the pattern decides on.
        self.target.flush()

    def finish(self) -> None:
        """At the end of the block: the last, unended line (unless it matches), then the target's flush."""
        if self.pending and not self.pattern.match(self.pending):
            self.target.write(self.pending)
        self.pending = ""
        self.target.flush()


@contextlib.contextmanager
def _dropping(stream: str, pattern: re.Pattern) -> Iterator[None]:
    """sys.stdout or sys.stderr (`stream`) without the lines matching `pattern`, for the block."""
    out = _DropLines(getattr(sys, stream), pattern)
    try:
        with (contextlib.redirect_stdout if stream == "stdout" else contextlib.redirect_stderr)(out):
            yield
    finally:
        out.finish()


def library_prints() -> contextlib.AbstractContextManager[None]:
    """Around DeepSpeed calls that print() start-up lines (process groups, the PipelineModule, the engine): drops
    the QUIET_PRINTS lines and passes everything else through."""
    return _dropping("stdout", QUIET_PRINTS)


def library_bars() -> contextlib.AbstractContextManager[None]:
    """Around a library call that draws tqdm progress bars on stderr (lm-eval's scoring inside a training run):
    drops the QUIET_BARS lines and passes every other line (a warning, an error) through."""
    return _dropping("stderr", QUIET_BARS)


quiet_libraries()
# Before megatron-core is imported, as the quieting above: off CUDA its fusers stay uncompiled (megatron_device).
megatron_device.skip_fuser_compile(device_type())


def to_cpu(t: torch.Tensor) -> torch.Tensor:
    """What tools and tests compare or save: a CPU tensor (a CUDA tensor saved with torch.save loads on CUDA)."""
    return t.detach().cpu()


def init_distributed(timeout_minutes: Optional[float] = None) -> Runtime:
    """Initialise torch.distributed through DeepSpeed (env:// from torchrun or our own launcher).

    A single process without torchrun's environment becomes a world of one, so `python -m threed.train`
    runs as is. A torch below MIN_TORCH is refused first, in one line. `timeout_minutes` (--dist-timeout-minutes)
    bounds every collective: a rank that waits longer for its peers raises instead of hanging until the job's time
    limit. It reaches every process group: the world group, every group made later without a timeout of its own
    (DeepSpeed's grid and PipelineModule groups call `torch.distributed.new_group(ranks)`, which takes torch's
    default, set here) and megatron-core's (`init_megatron_parallel_state` passes `collective_timeout()`).
    """
    too_old = torch_too_old()
    if too_old:  # before DeepSpeed and megatron-core, whose own failures on an old torch say less
        raise ConfigError(too_old)
    import deepspeed  # heavy: pulled in only where process groups are made (not by `threed plan`)

    set_cuda_environment()
    device, backend = device_and_backend()
    _use_device_policy_accelerator(device)
    import_muon_uncompiled()
    megatron_device.use_device(device)
    if not dist.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        # Port 0: the store binds a free port itself, atomically. Picking one, releasing it and binding it later
        # lost it to another process under load (EADDRINUSE, issue 29); a world of one tells no peer its port.
        os.environ.setdefault("MASTER_PORT", "0")
        if timeout_minutes and timeout_minutes > 0:
            set_default_timeout(timedelta(minutes=timeout_minutes))
        refuse_stale_build_lock()
        with library_prints():
            deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=collective_timeout(backend))
        # Every way out (a finished run, sys.exit(3) on divergence, a ConfigError) tears the groups down first.
        atexit.register(shutdown_distributed)
    return Runtime(
        device=device,
        backend=backend,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )


def refuse_stale_build_lock() -> None:
    """One line instead of a start-up that never ends: DeepSpeed's `init_distributed` JIT-builds its CPU comm op
    (ShareMemCommBuilder; no such op on CUDA) and waits for any build lock it finds, also one a killed build left
    (`threed.parallel.build_lock`). Asked of DeepSpeed's accelerator, as its own `build_shm_op` asks."""
    # deepspeed, torch's extension builder: heavy, as deepspeed above
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import get_default_build_root

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or installed_ops.get(builder.NAME, False):
        return  # nothing is JIT-built at start-up (CUDA, or the op was built into the install)
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    line = stale_lock(lock_candidates(root, builder.NAME))
    if line:
        raise ConfigError(line)


def is_multi_rank() -> bool:
    """Whether this process is one of several ranks (a process group of more than one): collectives are needed."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def set_default_timeout(timeout: timedelta) -> None:
    """torch's default collective timeout for groups made without one (nccl's and the others'): read by
    `torch.distributed.new_group` at each call, so every group DeepSpeed makes from here on takes it."""
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def collective_timeout(backend: Optional[str] = None) -> timedelta:
    """The timeout a new group gets: --dist-timeout-minutes once `init_distributed` has set it, else torch's
    default for the backend (of the world group when there is one)."""
    if backend is None:
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return distributed_c10d._get_default_timeout(backend)


MUON = "deepspeed.runtime.zero.muon.original_muon"


def import_muon_uncompiled() -> None:
    """DeepSpeed's engine start-up imports its Muon optimizer (`is_zero_supported_optimizer` asks whether ours is one),
    and that module decorates three functions with torch.compile as it is imported, which loads dynamo and inductor:
    1.5 s of CPU in every rank, for an optimizer threed never runs (AdamW: threed.engine.optimizer). So it is
    imported here, once, with DeepSpeed's own decorator for a torch without compile (`compiler.dummy_decorator`,
    the plain function). A DeepSpeed without that module or decorator is left as it is (asked, not its version)."""
    from deepspeed.runtime import compiler  # heavy: as deepspeed above

    if MUON in sys.modules or not hasattr(compiler, "dummy_decorator"):
        return
    compile_ = compiler.compile
    compiler.compile = lambda: compiler.dummy_decorator
    try:
        from deepspeed.runtime.zero.muon import original_muon  # noqa: F401  (heavy: as deepspeed above)
    except ImportError:  # no Muon in this DeepSpeed: nothing to spare
        pass
    finally:
        compiler.compile = compile_


def _use_device_policy_accelerator(device: torch.device) -> None:
    """DeepSpeed's accelerator is the device policy's. `quiet_libraries` sets DS_ACCELERATOR before DeepSpeed is
    imported; were deepspeed imported before this module (a caller's own import), its auto-detected accelerator is
    replaced here, before any process group or engine uses it."""
    from deepspeed.accelerator import get_accelerator, set_accelerator  # heavy: as deepspeed above

    if get_accelerator().device_name() == device.type:
        return
    if device.type == "cuda":
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator  # heavy: as deepspeed above

        set_accelerator(CUDA_Accelerator())
    else:
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator  # heavy: as deepspeed above

        set_accelerator(CPU_Accelerator())


def shutdown_distributed() -> None:
    """Destroy the process groups before the interpreter exits. Left to interpreter shutdown, gloo's worker threads
    can be torn down while joinable ("terminate called without an active exception": a SIGABRT after a run that
    had finished, seen under load on 2- and 4-rank runs, turning exit 0 or 3 into -6)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def init_megatron_parallel_state(tp: int, pp: int, cp: int = 1) -> None:
    """megatron-core's groups, in its default order tp-cp-ep-dp-pp: tp fastest, then cp, then dp, then pp, which is
    the rank order of DeepSpeed's PipeModelDataParallelTopology (axes pipe, data, model) when its data axis holds
    dp x cp ranks (`threed.parallel.pipeline.make_topology`): CP ranks hold the same weights, so DeepSpeed reduces
    gradients and shards ZeRO-1 state over dp x cp, megatron's data-parallel group "with context parallel". Their
    collective timeout is the world's (--dist-timeout-minutes, `collective_timeout`), not megatron's 30 minutes.

    Without megatron's gloo copies of its data-parallel groups: nothing here uses them (DeepSpeed's ZeRO, not
    megatron's distributed optimizer, holds the optimizer state); on CUDA they are a hang risk on multi-NIC nodes, and
    on a gloo world they only duplicate its groups, each with three threads, one waking 100 times a second."""
    from megatron.core import parallel_state  # heavy: as deepspeed above

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        create_gloo_process_groups=False,
        # megatron makes timedelta(minutes=this): a float keeps a fractional --dist-timeout-minutes
        distributed_timeout_minutes=collective_timeout().total_seconds() / 60,
    )


def grid_coordinates(rank: int, tp: int, dp: int, cp: int = 1) -> tuple[int, int, int]:
    """(pipeline stage, data-parallel rank, tensor-parallel rank) of a global rank, in the order both libraries use
    (tp fastest, then cp, then dp, then pp; `check_groups_agree` asserts it at start-up). Lets a rank know its role
    before any engine exists, e.g. whether it reads data and which rows (the CP ranks of one data-parallel rank read
    the same rows: `context_rank` says which share of them)."""
    return rank // (tp * cp * dp), rank // (tp * cp) % dp, rank % tp


def context_rank(rank: int, tp: int, cp: int) -> int:
    """The context-parallel rank of a global rank (`grid_coordinates`' order): which 2 of each row's 2·cp chunks it
    holds (threed.model.context.chunk_index)."""
    return rank // tp % cp


def loss_rank(tp: int, pp: int, dp: int, dp_rank: int = 0, cp: int = 1) -> int:
    """The global rank that holds data-parallel replica `dp_rank`'s loss: the last pipeline stage computes it and
    every TP rank of that stage holds the same value, so TP rank 0 of the last stage counts it (under CP, CP rank 0:
    DeepSpeed has averaged the CP ranks' shares of the loss over its data axis, which holds them). Replica 0's (the
    default) is the one rank that speaks for the run: it prints the log lines and writes the metrics (threed.train,
    threed.metrics.writer; DeepSpeed has already averaged the loss over DP there), so on a multi-node job every
    line of a run is in one node's log. Rank order as in `grid_coordinates` (tp fastest, then cp, dp, pp)."""
    return (((pp - 1) * dp + dp_rank) * cp) * tp


class GroupMismatch(RuntimeError):
    pass


def check_groups_agree(grid) -> dict[str, list[int]]:
    """Assert megatron-core's TP/DP/PP groups equal DeepSpeed's grid groups on this rank. Returns the groups.
    DeepSpeed's data axis is megatron's data-parallel group with context parallel (dp x cp: gradients and ZeRO
    shards span both); megatron's CP group must sit inside it, next to the TP ranks (tp-cp-dp-pp)."""
    from megatron.core import parallel_state as ps  # heavy: as deepspeed above

    ours = {
        "tp": dist.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group(with_context_parallel=True)),
        "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
    }
    cp_ranks = dist.get_process_group_ranks(ps.get_context_parallel_group())
    topo = grid._topo
    rank = dist.get_rank()
    theirs = {
        "tp": _axis_group(topo, "model", rank),
        "dp": _axis_group(topo, "data", rank),
        "pp": _axis_group(topo, "pipe", rank),
    }
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    ranks_ok = (
        ps.get_tensor_model_parallel_rank() == grid.get_slice_parallel_rank()
        and ps.get_pipeline_model_parallel_rank() == grid.get_stage_id()
        and ps.get_data_parallel_rank(with_context_parallel=True) == grid.get_data_parallel_rank()
        and ps.get_context_parallel_rank() == context_rank(rank, tp, cp)
        and sorted(cp_ranks) == [rank - context_rank(rank, tp, cp) * tp + i * tp for i in range(cp)]
    )
    if {k: sorted(v) for k, v in ours.items()} != {k: sorted(v) for k, v in theirs.items()} or not ranks_ok:
        raise GroupMismatch(
            f"rank {rank}: megatron-core groups {ours} (cp {cp_ranks}) differ from DeepSpeed's grid {theirs}. Both "
            f"must order ranks tp fastest, then cp, dp, pp (megatron order 'tp-cp-ep-dp-pp', DeepSpeed "
            f"PipeModelDataParallelTopology with a data axis of dp x cp)"
        )
    return ours


def _axis_group(topo, axis: str, rank: int) -> list[int]:
    for group in topo.get_axis_comm_lists(axis):
        if rank in group:
            return list(group)
    return [rank]  # axis of size 1: DeepSpeed lists no groups
