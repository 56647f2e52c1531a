"""What the model can do, while it trains, through the same engine (no export, no second job): every
--generate-interval steps the continuations of --generate-prompts (greedy), and every --harness-interval steps
lm-evaluation-harness scores on --harness-tasks (--harness-limit documents each), into metrics.jsonl and TensorBoard
beside the validation loss.

It must not change the run: the losses with it are bit-identical to those without (tests/ranks/test_samples.py).
So it draws no random number from the run's generators (lm-eval seeds Python's, NumPy's and torch's: their states
are put back), reads no training or validation data, and does not go through DeepSpeed's pipeline schedule (whose
buffers hold the training step's activations): it drives the stage modules itself (`threed.generate.decode`), and
under --vpp V > 1 each rank's V interleaved chunks in virtual-stage order, on the live interleaved engine.
Under --sequence-parallel and --context-parallel-size too: for the duration each rank runs whole sequences (no
split over tp, the CP ranks as extra replicas), and every module's flags are put back after
(tests/ranks/test_samples_split.py).

    threed train ... --generate-interval 500 --generate-prompts prompts.jsonl \
        --harness-interval 1000 --harness-tasks arc_easy,hellaswag --harness-limit 200
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import numpy as np
import torch
import torch.distributed as dist

from threed.config import ConfigError, RunConfig
from threed.errors import ThreedError
from threed.generate.decode import generate_all
from threed.generate.prompts import Sampling, Tokenizer, checkpoint_tokenizer, hf_tokenizer, read_prompts
from threed.parallel.distributed import library_bars

SHOWN = 3  # generations printed in the log at each interval (all of them go to metrics.jsonl)


@dataclass
class DuringTraining:
    """What --generate-interval / --harness-interval need, read and checked before the engine is built."""

    cfg: RunConfig
    texts: list[str]
    prompt_ids: list[list[int]]
    tokenizer: Optional[Tokenizer]
    harness_tasks: list[str]
    harness_tokenizer: Any = None

    def due(self, step: int, interval: int) -> bool:
        return interval > 0 and step % interval == 0


def run_tokenizer(cfg: RunConfig) -> str:
    """The run's tokenizer: --tokenizer (the data's), else the one the --init-from / --load checkpoint holds."""
    path = cfg.data.tokenizer
    for source in (cfg.checkpoint.init_from, cfg.checkpoint.load):
        path = path or (checkpoint_tokenizer(source) if source and os.path.isdir(source) else None)
    if path is None or not os.path.exists(path):
        raise ConfigError("--generate-interval / --harness-interval need the run's tokenizer: pass --tokenizer PATH")
    return path


def prepare(cfg: RunConfig) -> Optional[DuringTraining]:
    """None when neither is asked for; else the prompts, the tokenizer and the tasks, checked (one line each), so
    that a bad file or an unknown task stops the run before the engine is built, not at step N."""
    t = cfg.train
    if not t.generate_interval and not t.harness_interval:
        return None
    # Under --vpp V > 1 the decode loop runs the rank's chunks in virtual-stage order (threed.generate.decode).
    # Under --sequence-parallel and --context-parallel-size the decode loop runs whole sequences all the same: its
    # `evaluation` switches the split off for its duration (threed.generate.decode).
    with kept_rng():
        return _prepare(cfg)


def _prepare(cfg: RunConfig) -> DuringTraining:
    t = cfg.train
    try:
        tok_path = run_tokenizer(cfg)
        texts = read_prompts(None, t.generate_prompts, "--generate-prompts") if t.generate_interval else []
        tokenizer = Tokenizer(tok_path) if texts else None
        ids = [tokenizer.encode(x) for x in texts] if tokenizer else []
        for i, p in enumerate(ids):
            if len(p) + t.generate_max_new_tokens > cfg.model.max_position_embeddings:
                raise ConfigError(
                    f"--generate-prompts: prompt {i + 1} ({len(p)} tokens) + --generate-max-new-tokens "
                    f"{t.generate_max_new_tokens} is past the model's context of {cfg.model.max_position_embeddings}"
                )
        names: list[str] = []
        harness_tok = None
        if t.harness_interval:
            # lm-eval: the optional extra (threed[eval]); only runs that ask for harness scores import it
            from threed.harness.tasks import load_tasks, require_lm_eval, split_tasks, task_manager

            require_lm_eval()
            names = split_tasks(t.harness_tasks or "")
            load_tasks(names, task_manager(names, t.harness_include_path))
            harness_tok = hf_tokenizer(tok_path)
    except ThreedError as e:
        raise ConfigError(str(e)) from None
    return DuringTraining(cfg, texts, ids, tokenizer, names, harness_tok)


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """Python's, NumPy's and torch's generators (CPU and CUDA's, where it runs) as they were: lm-eval reseeds them
    and draws from them, in scoring and in loading tasks alike."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def after_step(state: Optional[DuringTraining], step: int, engine, metrics, speaks: bool) -> None:
    """Every rank, after a training step: the generations and scores due at `step`, logged by the writer rank."""
    if state is None:
        return
    t = state.cfg.train
    if state.due(step, t.generate_interval):
        with kept_rng():
            _generate(state, step, engine, metrics, speaks)
    if state.due(step, t.harness_interval):
        with kept_rng():
            _harness(state, step, engine, metrics, speaks)


