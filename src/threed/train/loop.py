"""Train a Llama with megatron-core TP x DeepSpeed PP x ZeRO-1 DP.

    torchrun --nproc-per-node 8 -m threed.train --model tiny --tp 2 --pp 2 \
        --data-path 0.3 runs/demo/a_text_document 0.7 runs/demo/b_text_document --split 95,5,0 ...
    threed train ...            # the same, as a console script

One step: the first stage reads micro-batches and embeds them; hidden states flow stage to stage (1F1B); the
last stage computes the vocab-parallel loss; DeepSpeed runs backward, all-reduces gradients over DP, clips,
and steps AdamW on fp32 master weights (ZeRO-1 shards optimizer state over DP).

Preemption: SIGUSR1 / SIGTERM (Slurm's --signal, scancel, torchrun's forwarded SIGTERM), Ctrl-C (SIGINT) or a
file named `STOP` in the save directory make every rank save a checkpoint at the next step boundary and exit 0;
the next run resumes from it (and removes the STOP file left behind, saying so).

One run per save directory: rank 0 holds `<save>/threed.lock` from before anything is written to --save until
the run ends, however it ends (threed.checkpoint.lock; a killed job's lock goes with its process).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from threed.checkpoint.lock import SaveLock
from threed.checkpoint.save import save
from threed.checkpoint.start import StartDecision, start as checkpoint_start
from threed.config import ConfigError, RunConfig
from threed.data.checks import check_cache_visible
from threed.data.datasets import build_datasets
from threed.data.loader import SampleCounter, micro_batches, token_weighted
from threed.data.splits import DataSplits, read_data_flags
from threed.model.context import preflight, share_batches
from threed.parallel.distributed import Runtime, context_rank, grid_coordinates, init_distributed, loss_rank
from threed.engine.build import build_engine
from threed.train.guard import RunGuard, StopRequest
from threed.train.preflight import check_run
from threed.train.samples import after_step as samples_after_step, prepare as prepare_samples
from threed.train.evaluate import evaluate
from threed.metrics.writer import RunMetrics
from threed.model.spec import parameter_count
from threed.parallel.partition import recompute_summary


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    start_step: int = 0
    end_step: int = 0
    saved_to: Optional[str] = None
    preempted: bool = False
    consumed_samples: int = 0
    evals: list[dict] = field(default_factory=list)  # {"step", "loss", "tokens", "loss/<dataset>": ...}
    samples_read: int = 0  # train + valid samples this rank read (0 on middle pipeline stages)
    loss_tokens: list[int] = field(default_factory=list)  # SFT, last stage: the tokens each step's loss counted


def checked_data_splits(cfg: RunConfig, rank: int, world: int):
    """Rank 0 runs every check before building (`threed.train.preflight.check_run`, what `threed check-config
    --paths` runs; the data checks read every token of small datasets: on a 1,000-rank job every rank doing it would
    read the corpus 1,000 times from the shared filesystem) and tells everyone the verdict, so all ranks stop
    together with the same one-line error (printed once) instead of waiting in the builder's barrier. What could
    not be checked (data without a sidecar) is said once, by rank 0."""
    verdict: list = [None]
    if rank == 0:
        try:
            for note in check_run(cfg, world).notes:
                print(f"threed: {note}", flush=True)
        except ConfigError as e:
            verdict[0] = str(e)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])
    return read_data_flags(cfg)  # the flags' reading of the splits: cheap, the same on every rank


def step_batches(batches, gas: int, sft: bool, engine, device: torch.device) -> tuple[Optional[object], Optional[int]]:
    """What DeepSpeed reads for one step, and (SFT, last stage) the global batch's loss-token count. SFT: the step's
    micro-batches are read first so that the last stage can weigh every response token of the global batch alike
    (`token_weighted`, one all-reduce over data parallel)."""
    if batches is None or not sft:
        return batches, None
    step = [next(batches) for _ in range(gas)]
    loss_tokens = None
    if engine.is_last_stage():
        step, loss_tokens = token_weighted(step, engine.grid.get_data_parallel_group(), device)
    return iter(step), loss_tokens


def batch_sources(dataset, first: int, count: int) -> str:
    """What a global batch (samples [first, first + count)) was made of, for the guard's loss-spike warning: read
    from the blend's index, no sample is read. Asked for only when a loss spikes."""
    if dataset is None:
        return ""
    index = getattr(dataset, "dataset_index", None)
    parts = getattr(dataset, "datasets", None)
    if index is None or parts is None:  # one dataset, not a blend
        return f"; batch sources: {Path(str(getattr(dataset, 'dataset_path', '?'))).name} {count}"
    tally = Counter(int(index[i]) for i in range(first, min(first + count, len(index))))
    names = [Path(str(getattr(d, "dataset_path", f"dataset {k}"))).name for k, d in enumerate(parts)]
    return "; batch sources: " + ", ".join(f"{names[k]} {n}" for k, n in sorted(tally.items()))


