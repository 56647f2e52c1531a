"""The divergence guard for blow-ups that stay finite (issue 19): a loss spike against the run's recent history, a
dead model (zero gradient norm on a step with loss tokens), a step that multiplies the weight norm, and a save
that refuses non-finite or absurd weights. Each stops with exit 3 and one line naming the step, what was seen and
the last good checkpoint, before anything of the distrusted step is written.

Unit tests replay the guard in one process (the demo's recorded loss curve must not trip it); the fault test runs
2 gloo ranks at pp2 (tests/ranks/ckpt_worker.py) with a far too high --lr, which reproduces the issue's run: step 1
sends the weights to ~1e8, step 2's loss is 5e6, then the loss sits at ln(vocab) with a gradient norm of 0; a second
run trains sanely, saves, then blows up. What the per-step weight-norm pass costs: benchmarks/bench_guard.py."""

from __future__ import annotations

import json

import pytest
import torch

from test_checkpoint_faults import RUN, WORKER, worker
from threed.train import guard
from threed.checkpoint import save as ckpt
from threed.config import CheckpointConfig, RunConfig, RunControlConfig
from threed.cli.flags import parse_run_config
from threed.model.presets import PRESETS

# (lm loss, grad norm) of `make demo`'s 150 steps (runs/demo/ckpt/metrics.jsonl: tiny model, tp2 pp2 dp2, bf16,
# lr 3e-3), with its own spike at step 16 (loss 7.0 against a median of 5.3, grad norm 97) that it recovered from.
DEMO = [
    (6.2572, 0.7596),
    (6.2039, 0.8191),
    (6.1128, 0.7876),
    (6.0296, 0.768),
    (5.9095, 0.7494),
    (5.7475, 0.7182),
    (5.6217, 0.6447),
    (5.5033, 0.5868),
    (5.3824, 0.5596),
    (5.3047, 0.8111),
    (5.2412, 0.476),
    (5.1846, 0.4673),
    (5.1316, 0.3666),
    (5.0773, 1.1287),
    (5.0744, 0.4592),
    (6.9997, 97.3811),
    (4.9843, 0.5341),
    (5.0348, 0.5827),
    (4.9877, 2.8343),
    (4.9469, 0.6865),
    (4.9356, 0.6814),
    (4.8479, 0.5314),
    (4.8394, 1.4481),
    (4.7911, 0.5714),
    (4.7692, 0.5431),
    (4.7264, 0.5679),
    (4.6877, 0.4479),
    (4.6656, 0.712),
    (4.639, 0.5671),
    (4.6087, 0.4574),
    (4.5733, 0.5466),
    (4.5494, 0.4382),
    (4.4939, 0.5214),
    (4.4474, 0.4916),
    (4.4211, 0.4402),
    (4.3574, 0.3811),
    (4.3711, 0.5069),
    (4.3159, 0.3732),
    (4.2549, 0.5255),
    (4.1953, 0.3679),
    (4.1696, 0.4172),
    (4.1766, 0.4117),
    (4.1691, 0.3846),
    (4.0775, 0.4949),
    (4.1351, 0.3939),
    (4.0825, 0.4277),
    (4.0662, 0.3847),
    (4.0207, 0.3862),
    (3.9883, 0.3532),
    (3.997, 0.3782),
    (3.9185, 0.3701),
    (3.9343, 0.3676),
    (3.8992, 0.3514),
    (3.8973, 0.3857),
    (3.9108, 0.4153),
    (3.7961, 0.3848),
    (3.8411, 0.3983),
    (3.7958, 0.3857),
    (3.7785, 0.4023),
    (3.811, 0.4014),
    (3.7513, 0.3727),
    (3.733, 0.3901),
    (3.7152, 0.3795),
    (3.7154, 0.3803),
    (3.6869, 0.4124),
    (3.7298, 0.4467),
    (3.6649, 0.4113),
    (3.6326, 0.3882),
    (3.6651, 0.5066),
    (3.62, 0.4972),
    (3.6831, 0.479),
    (3.6011, 0.4358),
    (3.6025, 0.466),
    (3.6293, 0.5249),
    (3.5474, 0.4492),
    (3.6122, 0.4868),
    (3.5416, 0.4996),
    (3.5688, 0.4855),
    (3.615, 0.4797),
    (3.5581, 0.4565),
    (3.4914, 0.4256),
    (3.5467, 0.4769),
    (3.5185, 0.4073),
    (3.4654, 0.4479),
    (3.5527, 0.4809),
    (3.4026, 0.5077),
    (3.5485, 0.4876),
    (3.5166, 0.5049),
    (3.4819, 0.5162),
    (3.4686, 0.4753),
    (3.4035, 0.4654),
    (3.5239, 0.5197),
    (3.4299, 0.5424),
    (3.4769, 0.4779),
    (3.4948, 0.5464),
    (3.4814, 0.4642),
    (3.4772, 0.4536),
    (3.4331, 0.5032),
    (3.4548, 0.4932),
    (3.4676, 0.5691),
    (3.4221, 0.5593),
    (3.3641, 0.5653),
    (3.2876, 0.6036),
    (3.4221, 0.4632),
    (3.4458, 0.5028),
    (3.2426, 0.6327),
    (3.3217, 0.5304),
    (3.3583, 0.5222),
    (3.4533, 0.5815),
    (3.3333, 0.5814),
    (3.3773, 0.5175),
    (3.2906, 0.5675),
    (3.3861, 0.5141),
    (3.3039, 0.5235),
    (3.3179, 0.4807),
    (3.3399, 0.5074),
    (3.3551, 0.5421),
    (3.2894, 0.6496),
    (3.3051, 0.4842),
    (3.3138, 0.5686),
    (3.3537, 0.5321),
    (3.2373, 0.4804),
    (3.2636, 0.5666),
    (3.3014, 0.5369),
    (3.2609, 0.48),
    (3.2311, 0.5186),
    (3.2515, 0.5966),
    (3.3927, 0.5767),
    (3.3158, 0.5367),
    (3.2812, 0.5515),
    (3.2505, 0.5405),
    (3.2534, 0.5507),
    (3.3016, 0.5877),
    (3.2672, 0.6137),
    (3.1847, 0.5737),
    (3.1972, 0.5773),
    (3.2662, 0.5788),
    (3.253, 0.5572),
    (3.2751, 0.5939),
    (3.2536, 0.6113),
    (3.2745, 0.6052),
    (3.3163, 0.6448),
    (3.2113, 0.5406),
    (3.2407, 0.6869),
    (3.292, 0.5252),
    (3.2323, 0.5838),
    (3.2885, 0.5316),
    (3.2713, 0.5661),
    (3.1479, 0.563),
    (3.1954, 0.6342),
]


