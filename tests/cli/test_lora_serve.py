"""A LoRA run's checkpoint served and exported (issue 38's checkpoint and serving part), without ranks: `threed
export --merge` gives HF + PEFT's logits (merge_and_unload, and the unmerged adapter); a LoRA checkpoint names its
base by a fingerprint that is the same at any layout and differs for another base; a resume against another base,
and `threed generate / eval-harness --lora` with a bad pairing, are refused in one line before any engine. The
greedy tokens of base + adapter on the engine are tests/ranks/test_lora_serving.py's.

    .venv/bin/python -m pytest -q tests/cli/test_lora_serve.py
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

from convert_fixtures import hf_model
from helpers import decide, own_world_env, tiny_train
from lora_fixtures import CONFIG, LORA, adapter_only, convert, make_served, peft_model
from threed.checkpoint.format import ADAPTERS_ONLY, open_checkpoint, read_model_config
from threed.checkpoint.manifest import read_manifest
from threed.checkpoint.lora_base import fingerprint, identity
from threed.cli.main import main
from threed.convert.lora import checkpoint_adapters
from threed.config import CheckpointConfig, ParallelConfig, RunConfig, TrainConfig
from threed.errors import ConfigError, ThreedError
from threed.generate.prompts import lora_request
from threed.model.spec import is_adapter_key
from threed.model.presets import PRESETS


@pytest.fixture(scope="module")
def served(tmp_path_factory, tok_dirs):
    return make_served(tmp_path_factory.mktemp("lora_serve"), tok_dirs["plain"])


def test_merged_export_gives_hf_peft_logits(served):
    """`threed export --merge`: W + alpha/r B A for q, k, v (fused in the base), o, gate, up (fused) and down, read
    from tp2 shards; transformers loads it, with the logits of PEFT's merge_and_unload and of the unmerged adapter."""
    from transformers import LlamaForCausalLM

    assert main(["export", "--merge", "--ckpt", str(served / "lora"), "--out", str(served / "merged"), "--quiet"]) == 0
    merged = LlamaForCausalLM.from_pretrained(str(served / "merged"), dtype=torch.float32).eval()
    adapter = peft_model()
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours, unmerged, plain = merged(tokens).logits, adapter(tokens).logits, hf_model(CONFIG)(tokens).logits
        theirs = adapter.merge_and_unload()(tokens).logits
    scale = theirs.abs().max()
    assert (unmerged - plain).abs().max() > 1e-2 * scale, "the adapter must change the logits"
    assert (ours - theirs).abs().max() <= 1e-5 * scale
    # A merge rounds W + delta in fp32: PEFT's own merged model is ~6e-6 (relative) from its unmerged one here.
    assert (ours - unmerged).abs().max() <= 3e-5 * scale


