"""Llama 3.2's tied embeddings through the converters: a tied HF Llama (no lm_head.weight in its files) converts
to a checkpoint of its stored layers only (no LM head file) at any tp / pp, gives HF's logits (DeepSpeed's own
load, at an even and an uneven pipeline), exports back tied and bit-identical, reshards; a trained tied run
exports tied too; and every disagreement about the tie is one line before anything is written or built. The ranks
of `threed verify` and of the trained run are the session's rank pool's (tests/ranks/conftest.py `verify_in_pool`).

    PYTHONPATH=$PWD/src .venv/bin/python -m pytest -q tests/ranks/test_tied_convert.py
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import decide
from convert_fixtures import TIED, TIED_DIVISIBLE_BY, assert_identical, hf_tensors, save_hf, save_tied_hf, write_tokens
from threed.checkpoint.format import (
    CheckpointError,
    checkpoint_bytes,
    layout_of_files,
    missing_files,
    open_checkpoint,
    read_model_config,
)
from threed.checkpoint.manifest import find_resumable
from threed.cli.main import main
from threed.config import CheckpointConfig, ConfigError, ParallelConfig, RunConfig, TrainConfig
from threed.convert.ds_checkpoint import checkpoint_files
from threed.hf.config import from_hf_config
from threed.model.spec import pipeline_layers
from threed.model.presets import PRESETS

REL_TOL = 1e-5
UNTIED = {k: v for k, v in TIED.items() if k != "tie_word_embeddings"}  # save_hf unties it


def head_files(step_dir: Path) -> list[Path]:
    """Files of the LM head's layer index (a tied checkpoint has none)."""
    head = pipeline_layers(read_model_config(step_dir.parent))[-1]
    assert head.kind == "lm_head" and not head.stored
    return list(step_dir.glob(f"layer_{head.index:02d}-model_*"))


def run(*argv: str) -> int:
    return main([*argv, "--quiet"])


def convert(src: Path, out: Path, tp: int, pp: int) -> Path:
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
            str(out),
            "--make-vocab-size-divisible-by",
            TIED_DIVISIBLE_BY,
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def tied_hf(tmp_path_factory) -> Path:
    src = save_tied_hf(tmp_path_factory.mktemp("hf") / "tied", shard_kb=200)  # sharded, with an index
    assert "lm_head.weight" not in hf_tensors(src)  # transformers saves the tied weight once
    return src


@pytest.fixture(scope="module")
def tied_ckpt(tied_hf, tmp_path_factory) -> Path:
    return convert(tied_hf, tmp_path_factory.mktemp("ck") / "tp2pp2", 2, 2)


def single_file_copy(src: Path, dest: Path) -> Path:
    """The tied model as one model.safetensors (easy to edit), same tensors."""
    dest.mkdir()
    shutil.copy(src / "config.json", dest / "config.json")
    save_file(hf_tensors(src), dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def verify_rel(capsys) -> float:
    line = [ly for ly in capsys.readouterr().out.splitlines() if ly.startswith("threed verify:")][-1]
    print(line)
    return float(re.search(r"max rel (\S+)", line).group(1))


def test_convert_writes_the_stored_layers_only(tied_ckpt):
    cfg = read_model_config(tied_ckpt)
    assert cfg.tie_word_embeddings
    assert sorted(p.name for p in (tied_ckpt / "global_step0").iterdir()) == sorted(checkpoint_files(cfg, 2, 2))
    assert not head_files(tied_ckpt / "global_step0")
    manifest = json.loads((tied_ckpt / "threed_convert.json").read_text())
    assert manifest["num_pipeline_layers"] == 8 and manifest["stored_layers"] == list(range(7))
    assert manifest["tie_word_embeddings"] is True
    ck = open_checkpoint(tied_ckpt)
    assert (ck.tp, ck.pp, [ly.index for ly in ck.layers]) == (2, 2, list(range(7)))
    emb = torch.load(tied_ckpt / "global_step0" / "layer_00-model_01-model_states.pt", weights_only=True)
    assert emb["word_embeddings.weight"].shape == (256, 64)  # vocab 500 padded to 512, half per TP rank


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 3)])  # (1, 3): 8 pipeline layers over 3 stages, uneven
def test_verify_logits_parity(tied_hf, tied_ckpt, tmp_path, capsys, tp, pp, verify_in_pool):
    ck = tied_ckpt if (tp, pp) == (2, 2) else convert(tied_hf, tmp_path / "ck", tp, pp)
    assert main(["verify", "--hf", str(tied_hf), "--ckpt", str(ck), "--tol", str(REL_TOL)]) == 0
    assert verify_rel(capsys) <= REL_TOL