class Engine:
    """What the guard and the save's weight check read of a DeepSpeed engine: the step, whether it was applied,
    and the local module's parameters."""

    def __init__(self, module: torch.nn.Module | None = None) -> None:
        self.applied, self.global_steps = True, 0
        if module is not None:
            self.module = module

    def was_step_applied(self) -> bool:
        return self.applied


def make(tmp_path, engine=None, **control) -> tuple[guard.RunGuard, Engine]:
    cfg = RunConfig(
        model=PRESETS["tiny"],
        checkpoint=CheckpointConfig(save=str(tmp_path)),
        control=RunControlConfig(watchdog_factor=0, **control),
    )
    engine = engine or Engine()
    return guard.RunGuard(cfg.control, cfg.checkpoint.save, 0, engine, None), engine


def aborted(capsys, call) -> str:
    """Run `call`, which must stop the run with exit 3 and one line on stderr; return that line."""
    with pytest.raises(SystemExit) as e:
        call()
    assert e.value.code == guard.EXIT_DIVERGED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_demo_loss_curve_never_trips_the_guard(tmp_path, capsys):
    g, _ = make(tmp_path)
    for step, (loss, norm) in enumerate(DEMO, start=1):
        assert g.after_step(step, loss, norm) is False
    assert capsys.readouterr().err == ""


