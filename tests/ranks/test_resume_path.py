"""The GPU-scale resume path, checked on CPU (issue 19): the universal conversion runs outside any collective (the
other ranks wait on the store with their own timeout), with several workers, and a conversion cut short is redone;
optimizer state lands on its parameters' device after a load; --dist-timeout-minutes reaches every process group;
DeepSpeed's accelerator follows the device policy; a run's log starts with our lines, not the libraries'.

The 2-rank runs (tests/ranks/ckpt_worker.py, fp32) take about a minute each on 2 cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch

from helpers import SRC, START_UP_NOISE
from test_checkpoint_faults import losses, worker


# ----------------------------------------------------------------------------------------- no ranks: fast


def test_conversion_workers_are_bounded_by_cpus_shards_and_memory():
    from threed.checkpoint.universal import MAX_EXTRACT_WORKERS, conversion_workers

    assert conversion_workers(1, 64, 10, None) == (1, 1)
    assert conversion_workers(96, 4, 10, None) == (4, 2)  # no more workers than shard files
    assert conversion_workers(96, 256, 10, None) == (MAX_EXTRACT_WORKERS, 8)
    gib = 1 << 30
    assert conversion_workers(96, 256, 26 * gib, 160 * gib) == (3, 1)  # 26 GiB shards, 160 GiB free: 3 at a time
    assert conversion_workers(96, 256, 26 * gib, 10 * gib) == (1, 1)  # never fewer than one


def test_partial_conversion_is_cleaned(tmp_path):
    from threed.checkpoint.universal import DONE, clean_partial

    out = tmp_path / "universal" / "global_step2-from-tp1pp2dp1fp32"
    tmp = out.parent / f".{out.name}.tmp-12345"  # what a killed conversion leaves (threed.atomic's temp name)
    (tmp / "zero").mkdir(parents=True)
    out.mkdir()  # a directory without its DONE file is not a conversion
    other = out.parent / "global_step4-from-tp1pp2dp1fp32"
    other.mkdir()
    (other / DONE).write_text("{}")
    assert sorted(clean_partial(out)) == sorted([tmp.name, out.name])
    assert not tmp.exists() and not out.exists() and other.exists()
    (out / "x").mkdir(parents=True)
    (out / DONE).write_text("{}")
    assert clean_partial(out) == [] and out.exists()  # a finished conversion is kept (reused)


def test_waiting_ranks_wait_on_the_store_not_in_a_collective(monkeypatch):
    """rank 1 waits longer than any collective would (its store wait has its own timeout); rank 0's ConfigError
    reaches it. Two threads share a HashStore as two ranks share torchrun's store."""
    import torch.distributed as dist

    import threed.checkpoint.start as start
    from threed.errors import ConfigError

    store = dist.HashStore()
    monkeypatch.setattr(start, "is_multi_rank", lambda: True)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    calls = start._patient_calls[0]

    def slow_ok():
        time.sleep(1.0)

    results = {}

    def rank1():
        t0 = time.time()
        try:
            start._patient_calls[0] = calls  # each "rank" counts its own calls, as each process does
            start.on_rank0_patiently(1, lambda: pytest.fail("rank 1 must not run fn"), timeout=timedelta(seconds=30))
            results["rank1"] = ("ok", time.time() - t0)
        except Exception as e:  # pragma: no cover - reported below
            results["rank1"] = ("raised", repr(e))

    t = threading.Thread(target=rank1)
    t.start()
    time.sleep(0.2)
    start._patient_calls[0] = calls
    start.on_rank0_patiently(0, slow_ok)
    t.join(10)
    assert results["rank1"][0] == "ok" and results["rank1"][1] >= 0.7, results

    # rank 0's refusal is every rank's
    def rank1_error():
        start._patient_calls[0] = calls + 1
        try:
            start.on_rank0_patiently(1, lambda: None, timeout=timedelta(seconds=30))
        except ConfigError as e:
            results["error"] = str(e)

    t = threading.Thread(target=rank1_error)
    t.start()
    start._patient_calls[0] = calls + 1

    def refuse():
        raise ConfigError("no room for the conversion")

    with pytest.raises(ConfigError):
        start.on_rank0_patiently(0, refuse)
    t.join(10)
    assert results["error"] == "no room for the conversion"


def _adamw_state(fused_flag: bool):
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones_like(p)
    opt.step()
    opt.param_groups[0]["fused"] = fused_flag  # as a fused=True group reads (CUDA only, so flagged by hand here)
    return p, opt


def test_optimizer_state_placement_is_a_no_op_on_cpu():
    from threed.engine.optimizer import place_optimizer_state

    for fused in (False, True):
        p, opt = _adamw_state(fused)
        before = {k: v for k, v in opt.state[p].items()}
        assert place_optimizer_state(opt) == 0
        assert all(opt.state[p][k] is v for k, v in before.items())
        assert all(v.device == p.device for v in opt.state[p].values())