def assert_tied_hf_dir(out: Path, src: Path) -> None:
    """HF's from_pretrained loads `out` tied, with no missing or unexpected keys, holding src's tensors."""
    from transformers import AutoModelForCausalLM

    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    got = hf_tensors(out)
    assert "lm_head.weight" not in got
    assert "lm_head.weight" not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert_identical(hf_tensors(src), got)
    model, info = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_export_round_trip(tied_hf, tied_ckpt, tmp_path):
    out = tmp_path / "exported"
    assert run("export", "--ckpt", str(tied_ckpt), "--out", str(out)) == 0
    assert_tied_hf_dir(out, tied_hf)


def test_reshard_then_export(tied_hf, tied_ckpt, tmp_path):
    resharded, out = tmp_path / "tp1pp3", tmp_path / "exported"
    assert run("reshard", "--ckpt", str(tied_ckpt), "--tp", "1", "--pp", "3", "--out", str(resharded)) == 0
    assert sorted(p.name for p in (resharded / "global_step0").iterdir()) == sorted(
        checkpoint_files(read_model_config(resharded), 1, 3)
    )
    assert json.loads((resharded / "threed_convert.json").read_text())["stored_layers"] == list(range(7))
    assert run("export", "--ckpt", str(resharded), "--out", str(out)) == 0
    assert_tied_hf_dir(out, tied_hf)


