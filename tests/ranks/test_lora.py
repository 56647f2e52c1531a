"""LoRA on the 3D engine against HF + PEFT in one process (issue 38's parity check): a tiny HF Llama with a PEFT adapter
whose A and B are both random (B = 0 would hide a wrong B path), brought in with --lora-init-from, trained 5 fp32
steps at tp2 pp2 dp1 with sequence parallelism (tests/ranks/lora_worker.py); the same steps in one process with PEFT
(tests/reference.py). Losses and gradient norms within 1e-5 relative at every step, the trained adapters within
1e-5, and only the adapters in DeepSpeed's optimizer. The run's checkpoint after step 2, resumed at tp1 pp2 and tp2
pp1 (slow) through DeepSpeed's universal checkpoint, continues its losses and ends at its adapters."""

from __future__ import annotations

import copy
import json
import re

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from helpers import RANKS, hf_model, model_config, write_dataset
from reference import GLOBAL_BATCH, PARITY, gpt_reference
from threed.checkpoint.format import ADAPTERS_ONLY, RUN_JSON, CheckpointLayout
from threed.checkpoint.lora_base import LORA_BASE, identity
from threed.checkpoint.manifest import Found, read_manifest
from threed.checkpoint.start import StartDecision
from threed.checkpoint.universal import check_convertible
from threed.convert.from_hf import convert_hf_checkpoint
from threed.config import LORA_TARGETS, ConfigError, LoraConfig, ParallelConfig, RunConfig, TrainConfig
from threed.engine.lora import check_lora_start
from threed.convert.lora import PEFT_MODULES, full_shapes, gather_adapters, shard, split_dims, target_slices
from threed.model.spec import (
    adapter_universal_patterns,
    is_adapter_key,
    is_adapter_pattern,
    parameter_count,
    pipeline_layers,
    stored_layers,
)
from tied_worker import tied_hf_model, tied_model_config

FP32_TOL = 1e-5
RANK, ALPHA, STEPS = 4, 8.0, 5  # lora_worker's


def peft_start(folder, base=None):
    """The tiny HF Llama (or `base`) with an adapter on every target, A and B drawn at random, saved as an HF PEFT
    folder."""
    import peft  # the optional extra; installed in the test environment

    model = peft.get_peft_model(
        hf_model("gqa31") if base is None else base,
        peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=list(PEFT_MODULES.values())),
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(str(folder))
    return model


def run_parity(out, rank_pool) -> dict:
    rng = np.random.default_rng(0)
    data = write_dataset(out / "random", rng.integers(0, 200, 5000), 200)
    model = peft_start(out / "peft")
    hf_model("gqa31").save_pretrained(str(out / "hf"))  # the base the run starts from, at another layout (tp1 pp1)
    convert_hf_checkpoint(out / "hf", out / "base", 1, 1, make_vocab_size_divisible_by=16, show_progress=False)
    argv = ["parity", "--out", str(out), "--data", data, "--peft", str(out / "peft"), "--base", str(out / "base")]
    rank_pool.run(4, str(RANKS / "lora_worker.py"), argv, timeout=900)
    train = TrainConfig(**PARITY, micro_batch_size=2, global_batch_size=GLOBAL_BATCH, seq_length=32, steps=STEPS)
    exact = copy.deepcopy(model).double()  # before the fp32 reference trains `model`
    start = torch.load(out / "start_logits.pt")
    with torch.no_grad():
        peft_logits = model(start["tokens"]).logits
    ref = gpt_reference(model, model_config("gqa31"), train, data)
    ranks = [json.loads((out / f"lora_rank{r}.json").read_text()) for r in range(4)]
    shards = [torch.load(out / f"adapters_rank{r}.pt") for r in range(4)]
    ref64 = gpt_reference(exact, model_config("gqa31"), train, data)
    return {
        "out": out,
        "data": data,
        "ranks": ranks,
        "ref": ref,
        "ref64": ref64,
        "shards": shards,
        "model": model,
        "exact": exact,
        "logits": (start["logits"], peft_logits),
        "start_adapters": load_file(str(out / "peft" / "adapter_model.safetensors")),
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory, rank_pool):
    return run_parity(tmp_path_factory.mktemp("lora"), rank_pool)