def test_optimizer_state_moves_to_the_parameters_device():
    """What a universal load leaves on a GPU run (state and `step` on the CPU, parameters elsewhere), with the meta
    device standing in for CUDA: every state tensor follows its parameter; `step` does in a fused group only."""
    from threed.engine.optimizer import place_optimizer_state

    class Wrapper:  # DeepSpeed's BF16_Optimizer / ZeRO optimizer keep the torch one as .optimizer
        def __init__(self, optimizer):
            self.optimizer = optimizer

    for fused in (True, False):
        p, opt = _adamw_state(fused)
        state = opt.state.pop(p)
        meta = torch.nn.Parameter(p.detach().to("meta"))
        opt.param_groups[0]["params"] = [meta]
        opt.state[meta] = state
        moved = place_optimizer_state(Wrapper(opt))
        s = opt.state[meta]
        assert s["exp_avg"].device.type == "meta" and s["exp_avg_sq"].device.type == "meta"
        assert s["step"].device.type == ("meta" if fused else "cpu") and s["step"].dtype == torch.float32
        assert moved == (3 if fused else 2)


def test_dist_timeout_reaches_every_process_group(tmp_path):
    """A world of one in its own process: the world group, DeepSpeed's groups (torch.distributed.new_group
    without a timeout, as deepspeed.comm makes them), a PipelineModule's and megatron-core's all take
    --dist-timeout-minutes (7), where torch's default is 30 min for gloo and megatron's 30."""
    script = r"""
import json, sys
import torch, torch.distributed as dist
from threed.parallel.distributed import init_distributed, init_megatron_parallel_state
rt = init_distributed(7.0)
import deepspeed
init_megatron_parallel_state(1, 1)
deepspeed.comm.new_group([0])
timeouts = {}
for pg in list(dist.distributed_c10d._world.pg_map):
    backend = pg._get_backend(torch.device("cpu"))
    timeouts[dist.distributed_c10d._world.pg_names[pg]] = backend.options._timeout.total_seconds()
from deepspeed.accelerator import get_accelerator
print(json.dumps({"timeouts": timeouts, "accelerator": get_accelerator().device_name()}))
"""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ACCELERATOR")
    }
    env.update(PYTHONPATH=str(SRC), OMP_NUM_THREADS="1", THREED_DEVICE="cpu")
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(got["timeouts"]) >= 5, got  # world, megatron's tp/pp/dp/... groups, DeepSpeed's
    assert set(got["timeouts"].values()) == {420.0}, got
    assert got["accelerator"] == "cpu"
    noise = [
        line
        for line in p.stdout.splitlines() + p.stderr.splitlines()
        if "Setting accelerator" in line or "Transformer Engine and Apex" in line
    ]
    assert not noise, noise


# ---------------------------------------------------------------------------------------------- 2 ranks


@pytest.fixture(scope="module")
def saved_at_pp2(tmp_path_factory):
    """2 ranks, tp1 pp2 dp1, a checkpoint at step 2, losses of steps 1-4."""
    root = tmp_path_factory.mktemp("resume_path")
    p = worker(
        2,
        root / "out",
        "--save",
        str(root / "save"),
        "--pp",
        "2",
        "--steps",
        "4",
        "--save-interval",
        "2",
        "--global-batch",
        "4",
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    return {"root": root, "stdout": p.stdout, "losses": losses(root / "out")}


def test_a_two_rank_run_prints_no_library_start_up_noise(saved_at_pp2):
    out = saved_at_pp2["stdout"]
    noise = [line for line in out.splitlines() if any(n in line for n in START_UP_NOISE)]
    assert not noise, "\n".join(noise)
    assert "Traceback" not in out


def test_a_conversion_cut_short_is_redone_while_the_other_rank_waits(saved_at_pp2, tmp_path):
    """Resume the pp2 run at dp2 on 2 ranks: rank 0 converts (rank 1 waits on the store), after deleting what a
    killed conversion left; the loss curve continues."""
    import shutil

    save, out = tmp_path / "save", tmp_path / "out"
    shutil.copytree(saved_at_pp2["root"] / "save", save)
    shutil.rmtree(save / "global_step4")
    (save / "latest").write_text("global_step2")
    name = "global_step2-from-tp1pp2dp1fp32"
    (save / "universal" / f".{name}.tmp-999999" / "zero").mkdir(parents=True)  # a killed conversion's leftovers
    (save / "universal" / name).mkdir()  # no DONE file
    p = worker(
        2,
        out,
        "--save",
        str(save),
        "--pp",
        "1",
        "--steps",
        "4",
        "--save-interval",
        "2",
        "--global-batch",
        "4",
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-4000:]
    assert "deleted what a conversion cut short left" in p.stdout and f".{name}.tmp-999999" in p.stdout
    assert f"to a universal checkpoint in {save}/universal/{name}" in p.stdout
    got, want = losses(out), saved_at_pp2["losses"]
    for step in (3, 4):
        assert abs(got[step] - want[step]) <= 1e-5 * abs(want[step]), (got, want)
    assert (save / "latest").read_text() == "global_step4"
    assert not [d for d in (save / "universal").iterdir()]
