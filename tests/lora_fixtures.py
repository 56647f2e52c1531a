"""Fixtures for serving LoRA adapters (tests/cli/test_lora_serve.py, tests/ranks/test_lora_serving.py): a tiny HF
Llama with a tokenizer converted to a threed checkpoint (the base), an HF PEFT adapter on it whose A and B are both
random (B = 0 would hide a wrong B path), and a threed LoRA run's checkpoint holding those adapters, as a LoRA run
saves one: the frozen base's layer files with each TP rank's adapter shards beside them, the run's `lora` section
and a manifest naming its base (threed.checkpoint.lora_base).

    root = make_served(tmp, tok_dir)   # root/hf, root/base (tp2 pp1), root/peft, root/lora, root/other (seed 1)
    adapter_only(root / "lora", root / "only", root / "base")   # the same, as an adapter-only checkpoint
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from convert_fixtures import GQA4, hf_model, save_hf
from threed.checkpoint.format import ADAPTERS_ONLY, LATEST, MANIFEST_NAME, RUN_JSON, CONVERT_MANIFEST, open_checkpoint
from threed.checkpoint.lora_base import LORA_BASE, identity
from threed.checkpoint.manifest import write_manifest
from threed.config import LoraConfig
from threed.convert.from_hf import convert_hf_checkpoint
from threed.convert.lora import PEFT_MODULES, shard, target_slices
from threed.model.spec import is_adapter_key

CONFIG = dict(GQA4, vocab_size=320)  # room for the 300-piece test tokenizer
LORA = LoraConfig(lora_rank=4, lora_alpha=8.0)
TP = 2


def peft_model(base=None, seed: int = 7):
    """The base HF model (seed 0, as save_hf writes it) with an adapter on every target, A and B random."""
    import peft  # the optional extra; installed in the test environment

    model = peft.get_peft_model(
        hf_model(CONFIG) if base is None else base,
        peft.LoraConfig(
            r=LORA.lora_rank, lora_alpha=LORA.lora_alpha, lora_dropout=0.0, target_modules=list(PEFT_MODULES.values())
        ),
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def convert(hf: Path, out: Path, tp: int, pp: int) -> Path:
    convert_hf_checkpoint(hf, out, tp, pp, make_vocab_size_divisible_by=16, show_progress=False)
    return out


def lora_checkpoint(base: Path, peft_dir: Path, out: Path) -> Path:
    """A LoRA run's checkpoint of `base`'s weights and `peft_dir`'s adapters at the base's layout: each block's layer
    files with their adapter shards, a `lora` section in its run record, tag global_step1 with (empty) optimizer
    shards and a manifest naming the base, as `threed train --lora-rank` leaves one."""
    shutil.copytree(base, out)
    ck = open_checkpoint(out)
    adapters = load_file(str(peft_dir / "adapter_model.safetensors"))
    for layer in (ly for ly in ck.layers if ly.kind == "block"):
        for rank in range(ck.tp):
            path = ck.layer_path(layer.index, rank)
            state = torch.load(path, weights_only=True)
            for t in target_slices(ck.model, layer, LORA, ck.tp, rank):
                state[t.key("A")], state[t.key("B")] = shard(adapters, t.a), shard(adapters, t.b)
            torch.save(state, path)
    step_dir = (out / ck.tag).rename(out / "global_step1")
    for name in [f.name for f in step_dir.glob("mp_rank_*_model_states.pt")]:
        torch.save({}, step_dir / name.replace("mp_rank_", "zero_pp_rank_0_mp_rank_").replace("model", "optim"))
    (out / CONVERT_MANIFEST).unlink()
    run = json.loads((out / RUN_JSON).read_text())
    (out / RUN_JSON).write_text(json.dumps({**run, "lora": dataclasses.asdict(LORA)}))
    files = {f.name: f.stat().st_size for f in step_dir.iterdir()}
    write_manifest(step_dir, files, {"step": 1, "dtype": "fp32", LORA_BASE: identity(base)})
    (out / LATEST).write_text(step_dir.name)
    return out


def adapter_only(lora: Path, out: Path, base: Path) -> Path:
    """`lora_checkpoint`'s checkpoint as a LoRA run from a base now saves it: its layer files stripped to the adapters
    (DeepSpeed's exclude_frozen_parameters), its manifest saying so and naming `base`."""
    shutil.copytree(lora, out)
    step_dir = out / "global_step1"
    for path in step_dir.glob("layer_*-model_states.pt"):
        state = torch.load(path, weights_only=True)
        torch.save({k: v for k, v in state.items() if is_adapter_key(k)}, path)
    files = {f.name: f.stat().st_size for f in step_dir.iterdir() if f.name != MANIFEST_NAME}
    meta = {"step": 1, "dtype": "fp32", LORA_BASE: identity(base), ADAPTERS_ONLY: True}
    write_manifest(step_dir, files, meta)
    return out


def greedy_rows(model, tok, texts: list[str], max_new: int) -> list[list[int]]:
    """HF's greedy continuation of each prompt alone (`model`: a transformers or PEFT model), stopping at the
    tokenizer's EOS (included)."""
    out = []
    for text in texts:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            seq = model.generate(  # the mask given: HF would infer one from pad_token_id, which these prompts hold
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=tok.eos_token_id,
                pad_token_id=0,
            )
        out.append(seq[0, ids.shape[1] :].tolist())
    return out


def make_served(root: Path, tok_dir: str) -> Path:
    """The base (tp2 pp1), the PEFT adapter, the LoRA checkpoint (whole, and adapter-only) and another base (seed 1),
    under `root`."""
    for name, seed in (("hf", 0), ("hf_other", 1)):
        save_hf(root / name, CONFIG, seed=seed)
        for f in Path(tok_dir).iterdir():  # the HF source's tokenizer files: they travel into the checkpoint
            shutil.copy(f, root / name / f.name)
    convert(root / "hf", root / "base", TP, 1)
    convert(root / "hf_other", root / "other", TP, 1)
    peft_model().save_pretrained(str(root / "peft"))
    lora_checkpoint(root / "base", root / "peft", root / "lora")
    adapter_only(root / "lora", root / "only", root / "base")
    return root
