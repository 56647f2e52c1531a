"""DeepSpeed's own load_checkpoint of converter output gives HF's logits (multi-rank), and a model trained from
a converted checkpoint exports to an HF folder whose logits equal our engine's. The first takes `threed verify`'s own
torchrun launch; the trained run and its verify are served by the session's rank pool (`verify_in_pool`).

    .venv/bin/python -m pytest -q tests/ranks/test_convert_parity.py
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from convert_fixtures import DIVISIBLE_BY, GQA4, assert_identical, hf_model, hf_tensors, save_hf, write_tokens
from threed.cli.main import main
from threed.verify.parity import compare, hf_logits
from helpers import gpt_dataset
from threed.config import DataConfig, ModelConfig, RunConfig, TrainConfig
from threed.data.loader import micro_batches

REL_TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf(tmp_path_factory.mktemp("hf") / "gqa4", GQA4, shard_kb=100)


def verify_line(capsys) -> str:
    out = capsys.readouterr().out
    line = [ly for ly in out.splitlines() if ly.startswith("threed verify:")][-1]
    print(line)
    return line


@pytest.mark.parametrize("tp,pp", [(2, 2), (4, 1)])  # (4, 1): each TP rank holds exactly one KV head (8 q / 4 kv)
def test_deepspeed_load_checkpoint_matches_hf(hf_dir, tmp_path, capsys, tp, pp, request):
    if (tp, pp) == (4, 1):
        # verify's own torchrun (4 ranks importing torch, DeepSpeed and megatron-core anew: ~40 s of CPU) is run by
        # the (2, 2) case; this one is served by the pool's ranks, which run the same module.
        request.getfixturevalue("verify_in_pool")
    ck = tmp_path / "ck"
    assert (
        main(
            [
                "convert",
                "--hf",
                str(hf_dir),
                "--tp",
                str(tp),
                "--pp",
                str(pp),
                "--out",
                str(ck),
                "--quiet",
                "--make-vocab-size-divisible-by",
                DIVISIBLE_BY,
            ]
        )
        == 0
    )
    # verify starts tp x pp ranks that build the engine and call engine.load_checkpoint(load_module_only=True).
    assert main(["verify", "--hf", str(hf_dir), "--ckpt", str(ck), "--tol", str(REL_TOL)]) == 0
    rel = float(re.search(r"max rel (\S+)", verify_line(capsys)).group(1))
    assert rel <= REL_TOL


def first_batch_loss(hf_dir, data: str, micro: int, gas: int, seq: int, seed: int) -> float:
    """HF's loss on the global batch of step 1 (dp=1), averaged over micro-batches as DeepSpeed reports it."""
    model = hf_model(GQA4)
    cfg = RunConfig(
        model=ModelConfig(
            name="x",
            vocab_size=200,
            hidden_size=8,
            num_layers=1,
            num_heads=1,
            num_kv_heads=1,
            ffn_hidden_size=8,
            max_position_embeddings=seq,
        ),
        train=TrainConfig(seq_length=seq, seed=seed, steps=3, eval_interval=0),
        data=DataConfig(data_path=(data,)),
    )
    batches = micro_batches(gpt_dataset(cfg, micro * gas).train, micro * gas, micro, 1, 0, 0, 200)
    losses = []
    with torch.no_grad():
        for _ in range(gas):
            x, (y, _) = next(batches)
            losses.append(F.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()).item())
    return sum(losses) / gas


@pytest.mark.slow  # end to end (~75 s); DeepSpeed loading converted weights stays in make test
def test_train_from_converted_then_export(hf_dir, tmp_path, capsys, rank_pool, verify_in_pool):
    ck, run, exported = tmp_path / "ck", tmp_path / "run", tmp_path / "exported"
    # Default padding multiple (128): `--model HF_DIR` then pads the vocab exactly as the converter did.
    assert main(["convert", "--hf", str(hf_dir), "--tp", "2", "--pp", "2", "--out", str(ck), "--quiet"]) == 0
    data = write_tokens(tmp_path / "tokens", 20_000, 200)
    micro, gas, seq, seed = 2, 2, 32, 1234
    proc = rank_pool.run_ranks(
        4,
        "threed.train",
        [
            "--model",
            str(hf_dir),
            "--init-from",
            str(ck),
            "--tp",
            "2",
            "--pp",
            "2",
            "--dtype",
            "bf16",
            "--micro-batch-size",
            str(micro),
            "--grad-accum-steps",
            str(gas),
            "--seq-length",
            str(seq),
            "--steps",
            "3",
            "--lr",
            "1e-3",
            "--min-lr",
            "1e-3",
            "--seed",
            str(seed),
            "--data-path",
            data,
            "--eval-iters",
            "1",
            "--save",
            str(run),
        ],
        timeout=600,
    )
    losses = [float(x) for x in re.findall(r"^step \d+/3 \| loss (\S+)", proc.stdout, re.M)]
    assert len(losses) == 3, proc.stdout[-3000:]
    # Step 1 runs the converted weights (bf16): its loss is HF's on the same batch. Were they not loaded, or
    # were the fp32 master weights not refreshed (loss jump after step 1), these would be far off.
    assert abs(losses[0] - first_batch_loss(hf_dir, data, micro, gas, seq, seed)) < 0.03, losses
    assert losses[1] < losses[0] + 0.05 and losses[2] < losses[0] + 0.05, losses

    assert main(["export", "--ckpt", str(run), "--out", str(exported), "--quiet"]) == 0
    # The exported model is the trained one, not the converted original.
    tokens = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(3))
    _, moved = compare(hf_logits(exported, tokens), hf_logits(hf_dir, tokens))
    assert moved > 1e-3, moved
    # HF's model from the exported folder == our engine (fp32, the bf16 trained weights) on the same tokens.
    assert main(["verify", "--hf", str(exported), "--ckpt", str(run), "--tol", str(REL_TOL)]) == 0
    verify_line(capsys)
    # A trained checkpoint reshards too (weights only), to the same tensors.
    resharded, again = tmp_path / "resharded", tmp_path / "again"
    assert main(["reshard", "--ckpt", str(run), "--tp", "4", "--pp", "1", "--out", str(resharded), "--quiet"]) == 0
    assert main(["export", "--ckpt", str(resharded), "--out", str(again), "--quiet"]) == 0
    assert_identical(hf_tensors(exported), hf_tensors(again))
    assert (again / "config.json").read_text() == (exported / "config.json").read_text()