def test_tied_checkpoint_complete_without_head_file_incomplete_without_layer_00(tied_ckpt, tmp_path):
    names = [p.name for p in (tied_ckpt / "global_step0").iterdir()]
    assert missing_files(layout_of_files("global_step0", names), names) is None
    assert find_resumable(str(tied_ckpt))[0] is not None
    broken = tmp_path / "broken"
    shutil.copytree(tied_ckpt, broken)
    (broken / "global_step0" / "layer_00-model_01-model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"each of the 7 stored layers .*tied to the embedding.*layer 0"):
        open_checkpoint(broken)
    (broken / "global_step0" / "layer_00-model_00-model_states.pt").unlink()
    found, warnings = find_resumable(str(broken))
    assert found is None and "layer_00-model_00-model_states.pt is missing" in " ".join(warnings)


def assert_refused(rc: int, capsys, message: str, out: Path) -> str:
    err = capsys.readouterr().err
    lines = [ly for ly in err.splitlines() if ly.strip()]
    assert rc == 2 and len(lines) == 1 and message in lines[0], err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return lines[0]


def test_source_lm_head_equal_accepted_different_refused(tied_hf, tied_ckpt, tmp_path, capsys):
    src = single_file_copy(tied_hf, tmp_path / "with_head")
    sd = load_file(src / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    same = convert(src, tmp_path / "same", 2, 2)  # accepted: the very same files as without lm_head.weight
    for f in sorted((tied_ckpt / "global_step0").glob("layer_*")):
        x, y = (torch.load(d / "global_step0" / f.name, weights_only=True) for d in (tied_ckpt, same))
        assert x.keys() == y.keys() and all(x[k] is None and y[k] is None or torch.equal(x[k], y[k]) for k in x)

    sd["lm_head.weight"][123, 7] += 1e-3
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    rc = main(["convert", "--hf", str(src), "--tp", "2", "--pp", "2", "--out", str(out), "--quiet"])
    assert_refused(
        rc,
        capsys,
        "lm_head.weight differs from model.embed_tokens.weight although config.json says tie_word_embeddings=true",
        out,
    )


def test_untied_config_over_tied_files_refused(tied_hf, tmp_path, capsys):
    src = single_file_copy(tied_hf, tmp_path / "untied_config")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    out = tmp_path / "out"
    rc = main(["convert", "--hf", str(src), "--tp", "1", "--pp", "1", "--out", str(out), "--quiet"])
    line = assert_refused(rc, capsys, "has no lm_head.weight and its config.json says tie_word_embeddings=false", out)
    assert "set tie_word_embeddings: true" in line


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> tuple[Path, Path]:
    """The same shape untied: its HF directory and its conversion at tp=2, pp=2."""
    root = tmp_path_factory.mktemp("untied")
    src = save_hf(root / "hf", UNTIED)
    return src, convert(src, root / "ck", 2, 2)


def test_init_from_across_the_tie_refused(tied_hf, tied_ckpt, untied, tmp_path, capsys, own_process_group):
    untied_hf, untied_ckpt = untied
    for model_dir, ckpt, tied_side in ((untied_hf, tied_ckpt, "checkpoint"), (tied_hf, untied_ckpt, "this run")):
        cfg = RunConfig(
            model=from_hf_config(model_dir),
            parallel=ParallelConfig(tp=2, pp=2),
            checkpoint=CheckpointConfig(init_from=str(ckpt)),
        )
        with pytest.raises(
            ConfigError,
            match=rf"^{tied_side}.* ties the LM head to the embedding "
            rf"\(tie_word_embeddings=true\), .*pass --model {re.escape(str(ckpt))}",
        ):
            decide(cfg, 4)
    # The command line: one line, exit 2, before the model is built.
    os.environ["RANK"] = "0"
    data = write_tokens(tmp_path / "tokens", 20_000, 500)
    rc = main(
        [
            "train",
            "--model",
            str(untied_hf),
            "--init-from",
            str(tied_ckpt),
            "--data-path",
            data,
            "--seq-length",
            "32",
            "--steps",
            "2",
        ]
    )
    err = capsys.readouterr().err
    lines = [ly for ly in err.splitlines() if ly.strip()]
    assert rc == 2 and len(lines) == 1 and "tie_word_embeddings=true" in lines[0] and "--model" in lines[0], err


def test_verify_across_the_tie_refused(tied_ckpt, untied, capsys):
    rc = main(["verify", "--hf", str(untied[0]), "--ckpt", str(tied_ckpt)])
    err = capsys.readouterr().err
    assert rc == 2 and "says tie_word_embeddings=false, the model in" in err and "tie_word_embeddings=true" in err


def test_trained_tied_checkpoint_exports_tied(tmp_path, capsys, rank_pool, verify_in_pool):
    run_dir, out = tmp_path / "run", tmp_path / "exported"
    data = write_tokens(tmp_path / "tokens", 20_000, 512)
    rank_pool.run_ranks(
        2,
        "threed.train",
        [
            "--model",
            "tiny-tied",
            "--tp",
            "1",
            "--pp",
            "2",
            "--micro-batch-size",
            "2",
            "--grad-accum-steps",
            "2",
            "--seq-length",
            "32",
            "--steps",
            "2",
            "--lr",
            "1e-2",
            "--data-path",
            data,
            "--eval-iters",
            "1",
            "--save",
            str(run_dir),
        ],
        timeout=600,
    )
    step_dir = run_dir / (run_dir / "latest").read_text().strip()
    assert (step_dir / "layer_00-model_00-model_states.pt").is_file() and not head_files(step_dir)
    # The size estimate (--save's free-space check, the dry run) counts the last stage's optimizer state of its copy:
    # [512, 64] x 12 B, 13% of this checkpoint, beyond the few KB of pickling per file.
    on_disk = sum(f.stat().st_size for f in step_dir.iterdir())
    cfg = RunConfig(model=PRESETS["tiny-tied"], parallel=ParallelConfig(tp=1, pp=2), train=TrainConfig(dtype="bf16"))
    estimate = checkpoint_bytes(cfg)
    print("checkpoint on disk", on_disk, "estimate", estimate)
    assert estimate <= on_disk <= estimate * 1.08
    assert run("export", "--ckpt", str(run_dir), "--out", str(out)) == 0
    assert "lm_head.weight" not in hf_tensors(out)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    # HF's tied model from the export == the engine on the trained checkpoint (both stages' copies of the weight).
    assert main(["verify", "--hf", str(out), "--ckpt", str(run_dir), "--tol", str(REL_TOL)]) == 0
    assert verify_rel(capsys) <= REL_TOL