def test_a_loss_spike_that_lasts_stops_with_exit_3_naming_step_and_checkpoint(tmp_path, capsys):
    (tmp_path / "latest").write_text("global_step10")
    g, _ = make(tmp_path, spike_confirm_steps=4)
    for step, (loss, norm) in enumerate(DEMO[:30], start=1):
        g.after_step(step, loss, norm)
    for step in range(31, 34):  # above the bound, not yet for --spike-confirm-steps steps: logged, saves wait
        assert g.after_step(step, 30.0 + step, 3.0, sources="; batch sources: a 3, b 1") is False
        assert g.holding()
    warned = capsys.readouterr().err.strip().splitlines()
    assert len(warned) == 1, warned  # said once, at the spike's first step, with the batch's sources
    assert warned[0].startswith("threed: warning: loss spike at step 31: loss 61.0000 is 12.0x the median 5.0758")
    assert "; batch sources: a 3, b 1; the run goes on, saves wait" in warned[0]
    line = aborted(capsys, lambda: g.after_step(34, 30.0, 3.0))
    assert line.startswith("threed: error: the run diverged at step 34: loss 30.0000 is ")
    assert "x the median 5.0758" in line and "of the last 30 steps (--spike-factor 5)" in line
    assert "for 4 steps in a row since step 31 (--spike-confirm-steps 4)" in line
    assert f"Last good checkpoint: {tmp_path}/global_step10." in line and "lower --lr" in line


def test_a_lone_spike_is_logged_and_the_run_goes_on(tmp_path, capsys):
    """Issue 29: a blend's rare hard source at a small batch sends one batch 33x above the median; healthy."""
    g, _ = make(tmp_path)
    for step in range(1, 40):
        assert g.after_step(step, 0.2365, 0.3) is False
    assert g.after_step(40, 7.9495, 2.0, sources="; batch sources: normal 1") is False
    assert g.holding()
    assert g.after_step(41, 0.24, 0.3) is False
    assert not g.holding()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("threed: warning: loss spike at step 40: loss 7.9495 is 33.6x the median 0.2365")
    assert err[1].startswith("threed: loss back to 0.2400 at step 41") and "not a divergence" in err[1]
    for step in range(42, 200):  # a spike every 7th step, for ever: never stopped
        assert g.after_step(step, 7.9 if step % 7 == 0 else 0.24, 0.3) is False


def test_the_guard_history_survives_a_resume(tmp_path, capsys):
    g, _ = make(tmp_path, spike_confirm_steps=3)
    for step in range(1, 31):
        g.after_step(step, 5.0, 1.0)
    g.after_step(31, 40.0, 3.0)  # a spike, unconfirmed when the run is saved and stopped
    capsys.readouterr()
    state = g.state()
    resumed, _ = make(tmp_path, spike_confirm_steps=3)
    resumed.load_state(state)
    assert resumed.holding() and resumed.losses == g.losses
    resumed.after_step(32, 41.0, 3.0)
    line = aborted(capsys, lambda: resumed.after_step(33, 42.0, 3.0))  # no new 10-step warm-up: still counted
    assert "diverged at step 33" in line and "for 3 steps in a row since step 31" in line
    fresh, _ = make(tmp_path)
    fresh.load_state(None)  # a checkpoint from before the guard's state was saved
    assert fresh.losses == [] and not fresh.holding()


def test_an_absent_grad_norm_is_not_a_non_finite_one(tmp_path, capsys):
    g, engine = make(tmp_path)
    for step in range(1, 5):
        assert g.after_step(step, 5.0, None) is False
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "reports no gradient norm" in err[0] and "checks on it are off" in err[0], err
    engine.applied = False  # a skipped step is still caught without a norm
    line = aborted(capsys, lambda: g.after_step(5, 5.0, None))
    assert "non-finite loss 5.0 / grad norm nan at step 5" in line


