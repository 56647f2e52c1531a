"""Interleaved stages (`--vpp`, issue 36) on DeepSpeed's engine, exact against 1F1B and a single process: fp32,
HF's gqa31 weights (4 blocks: one per virtual stage at pp 2 vpp 2), 5 steps: the same losses, gradient norms,
evaluation loss and final weights within 1e-6 relative. The messages' clock (`ticks`) is checked without ranks.

`make test` runs pp 2 vpp 2 against pp 2 at gas 4 (2 ranks). Slow: gas 6, a single process, pp 4, cp 2, tp2 pp2
vpp2 dp2 with sequence parallelism and Llama 3.2's tied embedding (8 ranks), bf16, full and selective recompute and
packed rows at pp 2, a checkpoint saved at vpp 2 resumed at vpp 2 and at vpp 1 (and back), a universal resume at
pp 4 vpp 1 (and back) and at tp 2, a rank killed mid-save, the memory model's activation peak; `threed export`,
`reshard` and `verify` of a vpp-2 checkpoint, the engine `threed generate` / `eval-harness` load from it (its weights,
HF's greedy tokens), and packed SFT at vpp 2 against HF (sft_vpp_worker.py). The divergence guard at vpp 2:
test_divergence.py.

The `make test` runs also generate and score on the live engines (--generate-interval / --harness-interval's decode
loop, over the chunks at vpp 2): before step 1 HF's greedy tokens and log-probabilities, after step 5 each other's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from convert_fixtures import assert_identical, hf_tensors
from interleaved_worker import NEW_TOKENS, PROMPTS
from helpers import RANKS, hf_model, model_config, sft_examples, write_dataset, write_sft_dataset
from reference import sft_reference
from sft_worker import sft_config
from threed.cli.main import main
from test_checkpoint_faults import RUN, losses, pooled, worker
from threed.parallel.interleaved import InterleavedEngine, InterleavedSchedule, ticks
from threed.parallel.schedule import interleaved_order

REL = 1e-6


@pytest.mark.parametrize("pp,vpp,gas", [(2, 2, 4), (2, 2, 6), (2, 3, 4), (4, 2, 8), (4, 3, 4), (3, 2, 6), (8, 2, 16)])
def test_ticks_run_every_pass_in_order_and_pair_every_message(pp, vpp, gas) -> None:
    orders = [interleaved_order(pp, vpp, gas, s) for s in range(pp)]
    plan = ticks(orders, vpp)
    at: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, virtual stage) -> tick index on its rank's clock
    for r, mine in enumerate(plan):
        assert [t.run for t in mine if t.run is not None] == orders[r], "each rank runs its own order"
    # Sends and receives pair up per (sender, receiver, what), in the same order at both ends.
    sent: dict[tuple[int, int], list] = {}
    got: dict[tuple[int, int], list] = {}
    for r, mine in enumerate(plan):
        for n, tick in enumerate(mine):
            if tick.run is not None:
                kind, j, c = tick.run
                at[(kind, j, c * pp + r)] = n
            for what, j, c, peer in tick.sends:
                k = c * pp + r
                sent.setdefault((r, peer), []).append((what, j, k + 1 if what == "act" else k - 1))
            for what, j, c, peer in tick.recvs:
                got.setdefault((peer, r), []).append((what, j, c * pp + r))
    assert sent == got
    total = pp * vpp
    # every activation but the last virtual stage's goes on, every gradient but the first's goes back
    assert sum(len(v) for v in sent.values()) == 2 * gas * (total - 1)


def test_schedule_commands_load_on_the_first_and_last_virtual_stage_only() -> None:
    pp, vpp, gas = 2, 2, 4
    for stage in range(pp):
        cmds = [c for step in InterleavedSchedule(gas, pp, stage, vpp) for c in step]
        names = [type(c).__name__ for c in cmds]
        loads = [c.kwargs["chunk"] for c in cmds if names[cmds.index(c)] == "LoadMicroBatch"]
        assert loads == ([0] if stage == 0 else [vpp - 1]) * gas
        assert names[-3:] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
        assert names.count("ForwardPass") == names.count("BackwardPass") == gas * vpp
        evaluation = [type(c).__name__ for step in InterleavedSchedule(gas, pp, stage, vpp, train=False) for c in step]
        assert "BackwardPass" not in evaluation and evaluation.count("ForwardPass") == gas * vpp
    from threed.metrics.stages import _instruction_buckets

    assert set(InterleavedEngine._INSTRUCTION_MAP) <= set(_instruction_buckets()), "every instruction is timed"


@pytest.fixture(scope="module")
def launch(tmp_path_factory, rank_pool):
    """interleaved_worker.py `scenario` on `world` ranks with `args`, on a random-token dataset: (every rank's
    results, the output folder)."""
    tokens = np.random.default_rng(0).integers(0, 200, 5000)
    data = write_dataset(tmp_path_factory.mktemp("interleaved_data") / "random", tokens, 200)

    def run(world: int, args: list[str], scenario: str = "main") -> tuple[list[dict], str]:
        out = tmp_path_factory.mktemp("interleaved")
        argv = [scenario, "--out", str(out), "--data", data, *args]
        rank_pool.run(world, str(RANKS / "interleaved_worker.py"), argv, timeout=1200)
        stem = {"main": "interleaved", "resume": "resumed"}.get(scenario, scenario)
        return [json.loads((out / f"{stem}_rank{r}.json").read_text()) for r in range(world)], str(out)

    return run


@pytest.fixture(scope="module")
def pp2(launch) -> list[dict]:
    return launch(2, ["--pp", "2", "--gas", "4", "--vpps", "1,2"])[0]


@pytest.fixture(scope="module")
def pp2_more(launch) -> tuple[list[dict], str]:
    return launch(2, ["--pp", "2", "--gas", "4,6", "--vpps", "1,2", "--resume"])


@pytest.fixture(scope="module")
def single(launch) -> list[dict]:
    return launch(1, ["--pp", "1", "--gas", "4,6", "--vpps", "1"])[0]


@pytest.fixture(scope="module")
def tp2pp2dp2(launch) -> list[dict]:
    return launch(8, ["--tp", "2", "--pp", "2", "--gas", "4", "--vpps", "1,2", "--sp", "--tied"])[0]


@pytest.fixture(scope="module")
def pp4(launch) -> list[dict]:
    return launch(4, ["--pp", "4", "--gas", "4,8", "--vpps", "1,2", "--layers", "8"])[0]


@pytest.fixture(scope="module")
def cp2pp2(launch) -> list[dict]:
    return launch(4, ["--pp", "2", "--cp", "2", "--gas", "4", "--vpps", "1,2"])[0]


@pytest.fixture(scope="module")
def pp2_variants(launch) -> list[dict]:
    return launch(2, ["--pp", "2", "--gas", "", "--vpps", "1,2", "--variants", "bf16,uniform1,selective,packed"])[0]


def weights(ranks: list[dict], run: str) -> dict[str, list[float]]:
    """Every parameter's checksum over the ranks of one run (names are global layer indices and TP ranks)."""
    out: dict[str, list[float]] = {}
    for r in ranks:
        out.update(r[run]["weights"])
    return out


