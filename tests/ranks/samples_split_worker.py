"""--generate-interval / --harness-interval under --sequence-parallel and --context-parallel-size 2 at once (tp2 cp2
sp, 4 ranks, fp32): one launch for tests/ranks/test_samples_split.py.

1. `threed train` with generations and harness scores after steps 1 and 2 (local lm-eval tasks); every greedy token
   list `generate_all` returns and every request row `score_all` scores is recorded (the real functions, wrapped),
   with each module's split attributes before and after each evaluation. After the last step, on the same engine,
   the controls: the same scoring with the switch left off, or only half of it on (each raises or differs).
2. the same run without the intervals (the losses must be bit-identical);
3. the first run's checkpoint (its weights after step 2, those the step-2 evaluation saw) at tp2 without sequence
   or context parallelism (dp2): the step-2 prompts and request rows through the same `generate_all` / `score_all`.

Rank 0 writes OUT/split.json.

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/samples_split_worker.py --out /tmp/s --spec spec.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

# worker_setup first: it puts tests/ on sys.path (helpers, harness_fixtures)
from worker_setup import run_worker, write_json
from samples_worker import next_draws, seed_all
from harness_fixtures import TASKS
import threed.harness.lm as harness_lm
import threed.train.loop as loop
import threed.train.samples as samples
from threed.config import CheckpointConfig, DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig
from threed.generate.decode import evaluation, score_batch, stage_of
from threed.generate.prompts import Sampling
from threed.generate.run import engine_config
from threed.model.attention import SDPACoreAttention
from threed.model.layers import LlamaBlock, whole_sequences
from threed.parallel.distributed import Runtime
from worker_setup import build_engine, train

STEPS, INTERVAL = 2, 1
TP, CP = 2, 2
# Rows for the controls: 9 positions (odd: no cut over tp 2) and 8 (cut into 2·cp = 4 chunks, so CP's attention
# runs on them and answers wrongly instead of refusing).
ODD, EVEN = [list(range(3, 13)), list(range(20, 30))], [list(range(5, 14)), list(range(40, 49))]


def run_config(spec: dict, save: Path, with_samples: bool) -> RunConfig:
    model = dataclasses.replace(ModelConfig(**spec["model"]), make_vocab_size_divisible_by=16)
    intervals = dict(
        generate_interval=INTERVAL,
        generate_prompts=spec["prompts"],
        generate_max_new_tokens=6,
        harness_interval=INTERVAL,
        harness_tasks=",".join(TASKS),
        harness_limit=4,
        harness_include_path=spec["include_path"],
    )
    return RunConfig(
        model=model,
        parallel=ParallelConfig(tp=TP, pp=1, cp=CP, sequence_parallel=True),
        train=TrainConfig(
            dtype="fp32",
            seq_length=32,
            micro_batch_size=2,
            grad_accum_steps=2,
            steps=STEPS,
            lr=1e-3,
            warmup_steps=1,
            seed=3,
            **(intervals if with_samples else {}),
        ),  # fmt: skip
        data=DataConfig(data_path=(spec["data"],), split="100,0,0", tokenizer=spec["tokenizer"]),
        checkpoint=CheckpointConfig(save=str(save)),
    )


def split_attributes(engine) -> list:
    """Every attribute the switch may touch on this rank's modules (the CP group by identity), and the norms'
    parameter tags: what must be the same after an evaluation as before."""
    out: list = []
    for module in engine.module.modules():
        for name in ("sequence_parallel", "reduce_scatter_embeddings", "scatter_to_sequence_parallel"):
            if hasattr(module, name):
                out.append((type(module).__name__, name, getattr(module, name)))
        if hasattr(module, "config") and hasattr(module.config, "sequence_parallel"):
            out.append((type(module).__name__, "config.sequence_parallel", module.config.sequence_parallel))
        if isinstance(module, LlamaBlock):
            out.append(("LlamaBlock", "shards/context", module.sequence_shards, list(module.context)))
        if isinstance(module, SDPACoreAttention):
            out.append(("SDPACoreAttention", "cp_group", id(module.cp_group) if module.cp_group else None))
    out += [("param", n, getattr(p, "sequence_parallel", None)) for n, p in engine.module.named_parameters()]
    return out


def split_counts(engine) -> dict[str, int]:
    """How many of this rank's modules split the sequence over tp (megatron's flags that say so) and over cp."""
    flags = split_attributes(engine)
    return {
        "split_on": sum(
            1 for f in flags if f[0] != "param" and f[1] in ("sequence_parallel", "reduce_scatter_embeddings") and f[2]
        ),
        "cp_groups": sum(1 for f in flags if f[1] == "cp_group" and f[2] is not None),
    }


class Recorder:
    """Wraps the real after_step / generate_all / score_all of a run (in the modules that call them) and keeps
    what they were given and returned, by step."""

    def __init__(self, model):
        self.model, self.step = model, 0
        self.generated: list[dict] = []
        self.scored: list[dict] = []
        self.flags: list[dict] = []
        self.controls: dict[str, Any] = {}
        self.kept: dict[str, Callable] = {}

    def __enter__(self) -> "Recorder":
        self.kept = {
            "after_step": loop.samples_after_step,
            "generate_all": samples.generate_all,
            "score_all": harness_lm.score_all,
        }
        loop.samples_after_step = self.after_step
        samples.generate_all = self.generate_all
        harness_lm.score_all = self.score_all
        return self

    def __exit__(self, *exc) -> None:
        loop.samples_after_step = self.kept["after_step"]
        samples.generate_all = self.kept["generate_all"]
        harness_lm.score_all = self.kept["score_all"]

    def after_step(self, state, step, engine, metrics, speaks) -> None:
        self.step = step
        before = split_attributes(engine)
        self.kept["after_step"](state, step, engine, metrics, speaks)
        after = split_attributes(engine)
        record = {"step": step, "same": before == after, "training": engine.module.training, **split_counts(engine)}
        if step == STEPS:
            self.controls = controls(engine, self.model)
            record["same_after_controls"] = split_attributes(engine) == before
        self.flags.append(record)

    def generate_all(self, engine, model, prompts, max_new, sampling, stop_ids=(), *args, **kwargs):
        out = self.kept["generate_all"](engine, model, prompts, max_new, sampling, stop_ids, *args, **kwargs)
        self.generated.append({
            "step": self.step, "prompts": [list(p) for p in prompts], "max_new": max_new, "stop": list(stop_ids),
            "tokens": [r.tokens for r in out], "indices": [r.index for r in out],
        })  # fmt: skip
        return out

    def score_all(self, engine, stage, rows, scored, batch_size):
        out = self.kept["score_all"](engine, stage, rows, scored, batch_size)
        self.scored.append(
            {"step": self.step, "rows": rows, "scored": scored, "batch": batch_size, "answers": [list(a) for a in out]}
        )
        return out


def controls(engine, model) -> dict[str, Any]:
    """The same scoring on the training engine after the last step: with the switch (`evaluation`, as generation
    and scoring run), without it, and with only its sequence-parallel or only its context-parallel half. Every rank
    runs the same rows, so a refusal is the same on every rank (no rank is left inside a collective)."""
    stage = stage_of(engine, model)
    cores = [m for m in engine.module.modules() if isinstance(m, SDPACoreAttention)]
    blocks = [m for m in engine.module.modules() if isinstance(m, LlamaBlock)]
    groups = [(c.cp_group, b.context) for c, b in zip(cores, blocks)]

    def score(rows) -> Any:
        try:
            out = score_batch(stage, rows, [len(r) - 1 for r in rows])
            return [o[0] for o in out]
        except Exception as e:  # the control's outcome: which error, the same on every rank
            return f"raised {type(e).__name__}: {str(e)[:120]}"

    def only_context_split_off(rows) -> Any:  # sequence parallelism left on
        for c, b in zip(cores, blocks):
            c.cp_group, b.context = None, (1, 0)
        try:
            return score(rows)
        finally:
            for (group, context), c, b in zip(groups, cores, blocks):
                c.cp_group, b.context = group, context

    def only_sequence_split_off(rows) -> Any:  # context parallelism left on
        with whole_sequences(fn for _, fn in stage.funcs):
            for (group, context), c, b in zip(groups, cores, blocks):
                c.cp_group, b.context = group, context
            return score(rows)

    out: dict[str, Any] = {}
    was_training = engine.module.training
    engine.module.eval()
    try:
        with torch.no_grad():
            out["none_odd"] = score(ODD)
            out["context_off_odd"] = only_context_split_off(ODD)
            out["sequence_off_even"] = only_sequence_split_off(EVEN)
    finally:
        engine.module.train(was_training)
    with evaluation(engine, stage):
        out["switched_odd"], out["switched_even"] = score(ODD), score(EVEN)
    dist.barrier()
    return out


def split_samples(args: argparse.Namespace, rt: Runtime) -> None:
    spec = json.loads(args.spec.read_text())
    model = dataclasses.replace(ModelConfig(**spec["model"]), make_vocab_size_divisible_by=16)
    seed_all()
    with Recorder(model) as rec:
        with_them = train(run_config(spec, args.out / "with", True))
    after_with = next_draws()
    dist.barrier()
    seed_all()
    without = train(run_config(spec, args.out / "without", False))
    after_without = next_draws()
    dist.barrier()
    # The reference: the step-2 weights (the run's last save) at tp2, built without either split.
    ref = build_engine(engine_config(str(args.out / "with"), model, TP, 1), rt).engine
    generated_ref = [
        [r.tokens for r in samples.generate_all(ref, model, g["prompts"], g["max_new"], Sampling(), g["stop"])]
        for g in rec.generated
        if g["step"] == STEPS
    ]
    ref_stage = stage_of(ref, model)
    scored_ref = [
        [list(a) for a in harness_lm.score_all(ref, ref_stage, s["rows"], s["scored"], s["batch"])]
        for s in rec.scored
        if s["step"] == STEPS
    ]
    if rt.rank == 0:  # pp1: rank 0 holds the losses
        write_json(
            args.out / "split.json",
            {
                "losses": {"with": with_them.losses, "without": without.losses},
                "draws": [after_with, after_without],
                "generated": rec.generated,
                "generated_ref": generated_ref,
                "scored": rec.scored,
                "scored_ref": scored_ref,
                "flags": rec.flags,
                "controls": rec.controls,
                "reference": {"replicas": ref.grid.get_data_parallel_world_size(), **split_counts(ref)},
            },
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec", type=Path, required=True, help="JSON: model, data, tokenizer, prompts, include_path")


if __name__ == "__main__":
    raise SystemExit(run_worker({"split": split_samples}, add_arguments))
