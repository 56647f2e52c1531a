"""HF -> threed -> HF is bit-identical for tp in {1,2,4,8} x pp in {1,2,4} (GQA, padded vocab, every source
format), resharding keeps every tensor, and the checkpoint layout is what DeepSpeed loads.

    .venv/bin/python -m pytest -q tests/unit/test_convert_roundtrip.py
"""

from __future__ import annotations

import json

import pytest
import torch

from convert_fixtures import DIVISIBLE_BY, GQA8, assert_identical, hf_tensors, save_hf
from threed.cli.main import main
from threed.checkpoint.format import open_checkpoint, read_model_config
from threed.convert.ds_checkpoint import checkpoint_files

# (source format, shard size KB, dtype): sharded safetensors + index, single file, old .bin shards + index, ...
SOURCES = {
    "st-sharded": ("safetensors", 60, torch.float32),
    "st-single": ("safetensors", 0, torch.bfloat16),
    "bin-sharded": ("bin", 60, torch.float32),
    "bin-single": ("bin", 0, torch.bfloat16),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: save_hf(root / name, GQA8, fmt, kb, dtype=dtype) for name, (fmt, kb, dtype) in SOURCES.items()}


def run(*argv: str) -> int:
    return main([*argv, "--quiet"])


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_hf_roundtrip_bit_identical(sources, tmp_path, tp, pp):
    name = list(SOURCES)[(tp.bit_length() + pp) % len(SOURCES)]  # every format at several layouts
    src = sources[name]
    ck, back = tmp_path / "ck", tmp_path / "back"
    assert (
        run(
            "convert",
            "--hf",
            str(src),
            "--tp",
            str(tp),
            "--pp",
            str(pp),
            "--out",
            str(ck),
            "--make-vocab-size-divisible-by",
            DIVISIBLE_BY,
        )
        == 0
    )
    # The layout DeepSpeed reads: latest -> tag, one file per (layer, TP rank), one mp_rank file per stage x TP.
    assert (ck / "latest").read_text() == "global_step0"
    assert sorted(p.name for p in (ck / "global_step0").iterdir()) == sorted(
        checkpoint_files(read_model_config(ck), tp, pp)
    )
    mp = torch.load(ck / "global_step0" / "mp_rank_00_model_states.pt", weights_only=False)
    assert mp["module"] is None and mp["mp_world_size"] == tp * pp and mp["dp_world_size"] == 1
    manifest = json.loads((ck / "threed_convert.json").read_text())
    assert (manifest["tp"], manifest["pp"], manifest["vocab_size"]) == (tp, pp, 200)
    assert manifest["padded_vocab_size"] == -(-200 // (16 * tp)) * 16 * tp > 200
    emb = torch.load(ck / "global_step0" / "layer_00-model_00-model_states.pt", weights_only=True)
    assert emb["word_embeddings.weight"].shape[0] == manifest["padded_vocab_size"] // tp
    # Each TP file holds only its own shard (a view would make torch.save write the whole tensor).
    qkv = torch.load(ck / "global_step0" / "layer_01-model_00-model_states.pt", weights_only=True)
    t = qkv["self_attention.linear_qkv.weight"]
    assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert run("export", "--ckpt", str(ck), "--out", str(back)) == 0
    assert_identical(hf_tensors(src), hf_tensors(back))
    assert (
        json.loads((back / "model.safetensors.index.json").read_text())["weight_map"].keys() == hf_tensors(src).keys()
    )


def test_reshard_chain_bit_identical(sources, tmp_path):
    src = sources["st-sharded"]
    a, b, c, back = (tmp_path / n for n in ("tp2pp2", "tp4pp1", "tp1pp2", "back"))
    assert (
        run(
            "convert",
            "--hf",
            str(src),
            "--tp",
            "2",
            "--pp",
            "2",
            "--out",
            str(a),
            "--make-vocab-size-divisible-by",
            DIVISIBLE_BY,
        )
        == 0
    )
    assert run("reshard", "--ckpt", str(a), "--tp", "4", "--pp", "1", "--out", str(b)) == 0
    assert run("reshard", "--ckpt", str(b), "--tp", "1", "--pp", "2", "--out", str(c)) == 0
    assert (open_checkpoint(c).tp, open_checkpoint(c).pp) == (1, 2)
    # Every layer file equals a direct conversion at that layout (not just the HF round trip).
    direct = tmp_path / "direct"
    assert (
        run(
            "convert",
            "--hf",
            str(src),
            "--tp",
            "1",
            "--pp",
            "2",
            "--out",
            str(direct),
            "--make-vocab-size-divisible-by",
            DIVISIBLE_BY,
        )
        == 0
    )
    for f in sorted((direct / "global_step0").glob("layer_*")):
        x, y = (torch.load(d / "global_step0" / f.name, weights_only=True) for d in (direct, c))
        assert x.keys() == y.keys() and all(x[k] is None and y[k] is None or torch.equal(x[k], y[k]) for k in x)
    assert run("export", "--ckpt", str(c), "--out", str(back)) == 0
    assert_identical(hf_tensors(src), hf_tensors(back))
    # HF side files travel along: config of the source, generation config.
    assert (back / "generation_config.json").is_file()


def test_dtype_cast_and_writer_processes(sources, tmp_path):
    src = sources["st-sharded"]
    one, two = tmp_path / "w1", tmp_path / "w2"
    for out, workers in ((one, "1"), (two, "2")):
        assert (
            run(
                "convert",
                "--hf",
                str(src),
                "--tp",
                "2",
                "--pp",
                "1",
                "--out",
                str(out),
                "--dtype",
                "bf16",
                "--workers",
                workers,
            )
            == 0
        )
    for f in sorted((one / "global_step0").glob("layer_*")):
        x, y = (torch.load(d / "global_step0" / f.name, weights_only=True) for d in (one, two))
        assert all(x[k] is None or (x[k].dtype == torch.bfloat16 and torch.equal(x[k], y[k])) for k in x)
    back = tmp_path / "back"
    assert run("export", "--ckpt", str(one), "--out", str(back), "--dtype", "fp32", "--max-shard-size", "50KB") == 0
    ref = {k: v.to(torch.bfloat16).float() for k, v in hf_tensors(src).items()}
    assert_identical(ref, hf_tensors(back))
    assert len(list(back.glob("model-*.safetensors"))) > 3
    assert json.loads((back / "config.json").read_text())["dtype"] == "float32"


def test_export_loads_in_transformers(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    src = sources["bin-sharded"]
    ck, back = tmp_path / "ck", tmp_path / "back"
    assert run("convert", "--hf", str(src), "--tp", "4", "--pp", "2", "--out", str(ck)) == 0
    assert run("export", "--ckpt", str(ck), "--out", str(back), "--max-shard-size", "100KB") == 0
    tokens = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src).eval()(tokens).logits
        got = AutoModelForCausalLM.from_pretrained(back).eval()(tokens).logits
    assert torch.equal(ref, got)