def test_no_spike_check_before_the_warm_up_nor_for_a_small_rise_on_a_tiny_loss(tmp_path, capsys):
    g, _ = make(tmp_path)
    for step in range(1, guard.SPIKE_WARMUP + 1):  # the first steps have no history to judge against
        g.after_step(step, 100.0 if step == 2 else 5.0, 1.0)
    for step in range(20, 40):  # a memorised SFT set: 10x a near-zero loss is still a rise of less than a nat
        g.after_step(step, 0.01, 0.5)
    g2, _ = make(tmp_path)
    for step in range(1, 30):
        g2.after_step(step, 0.01 if step < 29 else 0.5, 0.5)
    assert capsys.readouterr().err == ""


def test_a_spike_right_after_a_save_says_that_checkpoint_produced_it(tmp_path, capsys):
    (tmp_path / "latest").write_text("global_step30")
    g, _ = make(tmp_path, spike_confirm_steps=1)
    for step, (loss, norm) in enumerate(DEMO[:30], start=1):
        g.after_step(step, loss, norm)
    line = aborted(capsys, lambda: g.after_step(31, 40.0, 3.0))
    assert f"{tmp_path}/global_step30 (saved just before this step: its weights gave this loss" in line
    g, _ = make(tmp_path, spike_confirm_steps=2)
    for step, (loss, norm) in enumerate(DEMO[:30], start=1):
        g.after_step(step, loss, norm)
    g.after_step(31, 40.0, 3.0)
    capsys.readouterr()
    line = aborted(capsys, lambda: g.after_step(32, 40.0, 3.0))
    assert f"{tmp_path}/global_step30 (saved just before step 31, where the spike began: its weights" in line


def test_a_dead_model_stops_on_a_step_with_loss_tokens_only(tmp_path, capsys):
    g, _ = make(tmp_path)
    g.after_step(1, 5.2983, 1.4)
    assert g.after_step(2, 5.2983, 0.0, has_loss_tokens=False) is False  # an SFT batch without responses
    line = aborted(capsys, lambda: g.after_step(3, 5.2983, 0.0))
    assert "diverged at step 3: gradient norm 0 on a step with loss tokens (loss 5.2983): the model is dead" in line
    assert "(--dead-grad-norm 1e-06)" in line and f"Last good checkpoint: none yet in {tmp_path}. Start again" in line


def test_a_weight_jump_stops_before_the_step_is_saved(tmp_path, capsys):
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64, bias=False)
    g, _ = make(tmp_path, Engine(net))
    with torch.no_grad():
        net.weight.mul_(1.5)  # a big but healthy update
    assert g.after_step(1, 5.0, 1.0) is False
    with torch.no_grad():
        net.weight.mul_(1e8)
    line = aborted(capsys, lambda: g.after_step(2, 5.0, 1.0))
    assert "diverged at step 2: the step multiplied the weight norm by 1e+08 (--weight-jump-factor 10)" in line
    with torch.no_grad():
        net.weight.fill_(float("inf"))
    line = aborted(capsys, lambda: g.after_step(3, 5.0, 1.0))
    assert "diverged at step 3: the step made the weights non-finite" in line


def test_each_check_is_off_at_0(tmp_path, capsys):
    net = torch.nn.Linear(8, 8)
    g, _ = make(tmp_path, Engine(net), spike_factor=0, dead_grad_norm=0, weight_jump_factor=0, spike_confirm_steps=1)
    for step in range(1, 20):
        g.after_step(step, 5.0, 1.0)
    with torch.no_grad():
        net.weight.mul_(1e8)
    assert g.after_step(20, 500.0, 0.0) is False
    assert capsys.readouterr().err == ""


def test_the_flags_reach_the_config():
    cfg = parse_run_config(
        [
            "--model",
            "tiny",
            "--spike-factor",
            "3",
            "--dead-grad-norm",
            "0",
            "--weight-jump-factor",
            "100",
            "--max-weight",
            "1e6",
        ]
    )
    c = cfg.control
    assert (c.spike_factor, c.dead_grad_norm, c.weight_jump_factor, c.max_weight) == (3.0, 0.0, 100.0, 1e6)
    assert RunControlConfig().spike_factor == 5.0 and RunControlConfig().max_weight == 1e4


