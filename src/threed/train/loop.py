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
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import torch.distributed as dist

from threed.checkpoint.async_save import AsyncSaver, Published
from threed.checkpoint.lock import SaveLock
from threed.checkpoint.save import save
from threed.checkpoint.start import StartDecision, start as checkpoint_start
from threed.config import ConfigError, RunConfig
from threed.data.checks import check_cache_visible
from threed.data.datasets import build_datasets
from threed.data.loader import SampleCounter, micro_batches, on_device, token_weighted
from threed.data.splits import DataSplits, read_data_flags
from threed.model.context import preflight, share_batches
from threed.parallel.distributed import Runtime, context_rank, grid_coordinates, init_distributed, loss_rank
from threed.engine.build import build_engine
from threed.engine.resolved import ResolvedRun, resolve
from threed.train.guard import RunGuard, StopRequest, run_identity
from threed.train.host_gc import StepCollector
from threed.train.preflight import check_run
from threed.train.samples import after_step as samples_after_step, prepare as prepare_samples
from threed.train.evaluate import evaluate
from threed.metrics.writer import RunMetrics
from threed.model.spec import parameter_count


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

    def record(self, step: int, loss: float, norm: float, loss_tokens: Optional[int], consumed: int) -> None:
        """Step `step` (1-based) ended with `loss` and gradient norm `norm`, `consumed` samples read so far."""
        self.losses.append(loss)
        self.grad_norms.append(norm)
        if loss_tokens is not None:
            self.loss_tokens.append(loss_tokens)
        self.end_step = step
        self.consumed_samples = consumed


def checked_data_splits(run: ResolvedRun, rank: int):
    """Rank 0 runs every check before building (`threed.train.preflight.check_run`, what `threed check-config
    --paths` runs; the data checks read every token of small datasets: on a 1,000-rank job every rank doing it would
    read the corpus 1,000 times from the shared filesystem) and tells everyone the verdict, so all ranks stop
    together with the same one-line error (printed once) instead of waiting in the builder's barrier. What could
    not be checked (data without a sidecar) is said once, by rank 0."""
    verdict: list = [None]
    if rank == 0:
        try:
            for note in check_run(run).notes:
                print(f"threed: {note}", flush=True)
        except ConfigError as e:
            verdict[0] = str(e)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is not None:
        raise ConfigError(verdict[0])
    return read_data_flags(run.cfg)  # the flags' reading of the splits: cheap, the same on every rank


def step_batches(batches, gas: int, sft: bool, engine, rt: Runtime) -> tuple[Optional[object], Optional[int]]:
    """What DeepSpeed reads for one step, and (SFT, last stage) the global batch's loss-token count. The step's
    micro-batches are read first and reach the device together (threed.data.loader.on_device: one pinned,
    non-blocking copy per step), so DeepSpeed's per-micro-batch `.to(device)` finds them there and the host never
    waits for a copy inside the step. SFT: before they move, the last stage weighs every response token of the global
    batch alike (`token_weighted`, one all-reduce over data parallel, at the step's start)."""
    if batches is None:
        return None, None
    step = [next(batches) for _ in range(gas)]
    loss_tokens = None
    if sft and engine.is_last_stage():
        step, loss_tokens = token_weighted(step, engine.grid.get_data_parallel_group(), rt.device)
    return iter(on_device(step, rt.device, rt.cuda_only.pinned_batches)), loss_tokens


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


def train(run: ResolvedRun) -> TrainResult:
    """`run`: the config resolved once, before torch and DeepSpeed were imported (threed.cli.main; a caller in
    process resolves it with threed.engine.resolved.resolve)."""
    rt = init_distributed(run.cfg.control.dist_timeout_minutes)
    if rt.world_size != run.world:  # a launcher of another kind may set the world only now: resolved at its size
        run = resolve(run.cfg, rt.world_size)
    cfg = run.cfg
    preflight(cfg.parallel.cp, rt.device, cfg.train.dtype)  # a CP attention kernel that would mask top-left
    splits = checked_data_splits(run, rt.rank)  # every data problem, before datasets or the model are built
    # Rank 0 holds --save's lock from checkpoint_start on; it is released on every way out of this block (the
    # end, exit 2/3, an exception, Ctrl-C), and by the kernel when the process is killed.
    with SaveLock(cfg.checkpoint.save) as lock, StopRequest.restoring_handlers():
        # Where the run starts (resume / refuse / universal conversion) and --save checks, before any dataset.
        start_decision = checkpoint_start(cfg, run.dims, rt.rank, lock=lock)
        if start_decision.finished:  # said on rank 0; nothing converted or built
            return TrainResult(start_step=start_decision.source.step, end_step=start_decision.source.step)
        return _train(run, rt, splits, start_decision)