def assert_same_run(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == pytest.approx(want["losses"], rel=REL), f"{what}: losses"
    assert got["grad_norms"] == pytest.approx(want["grad_norms"], rel=REL), f"{what}: gradient norms"
    if want.get("eval") is not None:
        assert got["eval"] == pytest.approx(want["eval"], rel=REL), f"{what}: evaluation loss"


def assert_same_weights(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: the same parameters, by global name"
    for name, (total, size) in want.items():
        assert abs(got[name][0] - total) <= REL * size, f"{what}: final weight {name}"


def check_against_1f1b(ranks: list[dict], gas: int, run: str = "vppV_gasG") -> None:
    one_run, inter_run = (run.replace("V", v).replace("G", str(gas)) for v in "12")
    for rank, r in enumerate(ranks):
        one, inter = r[one_run], r[inter_run]
        assert one["class"] == "LeanPipelineEngine" and inter["class"] == "InterleavedEngine"
        assert one["grad_norms"][0] > 0.5, "a run that learns something"
        assert_same_run(inter, one, f"rank {rank} {inter_run}")
    assert_same_weights(weights(ranks, inter_run), weights(ranks, one_run), inter_run)


def test_pp2_vpp2_is_1f1b_at_gas4(pp2) -> None:
    check_against_1f1b(pp2, 4)


def test_the_idle_metric_times_every_stage_and_chunk_at_vpp2(pp2) -> None:
    """threed.metrics.stages times the interleaved engine's instructions: compute (loads, forwards, backwards) and
    p2p (posting a tick's messages, waiting for a received one), from which the idle fraction comes; and each
    chunk's compute and waits apart, whose idle fractions add up to at most the stage's (the metrics writer's
    per_stage over the gathered rows; none at vpp 1)."""
    for rank, r in enumerate(pp2):
        timing, chunks = r["vpp2_gas4"]["timing"], r["vpp2_gas4"]["chunk_timing"]
        assert timing["compute"] > 0 and timing["p2p"] > 0, (rank, timing)
        assert timing["dp-reduce"] > 0 and timing["optimizer"] > 0, (rank, timing)
        assert len(chunks) == 2 and all(c["compute"] > 0 for c in chunks), (rank, chunks)
        assert 0 < sum(c["p2p"] for c in chunks) <= timing["p2p"], (rank, chunks, timing)
        assert sum(c["compute"] for c in chunks) == pytest.approx(timing["compute"], rel=1e-9)
        assert r["vpp1_gas4"]["chunk_timing"] == [] and not any("chunk" in k for k in r["vpp1_gas4"]["per_stage"])
    stages = pp2[0]["vpp2_gas4"]["per_stage"]
    for s in range(2):
        idle = [stages[f"stage{s}/chunk{c}/idle-fraction"] for c in range(2)]
        assert f"stage{s}/chunk2/idle-fraction" not in stages
        assert 0 < sum(idle) <= stages[f"stage{s}/idle-fraction"] + 1e-12, (s, idle, stages)


def test_the_pipeline_group_opens_with_all_its_ranks_and_carries_every_message(pp2) -> None:
    """The interleaved sends and receives go over the rank's pipeline group, whose first collective is an
    all-reduce of all its ranks (NCCL: a batch_isend_irecv of some of them first is undefined); 1F1B's go over
    DeepSpeed's own blocking p2p, no batch."""
    for rank, r in enumerate(pp2):
        calls = r["vpp2_gas4"]["pipe_group"]
        assert calls["first"][0] == "all_reduce" and "p2p" in calls["first"], (rank, calls)
        assert not calls["p2p_elsewhere"] and calls["p2p"] > 0, (rank, calls)
        assert r["vpp1_gas4"]["pipe_group"]["p2p"] == 0


def hf_greedy_and_scores() -> tuple[list[list[int]], list[float]]:
    """HF's gqa31 (the weights the runs start from): greedy generate's new tokens on PROMPTS, and each prompt's sum
    of log-probabilities of its tokens after the first (float64)."""
    hf = hf_model("gqa31")
    tokens, scores = [], []
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = hf.generate(ids, do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
            tokens.append(out[0, len(p) :].tolist())
            logprobs = torch.log_softmax(hf(ids).logits[0, :-1].double(), dim=-1)
            scores.append(float(logprobs.gather(1, ids[0, 1:, None]).sum()))
    return tokens, scores


def assert_same_decoding(ranks: list[dict]) -> None:
    """vpp 2's greedy and sampled tokens on the live engine are vpp 1's, before step 1 and after step 5, every step's
    top-1 / top-2 margin above 1e-5 (no near-tie decides a token), and its scores within 1e-5 of vpp 1's."""
    for rank, r in enumerate(ranks):
        inter, one = r["vpp2_gas4"]["decoded"], r["vpp1_gas4"]["decoded"]
        for m in ("start", "end"):
            assert (inter[m]["tokens"], inter[m]["sampled"]) == (one[m]["tokens"], one[m]["sampled"]), (rank, m)
            margins = [x for key in ("margins", "sampled_margins") for row in inter[m][key] for x in row]
            assert len(margins) == 2 * len(PROMPTS) * NEW_TOKENS and min(margins) > 1e-5, (rank, m, margins)
            got, want = ([s for s, _ in d[m]["scores"] or []] for d in (inter, one))
            assert got == pytest.approx(want, rel=1e-5), (rank, m)


def test_generation_and_harness_scores_on_the_live_vpp2_engine(pp2) -> None:
    """--generate-interval / --harness-interval's decode loop on the live interleaved engine (rank 0 chunk 0 -> rank 1
    chunk 0 -> rank 0 chunk 1 -> rank 1 chunk 1, KV cache): before step 1 HF generate's greedy tokens and HF's
    log-probabilities; before and after the 5 steps, vpp 1's greedy and sampled tokens and its scores."""
    assert_same_decoding(pp2)
    want_tokens, want_scores = hf_greedy_and_scores()
    for rank, r in enumerate(pp2):
        inter = r["vpp2_gas4"]["decoded"]
        assert inter["start"]["tokens"] == want_tokens and inter["end"]["tokens"] != want_tokens, rank
        assert inter["start"]["sampled"] != want_tokens, "sampled, not greedy"
        got = [s for s, _ in inter["start"]["scores"] or []]
        assert (got == []) == (rank == 0), "the scores come from the last stage"
        assert got == pytest.approx(want_scores if got else [], rel=1e-5), rank


@pytest.mark.slow
@pytest.mark.parametrize("gas", [4, 6])
def test_pp2_vpp2_is_1f1b_and_a_single_process(pp2_more, single, gas) -> None:
    ranks, _ = pp2_more
    check_against_1f1b(ranks, gas)
    alone = single[0][f"vpp1_gas{gas}"]
    for rank, r in enumerate(ranks):
        assert_same_run(r[f"vpp2_gas{gas}"], alone, f"rank {rank} gas {gas} against one process")
    assert_same_weights(weights(ranks, f"vpp2_gas{gas}"), alone["weights"], f"gas {gas} against one process")


@pytest.mark.slow
@pytest.mark.parametrize("gas", [4, 8])
def test_pp4_vpp2_is_1f1b(pp4, gas) -> None:
    """Four ranks: each sends to the next and the one before, which differ, and rank 3's chunk c feeds rank 0's
    chunk c + 1 (8 blocks, threed's own init, the same at any layout)."""
    check_against_1f1b(pp4, gas)


@pytest.mark.slow
def test_cp2_pp2_vpp2_is_cp2_pp2(cp2pp2) -> None:
    check_against_1f1b(cp2pp2, 4)
    assert_same_decoding(cp2pp2)  # the CP ranks replicas of their own, each its share of the prompts


@pytest.mark.slow
def test_tp2_pp2_vpp2_dp2_with_sequence_parallel_and_tied_embedding(tp2pp2dp2) -> None:
    check_against_1f1b(tp2pp2dp2, 4)
    assert_same_decoding(tp2pp2dp2)  # whole sequences over TP under SP, the tied head, two replicas
    names = weights(tp2pp2dp2, "vpp2_gas4")
    assert "tp0/tied_modules.embedding.word_embeddings.weight" in names, "the tied embedding, one weight"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["bf16", "uniform1", "selective", "packed"])
def test_pp2_vpp2_in_bf16_with_recompute_and_packed_rows(pp2_variants, variant) -> None:
    """bf16 (the fp32 accumulation hooks see each weight's micro-batches in 1F1B's order), full recompute per chunk
    (uniform, 1: every block on its own), selective recompute, packed rows (the activations a tuple with the integer
    document ids, which get no gradient)."""
    check_against_1f1b(pp2_variants, 4, f"{variant}_vppV")


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [(2, 2), (2, 1), (1, 2)])
def test_a_checkpoint_resumes_under_either_vpp(pp2_more, saved, resumed) -> None:
    """Saved at step 3, resumed: steps 4-5 as in the uninterrupted run. Layer files carry global indices, so the
    same files load at vpp 1 and 2; the optimizer's ZeRO shards differ between them, so a change of vpp goes
    through DeepSpeed's universal checkpoint (by parameter name)."""
    ranks, _ = pp2_more
    for rank, r in enumerate(ranks):
        whole = r[f"vpp{saved}_gas4"]
        got = r[f"vpp{saved}_then_vpp{resumed}"]
        assert got["universal"] == (saved != resumed)
        want = {"losses": whole["losses"][3:], "grad_norms": whole["grad_norms"][3:]}
        assert_same_run(got, want, f"rank {rank} vpp {saved} -> {resumed}")


def assert_continues_universally(resumed: list[dict], whole: dict) -> None:
    """Every rank of a resume at another layout went through a universal checkpoint and continued `whole` (steps
    4-5 of the uninterrupted run)."""
    want = {"losses": whole["losses"][3:], "grad_norms": whole["grad_norms"][3:]}
    for rank, r in enumerate(resumed):
        assert r["universal"]
        assert_same_run(r, want, f"rank {rank}")


@pytest.mark.slow
def test_universal_resume_from_pp2_vpp2_at_pp4_vpp1(pp2_more, launch) -> None:
    ranks, out = pp2_more
    resumed, _ = launch(4, ["--pp", "4", "--gas", "4", "--vpps", "1", "--load", f"{out}/ckpt_vpp2"], "resume")
    assert_continues_universally(resumed, ranks[0]["vpp2_gas4"])


@pytest.mark.slow
def test_universal_resume_from_pp4_vpp1_at_pp2_vpp2(launch) -> None:
    ranks, out = launch(4, ["--pp", "4", "--gas", "4", "--vpps", "1", "--resume"])
    resumed, _ = launch(2, ["--pp", "2", "--gas", "4", "--vpps", "2", "--load", f"{out}/ckpt_vpp1"], "resume")
    assert_continues_universally(resumed, ranks[0]["vpp1_gas4"])


@pytest.mark.slow
def test_a_rank_killed_mid_save_at_vpp2_then_the_same_command_resumes_bit_identical(tmp_path, rank_pool) -> None:
    """test_checkpoint_faults.py's kill -9 of rank 1 after its first file of step 4's save, at --vpp 2: the torn
    step 4 is skipped, the same command resumes from step 2 and ends on the uninterrupted run's losses, bit for
    bit. The killed run is a torchrun of its own (a real SIGKILL, judged by its exit); the uninterrupted run and the
    resume must simply succeed, in the session's 2-rank launch (as test_checkpoint_faults.py's `pooled`)."""
    reference = pooled(rank_pool, 2, tmp_path / "ref", "--save", str(tmp_path / "ref_save"), *RUN, "--vpp", "2")
    assert reference.returncode == 0, reference.stdout[-3000:]
    save, out = tmp_path / "save", tmp_path / "out"
    killed = worker(2, out, "--save", str(save), *RUN, "--vpp", "2", "--kill", "file1:4:1")
    assert killed.returncode != 0 and "SIGKILL" in killed.stdout, killed.stdout[-3000:]
    resumed = pooled(rank_pool, 2, out, "--save", str(save), *RUN, "--vpp", "2")
    assert resumed.returncode == 0, resumed.stdout[-4000:]
    assert json.loads((out / "result.json").read_text())["start"] == 2
    assert "skipping checkpoint" in resumed.stdout and "global_step4" in resumed.stdout
    assert losses(out) == losses(tmp_path / "ref")


@pytest.mark.slow
def test_the_activation_peak_at_vpp2_is_the_memory_model_s(memory_zb_run) -> None:
    """The CPU peak of a train step (tests/ranks/memory_zb_worker.py's: pp 2, gas 4, bf16) at --vpp 2 against
    threed.memory's estimate, which counts each chunk's micro-batches in flight: within 10% on both ranks (measured
    on 2026-11-29: rank 0 82.6 MB, predicted 84.8; rank 1 58.5 MB, predicted 57.6; at vpp 1 64.4 / 67.0 and
    40.2 / 40.4 MB). Rank 1 measured 63.7 MB while the engine kept every gradient it sent until the step's end. The
    peaks are those of the session's one memory_zb_worker.py run (tests/ranks/conftest.py), whose 1F1B peak
    test_memory_zb.py compares with ZB-H1's."""
    peaks = [json.loads(path.read_text()) for path in sorted(memory_zb_run.glob("schedule_peaks_rank*.json"))]
    assert [r["1f1b-vpp2"]["stage"] for r in peaks] == [0, 1]
    for one, inter in ((r["1f1b"], r["1f1b-vpp2"]) for r in peaks):
        print(f"rank {inter['stage']}, measured / estimated bytes: vpp 1", one["measured"], one["phase"], end="")
        print("; vpp 2", inter["measured"], inter["phase"])
        assert inter["phase"] > one["phase"], "interleaving holds more on every rank here"
        assert abs(inter["phase"] - inter["measured"]) <= 0.10 * inter["measured"]


@pytest.mark.slow
@pytest.mark.parametrize("vpp", [2, 1])
def test_universal_resume_from_tp1_pp2_vpp2_at_tp2(pp2_more, launch, vpp) -> None:
    """A change of tp at vpp 2: every weight and its Adam state cut in two over TP (DeepSpeed's universal checkpoint,
    by parameter name), resumed at tp2 pp2 with the same and with one chunk per rank."""
    ranks, out = pp2_more
    args = ["--tp", "2", "--pp", "2", "--gas", "4", "--vpps", str(vpp), "--load", f"{out}/ckpt_vpp2"]
    resumed, _ = launch(4, args, "resume")
    assert_continues_universally(resumed, ranks[0]["vpp2_gas4"])


@pytest.fixture(scope="module")
def exported(pp2_more, tmp_path_factory) -> dict[int, Path]:
    """`threed export` of the step-3 checkpoints written at vpp 1 and at vpp 2 (tp1 pp2): vpp -> HF folder."""
    _, out = pp2_more
    folders = {}
    for vpp in (1, 2):
        folders[vpp] = tmp_path_factory.mktemp(f"exported_vpp{vpp}") / "hf"
        assert main(["export", "--ckpt", f"{out}/ckpt_vpp{vpp}", "--out", str(folders[vpp]), "--quiet"]) == 0
    return folders


@pytest.mark.slow
def test_export_reshard_and_verify_read_a_vpp2_checkpoint(pp2_more, exported, tmp_path, capsys, verify_in_pool):
    """The layer files carry global indices, so the tools read an interleaved checkpoint as any other: its export
    holds the weights of the same 3 steps run at vpp 1 (within the runs' 1e-6), `threed reshard` of it to tp2 pp1
    exports bit for bit the same, and `threed verify` of it against its export agrees on the logits."""
    _, out = pp2_more
    inter, one = hf_tensors(exported[2]), hf_tensors(exported[1])
    assert sorted(inter) == sorted(one) and len(inter) == 4 * 9 + 3
    for name, want in one.items():
        assert (inter[name] - want).abs().max() <= 1e-5 * want.abs().max(), name
    resharded = tmp_path / "tp2pp1"
    assert main(["reshard", "--ckpt", f"{out}/ckpt_vpp2", "--tp", "2", "--pp", "1", "--out", str(resharded)]) == 0
    assert main(["export", "--ckpt", str(resharded), "--out", str(tmp_path / "again"), "--quiet"]) == 0
    assert_identical(hf_tensors(tmp_path / "again"), inter)
    capsys.readouterr()
    assert main(["verify", "--hf", str(exported[2]), "--ckpt", f"{out}/ckpt_vpp2", "--tol", "1e-5"]) == 0
    line = [ly for ly in capsys.readouterr().out.splitlines() if ly.startswith("threed verify:")][-1]
    print(line)


@pytest.mark.slow
def test_generation_and_the_harness_engine_load_a_vpp2_checkpoint(pp2_more, exported, launch) -> None:
    """The engine `threed generate` / `eval-harness` build (`pinned_engine`, vpp 1) from a vpp-2 checkpoint holds the
    weights the run saved, bit for bit, and generates greedily HF's tokens on the checkpoint's export; every compared
    step's top-1 / top-2 margin is above 1e-5, so no near-tie decides it."""
    ranks, out = pp2_more
    got, _ = launch(2, ["--tp", "1", "--pp", "2", "--load", f"{out}/ckpt_vpp2"], "inference")
    assert [r["vpp"] for r in got] == [1, 1]
    loaded = {k: v for r in got for k, v in r["weights"].items()}
    saved = {k: v for r in ranks for k, v in r["vpp2_gas4"]["saved_weights"].items()}
    assert loaded == saved
    from transformers import AutoModelForCausalLM  # heavy (~1.5 s of CPU): only this test runs HF's generate

    hf = AutoModelForCausalLM.from_pretrained(str(exported[2])).eval()
    with torch.no_grad():
        want = [
            hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=0,
                        eos_token_id=None)[0, len(p):].tolist()
            for p in PROMPTS
        ]  # fmt: skip
    assert got[1]["tokens"] == want
    margins = [m for row in got[1]["margins"] for m in row]
    assert len(margins) == len(PROMPTS) * NEW_TOKENS and min(margins) > 1e-5, margins


