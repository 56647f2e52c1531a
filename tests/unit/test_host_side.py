"""The host-side pieces of a step, one process (issue 35, part 1; tests/ranks/test_host_sync.py runs them in a
pipeline):
- `threed.data.loader.on_device` moves a step's micro-batches in one copy per tensor position, each micro-batch a
  view of it, values unchanged, so DeepSpeed's `.to(device)` of each is a no-op (on the meta device: a real move
  off the host without a GPU);
- `threed.train.host_gc.StepCollector` keeps Python's collector off during the loop, frees cycles at step
  boundaries, reports what it freed, and restores the collector on the way out.
"""

from __future__ import annotations

import gc

import pytest
import torch

import threed.train.host_gc as host_gc
from threed.config import RunConfig
from threed.engine.resolved import resolve
from threed.model.presets import PRESETS
from threed.data.loader import collate, on_device
from threed.parallel.device_policy import cuda_only


def micro_batch(seed: int, doc_ids: bool = False, datasets: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(2):
        s = {
            "tokens": torch.randint(0, 50, (8,), generator=gen),
            "labels": torch.randint(0, 50, (8,), generator=gen),
            "loss_mask": (torch.rand(8, generator=gen) > 0.3).float(),
            "dataset_id": int(torch.randint(0, max(datasets, 1), (1,), generator=gen)),
        }
        if doc_ids:
            s["doc_ids"] = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
        samples.append(s)
    return collate(samples, 64, datasets)


def leaves(tree) -> list[torch.Tensor]:
    return [tree] if isinstance(tree, torch.Tensor) else [t for part in tree for t in leaves(part)]


@pytest.mark.parametrize("kind", ["train", "packed", "eval"])
def test_on_device_keeps_every_value_and_structure(kind):
    step = [micro_batch(i, doc_ids=kind == "packed", datasets=3 if kind == "eval" else 0) for i in range(4)]
    moved = on_device(step, torch.device("cpu"), pin=False)
    assert len(moved) == 4
    for before, after in zip(step, moved):
        assert [type(p) for p in after] == [type(p) for p in before]
        for a, b in zip(leaves(before), leaves(after)):
            assert b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(a, b)


def test_on_device_moves_the_step_once_and_deepspeeds_copy_is_a_no_op():
    step = [micro_batch(i, doc_ids=True) for i in range(3)]
    meta = torch.device("meta")
    moved = on_device(step, meta, pin=False)
    bases = [{id(leaves(b)[k]._base) for b in moved} for k in range(len(leaves(step[0])))]
    assert all(len(b) == 1 for b in bases)  # one buffer per tensor position: one copy of the step
    assert len({next(iter(b)) for b in bases}) == len(bases)
    for b in moved:
        for t in leaves(b):
            assert t.device == meta
            assert t.to(meta) is t  # what DeepSpeed's _exec_load_micro_batch does: nothing left to copy


def test_pinning_is_cuda_only():
    assert cuda_only("cuda").pinned_batches and cuda_only("cuda").pinned_saves
    assert not cuda_only("cpu").pinned_batches and not cuda_only("cpu").pinned_saves


class Metrics:
    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log(self, step: int, values: dict, line: bool = True) -> None:
        self.logged.append((step, values))


def cycle(payload: object) -> None:
    a: dict = {"payload": payload}
    a["self"] = a  # unreachable once this returns: only the cyclic collector frees it


def test_step_collector_runs_the_collector_at_step_boundaries_only():
    was = gc.isenabled()
    metrics = Metrics()
    with host_gc.StepCollector(torch.device("cpu"), log_interval=2) as collector:
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0
        for _ in range(1000):
            cycle(None)
        assert collector.after_step(1, metrics) is None
        assert metrics.logged == []
        collector.after_step(2, metrics)
    assert gc.isenabled() == was
    assert gc.get_freeze_count() == 0
    [(step, values)] = metrics.logged
    assert step == 2
    assert values["gc-objects"] >= 1000  # the cycles of step 1, freed at its boundary
    assert set(values) == {"gc-seconds", "gc-objects", "gc-freed-host-bytes", "gc-freed-bytes"}


def test_step_collector_says_when_a_collection_frees_a_lot(monkeypatch):
    monkeypatch.setattr(host_gc, "LOUD_BYTES", 32 << 20)
    with host_gc.StepCollector(torch.device("cpu"), log_interval=10) as collector:
        cycle(torch.ones(64 << 20, dtype=torch.uint8))  # 64 MiB held only by a cycle
        line = collector.after_step(3, Metrics())
    assert line is not None and line.startswith("python gc after step 3:")


def test_deepspeeds_throughput_timer_never_synchronizes():
    """Its start() in every micro-batch's forward pass would synchronize the device (DeepSpeed's default)."""
    from deepspeed.utils.config import get_timers_config  # deepspeed: heavy, only this test reads its config

    timer = get_timers_config(resolve(RunConfig(model=PRESETS["tiny"]), 1).ds_config)
    assert not timer.enabled and not timer.synchronized