@dataclass
class Running:
    """What one run holds between its steps: built once by `_begin`, read and advanced by `_step`."""

    run: ResolvedRun
    rt: Runtime
    splits: DataSplits
    engine: object
    data: object  # threed.data.datasets: train / valid datasets and the valid names
    guard: RunGuard
    metrics: RunMetrics
    samples: object  # generations / harness scores during training (threed.train.samples), or None
    batches: Optional[Iterator]  # this rank's training micro-batches (first and last stage only)
    counter: SampleCounter
    logger: bool  # the one rank that speaks: the loss rank
    consumed: int  # samples consumed so far (positions the sampler)
    result: TrainResult
    waiting: bool = False  # an interval save is due and waits for an unconfirmed loss spike to end
    saver: Optional[AsyncSaver] = None  # --async-save: the save being written in the background, if any


def _train(run: ResolvedRun, rt: Runtime, splits: DataSplits, start_decision: StartDecision) -> TrainResult:
    """The run, from the start rank 0 decided and prepared: build, step until the last step or a stop, close."""
    r = _begin(run, rt, splits, start_decision)
    # Python's garbage collector runs between steps only, never inside a micro-batch (threed.train.host_gc).
    with StepCollector(rt.device, run.cfg.train.log_interval) as collector:
        for step in range(r.result.start_step, run.cfg.train.steps):
            stop = _step(r, step)
            loud = collector.after_step(step + 1, r.metrics)
            if loud:
                log(r.logger, loud)
            if stop:
                break
    if r.saver is not None:  # the last step's save was waited for; this one catches any other way out of the loop
        _published(r, r.saver.finish("the run ends"))
    r.guard.close()
    r.metrics.close()
    r.result.samples_read = r.counter.samples
    return r.result


def _begin(run: ResolvedRun, rt: Runtime, splits: DataSplits, start_decision: StartDecision) -> Running:
    """Datasets, the engine, the guard, the metrics writer and the start-up line."""
    cfg, d = run.cfg, run.dims
    # The CP ranks of a data-parallel rank read the same rows (the sampler sees dp only), each keeping its share.
    stage, dp_rank, _ = grid_coordinates(rt.rank, d.tp, d.dp, d.cp)
    # One rank speaks: the one that holds the loss and writes the metrics (last stage, tp 0, cp 0, dp 0), so on a
    # multi-node job every line of a run is in one node's log.
    logger = rt.rank == loss_rank(d.tp, d.pp, d.dp, cp=d.cp)
    reads_data = stage in (0, d.pp - 1)  # the first stage embeds tokens, the last computes the loss
    if cfg.data.data_cache_path:
        check_cache_visible(cfg.data.data_cache_path, rt.rank)
    data = build_datasets(cfg, splits, d.global_batch, builds_here=reads_data)
    stop = StopRequest(cfg.checkpoint.save)
    samples = prepare_samples(cfg)  # --generate-interval / --harness-interval: prompts, tokenizer, tasks checked
    built = build_engine(run, rt, start_decision, token_weighted=splits.sft)
    engine = built.engine
    # Stop request, non-finite steps, time budget, watchdog; what the losses depend on, compared on resume.
    guard = RunGuard(cfg.control, cfg.checkpoint.save, rt.rank, engine, stop, rt.device, run_identity(cfg, splits))
    guard.load_state(built.client_state.get("guard"))  # the loss history a resume judges against, unless it changed
    start = engine.global_steps
    # Consumed samples position the sampler; a checkpoint from before they were recorded had a constant batch.
    consumed = int(built.client_state.get("consumed_samples", start * d.global_batch))
    log(logger, start_line(run, rt, built.resumed_from, start, consumed, splits))
    counter = SampleCounter()
    batches = None
    if reads_data:
        rows = micro_batches(
            data.train, d.global_batch, d.micro, d.dp, dp_rank, consumed, cfg.model.vocab_size, counter=counter
        )
        batches = share_batches(rows, d.cp, context_rank(rt.rank, d.tp, d.cp))
    metrics = RunMetrics(
        cfg, d, engine, rt, built.ds_config, start
    )  # every rank: times its stage; the loss rank writes
    result = TrainResult(start_step=start, end_step=start)
    saver = None
    if cfg.checkpoint.save and cfg.checkpoint.async_save:  # refused here when the host copies cannot fit
        saver = AsyncSaver(cfg, rt.rank, rt.device, lambda line: log(logger, line))
    r = Running(
        run, rt, splits, engine, data, guard, metrics, samples, batches, counter, logger, consumed, result, saver=saver
    )
    if saver is not None:  # a stop for divergence publishes a pending save, then names it as the last good one
        guard.settle_saves = lambda: _published(r, saver.finish("exiting (the run diverged)"))
    return r