def test_export_merge_of_a_full_checkpoint_is_one_line(served, capsys):
    assert main(["export", "--merge", "--ckpt", str(served / "base"), "--out", str(served / "x"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its run trained no LoRA adapters" in err[0] and "--merge needs" in err[0], err
    assert not (served / "x").exists()


def test_fingerprint_names_the_base_at_any_layout(served):
    """The LoRA checkpoint's own frozen base (adapters left out) and a tp1 pp2 conversion of the same HF model
    have the base's fingerprint; another random init has another."""
    base = identity(served / "base")
    assert base["tag"] == "global_step0" and len(base["fingerprint"]) == 64
    assert fingerprint(open_checkpoint(served / "lora")) == base["fingerprint"]
    assert identity(convert(served / "hf", served / "base_tp1_pp2", 1, 2))["fingerprint"] == base["fingerprint"]
    assert identity(served / "other")["fingerprint"] != base["fingerprint"]


def resume_config(served, init_from, load: str = "lora", lora=LORA) -> RunConfig:
    return RunConfig(
        model=read_model_config(served / "base"),
        parallel=ParallelConfig(tp=2),
        train=TrainConfig(micro_batch_size=1, seq_length=32, steps=4),
        checkpoint=CheckpointConfig(load=str(served / load), init_from=init_from),
        lora=lora,
    )


def test_a_resume_against_another_base_is_refused(served):
    """--load LORA_RUN --init-from OTHER: one line naming both fingerprints; the base itself (or none) resumes, and
    the decision carries the base on to the next save's manifest."""
    with pytest.raises(ConfigError, match=r"other is not the base the LoRA adapters of .*lora/global_step1 were"):
        decide(resume_config(served, str(served / "other")), 2)
    for init_from in (str(served / "base"), None):
        decision = decide(resume_config(served, init_from), 2)
        assert decision.mode == "resume" and decision.lora_base == identity(served / "base")


def test_weights_from_a_lora_checkpoint_name_its_base(served):
    """A LoRA run started from a LoRA checkpoint's weights names the base that one names, not the checkpoint."""
    cfg = dataclasses.replace(resume_config(served, None), checkpoint=CheckpointConfig(init_from=str(served / "lora")))
    assert decide(cfg, 2).lora_base == identity(served / "base")


REFUSALS = [
    (["--lora", "{root}/peft"], r"peft is an HF PEFT folder: give the base it was trained on with --load BASE"),
    (["--lora", "{root}/lora", "--load", "{root}/other"], r"other is not the base the LoRA adapters of .*lora were"),
    (["--lora", "{root}/hf"], r"hf: neither a threed LoRA run's checkpoint .* nor an HF PEFT folder"),
    (["--load", "{root}/lora"], r"lora is a LoRA run's checkpoint: pass --lora .*lora to run it with its adapters"),
    (["--lora", "{root}/base"], r"base is the checkpoint of a run without LoRA adapters; pass it as --load"),
    (["--lora", "{root}/wider", "--load", "{root}/base"], r"is \(192, 4\), this base needs \(176, 4\)"),
    (["--lora", "{root}/rslora", "--load", "{root}/base"], r"rslora: use_rslora in its adapter_config.json is not sup"),
]


@pytest.fixture(scope="module")
def odd_adapters(served):
    """Adapters threed must not run: one made for a wider MLP (ffn 192, the base's is 176), one with rsLoRA's scale."""
    from transformers import LlamaConfig, LlamaForCausalLM

    peft_model(LlamaForCausalLM(LlamaConfig(**{**CONFIG, "intermediate_size": 192}))).save_pretrained(
        str(served / "wider")
    )
    shutil.copytree(served / "peft", served / "rslora")
    config = json.loads((served / "rslora" / "adapter_config.json").read_text())
    (served / "rslora" / "adapter_config.json").write_text(json.dumps({**config, "use_rslora": True}))
    return served


@pytest.mark.parametrize("flags,line", REFUSALS)
def test_generate_lora_bad_input_is_one_line_before_any_engine(odd_adapters, capsys, flags, line):
    served = odd_adapters
    argv = ["generate", "--prompt", "x", "--max-new-tokens", "4", "--nproc-per-node", "2"]
    assert main(argv + [f.format(root=served) for f in flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("threed generate: "), err
    assert re.search(line, err[0]), err[0]
    assert not torch.distributed.is_initialized()  # refused before any process group or engine


def test_eval_harness_lora_bad_input_is_one_line(served, capsys):
    argv = ["eval-harness", "--tasks", "arc_easy", "--lora", str(served / "peft")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is an HF PEFT folder: give the base it was trained on with --load BASE" in err[0], err


def test_each_save_names_the_base_the_engine_was_given():
    """threed.engine.lora puts the decision's base on the module; every save's manifest says it (LoRA runs only)."""
    from types import SimpleNamespace

    from threed.checkpoint.lora_base import LORA_BASE, MODULE_ATTR
    from threed.checkpoint.save import describe

    base = {"path": "b", "tag": "global_step0", "fingerprint": "f" * 64}
    module = torch.nn.Module()
    setattr(module, MODULE_ATTR, base)
    engine = SimpleNamespace(global_steps=3, module=module)
    cfg = RunConfig(model=PRESETS["tiny"], lora=LORA)
    assert describe(engine, cfg, None)[LORA_BASE] == base
    assert LORA_BASE not in describe(
        engine, dataclasses.replace(cfg, lora=dataclasses.replace(LORA, lora_rank=0)), None
    )


@pytest.mark.slow  # four runs of threed train and a generate (~100 s)
def test_a_lora_run_names_its_base_and_refuses_another(tiny_corpus, tok_dirs, tmp_path):
    """`threed train --lora-rank --init-from BASE`: its manifest names BASE, its layer files hold only the adapters;
    resumed with --init-from OTHER it is refused in one line; `threed generate --lora RUN` runs it (on BASE), and with
    `--load OTHER` is refused."""
    for name, seed in (("base", "1"), ("other", "2")):
        p = tiny_train(tiny_corpus, tmp_path / name, "--steps", "1", "--seed", seed)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lora = ("--lora-rank", "4", "--steps", "3", "--exit-duration-in-mins", "0.0001")
    p = tiny_train(tiny_corpus, tmp_path / "run", "--init-from", str(tmp_path / "base"), *lora)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    manifest = read_manifest(tmp_path / "run" / "global_step1")
    assert manifest["lora_base"] == identity(tmp_path / "base", "global_step1") and manifest[ADAPTERS_ONLY]
    run = open_checkpoint(tmp_path / "run")
    assert all(is_adapter_key(k) for layer in run.layers for sd in run.load_layer(layer) for k in sd)
    p = tiny_train(tiny_corpus, tmp_path / "run", "--init-from", str(tmp_path / "other"), *lora)
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert p.returncode != 0 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "other is not the base the LoRA adapters of" in errors[0]
    argv = ["generate", "--lora", str(tmp_path / "run"), "--prompt", "hello", "--max-new-tokens", "3"]
    argv += ["--tokenizer", tok_dirs["plain"]]
    p = subprocess.run([sys.executable, "-m", "threed.cli", *argv], env=own_world_env(), capture_output=True, text=True)
    assert p.returncode == 0 and len(json.loads(p.stdout.splitlines()[-1])["tokens"]) == 3, p.stderr[-3000:]
    assert main([*argv, "--load", str(tmp_path / "other")]) == 2


def safetensors_of(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_an_adapter_only_checkpoint_reads_as_the_whole_one(served):
    """The adapter-only form of the LoRA checkpoint (layer files holding the adapters alone, the base named): its
    files hold no base tensor; `threed export --lora` and `--merge` (the base read from the one it names) write what
    they write from the whole checkpoint, bit for bit."""
    only = open_checkpoint(served / "only")
    assert only.adapters_only and not open_checkpoint(served / "lora").adapters_only
    assert all(is_adapter_key(k) for layer in only.layers for sd in only.load_layer(layer) for k in sd)
    assert (
        main(["export", "--lora", "--ckpt", str(served / "only"), "--out", str(served / "only_peft"), "--quiet"]) == 0
    )
    exported = safetensors_of(served / "only_peft")  # what the whole checkpoint's export writes: its adapters
    whole = checkpoint_adapters(open_checkpoint(served / "lora"), LORA)
    assert exported.keys() == whole.keys() and all(torch.equal(exported[k], whole[k]) for k in whole)
    outs = [served / f"merged_{name}" for name in ("lora", "only")]
    for name, out in zip(("lora", "only"), outs):
        assert main(["export", "--merge", "--ckpt", str(served / name), "--out", str(out), "--quiet"]) == 0
    whole, merged = (safetensors_of(out) for out in outs)
    assert whole.keys() == merged.keys() and all(torch.equal(whole[k], merged[k]) for k in whole)


def one_line(call) -> str:
    with pytest.raises(ConfigError) as e:
        call()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_an_adapter_only_resume_reads_the_base_it_names_or_says_why_not(served, tmp_path):
    """A resume of the adapter-only checkpoint reads the base its manifest names (fingerprint checked on rank 0,
    before any build); a base gone or changed is one line naming it and the fix, a base that moved is given with
    --init-from; other adapters than it holds, or --init-from of it, one line each. `threed generate --lora ONLY`
    runs on the named base (one line when it is gone)."""
    decision = decide(resume_config(served, None, "only"), 2)
    assert decision.adapters_only and decision.lora_base == identity(served / "base")
    moved = shutil.copytree(served / "base", tmp_path / "base")
    adapter_only(served / "lora", tmp_path / "only", moved)
    shutil.rmtree(moved)
    cfg = resume_config(served, None, str(tmp_path / "only"))
    line = one_line(lambda: decide(cfg, 2))
    assert f"only/global_step1 holds only LoRA adapters, and its base {moved} (global_step0, fingerprint" in line
    assert "put the base back there, or give where it is now with --init-from BASE" in line
    given = decide(resume_config(served, str(served / "base"), str(tmp_path / "only")), 2)
    assert given.adapters_only and given.lora_base == identity(served / "base")
    with pytest.raises(ThreedError, match=f"holds only LoRA adapters, and its base {moved} .* put the base back at"):
        lora_request(None, str(tmp_path / "only"))
    assert lora_request(None, str(served / "only"))[0] == str(served / "base")
    shutil.copytree(served / "other", moved)  # another model's weights where the base was
    assert f"{moved} is not the base the LoRA adapters of" in one_line(lambda: decide(cfg, 2))
    other = dataclasses.replace(LORA, lora_targets=("q", "v"))
    line = one_line(lambda: decide(resume_config(served, None, "only", other), 2))
    assert "with other LoRA adapters than it holds (--lora-targets" in line
    weights = dataclasses.replace(cfg, checkpoint=CheckpointConfig(init_from=str(served / "only")))
    assert "holds only LoRA adapters (its base is elsewhere); export them" in one_line(lambda: decide(weights, 2))