@contextlib.contextmanager
def recorded_stop(metrics: RunMetrics, step: int, samples: int) -> Iterator[None]:
    """A guard's stop inside the block (exit 3: diverged) is recorded in the metrics as `exit-status` at `step`,
    so `threed report` says the run was stopped instead of reading like a healthy short run."""
    try:
        yield
    except SystemExit as e:
        metrics.log(step, {"exit-status": int(e.code or 0)}, samples=samples, line=False)
        raise


def stopped_line(cfg: RunConfig, step: int, saved_to: Optional[str]) -> str:
    """What a stop request (signal, STOP file, time budget) ends with: where step `step` was saved, or, for a run
    without --save, that nothing could be."""
    if not cfg.checkpoint.save:
        return (
            f"stop requested: stopped after step {step}; nothing could be saved (the run has no --save), so a "
            f"restart begins again from its start"
        )
    return f"stop requested: saved step {step} to {saved_to}; exiting for a restart"


def log(is_logger: bool, msg: str) -> None:
    if is_logger:
        print(msg, flush=True)


def train(cfg: RunConfig) -> TrainResult:
    if cfg.train.steps == 0:
        raise ConfigError(
            "--steps 0 trains nothing (it is the total step count to train to); give --steps N >= 1, "
            "or check a configuration without building it with `threed check-config`"
        )
    # The configuration is checked before any process group exists: torchrun's WORLD_SIZE, else a world of one.
    cfg.validate(int(os.environ.get("WORLD_SIZE", "1")))
    rt = init_distributed(cfg.control.dist_timeout_minutes)
    cfg.validate(rt.world_size)  # the same world (a launcher of another kind may set it only now)
    preflight(cfg.parallel.cp, rt.device, cfg.train.dtype)  # a CP attention kernel that would mask top-left
    recompute_summary(cfg)  # --recompute-num-layers against the stages' blocks, before anything is built
    splits = checked_data_splits(
        cfg, rt.rank, rt.world_size
    )  # every data problem, before datasets or the model are built
    # Rank 0 holds --save's lock from checkpoint_start on; it is released on every way out of this block (the
    # end, exit 2/3, an exception, Ctrl-C), and by the kernel when the process is killed.
    with SaveLock(cfg.checkpoint.save) as lock, StopRequest.restoring_handlers():
        # Where the run starts (resume / refuse / universal conversion) and --save checks, before any dataset.
        start_decision = checkpoint_start(cfg, rt.rank, rt.world_size, lock=lock)
        if start_decision.finished:  # said on rank 0; nothing converted or built
            return TrainResult(start_step=start_decision.source.step, end_step=start_decision.source.step)
        return _train(cfg, rt, splits, start_decision)