def _generate(state: DuringTraining, step: int, engine, metrics, speaks: bool) -> None:
    t0 = time.perf_counter()
    results = generate_all(
        engine, state.cfg.model, state.prompt_ids, state.cfg.train.generate_max_new_tokens, Sampling(),
        state.tokenizer.stop_ids,
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    texts = [state.tokenizer.decode(r.tokens) for r in results]
    new = sum(len(r.tokens) for r in results)
    values: dict[str, Any] = {"generate tokens/s": new / max(seconds, 1e-9)}
    values.update({f"generate/{i}": text for i, text in enumerate(texts)})
    metrics.log(step, values, line=False)
    if speaks:
        for prompt, text in list(zip(state.texts, texts))[:SHOWN]:
            print(f"generation at step {step} | {prompt!r} -> {text!r}", flush=True)


def _harness(state: DuringTraining, step: int, engine, metrics, speaks: bool) -> None:
    # lm-eval: the optional extra (threed[eval]); prepare() checked it is installed
    from lm_eval import evaluator

    from threed.harness.lm import ThreedLM
    from threed.harness.tasks import quiet_lm_eval, task_manager

    t = state.cfg.train
    lm = ThreedLM(engine, state.cfg.model, state.harness_tokenizer)
    with quiet_lm_eval(), library_bars():  # lm-eval's tqdm bars stay out of the training log
        out = evaluator.simple_evaluate(
            model=lm, tasks=state.harness_tasks, limit=t.harness_limit, bootstrap_iters=0, log_samples=False,
            task_manager=task_manager(state.harness_tasks, t.harness_include_path),
        )  # fmt: skip
    # lm-eval returns the results where LOCAL_RANK is 0 (global rank 0 among them); the writer may be elsewhere
    scores = [harness_scores(out) if out is not None and dist.get_rank() == 0 else None]
    dist.broadcast_object_list(scores, src=0)
    metrics.log(step, scores[0], line=False)
    if speaks:
        print(f"harness at step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in scores[0].items()), flush=True)


def harness_scores(results: dict) -> dict[str, float]:
    """`harness/<task>/<metric>` for each task's metrics (lm-eval's `acc,none` -> `acc`), stderr left out."""
    out = {}
    for task, metrics in sorted(results.get("results", {}).items()):
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and "stderr" not in key:
                if key != "sample_len":
                    out[f"harness/{task}/{key.split(',')[0]}"] = float(value)
    return out
