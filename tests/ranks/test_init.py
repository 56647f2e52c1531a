"""Random initialisation depends only on the seed: the same weights at every (tp, pp), no two blocks alike, and
exactly `random_hf_state(model, seed)`; and bf16 runs reduce gradients over DP in fp32.

One 4-rank run (tests/ranks/init_worker.py) builds the model at tp/pp (1,1) (2,1) (1,2) (1,4) (2,2).
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import RANKS, model_config
from threed.convert.in_memory import random_hf_state
from threed.convert.mapping import layer_to_hf
from threed.model.spec import pipeline_layers

LAYOUTS = [(1, 1), (2, 1), (1, 2), (1, 4), (2, 2)]


@pytest.fixture(scope="module")
def out(tmp_path_factory, rank_pool):
    d = tmp_path_factory.mktemp("init")
    rank_pool.run(4, str(RANKS / "init_worker.py"), ["--out", str(d)], timeout=900)
    return d


def exported(out, tp: int, pp: int) -> dict[str, torch.Tensor]:
    """HF state dict of the model built at (tp, pp), from every rank's local layers (what `threed export` does)."""
    mc = model_config("gqa31")
    shards: dict[int, list[dict]] = {}
    for t in range(tp):
        for s in range(pp):
            for idx, state in torch.load(out / f"init_tp{tp}_pp{pp}_t{t}_s{s}.pt").items():
                shards.setdefault(idx, [None] * tp)[t] = state
    hf: dict[str, torch.Tensor] = {}
    for layer in pipeline_layers(mc):
        hf.update(layer_to_hf(mc, layer, shards[layer.index]))
    return hf


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_random_init_is_the_same_at_every_layout(out, tp, pp):
    want = random_hf_state(model_config("gqa31"), seed=4321)
    got = exported(out, tp, pp)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name} differs at tp={tp} pp={pp}"


def test_no_two_blocks_are_equal(out):
    hf = exported(out, 1, 4)
    mc = model_config("gqa31")
    for suffix in ("self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"):
        blocks = [hf[f"model.layers.{i}.{suffix}"] for i in range(mc.num_layers)]
        for i in range(len(blocks)):
            for j in range(i + 1, len(blocks)):
                assert not torch.equal(blocks[i], blocks[j]), f"blocks {i} and {j}: {suffix} equal"
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(gate, up)


def test_init_distribution_follows_megatron(out):
    mc = model_config("gqa31")
    hf = exported(out, 2, 2)
    assert hf["model.embed_tokens.weight"].std().item() == pytest.approx(mc.init_std, rel=0.05)
    out_std = mc.init_std / (2 * mc.num_layers) ** 0.5  # Megatron's scaled init of the output projections
    assert hf["model.layers.0.mlp.down_proj.weight"].std().item() == pytest.approx(out_std, rel=0.05)
    assert torch.equal(hf["model.norm.weight"], torch.ones(mc.hidden_size))


def test_bf16_gradients_are_reduced_in_fp32(out):
    norms = json.loads((out / "grad_norms.json").read_text())
    print("grad norms", norms)
    rel = abs(norms["fp32_dp2_gas1"] - norms["fp32_dp1_gas2"]) / norms["fp32_dp1_gas2"]
    rel_bf16 = abs(norms["bf16_dp2_gas1"] - norms["bf16_dp1_gas2"]) / norms["bf16_dp1_gas2"]
    off = abs(norms["bf16_dp2_gas1"] - norms["fp32_dp2_gas1"]) / norms["fp32_dp2_gas1"]
    print(
        f"dp2 x gas1 vs dp1 x gas2: relative grad-norm difference {rel:.2e} (fp32 reduce), "
        f"{rel_bf16:.2e} (bf16 reduce); bf16 reduce vs fp32 reduce: {off:.2e}"
    )
    assert rel <= 1e-6
    # DeepSpeed's default casts the fp32 accumulated gradients to bf16 even for a group of one: the norm moves
    # by ~1e-5 relative. Proves the fp32 setting is what reaches the engine.
    assert off > 1e-6


def test_cuda_only_switches_stay_off_on_cpu(out):
    """The CPU run is the GPU code path minus the switches of `threed.parallel.distributed.cuda_only`; megatron's gloo
    copies of its data-parallel groups are made on neither (`init_megatron_parallel_state`)."""
    got = json.loads((out / "cpu_switches.json").read_text())
    assert got == {"fused_adamw": False, "fused_swiglu": False, "device": "cpu", "megatron_gloo_groups": False}


def test_device_policy_refuses_cuda_without_a_gpu(monkeypatch):
    from threed.parallel.distributed import DeviceError, cuda_only, device_and_backend  # cuda_only: re-exported

    monkeypatch.setenv("THREED_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="DEVICE=cuda.*no GPU is usable.*DEVICE=cpu"):
        device_and_backend()
    monkeypatch.setenv("THREED_DEVICE", "gpu")
    with pytest.raises(DeviceError, match="auto, cpu or cuda"):
        device_and_backend()
    monkeypatch.setenv("THREED_DEVICE", "auto")
    assert device_and_backend() == (torch.device("cpu"), "gloo")
    on_cpu, on_gpu = cuda_only(torch.device("cpu")), cuda_only(torch.device("cuda", 0))
    assert not (on_cpu.fused_adamw or on_cpu.fused_swiglu or on_cpu.pinned_batches)
    assert on_gpu.fused_adamw and on_gpu.fused_swiglu and on_gpu.pinned_batches


def test_device_policy_refuses_more_ranks_than_gpus(monkeypatch):
    from threed.parallel.distributed import DeviceError, device_and_backend

    monkeypatch.setenv("THREED_DEVICE", "auto")
    monkeypatch.setenv("LOCAL_RANK", "4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(DeviceError, match="local rank 4 has no GPU: this node shows 4 GPUs"):
        device_and_backend()