@pytest.mark.slow
def test_sft_with_packed_rows_at_vpp2_is_single_process_hf(tmp_path, rank_pool) -> None:
    """test_sft_train.py's packed SFT run (5 fp32 steps through threed.train, loss over the response tokens of the
    global batch, validation after the last step) at tp1 pp2 vpp2 dp2: the same global batch of 8 packed rows, so
    the same reference (HF's model trained on each example alone), within 1e-5."""
    data = write_sft_dataset(tmp_path / "chat", sft_examples(400, model_config("gqa31").vocab_size), 200)
    ran = rank_pool.run(4, str(RANKS / "sft_vpp_worker.py"), ["--out", str(tmp_path), "--data", data], timeout=1200)
    assert "chunks idle" in ran.stdout, "the log line's per-chunk idle time (interleaved: two chunks per rank)"
    ranks = [json.loads((tmp_path / f"sft_vpp_rank{r}.json").read_text()) for r in range(4)]
    ref_losses, ref_norms, ref_valid, ref_counts = sft_reference(hf_model("gqa31"), sft_config(data, True, 5))
    got = ranks[0]
    assert len(got["losses"]) == 5
    assert got["losses"] == pytest.approx(ref_losses, rel=1e-5)
    assert got["grad_norms"] == pytest.approx(ref_norms, rel=1e-5)
    assert ranks[2]["loss_tokens"] == ref_counts  # the loss rank: last stage, dp 0
    assert got["evals"][0]["loss"] == pytest.approx(ref_valid, rel=1e-5)
