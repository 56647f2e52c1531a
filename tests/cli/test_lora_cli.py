"""HF PEFT both ways through the command line: an adapter made with PEFT comes into `threed train --lora-init-from`
(tp2 with sequence parallelism, 2 ranks), one step at lr 0 saves it in threed's checkpoint, `threed export --lora`
writes it back as a PEFT folder: the same tensors, bit for bit, and `peft.PeftModel.from_pretrained` loads it with
the original's logits. The parity of training itself is tests/ranks/test_lora.py's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from helpers import fake_checkpoint, own_world_env, tiny_train, tiny_train_argv
from threed.config import ParallelConfig, RunConfig
from threed.convert.in_memory import random_hf_state
from threed.convert.lora import PEFT_MODULES
from threed.hf.config import to_hf_config
from threed.model.presets import PRESETS
from threed.parallel.launch import torchrun_command


def tiny_base():
    """The HF model of `threed train --model tiny`'s random init (seed 1234, threed's default)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**to_hf_config(PRESETS["tiny"])))
    model.load_state_dict(random_hf_state(PRESETS["tiny"], 1234))
    return model.eval()


@pytest.mark.slow  # 2 ranks of threed train and an export (~90 s); tests/ranks/test_lora.py is make test's LoRA case
def test_peft_adapter_in_and_out_of_a_lora_run(tiny_corpus, tmp_path):
    import peft

    made = peft.get_peft_model(
        tiny_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PEFT_MODULES.values()))
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in made.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)  # B too: B = 0 would hide a wrong B
    made.save_pretrained(str(tmp_path / "peft"))
    lora = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-init-from", str(tmp_path / "peft")]
    flags = ["--tp", "2", "--sequence-parallel", "true", "--steps", "1", "--lr", "0", "--min-lr", "0", *lora]
    cmd = torchrun_command(2, "threed.train", tiny_train_argv(tiny_corpus, tmp_path / "save", *flags)[1:])
    p = subprocess.run(cmd, env=own_world_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]

    out = tmp_path / "exported"
    cmd = [sys.executable, "-m", "threed.cli", "export", "--lora", "--ckpt", str(tmp_path / "save"), "--out", str(out)]
    p = subprocess.run(cmd, env=own_world_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    original, exported = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "peft", out))
    assert exported.keys() == original.keys() and all(torch.equal(exported[k], original[k]) for k in original)

    loaded = peft.PeftModel.from_pretrained(tiny_base(), str(out)).eval()
    tokens = torch.randint(0, 500, (2, 32), generator=gen)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, made.eval()(tokens).logits)


def refused_export(*argv: str) -> str:
    """`threed export ARGV`, which must fail with one error line: that line."""
    cmd = [sys.executable, "-m", "threed.cli", "export", *argv]
    p = subprocess.run(cmd, env=own_world_env(), capture_output=True, text=True, timeout=300)
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert p.returncode != 0 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    return errors[0]


def test_export_lora_of_a_full_run_is_one_line(tmp_path):
    fake_checkpoint(tmp_path / "ck", step=1)
    run = RunConfig(model=PRESETS["tiny"], parallel=ParallelConfig(pp=2))
    (tmp_path / "ck" / "threed_run.json").write_text(json.dumps(run.to_dict()))
    assert "trained no LoRA adapters" in refused_export(
        "--lora", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "o")
    )


def losses(save) -> dict[int, float]:
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm loss"] for r in records if "lm loss" in r}


@pytest.mark.slow  # three runs of threed train (~60 s)
def test_a_lora_run_resumes_exactly(tiny_corpus, tmp_path):
    """A LoRA run stopped after step 1 and resumed by the same command: steps 2 and 3 give the uninterrupted run's
    losses bit for bit (its checkpoint holds the adapters and their Adam state; the frozen base is saved with them)."""
    lora = ("--lora-rank", "4", "--lora-targets", "q", "v", "down", "--lr", "3e-3", "--min-lr", "3e-4")
    p = tiny_train(tiny_corpus, tmp_path / "whole", "--steps", "3", *lora)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    # The same command stopped after its first step (a time budget spent at once: save and exit), then resumed.
    for stop in (("--exit-duration-in-mins", "0.0001"), ()):
        p = tiny_train(tiny_corpus, tmp_path / "halves", "--steps", "3", *lora, *stop)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "resumed from" in p.stdout and "at step 1" in p.stdout
    whole, halves = losses(tmp_path / "whole"), losses(tmp_path / "halves")
    assert len(set(whole.values())) == 3, "the adapters must train"
    assert whole == halves
    # The full export reads only the base weights: refused, never the base silently without its adapters.
    error = refused_export("--ckpt", str(tmp_path / "whole"), "--out", str(tmp_path / "x"))
    assert "is a LoRA run's checkpoint: `threed export` reads only the base weights" in error
    assert not (tmp_path / "x").exists()
    # Nor does a run without --lora-rank start from it (generation and scoring build the same way).
    p = tiny_train(tiny_corpus, tmp_path / "full", "--steps", "1", "--init-from", str(tmp_path / "whole"))
    errors = [line for line in p.stderr.splitlines() if "threed: " in line and "error" in line]
    assert p.returncode != 0 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "is a LoRA run's checkpoint: starting from it without its adapters is not in this build" in errors[0]


def test_an_adapter_of_another_base_is_refused_in_one_line(tiny_corpus, tmp_path):
    """--lora-init-from of an adapter made for a wider MLP: refused before anything is built."""
    import dataclasses

    from threed.config import LoraConfig
    from threed.convert.lora import full_shapes, write_peft
    from threed.model.spec import pipeline_layers

    lora, wider = LoraConfig(lora_rank=4, lora_alpha=8), dataclasses.replace(PRESETS["tiny"], ffn_hidden_size=192)
    tensors = {}
    for layer in (ly for ly in pipeline_layers(wider) if ly.kind == "block"):
        tensors.update({k: torch.zeros(s) for k, s in full_shapes(wider, layer, lora).items()})
    write_peft(tmp_path / "peft", tensors, lora)
    flags = ("--lora-rank", "4", "--lora-alpha", "8", "--lora-init-from", str(tmp_path / "peft"))
    p = tiny_train(tiny_corpus, tmp_path / "save", *flags)
    errors = [line for line in p.stderr.splitlines() if "threed: " in line and "error" in line]
    assert p.returncode != 0 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert (
        "gate_proj.lora_B.weight is (192, 4), this base needs (176, 4): the adapter was made for another" in errors[0]
    )
    assert not (tmp_path / "save" / "latest").exists()
