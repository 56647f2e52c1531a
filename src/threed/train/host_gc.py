"""Python's cyclic garbage collector, run at step boundaries only (Megatron-LM's --manual-gc, torchtitan's gc_freq).

CPython's automatic collector starts whenever allocations outnumber deallocations by 700, and now and then scans
every object of the process (torch, DeepSpeed, megatron-core and the model's modules: hundreds of thousands). A step
issues thousands of kernel launches from Python, so such a scan lands inside a micro-batch, on one rank at a time,
and the whole pipeline waits for that rank. While the training loop runs (`StepCollector` as a context manager):
- the collector is off;
- what exists once the engine is built is frozen (`gc.freeze`): it lives for the run, so no collection scans it;
- every step boundary runs one collection of what the steps left, at the same point on every rank, and reads the
  memory around it (the host's resident set, and `mem-allocated-bytes`' reading: CUDA's allocated bytes on CUDA),
  so a step that leaves cycles holding memory shows in the metrics (`gc-*` every log interval) and, past
  `LOUD_BYTES`, in a line.
On the way out (the last step, a stop, an exception) the frozen objects are handed back and the collector is
restored as it was: a process that trains twice (the tests' rank pool) frees the first run's engine as before.
Collections only free unreachable objects, so losses and gradients are bit-identical with and without this.
"""

from __future__ import annotations

import gc
import time
from typing import Any, Optional

import torch

from threed.metrics.stages import memory_bytes, resident_bytes

LOUD_BYTES = 1 << 30  # a collection that frees this much (host or device) is said in a line


class StepCollector:
    """The collector of one training loop: `with StepCollector(device, interval) as gc_:` around the steps, and
    `gc_.after_step(step, metrics)` after each."""

    def __init__(self, device: torch.device, log_interval: int):
        self.device = device
        self.log_interval = max(1, log_interval)
        self._was_enabled = True
        self._window = self._empty_window()

    @staticmethod
    def _empty_window() -> dict[str, float]:
        return {"gc-seconds": 0.0, "gc-objects": 0.0, "gc-freed-host-bytes": 0.0, "gc-freed-bytes": 0.0}

    def __enter__(self) -> "StepCollector":
        self._was_enabled = gc.isenabled()
        gc.collect()  # the building's garbage, before what remains is frozen
        gc.freeze()
        gc.disable()
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()

    def _memory(self) -> tuple[float, float]:
        """(host resident bytes, the device reading of mem-allocated-bytes); no wait for the device."""
        device_now = memory_bytes(self.device)[0]
        host = resident_bytes()
        return (device_now if host is None else host), device_now

    def after_step(self, step: int, metrics: Any) -> Optional[str]:
        """Collect what step `step` (1-based) left. Every log interval the window's figures go to `metrics` (the
        writer rank records them: seconds spent collecting, objects freed, bytes the host's resident set and the
        device's allocation shrank). Returns a line when this collection freed `LOUD_BYTES` or more."""
        before = self._memory()
        t0 = time.perf_counter()
        objects = gc.collect()
        seconds = time.perf_counter() - t0
        after = self._memory()
        freed_host, freed_device = before[0] - after[0], before[1] - after[1]
        w = self._window
        w["gc-seconds"] += seconds
        w["gc-objects"] += objects
        w["gc-freed-host-bytes"] += freed_host
        w["gc-freed-bytes"] += freed_device
        if step % self.log_interval == 0:
            metrics.log(step, dict(w), line=False)
            self._window = self._empty_window()
        if max(freed_host, freed_device) < LOUD_BYTES:
            return None
        return (
            f"python gc after step {step}: {objects} objects, {freed_host / 2**30:.2f} GiB of host memory and "
            f"{freed_device / 2**30:.2f} GiB of mem-allocated freed in {seconds * 1000:.0f} ms: something the step "
            f"made kept memory in a reference cycle"
        )