@pytest.mark.parametrize(
    "value, said",
    [
        (float("nan"), "a non-finite weight (nan)"),
        (float("inf"), "a non-finite weight (inf)"),
        (3e5, "a weight of magnitude 3e+05 (--max-weight 10000)"),
    ],
)
def test_a_save_of_diverged_weights_is_refused_and_writes_nothing(tmp_path, capsys, value, said):
    (tmp_path / "latest").write_text("global_step4")
    net = torch.nn.Linear(8, 8)
    with torch.no_grad():
        net.weight[3, 5] = value
    engine = Engine(net)
    engine.global_steps = 6
    cfg = RunConfig(model=PRESETS["tiny"], checkpoint=CheckpointConfig(save=str(tmp_path)))
    line = aborted(capsys, lambda: ckpt.save(engine, cfg, 0))  # the fake engine has no save_checkpoint: not reached
    assert line == (
        f"threed: error: refusing to save step 6: rank 0 holds {said}: the run diverged; nothing was "
        f"written. Last good checkpoint: {tmp_path}/global_step4. Resume from it with a lower --lr or "
        f"more --warmup-steps"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]
    assert (tmp_path / "latest").read_text() == "global_step4"


def test_finite_blow_up_at_pp2_exits_3_and_saves_nothing_distrusted(tmp_path):
    """--lr 1e3 from random init: step 1 multiplies the weights ~1e4x. No checkpoint, none named."""
    save, out = tmp_path / "save", tmp_path / "out"
    p = worker(2, out, "--save", str(save), *RUN, "--save-interval", "1", "--lr", "1e3")
    assert "exitcode  : 3" in p.stdout, p.stdout[-3000:]
    lines = [line for line in p.stdout.splitlines() if "threed: error" in line]
    assert len(lines) == 1, p.stdout[-3000:]
    assert "the run diverged at step 1: the step multiplied the weight norm by" in lines[0]
    assert f"Last good checkpoint: none yet in {save}. Start again with a lower --lr" in lines[0]
    assert not (save / "latest").exists() and not list(save.glob("global_step*"))


@pytest.mark.parametrize("vpp", ["1", pytest.param("2", marks=pytest.mark.slow)])
def test_finite_blow_up_at_pp2_after_saves_names_the_last_sane_checkpoint(tmp_path, vpp):
    """Steps 1-4 at --lr 1e-3, saved at 2 and 4; from step 5 the lr is 1e3 and the weights jump. Step 4's
    checkpoint is named and kept, with sane weights, and nothing of step 5 or later is written. Also with
    interleaved stages (--vpp 2, tests/ranks/test_interleaved.py)."""
    save, out = tmp_path / "save", tmp_path / "out"
    p = worker(2, out, "--save", str(save), *RUN, "--vpp", vpp, "--lr-jump-step", "5", "--lr-jump", "1e3")
    assert "exitcode  : 3" in p.stdout, p.stdout[-3000:]
    lines = [line for line in p.stdout.splitlines() if "threed: error" in line]
    assert len(lines) == 1, p.stdout[-3000:]
    assert "the run diverged at step 5: the step multiplied the weight norm by" in lines[0]
    assert f"Last good checkpoint: {save}/global_step4. Resume from it with a lower --lr" in lines[0]
    assert (save / "latest").read_text() == "global_step4"
    assert sorted(d.name for d in save.glob("global_step*")) == ["global_step2", "global_step4"]
    layers = sorted((save / "global_step4").glob("layer_*-model_states.pt"))
    assert layers, sorted(f.name for f in (save / "global_step4").iterdir())
    checked = 0
    for f in layers:
        for name, w in torch.load(f, map_location="cpu", weights_only=True).items():
            if isinstance(w, torch.Tensor) and torch.is_floating_point(w):  # (entries like _extra_state: None)
                assert torch.isfinite(w).all() and w.abs().max() < 1e3, (f.name, name, w.abs().max())
                checked += w.numel()
    assert checked > 100_000  # the model's weights (~180k), not a stray tensor


