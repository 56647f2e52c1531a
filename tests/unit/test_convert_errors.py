"""Bad inputs fail with a message that names the problem, exit status 2, and leave no output behind.

.venv/bin/python -m pytest -q tests/unit/test_convert_errors.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from convert_fixtures import GQA4, save_hf
from threed.cli.main import main
from threed.checkpoint.format import check_loadable, read_model_config


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("hf") / "good", GQA4)


@pytest.fixture(scope="module")
def good_ckpt(good, tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "ck"
    assert main(["convert", "--hf", str(good), "--tp", "2", "--pp", "2", "--out", str(out), "--quiet"]) == 0
    return out


def broken(good: Path, tmp_path: Path, edit) -> Path:
    src = tmp_path / "src"
    shutil.copytree(good, src)
    edit(src / "model.safetensors")
    return src


def rewrite(change):
    def edit(path: Path) -> None:
        sd = load_file(path)
        change(sd)
        save_file(sd, path, metadata={"format": "pt"})

    return edit


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-1000])


def corrupt_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))


BAD_SOURCES = {
    "missing": (
        rewrite(lambda sd: sd.pop("model.layers.2.mlp.up_proj.weight")),
        "1 missing: model.layers.2.mlp.up_proj.weight",
    ),
    "unexpected": (
        rewrite(lambda sd: sd.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(2)})),
        "1 unexpected: model.layers.7.mlp.up_proj.weight",
    ),
    "wrong-shape": (
        rewrite(lambda sd: sd.update({"model.layers.1.self_attn.k_proj.weight": torch.zeros(48, 64)})),
        "model.layers.1.self_attn.k_proj.weight is [48, 64], expected [32, 64]",
    ),
    "truncated": (truncate, "is truncated"),
    "corrupt-header": (corrupt_header, "corrupt safetensors header"),
}


def assert_failed_cleanly(rc: int, capsys, message: str, out: Path) -> None:
    err = capsys.readouterr().err
    assert rc == 2, err
    assert message in err, err
    assert "Traceback" not in err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]  # no temp dirs left


@pytest.mark.parametrize("case", list(BAD_SOURCES))
def test_bad_source_fails_clearly(good, tmp_path, capsys, case):
    edit, message = BAD_SOURCES[case]
    src = broken(good, tmp_path, edit)
    out = tmp_path / "out"
    rc = main(["convert", "--hf", str(src), "--tp", "2", "--pp", "2", "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, message, out)


def test_corrupt_bin_and_stale_index(tmp_path, capsys):
    src = save_hf(tmp_path / "bin", GQA4, fmt="bin", shard_kb=100)
    victim = sorted(src.glob("pytorch_model-*.bin"))[1]
    victim.write_bytes(victim.read_bytes()[:2000])
    out = tmp_path / "out"
    rc = main(["convert", "--hf", str(src), "--tp", "1", "--pp", "1", "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, f"cannot read {victim}", out)
    victim.unlink()
    rc = main(["convert", "--hf", str(src), "--tp", "1", "--pp", "1", "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, f"names files that are not in {src}: {victim.name}", out)


def test_existing_output_needs_force(good, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc = main(["convert", "--hf", str(good), "--tp", "1", "--pp", "1", "--out", str(out), "--quiet"])
    assert rc == 2 and "already exists" in capsys.readouterr().err and (out / "keep.txt").exists()
    assert main(["convert", "--hf", str(good), "--tp", "1", "--pp", "1", "--out", str(out), "--quiet", "--force"]) == 0
    assert (out / "latest").is_file() and not (out / "keep.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_failure_while_writing_leaves_nothing(good, tmp_path, capsys, monkeypatch):
    import threed.convert.from_hf as conv

    calls = []
    real = conv.save_rank

    def failing(step_dir, layer, rank, sd):
        calls.append(layer.index)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(step_dir, layer, rank, sd)

    monkeypatch.setattr(conv, "save_rank", failing)
    out = tmp_path / "out"
    rc = main(["convert", "--hf", str(good), "--tp", "2", "--pp", "2", "--out", str(out), "--quiet"])
    assert calls == [0, 0, 1, 1, 2] and list(tmp_path.iterdir()) == []
    assert rc == 2 and "No space left on device" in capsys.readouterr().err


def test_bad_parallel_layout(good, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["convert", "--hf", str(good), "--tp", "8", "--pp", "1", "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, "tp=8 does not divide num_kv_heads=4", out)
    rc = main(["convert", "--hf", str(good), "--tp", "1", "--pp", "5", "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, "pp=5 is larger than num_layers=4", out)


def test_bad_checkpoints(good_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["export", "--ckpt", str(tmp_path), "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, "no 'latest' file", out)
    ck = tmp_path / "ck"
    shutil.copytree(good_ckpt, ck)
    (ck / "global_step0" / "layer_03-model_01-model_states.pt").unlink()
    rc = main(["export", "--ckpt", str(ck), "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, "layer 3: TP ranks [0]", out)
    (ck / "global_step0" / "layer_03-model_01-model_states.pt").write_bytes(b"not a torch file")
    rc = main(["reshard", "--ckpt", str(ck), "--tp", "1", "--pp", "1", "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, "layer_03-model_01-model_states.pt", out)
    shutil.copyfile(
        good_ckpt / "global_step0" / "layer_02-model_01-model_states.pt",
        ck / "global_step0" / "layer_00-model_01-model_states.pt",
    )  # a block where the embedding was
    rc = main(["export", "--ckpt", str(ck), "--out", str(out), "--quiet"])
    assert_failed_cleanly(rc, capsys, "layer_00-model_01-model_states.pt holds ['input_layernorm.weight'", out)


def test_layout_or_model_mismatch_is_named_before_deepspeed_loads(good_ckpt):
    import dataclasses

    model = read_model_config(good_ckpt)
    check_loadable(good_ckpt, model, tp=2, pp=2)
    for tp, pp in ((4, 2), (2, 1)):
        with pytest.raises(
            Exception,
            match=rf"written at tp=2 pp=2; this run has tp={tp} pp={pp}. Reshard it: "
            rf"threed reshard --ckpt {good_ckpt} --tp {tp} --pp {pp}",
        ):
            check_loadable(good_ckpt, model, tp=tp, pp=pp)
    with pytest.raises(Exception, match="converted checkpoint"):
        check_loadable(good_ckpt, model, tp=2, pp=2, weights_only=False)
    with pytest.raises(Exception, match="make_vocab_size_divisible_by 128 != 16"):
        check_loadable(good_ckpt, dataclasses.replace(model, make_vocab_size_divisible_by=16), tp=2, pp=2)


def test_verify_exit_status_follows_tolerance(good, good_ckpt, monkeypatch, capsys):
    import threed.verify.parity as verify

    def fake_logits(ckpt, tokens, timeout=None):  # the multi-rank path is tested in test_convert_parity
        logits = verify.hf_logits(good, tokens)
        return logits * (1 + 1e-3), 2, 2

    monkeypatch.setattr(verify, "checkpoint_logits", fake_logits)
    assert main(["verify", "--hf", str(good), "--ckpt", str(good_ckpt)]) == 1
    assert "FAIL" in capsys.readouterr().out
    assert main(["verify", "--hf", str(good), "--ckpt", str(good_ckpt), "--tol", "2e-3"]) == 0
    assert "OK" in capsys.readouterr().out
