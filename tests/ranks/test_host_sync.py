"""The host never waits inside a micro-batch (issue 35, part 1), on a real pp 2 run of `threed.train.loop.train`
(2 gloo ranks, bf16 and fp32, with a validation pass; tests/ranks/host_sync_worker.py says how syncs are seen on
CPU):
- no host synchronisation of threed's or DeepSpeed's inside a micro-batch instruction;
- every micro-batch DeepSpeed loads is already on the device, a view of the step's one staged copy;
- staging the step's micro-batches and collecting garbage at step boundaries keep losses, gradient norms and
  validation losses (fp32 and bf16) bit-identical to the path before them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import RANKS, write_dataset
from host_sync_worker import GAS


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("host_sync")
    data = write_dataset(out / "data", np.random.default_rng(3).integers(0, 200, 12_000), 200, seed=3)
    rank_pool.run(2, str(RANKS / "host_sync_worker.py"), ["--out", str(out), "--data", data], timeout=900)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


# DeepSpeed's one sync that threed cannot avoid: a receiving stage learns the dtype and shape of what it receives once
# per engine, on its first receive (PipelineEngine._recv_tensor_meta: three .item() and one .tolist() of the metadata
# it received), then reuses its buffer for every later micro-batch and step.
DEEPSPEED_FIRST_RECEIVE = "deepspeed/runtime/pipe/engine.py:", " _recv_tensor_meta"


def first_receive(where: str) -> bool:
    return where.startswith(DEEPSPEED_FIRST_RECEIVE[0]) and where.endswith(DEEPSPEED_FIRST_RECEIVE[1])


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_no_host_sync_inside_a_micro_batch(ranks, dtype):
    for rank, got in enumerate(ranks):
        syncs = got[dtype]["syncs"]  # (step, instruction, what, where)
        others = [s for s in syncs if not first_receive(s[3])]
        assert others == [], f"rank {rank}: host syncs inside micro-batches"
        assert all(step == 0 and instruction == "RecvActivation" for step, instruction, _, _ in syncs)
        assert len(syncs) == (4 if rank == 1 else 0)  # the last stage receives; its metadata: 3 items, 1 list


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_micro_batches_reach_deepspeed_on_the_device(ranks, dtype):
    for got in ranks:
        run = got[dtype]
        assert len(run["evals"]) == 2  # validation at step 2 and at the last step, 3: one batch each
        assert run["loaded"] == GAS * (3 + 2)
        assert run["staged"] == run["loaded"]
    assert all(r[f"unstaged-{dtype}"]["staged"] == 0 for r in ranks)  # the check tells the paths apart


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_staging_and_step_gc_keep_the_bits(ranks, dtype):
    last = ranks[1]  # the last stage holds the loss
    staged, before = last[dtype], last[f"unstaged-{dtype}"]
    assert len(staged["losses"]) == 3 and len(staged["evals"]) == 2
    assert staged["losses"] == before["losses"]
    assert staged["grad_norms"] == before["grad_norms"]
    assert staged["evals"] == before["evals"]