def grad_norm_run(rank_pool, tmp_path, zero: int, clip: str) -> list[dict]:
    """A 3-step pp2 fp32 run on the session's 2-rank launch (it raises unless every rank ends well); its per-step
    {"step", "loss", "norm"}. It must finish without a guard line."""
    out = tmp_path / f"z{zero}c{clip}"
    args = ["--out", str(out), "--pp", "2", "--steps", "3", "--zero-stage", str(zero), "--grad-clip", clip]
    p = rank_pool.run(2, WORKER, args, timeout=240)
    assert "threed: error" not in p.stdout and "reports no gradient norm" not in p.stdout, p.stdout[-3000:]
    return [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]


def test_fp32_zero0_without_clipping_reports_the_model_global_grad_norm(rank_pool, tmp_path):
    """Issue 29: fp32 without ZeRO reported no gradient norm and the guard read it as NaN (exit 3 at step 1). The
    guard's own norm must equal the one ZeRO 1 reports (before clipping, over both pipeline stages) at step 1,
    where both start from the same weights, and the run must finish."""
    zero1, zero0 = grad_norm_run(rank_pool, tmp_path, 1, "1.0"), grad_norm_run(rank_pool, tmp_path, 0, "0")
    assert len(zero0) == 3 and all(r["norm"] > 0.1 for r in zero0), zero0
    assert zero0[0]["loss"] == zero1[0]["loss"]
    assert zero0[0]["norm"] == pytest.approx(zero1[0]["norm"], rel=1e-4)


@pytest.mark.slow
def test_fp32_zero0_with_clipping_reports_the_same_norms_as_zero1(rank_pool, tmp_path):
    """DeepSpeed's fp32 clipping without ZeRO computes the norm and drops it: every step's norm and loss must match
    ZeRO 1's (the same clipped updates)."""
    zero1, zero0 = grad_norm_run(rank_pool, tmp_path, 1, "1.0"), grad_norm_run(rank_pool, tmp_path, 0, "1.0")
    for a, b in zip(zero1, zero0, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["norm"] == pytest.approx(a["norm"], rel=1e-4)


def test_a_spike_over_a_zero_median_is_said_not_crashed(tmp_path, capsys):
    g, _ = make(tmp_path)
    for step in range(1, 20):  # a memorised set: the loss is 0
        g.after_step(step, 0.0, 0.1)
    assert g.after_step(20, 2.0, 0.5) is False
    err = capsys.readouterr().err
    assert "loss spike at step 20: loss 2.0000 is infx the median 0.0000" in err


def identity(data: str = "/d/easy", lr: float = 3e-3, init=None, content: str = "sha256:a") -> dict:
    """A `guard.run_identity` as a checkpoint records it: one dataset, the cosine schedule, the init."""
    return {
        "data": {"split": "100,0,0", "blend": [[None, data, content]]},
        "schedule": {"kind": "cosine", "lr": lr, "min_lr": 3e-5, "warmup_steps": 0, "decay_end": 100},
        "init": init,
    }


def resumed(tmp_path, state: dict, now: dict, **control) -> guard.RunGuard:
    engine = Engine()
    engine.global_steps = 40
    cfg = RunConfig(model=PRESETS["tiny"], checkpoint=CheckpointConfig(save=str(tmp_path)))
    g = guard.RunGuard(RunControlConfig(watchdog_factor=0, **control), cfg.checkpoint.save, 0, engine, None, None, now)
    g.load_state(state)
    return g


def easy_history(tmp_path) -> dict:
    """40 steps of an easy source (loss ~0.3), saved: the window a resume would judge against."""
    g = guard.RunGuard(RunControlConfig(watchdog_factor=0), str(tmp_path), 0, Engine(), None, None, identity())
    for step in range(1, 41):
        g.after_step(step, 0.3 + 0.01 * (step % 3), 0.3)
    return g.state()


def test_a_resume_onto_new_harder_data_starts_a_new_window_and_is_not_stopped(tmp_path, capsys):
    """Issue 39: the loss of new, harder data is 20x the old median while it falls; the old window would stop it."""
    state = easy_history(tmp_path)
    assert state["identity"] == identity()
    stale = resumed(tmp_path, state, identity(), spike_confirm_steps=3)  # the same data: the old window stops it
    stale.after_step(41, 6.0, 1.0)
    stale.after_step(42, 5.9, 1.0)
    capsys.readouterr()
    assert "diverged at step 43: loss 5.8000 is" in aborted(capsys, lambda: stale.after_step(43, 5.8, 1.0))
    g = resumed(tmp_path, state, identity(data="/d/hard"))
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "threed: the resume at step 40 changed the training data (/d/easy -> /d/hard): the loss-spike check starts a "
        "new window (the first 10 steps' losses) instead of judging the new losses against the old; the weight-jump, "
        "dead-gradient and non-finite checks stay on"
    ]
    for step in range(41, 101):
        assert g.after_step(step, 6.0 - 0.03 * (step - 41), 1.0) is False
    assert capsys.readouterr().err == ""
    assert g.state()["identity"] == identity(data="/d/hard")


