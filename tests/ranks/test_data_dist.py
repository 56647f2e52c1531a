"""`threed train` on a 2-source megatron-core blend at tp2 x pp2 x dp2 (8 gloo ranks, one run): validation
equals a single-process evaluation of the same weights, per source dataset too; evaluation does not change
training; a stopped run resumes on the same samples; middle pipeline stages read no data."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data_worker import base_config
from helpers import RANKS, gpt_dataset, learnable_tokens, write_dataset
from threed.cli.main import main as cli

FP32_TOL = 1e-5


@pytest.fixture(scope="module")
def run(tmp_path_factory, rank_pool):
    out = tmp_path_factory.mktemp("data_dist")
    a = write_dataset(out / "a", learnable_tokens(12_000, seed=1), 200, seed=1)
    b = write_dataset(out / "b", np.random.default_rng(2).integers(0, 200, 12_000), 200, seed=2)
    rank_pool.run(8, str(RANKS / "data_worker.py"), ["--out", str(out), "--a", a, "--b", b], timeout=1500)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(8)]
    return {"ranks": ranks, "out": out, "a": a, "b": b}


def reference_eval(run, eval_index: int) -> tuple[float, dict[str, float]]:
    """One process: HF's model exported from the run's final checkpoint, on the valid samples of evaluation
    `eval_index`, token-weighted over everything and per source dataset."""
    from transformers import LlamaForCausalLM

    exported = run["out"] / "exported"
    assert cli(["export", "--ckpt", str(run["out"] / "full"), "--out", str(exported), "--quiet"]) == 0
    model = LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32).eval()
    cfg = base_config(run["a"], run["b"])
    gbs, iters = 8, cfg.train.eval_iters
    valid = gpt_dataset(cfg, gbs).valid
    sums, counts = {}, {}
    with torch.no_grad():
        for i in range(eval_index * iters * gbs, (eval_index + 1) * iters * gbs):
            s = valid[i]
            tokens = torch.as_tensor(s["tokens"])[None].long()
            labels = torch.as_tensor(s["labels"]).long()
            mask = torch.as_tensor(s["loss_mask"]).float()
            loss = F.cross_entropy(model(tokens).logits[0].float(), labels, reduction="none")
            src = (run["a"], run["b"])[int(s["dataset_id"])]
            sums[src] = sums.get(src, 0.0) + float((loss * mask).sum())
            counts[src] = counts.get(src, 0.0) + float(mask.sum())
    return sum(sums.values()) / sum(counts.values()), {k: sums[k] / counts[k] for k in sums}


def test_validation_equals_single_process_evaluation(run):
    got = run["ranks"][0]["full"]["evals"]
    assert [e["step"] for e in got] == [2, 4]
    want, per = reference_eval(run, eval_index=1)  # step 4 is the second evaluation
    print(f"valid loss 3D {got[-1]['loss']:.7f} vs single process {want:.7f}; per dataset {per}")
    assert abs(got[-1]["loss"] - want) <= FP32_TOL * want
    for src, loss in per.items():
        assert abs(got[-1][f"loss/{src}"] - loss) <= FP32_TOL * loss, src
    assert len(per) == 2, "both sources are in the valid batches"
    assert all(r["full"]["evals"] == got for r in run["ranks"]), "every rank reports the same validation"
    assert math.isfinite(got[0]["loss"]) and got[0]["tokens"] == 2 * 8 * 32


def test_evaluation_does_not_change_training(run):
    r = run["ranks"][0]
    assert r["full"]["losses"] == r["no_eval"]["losses"]  # bit for bit


def test_stopped_run_resumes_on_the_same_samples(run):
    r = run["ranks"][0]
    assert r["resumed"]["preempted"] and len(r["resumed"]["first"]) == 1
    assert r["resumed"]["start"] == 1
    assert r["resumed"]["first"] + r["resumed"]["second"] == r["full"]["losses"]
    assert r["resumed"]["evals"] == r["full"]["evals"]


def test_only_first_and_last_stage_read_data(run):
    # tp2 x pp4 x dp1: ranks 0-1 stage 0, 2-5 the middle stages, 6-7 the last stage.
    reads = [r["pp4_samples_read"] for r in run["ranks"]]
    print("samples read per rank at tp2 pp4:", reads)
    assert reads[2:6] == [0, 0, 0, 0]
    assert all(n > 0 for n in reads[:2] + reads[6:])
    # tp2 pp2 dp2: every rank is on the first or last stage; each reads its dp share of train + valid.
    assert all(r["full"]["samples_read"] == 4 * 4 + 2 * 2 * 4 for r in run["ranks"])