def trained_adapters(run) -> dict[str, torch.Tensor]:
    """The 3D run's adapters as PEFT tensors: each block's TP shards put together (threed.convert.lora)."""
    return put_together(run["shards"])


def put_together(shards: list[dict]) -> dict[str, torch.Tensor]:
    """PEFT tensors from every rank's lora_worker.save_adapters file (a block's TP shards, once per dp rank)."""
    mc, lora = model_config("gqa31"), LoraConfig(lora_rank=RANK, lora_alpha=ALPHA)
    out = {}
    for layer in (ly for ly in pipeline_layers(mc) if ly.kind == "block"):
        held = {s["tp_rank"]: s["blocks"][layer.block] for s in shards if layer.block in s["blocks"]}
        out.update(gather_adapters(mc, layer, lora, [held[r] for r in sorted(held)]))
    return out


def test_lora_3d_training_matches_hf_peft(run):
    """Losses at every step. The gradient norm of the first step (no update yet) against HF + PEFT in fp64: a norm
    of adapter gradients is sensitive to rounding, the fp32 reference's own first norm is 1e-5 from fp64's (3D's:
    1.5e-6), and after a few Adam steps fp32 runs depart from fp64 by ~1e-3 in it (the losses by ~1e-7)."""
    ref_losses, ref_norms = run["ref"]
    got = run["ranks"][0]
    print("3D losses", got["losses"], "\nref losses", ref_losses)
    print("3D norms", got["grad_norms"], "\nfp64 norms", run["ref64"][1])
    assert max(ref_norms) > PARITY["grad_clip"], "clipping must be active in this test"
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert abs(a - b) <= FP32_TOL * abs(b), f"step {step + 1}: loss {a} vs HF + PEFT {b}"
    first, exact = got["grad_norms"][0], run["ref64"][1][0]
    assert abs(first - exact) <= FP32_TOL * exact, f"step 1: grad norm {first} vs HF + PEFT in fp64 {exact}"


def test_imported_adapter_gives_peft_logits(run):
    """--lora-init-from of the PEFT folder, at tp2 pp2 with sequence parallelism: the logits of HF + PEFT."""
    ours, theirs = run["logits"]
    assert (ours - theirs).abs().max() <= FP32_TOL * theirs.abs().max()