def start_line(run: ResolvedRun, rt: Runtime, resumed_from, start: int, consumed: int, splits: DataSplits) -> str:
    """The run's one start-up line: the layout, the batch, the model, recompute, where it starts, validation, SFT."""
    cfg, d = run.cfg, run.dims
    where = (
        f"resumed from {resumed_from} at step {start} ({consumed} samples consumed)"
        if resumed_from
        else f"weights from {cfg.checkpoint.init_from}"
        if cfg.checkpoint.init_from
        else "random init"
    )
    validation = (
        f"; validation every {splits.eval_interval} steps ({cfg.train.eval_iters} batches)"
        if splits.eval_interval
        else "; no validation"
    )
    sft = (
        f"; SFT data, response-only loss, {'packed' if cfg.data.pack else 'one example per'} sequence"
        if splits.sft
        else ""
    )
    return (
        f"threed: world {rt.world_size} = {d.layout} on {rt.device.type}/{rt.backend}; global batch "
        f"{d.global_batch} = micro {d.micro} x gas {d.gas} x dp {d.dp}; {cfg.model.name} "
        f"{parameter_count(cfg.model) / 1e6:.1f}M params; dtype {cfg.train.dtype}; "
        + (f"pipeline schedule {d.schedule}; " if d.pp > 1 else "")
        + f"recompute: {d.recompute_phrase}; "
        + where
        + validation
        + sft
    )


def _step(r: Running, step: int) -> bool:
    """One training step and what is due after it (guard, validation, samples, save); True: stop after it."""
    cfg, d = r.run.cfg, r.run.dims
    step_iter, loss_tokens = step_batches(r.batches, d.gas, r.splits.sft, r.engine, r.rt)
    loss = r.engine.train_batch(data_iter=step_iter).item()
    first_sample, r.consumed = r.consumed, r.consumed + d.global_batch
    reported = r.engine.get_global_grad_norm()  # None: not reported, which the guard never reads as non-finite
    norm = float(reported) if reported is not None else float("nan")
    r.result.record(step + 1, loss, norm, loss_tokens, r.consumed)
    r.metrics.step(step + 1, loss, norm, samples=r.consumed, loss_tokens=loss_tokens)  # every rank (an all-gather)
    # The step's one control all-reduce: exit 3 on divergence (before the step can be saved); True: every rank
    # saves and exits after this step. SFT: only the last stage knows whether the step had loss tokens.
    has_loss_tokens = not r.splits.sft or bool(loss_tokens)
    with recorded_stop(r.metrics, step + 1, r.consumed):
        stop_now = r.guard.after_step(
            step + 1,
            loss,
            None if reported is None else norm,
            has_loss_tokens,
            sources=lambda: batch_sources(r.data.train, first_sample, d.global_batch),
        )
    last = step + 1 == cfg.train.steps
    if r.splits.eval_interval and ((step + 1) % r.splits.eval_interval == 0 or last):
        _validate(r, step + 1)
    samples_after_step(r.samples, step + 1, r.engine, r.metrics, r.logger)  # generations / harness scores when due
    return _save_or_stop(r, step + 1, stop_now, last)