def test_a_divergence_right_after_a_data_change_is_still_stopped_and_named(tmp_path, capsys):
    g = resumed(tmp_path, easy_history(tmp_path), identity(content="sha256:b"), spike_confirm_steps=3)
    assert "changed the training data (the content of /d/easy changed (its fingerprint))" in capsys.readouterr().err
    for step in range(41, 53):
        g.after_step(step, 6.0, 1.0)
    g.after_step(53, 60.0, 9.0)
    g.after_step(54, 61.0, 9.0)
    assert "loss spike at step 53" in capsys.readouterr().err
    line = aborted(capsys, lambda: g.after_step(55, 62.0, 9.0))
    assert "the run diverged at step 55: loss 62.0000 is 10.3x the median 6.0000 of the last 12 steps" in line
    assert "saved just before" not in line  # the change gave this loss, not the checkpoint
    assert (
        "The resume at step 40 changed the training data (the content of /d/easy changed (its fingerprint)), the "
        "likely cause: Start again with the previous data, or check the new data" in line
    )
    assert line.endswith(
        "if the run was healthy, raise --spike-factor or --spike-confirm-steps (--spike-factor 0 turns the check off)"
    )


@pytest.mark.parametrize(
    "now, said, fix",
    [
        (identity(lr=1e-2), "the learning-rate schedule (--lr 0.003 -> 0.01)", "the previous learning-rate schedule"),
        (identity(init="/ck/a"), "the model's init (--init-from none -> /ck/a)", "the previous --init-from weights"),
    ],
    ids=["lr", "init"],
)
def test_a_schedule_or_init_change_resets_the_window_and_is_named_by_a_stop(tmp_path, capsys, now, said, fix):
    g = resumed(tmp_path, easy_history(tmp_path), now, skip_nonfinite=0)
    assert f"changed {said}: the loss-spike check starts a new window" in capsys.readouterr().err
    assert g.losses == [] and not g.holding()
    line = aborted(capsys, lambda: g.after_step(41, float("nan"), 1.0))
    assert f"The resume at step 40 changed {said}, the likely cause: Start again with {fix}" in line
    assert line.endswith("or allow skipping such batches with --skip-nonfinite N")


def test_a_checkpoint_without_an_identity_keeps_its_window(tmp_path, capsys):
    state = easy_history(tmp_path)
    del state["identity"]  # saved before the guard recorded what the losses depend on
    g = resumed(tmp_path, state, identity(data="/d/hard"))
    assert len(g.losses) == 40 and capsys.readouterr().err == ""


def test_the_stop_hints_say_which_way_makes_each_check_less_sensitive(tmp_path, capsys):
    g, _ = make(tmp_path)
    g.after_step(1, 5.0, 1.0)
    line = aborted(capsys, lambda: g.after_step(2, 5.0, 0.0))
    assert "lower --dead-grad-norm: the check stops a step whose gradient norm is at most it (0 turns it off)" in line
    assert "raise" not in line.split("if the run was healthy")[1]