def worst(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_trained_adapters_equal_hf_peft(run):
    """After 5 Adam steps the fp32 reference's own adapters are 7e-5 from fp64's (an element whose gradient is
    near zero moves by a rounding-sized m / sqrt(v)): the 3D run's must be at least as close to fp64's."""
    import peft

    got = trained_adapters(run)
    ref32, ref64 = (peft.get_peft_model_state_dict(run[k]) for k in ("model", "exact"))
    assert set(got) == set(ref32) and len(got) == 4 * len(LORA_TARGETS) * 2
    moved = worst(run["start_adapters"], ref64)
    assert moved > 1e-3, "the adapters must have trained"
    print("3D vs fp64", worst(got, ref64), "fp32 vs fp64", worst(ref32, ref64))
    assert worst(got, ref64) <= max(worst(ref32, ref64), FP32_TOL)


def test_only_adapters_train(run):
    for rank in run["ranks"]:
        assert rank["adapter_elements"] > 0
        assert rank["optimizer_elements"] == rank["adapter_elements"]
        assert rank["base_with_grad"] == [] and rank["adapters_without_grad"] == []


@pytest.mark.slow  # 8 engines of 4 ranks, one step each (~40 s)
def test_recompute_gives_every_adapter_its_gradient(run, rank_pool):
    """Full recompute (DeepSpeed's reentrant checkpoint of every block) at pp2 and pp1: every adapter of every rank,
    stage 0's included (its input comes from the frozen embedding), gets its gradient, equal to the run without."""
    out = run["out"]
    argv = ["recompute", "--out", str(out), "--data", run["data"], "--peft", str(out / "peft")]
    rank_pool.run(4, str(RANKS / "lora_worker.py"), argv, timeout=900)
    for rank in range(4):
        grads = torch.load(out / f"recompute_rank{rank}.pt")
        for pp in (2, 1):
            plain, again = grads[f"pp{pp}_plain"], grads[f"pp{pp}_recompute"]
            blocks = 4 // pp
            assert len(plain) == len(again) == blocks * len(LORA_TARGETS) * 2, (rank, pp, sorted(again))
            for name, g in plain.items():
                assert g.abs().max() > 0, (rank, pp, name)
                assert (again[name] - g).abs().max() <= 1e-6 * g.abs().max(), (rank, pp, name)


@pytest.mark.slow  # three more 4-rank runs and a reference (~90 s)
def test_tied_model_lora_matches_hf_peft_and_bf16_trains(run, rank_pool):
    """Llama 3.2's tied embedding, frozen, at tp1 pp2 dp2 (each of the two stages holds a copy): HF + PEFT's losses in
    fp32; in bf16 (DeepSpeed's BF16_Optimizer) the same run and the untied tp2 pp2 SP one stay within 5% of fp32."""
    out = run["out"] / "tied"
    out.mkdir()
    model = peft_start(out / "peft", base=tied_hf_model())
    argv = ["tied", "--out", str(out), "--data", run["data"], "--peft", str(out / "peft")]
    argv += ["--untied-peft", str(run["out"] / "peft")]
    rank_pool.run(4, str(RANKS / "lora_worker.py"), argv, timeout=900)
    train = TrainConfig(**PARITY, micro_batch_size=2, global_batch_size=GLOBAL_BATCH, seq_length=32, steps=STEPS)
    ref_losses, _ = gpt_reference(model, tied_model_config(), train, run["data"])
    for rank in range(4):
        got = json.loads((out / f"tied_rank{rank}.json").read_text())
        # ZeRO-1 over dp 2: each rank's optimizer holds half of its stage's adapters, and nothing else.
        assert 2 * got["fp32"]["optimizer_elements"] == got["fp32"]["adapter_elements"] > 0
        for step, (a, b) in enumerate(zip(got["fp32"]["losses"], ref_losses)):
            assert abs(a - b) <= FP32_TOL * abs(b), f"rank {rank} step {step + 1}: loss {a} vs HF + PEFT {b}"
        for name, fp32 in (("bf16", got["fp32"]["losses"]), ("untied_bf16", run["ranks"][0]["losses"])):
            assert got[name]["optimizer"] == "BF16_Optimizer"
            for a, b in zip(got[name]["losses"], fp32):
                assert abs(a - b) <= 0.05 * b, (name, got[name]["losses"], fp32)


def test_adapter_shards_are_even_ranges_of_their_split_dim():
    """What a LoRA run's universal checkpoint tells DeepSpeed (threed.convert.lora.split_dims): each adapter's TP
    shards, concatenated in rank order on its dim, are the PEFT tensor (a column base's B too: whole KV groups, the
    gate / up halves), and only a row-parallel base's A is named, on dim 1 (DeepSpeed's default is dim 0)."""
    mc, lora = model_config("gqa31"), LoraConfig(lora_rank=RANK, lora_alpha=ALPHA)
    block = next(ly for ly in pipeline_layers(mc) if ly.kind == "block")
    full = {name: torch.randn(shape) for name, shape in full_shapes(mc, block, lora).items()}
    dims, tp = dict(split_dims(mc, lora)), 2
    ranks = [target_slices(mc, block, lora, tp, r) for r in range(tp)]
    for i, t in enumerate(ranks[0]):
        for which in ("A", "B"):
            specs = [getattr(held[i], which.lower()) for held in ranks]
            cat = torch.cat([shard(full, spec) for spec in specs], dim=dims[t.key(which)])
            assert torch.equal(cat, full[specs[0].source]), t.key(which)
    rows = adapter_universal_patterns(split_dims(mc, lora))["PARAMETER_WITH_ROW_PARALLELISM_PATTERNS"]
    named = [
        n
        for n in ("3.self_attention.linear_proj.lora.A.o", "2.mlp.linear_fc2.lora.A.down")
        if any(re.match(p, n) for p in rows)
    ]
    assert len(rows) == 2 and len(named) == 2 and all(is_adapter_pattern(p) for p in rows)
    assert not any(re.match(p, "3.self_attention.linear_proj.lora.B.o") for p in rows)


@pytest.mark.parametrize("layout", ["1x2", pytest.param("2x1", marks=pytest.mark.slow)])  # ~5 s each
def test_universal_resume_at_another_layout_continues_the_lora_run(run, rank_pool, layout):
    """The parity run's adapter-only checkpoint after step 2 (tp2 pp2 dp1) resumed at tp1 pp2 dp2 (and, slow, tp2 pp1
    dp2) through DeepSpeed's universal checkpoint (the adapters' fp32 master and Adam moments; the frozen base from
    the tp1 pp1 base the checkpoint names): steps 3 to 5 give the uninterrupted run's losses, and its trained
    adapters, within 1e-5."""
    out = run["out"]
    argv = ["universal", "--out", str(out), "--data", run["data"], "--peft", str(out / "peft")]
    rank_pool.run(4, str(RANKS / "lora_worker.py"), [*argv, "--layouts", layout], timeout=900)
    want, whole = run["ranks"][0]["losses"], trained_adapters(run)
    for rank in range(4):
        got = json.loads((out / f"universal_rank{rank}.json").read_text())[layout]
        assert got["start"] == 2 and got["universal"] and got["client_state"] == {"consumed_samples": 16}
        print(layout, "resumed", got["losses"], "\nuninterrupted", want[2:])
        for step, (a, b) in enumerate(zip(got["losses"], want[2:]), start=3):
            assert abs(a - b) <= FP32_TOL * abs(b), f"{layout} rank {rank} step {step}: {a} vs {b}"
        assert len(got["losses"]) == STEPS - 2
    adapters = put_together([torch.load(out / f"universal_{layout}_rank{r}.pt") for r in range(4)])
    assert set(adapters) == set(whole) and worst(whole, run["start_adapters"]) > 1e-3
    assert worst(adapters, whole) <= FP32_TOL, (layout, worst(adapters, whole))


def test_what_a_lora_universal_resume_cannot_do_is_one_line(tmp_path):
    """A LoRA checkpoint whose universal patterns name the frozen base (saved before they named its adapters: the
    conversion would fail on patterns that match nothing), and a universal LoRA resume with --vpp > 1 on either side
    (untested), are refused in one line; a checkpoint naming only adapters converts."""
    step = tmp_path / "global_step2"
    step.mkdir()
    (tmp_path / RUN_JSON).write_text(json.dumps({"lora": {"lora_rank": RANK}, "parallel": {"vpp": 2}}))
    found = Found(str(tmp_path), step.name, 2, CheckpointLayout(step.name, 2, 4, 4), True)
    old = [r"\d+\.input_layernorm\.weight$", r"\d+\.self_attention\.linear_proj\.weight$"]
    for patterns, refused in ((old, True), (adapter_universal_patterns([("mlp.linear_fc2.lora.A.down", 1)]), False)):
        rows = patterns if isinstance(patterns, list) else patterns["PARAMETER_WITH_ROW_PARALLELISM_PATTERNS"]
        info = {"universal_checkpoint_version": 0.2, "parameter_with_row_parallelism_patterns": rows}
        torch.save({"universal_checkpoint_info": info}, step / "mp_rank_00_model_states.pt")
        if refused:
            with pytest.raises(ConfigError, match="LoRA run's checkpoint saved by an older threed") as e:
                check_convertible(found)
            assert "\n" not in str(e.value)
        else:
            check_convertible(found)
    lora = LoraConfig(lora_rank=RANK, lora_alpha=ALPHA)
    for vpp in (1, 2):  # the checkpoint's vpp is 2 (its threed_run.json); this run's either
        cfg = RunConfig(model=model_config("gqa31"), parallel=ParallelConfig(vpp=vpp), lora=lora)
        with pytest.raises(ConfigError, match=r"with --vpp > 1 \(this run's or the checkpoint's\) is not supported"):
            check_lora_start(cfg, StartDecision(mode="resume", source=found, universal=True))
    check_lora_start(cfg, StartDecision(mode="resume", source=found, universal=False))  # its own layout: natively


def tensors_of(path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in torch.load(path, map_location="cpu", weights_only=False).items() if torch.is_tensor(v)}


def elements(state) -> int:
    """Elements of every tensor (not scalars: Adam's step) anywhere in a loaded checkpoint file."""
    if torch.is_tensor(state):
        return state.numel() if state.dim() else 0
    if isinstance(state, dict):
        return sum(elements(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(elements(v) for v in state)
    return 0


def test_the_checkpoint_holds_only_the_adapters(run):
    """The parity run's checkpoint (a LoRA run from a base) is adapter-only: its manifest names the base and says so,
    its layer files hold the adapters' elements and nothing else (not a byte of the frozen base), its optimizer
    shards 12 B per adapter element (fp32 master, Adam's two moments), and --async-save writes the same tensors."""
    out = run["out"]
    step = out / "save" / "global_step2"
    manifest = read_manifest(step)
    assert manifest[ADAPTERS_ONLY] is True and manifest[LORA_BASE] == identity(out / "base")
    adapters = sum(r["adapter_elements"] for r in run["ranks"])  # dp1: each rank's stage shards, once
    layers = {f.name: tensors_of(f) for f in sorted(step.glob("layer_*-model_states.pt"))}
    assert len(layers) == 2 * len(stored_layers(model_config("gqa31")))  # a file per layer and TP rank, as before
    assert all(is_adapter_key(k) for sd in layers.values() for k in sd)
    held = sum(t.numel() for sd in layers.values() for t in sd.values())
    nbytes = sum(t.numel() * t.element_size() for sd in layers.values() for t in sd.values())
    assert held == adapters and nbytes == 4 * adapters, (held, adapters)
    base = parameter_count(model_config("gqa31"), 2)
    assert adapters < base / 10  # the frozen base, which the files no longer hold, is 11x their size here
    optimizer = sum(elements(torch.load(f, map_location="cpu", weights_only=False)) for f in step.glob("*optim_st*"))
    assert optimizer == 3 * adapters, (optimizer, adapters)
    async_step = out / "async_save" / "global_step2"
    assert read_manifest(async_step)[ADAPTERS_ONLY] is True
    for name, sd in layers.items():
        copied = tensors_of(async_step / name)
        assert copied.keys() == sd.keys() and all(torch.equal(copied[k], sd[k]) for k in sd), name


def test_a_native_resume_of_the_adapter_only_checkpoint_is_exact(run, rank_pool):
    """The adapter-only checkpoint resumed at its own layout (tp2 pp2 dp1: natively, the base read from the tp1 pp1
    base it names, the adapters and their Adam state from the checkpoint): steps 3 to 5 give the uninterrupted
    run's losses and adapters bit for bit."""
    out = run["out"]
    argv = ["universal", "--out", str(out), "--data", run["data"], "--peft", str(out / "peft")]
    rank_pool.run(4, str(RANKS / "lora_worker.py"), [*argv, "--layouts", "2x2"], timeout=900)
    for rank in range(4):
        got = json.loads((out / f"universal_rank{rank}.json").read_text())["2x2"]
        assert got["start"] == 2 and not got["universal"] and got["client_state"] == {"consumed_samples": 16}
        assert got["losses"] == run["ranks"][0]["losses"][2:], (got["losses"], run["ranks"][0]["losses"])
    adapters = put_together([torch.load(out / f"universal_2x2_rank{r}.pt") for r in range(4)])
    whole = trained_adapters(run)
    assert set(adapters) == set(whole) and all(torch.equal(adapters[k], whole[k]) for k in whole)