def _train(cfg: RunConfig, rt: Runtime, splits: DataSplits, start_decision: StartDecision) -> TrainResult:
    """The run, from the start rank 0 decided and prepared."""
    tp, pp, cp, dp = cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.cp, cfg.parallel.dp(rt.world_size)
    micro, gas, glob = cfg.train.resolve_batch(dp)
    # The CP ranks of a data-parallel rank read the same rows (the sampler sees dp only), each keeping its share.
    stage, dp_rank, _ = grid_coordinates(rt.rank, tp, dp, cp)
    # One rank speaks: the one that holds the loss and writes the metrics (last stage, tp 0, cp 0, dp 0), so on a
    # multi-node job every line of a run is in one node's log.
    logger = rt.rank == loss_rank(tp, pp, dp, cp=cp)
    reads_data = stage in (0, pp - 1)  # the first stage embeds tokens, the last computes the loss
    if cfg.data.data_cache_path:
        check_cache_visible(cfg.data.data_cache_path, rt.rank)
    data = build_datasets(cfg, splits, glob, builds_here=reads_data)
    stop = StopRequest(cfg.checkpoint.save)
    samples = prepare_samples(cfg)  # --generate-interval / --harness-interval: prompts, tokenizer, tasks checked
    built = build_engine(cfg, rt, start_decision, token_weighted=splits.sft)
    engine = built.engine
    guard = RunGuard(cfg, rt.rank, engine, stop, rt.device)  # stop request, non-finite steps, time budget, watchdog
    guard.load_state(built.client_state.get("guard"))  # the loss history a resume judges against
    start = engine.global_steps
    # Consumed samples position the sampler; a checkpoint from before they were recorded had a constant batch.
    consumed = int(built.client_state.get("consumed_samples", start * glob))
    result = TrainResult(start_step=start, end_step=start)
    log(
        logger,
        f"threed: world {rt.world_size} = tp {tp} x pp {pp} x " + (f"cp {cp} x " if cp > 1 else "") + f"dp {dp} on "
        f"{rt.device.type}/{rt.backend}; global batch {glob} = micro {micro} x gas {gas} x dp {dp}; "
        f"{cfg.model.name} {parameter_count(cfg.model) / 1e6:.1f}M params; dtype {cfg.train.dtype}; "
        + (f"pipeline schedule {cfg.parallel.pipeline_schedule}; " if pp > 1 else "")
        + f"recompute: {recompute_summary(cfg)}; "
        + (
            f"resumed from {built.resumed_from} at step {start} ({consumed} samples consumed)"
            if built.resumed_from
            else f"weights from {cfg.checkpoint.init_from}"
            if cfg.checkpoint.init_from
            else "random init"
        )
        + (
            f"; validation every {splits.eval_interval} steps ({cfg.train.eval_iters} batches)"
            if splits.eval_interval
            else "; no validation"
        )
        + (
            f"; SFT data, response-only loss, {'packed' if cfg.data.pack else 'one example per'} sequence"
            if splits.sft
            else ""
        ),
    )
    counter = SampleCounter()
    batches = (
        share_batches(
            micro_batches(data.train, glob, micro, dp, dp_rank, consumed, cfg.model.vocab_size, counter=counter),
            cp,
            context_rank(rt.rank, tp, cp),
        )
        if reads_data
        else None
    )
    metrics = RunMetrics(cfg, engine, rt, built.ds_config, start)  # every rank: times its stage; the loss rank writes
    waiting = False  # an interval save is due and waits for an unconfirmed loss spike to end
    for step in range(start, cfg.train.steps):
        step_iter, loss_tokens = step_batches(batches, gas, splits.sft, engine, rt.device)
        loss = engine.train_batch(data_iter=step_iter).item()
        first_sample, consumed = consumed, consumed + glob
        reported = engine.get_global_grad_norm()  # None: not reported, which the guard never reads as non-finite
        norm = float(reported) if reported is not None else float("nan")
        result.losses.append(loss)
        result.grad_norms.append(norm)
        if loss_tokens is not None:
            result.loss_tokens.append(loss_tokens)
        result.end_step = step + 1
        result.consumed_samples = consumed
        metrics.step(
            step + 1, loss, norm, samples=consumed, loss_tokens=loss_tokens
        )  # every rank (one all-gather per log interval)
        # The step's one control all-reduce: exit 3 on divergence (before the step can be saved); True: every rank
        # saves and exits after this step. SFT: only the last stage knows whether the step had loss tokens.
        has_loss_tokens = not splits.sft or bool(loss_tokens)
        with recorded_stop(metrics, step + 1, consumed):
            stop_now = guard.after_step(
                step + 1,
                loss,
                None if reported is None else norm,
                has_loss_tokens,
                sources=lambda: batch_sources(data.train, first_sample, glob),
            )
        last = step + 1 == cfg.train.steps
        if splits.eval_interval and ((step + 1) % splits.eval_interval == 0 or last):
            # Evaluation k reads the k-th block of eval_iters valid batches (the last one may be off-interval).
            index = (
                (step + 1) // splits.eval_interval - 1
                if (step + 1) % splits.eval_interval == 0
                else (step + 1) // splits.eval_interval
            )
            ev = evaluate(
                engine,
                data.valid,
                data.valid_names,
                index,
                cfg.train.eval_iters,
                micro,
                gas,
                cfg.model.vocab_size,
                rt.device,
                counter=counter,
            )
            metrics.validation(step + 1, ev.loss, {Path(k).name: v for k, v in ev.per_dataset.items()}, consumed)
            result.evals.append(
                {
                    "step": step + 1,
                    "loss": ev.loss,
                    "tokens": ev.tokens,
                    **{f"loss/{k}": v for k, v in ev.per_dataset.items()},
                }
            )
            per = "".join(f" | {Path(k).name} {v:.4f}" for k, v in ev.per_dataset.items())
            log(
                logger,
                f"validation at step {step + 1} | loss {ev.loss:.4f} | perplexity {ev.perplexity:.2f} | "
                f"{ev.tokens} tokens{per}",
            )
        samples_after_step(samples, step + 1, engine, metrics, logger)  # generations / harness scores when due
        interval = cfg.checkpoint.save_interval
        # An interval save waits while a loss spike is unconfirmed (the guard's `holding`), and is made at the
        # first step after it: `latest` never names weights a spike may have ruined. A stop or the last step saves.
        waiting = waiting or bool(interval and (step + 1) % interval == 0)
        due = last or (waiting and not guard.holding())
        if cfg.checkpoint.save and (stop_now or due):
            with recorded_stop(metrics, step + 1, consumed):  # a save of diverged weights is refused: exit 3
                saved = save(engine, cfg, rt.rank, {"consumed_samples": consumed, "guard": guard.state()})
            guard.saved(saved.seconds)  # the time budget keeps room for one more save
            result.saved_to = saved.path
            waiting = False
        if stop_now:
            result.preempted = True
            log(logger, stopped_line(cfg, step + 1, result.saved_to))
            break
        if cfg.checkpoint.save and due:
            log(logger, f"saved checkpoint step {step + 1} to {cfg.checkpoint.save}")
    guard.close()
    metrics.close()
    result.samples_read = counter.samples
    return result
