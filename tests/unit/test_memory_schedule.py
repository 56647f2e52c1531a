"""threed.memory under `--pipeline-schedule zb-h1`: what a micro-batch awaiting its weight-gradient pass holds
(checked against a hand count from the linears' widths), and how the held counts of threed.parallel.schedule move the
activation term from stage 0 to the later stages. Pure functions of the model (no engine), at 70B shapes."""

from __future__ import annotations

import pytest

from threed.convert.resolve import model_config
from threed.memory.deferred import awaiting_w_bytes, deferred_bytes_per_token
from threed.memory.model import estimate, stage_kinds
from threed.parallel.schedule import held_before_backward

M70 = model_config("llama3.1-70b")
TP, PP, SEQ = 8, 4, 8192


def test_awaiting_w_bytes_per_token_hand_count() -> None:
    # 70B: h 8192, 64 q heads and 8 KV heads of 128, ffn 28672; per TP rank at tp 8, bf16 (2 B), input + output:
    h, kv, f = 8192, 8 * 128, 28672
    qkv = h + (h + 2 * kv) // TP
    o = h // TP + h
    fc1 = h + 2 * f // TP
    fc2 = f // TP + h
    assert deferred_bytes_per_token(M70, TP, "block") == 2 * (qkv + o + fc1 + fc2) == 91648
    # Sequence parallelism: the column-parallel linears (qkv, fc1) keep their [s/tp] input part, the row-parallel
    # ones (o, fc2) their [s/tp] part of the output gradient.
    assert deferred_bytes_per_token(M70, TP, "block", True) == 2 * (qkv + o + fc1 + fc2 - 4 * (h - h // TP)) == 34304
    vocab = M70.padded_vocab_size(TP)  # the head's rows: the padded vocabulary
    assert deferred_bytes_per_token(M70, TP, "lm_head") == 2 * (h + vocab // TP)
    assert deferred_bytes_per_token(M70, TP, "lm_head", True) == 2 * (h // TP + vocab // TP)
    for kind in ("embedding", "final_norm"):  # no megatron linear: nothing deferred
        assert deferred_bytes_per_token(M70, TP, kind) == 0
    # The tied head (Llama 3.2) runs the embedding's weight through the same linear: the same widths.
    m1b = model_config("llama3.2-1b")
    assert deferred_bytes_per_token(m1b, 2, "lm_head") == 2 * (2048 + m1b.padded_vocab_size(2) // 2)
    assert awaiting_w_bytes(M70, TP, ["block"] * 3 + ["final_norm", "lm_head"]) == 3 * 91648 + 2 * (h + vocab // TP)


@pytest.mark.parametrize("pp, gas", [(4, 8), (4, 2), (8, 16), (2, 1)])
def test_held_before_backward_grows_to_stage_zero_count(pp: int, gas: int) -> None:
    for s in range(pp):
        one = held_before_backward("1f1b", pp, gas, s)
        zb = held_before_backward("zb-h1", pp, gas, s)
        assert len(one) == len(zb) == gas  # one state per B
        assert [live for live, _ in one] == [live for live, _ in zb]  # the same F/B order
        assert max(live for live, _ in one) == min(pp - s, gas) and all(w == 0 for _, w in one)
        # ZB-H1: stage s defers s weight passes, so it holds up to 1F1B's first-stage count, never more.
        most = max(live + waiting for live, waiting in zb)
        assert most <= pp and (most == pp or gas < pp)


def _activations(sp: bool, schedule: str, gas: int, recompute: bool = False) -> list[float]:
    return [
        m.activations for m in estimate(M70, TP, PP, 1, 1, gas, SEQ, recompute, sequence_parallel=sp, schedule=schedule)
    ]


@pytest.mark.parametrize("sp", [False, True])
def test_later_stages_hold_s_micro_batches_awaiting_w(sp: bool) -> None:
    """At gas 8 stage s holds what 1F1B holds plus s micro-batches awaiting W (the steady state's (pp - s, s)),
    beyond what one micro-batch alone (gas 1) differs by."""
    stages = [m.stage for m in estimate(M70, TP, PP, 1, 1, 8, SEQ, False, sequence_parallel=sp)]
    one, zb = _activations(sp, "1f1b", 8), _activations(sp, "zb-h1", 8)
    one1, zb1 = _activations(sp, "1f1b", 1), _activations(sp, "zb-h1", 1)
    sent = 2 * 2 * SEQ * M70.hidden_size // TP  # a later stage's last two gradients sent: [s/tp, b, h] each
    for s, st in enumerate(stages):
        waiting = awaiting_w_bytes(M70, TP, stage_kinds(st), sp) * SEQ
        assert (zb[s] - zb1[s]) - (one[s] - one1[s]) == pytest.approx(s * waiting + (s > 0) * sent, rel=1e-12)
        # One micro-batch: at most its W tensors more (the end of its B, when they outweigh its activations).
        assert 0 <= zb1[s] - one1[s] <= waiting
        assert zb[s] > one[s] if s else zb[s] >= one[s]
    # A micro-batch's W tensors weigh less than its activations (with or without SP): nothing more at gas 1, nor
    # on stage 0; beyond it, the gradient a stage sent and the stage before has not received yet (one [s/tp, b, h]).
    # (Each stage but the last runs B on a copy of the gradient it received: one [s/tp, b, h] more.)
    copy = 2 * SEQ * M70.hidden_size // TP
    assert [z - o for z, o in zip(zb1, one1)] == [copy] * (PP - 1) + [0] and zb[0] - one[0] == copy
    # The heaviest stage: 1F1B's (pp micro-batches at most) but for the stages' block counts (20 / 21).
    blocks = [st.blocks for st in stages]
    assert max(zb) <= max(one) * max(blocks) / blocks[0]


def test_zb_h1_recompute_keeps_the_w_tensors() -> None:
    """Full recompute shrinks what a micro-batch keeps in flight, not what it keeps for W: the last stage (one in
    flight, pp - 1 awaiting W) gains next to nothing from it under ZB-H1, stage 0 as much as under 1F1B."""
    plain, ckpt = _activations(False, "zb-h1", 8), _activations(False, "zb-h1", 8, True)
    one, one_ckpt = _activations(False, "1f1b", 8), _activations(False, "1f1b", 8, True)
    assert ckpt[0] < plain[0] / 2 and one_ckpt[0] < one[0] / 2
    assert ckpt[-1] > 0.9 * plain[-1]