def _validate(r: Running, step: int) -> None:
    """Evaluation k reads the k-th block of eval_iters valid batches (the last one may be off-interval)."""
    cfg, d, every = r.run.cfg, r.run.dims, r.splits.eval_interval
    index = step // every - 1 if step % every == 0 else step // every
    ev = evaluate(
        r.engine,
        r.data.valid,
        r.data.valid_names,
        index,
        cfg.train.eval_iters,
        d.micro,
        d.gas,
        cfg.model.vocab_size,
        r.rt.device,
        counter=r.counter,
    )
    r.metrics.validation(step, ev.loss, {Path(k).name: v for k, v in ev.per_dataset.items()}, r.consumed)
    r.result.evals.append(
        {"step": step, "loss": ev.loss, "tokens": ev.tokens, **{f"loss/{k}": v for k, v in ev.per_dataset.items()}}
    )
    per = "".join(f" | {Path(k).name} {v:.4f}" for k, v in ev.per_dataset.items())
    log(
        r.logger,
        f"validation at step {step} | loss {ev.loss:.4f} | perplexity {ev.perplexity:.2f} | {ev.tokens} tokens{per}",
    )


def _save_or_stop(r: Running, step: int, stop_now: bool, last: bool) -> bool:
    """An interval save waits while a loss spike is unconfirmed (the guard's `holding`), and is made at the first
    step after it: `latest` never names weights a spike may have ruined. A stop or the last step saves."""
    ckpt = r.run.cfg.checkpoint
    interval = ckpt.save_interval
    r.waiting = r.waiting or bool(interval and step % interval == 0)
    due = last or (r.waiting and not r.guard.holding())
    if r.saver is not None:  # every boundary: publishes a background save once every rank has written it
        _published(r, r.saver.poll())
    if ckpt.save and (stop_now or due):
        client = {"consumed_samples": r.consumed, "guard": r.guard.state()}
        with recorded_stop(r.metrics, step, r.consumed):  # a save of diverged weights is refused: exit 3
            if r.saver is not None:
                _save_async(r, step, client, "exiting" if stop_now or last else None)
            else:
                saved = save(r.engine, r.run.cfg, r.rt.rank, client)
                r.guard.saved(saved.seconds)  # the time budget keeps room for one more save
        r.result.saved_to = ckpt.save
        r.waiting = False
    if stop_now:
        r.result.preempted = True
        log(r.logger, stopped_line(r.run.cfg, step, r.result.saved_to))
        return True
    if ckpt.save and due and r.saver is None:
        log(r.logger, f"saved checkpoint step {step} to {ckpt.save}")
    return False


def _save_async(r: Running, step: int, client: dict, final: Optional[str]) -> None:
    """--async-save: a pending save is published first (a second save waits for the first), then this one is
    copied and written in the background; `final` (the run is about to exit): waited for and published now."""
    _published(r, r.saver.finish("the next save"))
    blocked = r.saver.save(r.engine, client)
    log(r.logger, f"checkpoint step {step}: training blocked {blocked:.2f} s; writing in the background")
    if final:
        _published(r, r.saver.finish(final))


def _published(r: Running, done: Optional[Published]) -> None:
    """A background save was published: its line (blocked and time-to-publish as separate fields), its metrics
    (at the step just taken, which may be later than the checkpoint's), and the guard's time budget (which keeps
    room for a whole save: the last one is waited for)."""
    if done is None:
        return
    r.guard.saved(done.seconds)
    scalars = {"checkpoint/step": done.step, "checkpoint/blocked_s": done.blocked, "checkpoint/publish_s": done.seconds}
    r.metrics.log(r.result.end_step, scalars, samples=r.consumed, line=False)
    log(
        r.logger,
        f"saved checkpoint step {done.step} to {done.path} | training blocked {done.blocked:.2f} s | published "
        f"after {done.seconds:.2f} s",
    )
