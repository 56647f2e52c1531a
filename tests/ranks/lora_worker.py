"""Multi-rank LoRA scenarios for tests/ranks/test_lora.py (4 ranks, tp2 pp2 dp1, fp32, the `gqa31` HF test model):
an HF PEFT adapter brought in with --lora-init-from and trained 5 steps with sequence parallelism, against HF + PEFT
in one process (tests/reference.py's optimizer and data).

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/lora_worker.py parity --out /tmp/l --data PREFIX \\
        --peft PEFT_DIR --base BASE_CKPT

parity: every rank writes OUT/lora_rank<R>.json (losses, gradient norms, what the optimizer holds) and
OUT/adapters_rank<R>.pt (its blocks' adapter shards, for the pytest side to put together with
threed.convert.lora.gather_adapters); the last stage's TP rank 0 OUT/start_logits.pt; the checkpoint after step 2 in
OUT/save (adapter-only: the run starts from --base, a tp1 pp1 conversion of the HF model) and OUT/async_save.
universal: that checkpoint resumed at other layouts (`universal`'s docstring). recompute: OUT/recompute_rank<R>.pt,
each adapter's first-step gradient with and without full recompute, at pp2 and pp1. tied: OUT/tied_rank<R>.json, a
tied model's runs at tp1 pp2 dp2 (fp32, bf16) and the untied model's in bf16.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import build_engine, keeps_logits, load_hf_weights, local_modules, rank_json, run_worker
from dist_worker import run_steps, train_dataset
from helpers import hf_model, model_config
from reference import PARITY
from threed.checkpoint.async_save import AsyncSaver
from threed.checkpoint.save import save
from threed.config import CheckpointConfig, DataConfig, LoraConfig, ParallelConfig, RunConfig, TrainConfig
from threed.model.spec import is_adapter_key
from threed.parallel.distributed import Runtime
from threed.verify.logits import pipeline_logits
from tied_worker import tied_hf_model, tied_model_config

STEPS, RANK, ALPHA, SAVED = 5, 4, 8.0, 2


def lora_config(data: str, peft: str, steps: int = STEPS, **train) -> RunConfig:
    """reference.gqa31_reference's model, batch (8 sequences of 32) and optimizer, with the adapter of `peft`."""
    return RunConfig(
        model=model_config("gqa31"),
        parallel=ParallelConfig(tp=2, pp=2, sequence_parallel=True),
        train=TrainConfig(**{**PARITY, **train}, micro_batch_size=2, global_batch_size=8, seq_length=32, steps=steps),
        data=DataConfig(data_path=(data,)),
        lora=LoraConfig(lora_rank=RANK, lora_alpha=ALPHA, lora_init_from=peft),
    )


def optimizer_elements(engine) -> int:
    """Elements of the parameters DeepSpeed's optimizer holds (its torch optimizer's groups)."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and hasattr(opt, "optimizer"):
        opt = opt.optimizer
    return sum(p.numel() for g in opt.param_groups for p in g["params"])


def start_logits(cfg: RunConfig, rt: Runtime, out) -> None:
    """The logits of LOGIT_TOKENS through the base with the imported adapter, saved by the last stage's TP rank 0
    (an engine of its own: DeepSpeed's eval then train on one engine is not what threed does)."""
    engine = build_engine(cfg, rt).engine
    load_hf_weights(engine, cfg, hf_model("gqa31").state_dict())
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    logits = pipeline_logits(engine, tokens, cfg.model.vocab_size)
    if logits is not None and keeps_logits(engine):
        torch.save({"tokens": tokens, "logits": logits}, out / "start_logits.pt")


def save_adapters(engine, cfg: RunConfig, path) -> None:
    """This rank's blocks' adapter shards and its TP rank, for the pytest side to put together."""
    blocks = {
        layer.block: {k: v.detach().clone() for k, v in m.state_dict().items() if ".lora." in k}
        for layer, m in local_modules(engine.module, cfg.model)
        if layer.kind == "block"
    }
    torch.save({"tp_rank": engine.grid.get_slice_parallel_rank(), "blocks": blocks}, path)


def parity(args: argparse.Namespace, rt: Runtime) -> None:
    """Started from --base (the HF model converted at tp1 pp1: its weights read slice by slice), it saves an
    adapter-only checkpoint naming that base after step SAVED into OUT/save (what `universal` resumes at other
    layouts), and the same state through --async-save into OUT/async_save."""
    cfg = lora_config(args.data, args.peft)
    start_logits(cfg, rt, args.out)
    cfg = dataclasses.replace(cfg, checkpoint=CheckpointConfig(save=str(args.out / "save"), init_from=args.base))
    engine = build_engine(cfg, rt).engine
    params = dict(engine.module.named_parameters())
    adapters = {k: p for k, p in params.items() if is_adapter_key(k)}
    ds = train_dataset(cfg, rt.world_size)
    losses, norms = run_steps(engine, cfg, ds, 0, SAVED)
    client = {"consumed_samples": SAVED * cfg.train.global_batch_size}
    save(engine, cfg, rt.rank, client)
    async_cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, save=str(args.out / "async_save"), async_save=True)
    )
    saver = AsyncSaver(async_cfg, rt.rank, rt.device, print)
    saver.save(engine, client)
    saver.finish("the parity run goes on")
    more = run_steps(engine, cfg, ds, SAVED, STEPS)
    losses, norms = losses + more[0], norms + more[1]
    save_adapters(engine, cfg, args.out / f"adapters_rank{rt.rank}.pt")
    rank_json(
        args.out,
        "lora",
        {
            "losses": losses,
            "grad_norms": norms,
            "adapter_elements": sum(p.numel() for p in adapters.values()),
            "optimizer_elements": optimizer_elements(engine),
            "base_with_grad": [
                k for k, p in params.items() if k not in adapters and (p.requires_grad or p.grad is not None)
            ],
            "adapters_without_grad": [k for k, p in adapters.items() if not p.requires_grad],
        },
    )


def universal(args: argparse.Namespace, rt: Runtime) -> None:
    """parity's checkpoint after step SAVED (tp2 pp2 dp1) resumed at each --layouts TPxPP (dp = 4 / tp / pp) by the
    same command, through DeepSpeed's universal checkpoint (converted once, into OUT/save/universal; at 2x2, its own
    layout: natively), the frozen base read from the base the checkpoint names, trained on to
    step STEPS: its losses and the start it got in OUT/universal_rank<R>.json, its adapters in
    OUT/universal_<layout>_rank<R>.pt."""
    out = {}
    for layout in args.layouts:
        tp, pp = (int(n) for n in layout.split("x"))
        cfg = lora_config(args.data, args.peft)
        cfg = dataclasses.replace(
            cfg,
            parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=tp > 1),
            checkpoint=CheckpointConfig(save=str(args.out / "save")),
        )
        built = build_engine(cfg, rt)
        engine, start = built.engine, built.engine.global_steps
        losses, _ = run_steps(engine, cfg, train_dataset(cfg, rt.world_size), start, STEPS)
        save_adapters(engine, cfg, args.out / f"universal_{layout}_rank{rt.rank}.pt")
        out[layout] = {
            "start": start,
            "losses": losses,
            "universal": bool(built.decision and built.decision.universal),
            "client_state": built.client_state,
        }
    rank_json(args.out, "universal", out)


def adapter_grads(engine, cfg: RunConfig, rt: Runtime) -> dict[str, torch.Tensor]:
    """One step's gradient of every adapter of this rank (summed over the step's micro-batches), caught as autograd
    hands it to the parameter: what DeepSpeed then reduces and steps with."""
    grads: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def add(grad: torch.Tensor) -> None:
            grads[name] = grad.detach().clone() + grads.get(name, 0)

        return add

    for name, p in engine.module.named_parameters():
        if is_adapter_key(name):
            p.register_hook(keep(name))
    run_steps(engine, cfg, train_dataset(cfg, rt.world_size), 0, 1)
    return grads


def recompute(args: argparse.Namespace, rt: Runtime) -> None:
    """At tp2 pp2 and at tp2 pp1 (dp2), full recompute (DeepSpeed's reentrant checkpoint of every block) against
    none: each adapter's first-step gradient, per rank."""
    out = {}
    for pp in (2, 1):
        for ac in (False, True):
            cfg = lora_config(args.data, args.peft, steps=1, activation_checkpointing=ac)
            cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=pp))
            engine = build_engine(cfg, rt).engine
            load_hf_weights(engine, cfg, hf_model("gqa31").state_dict())
            out[f"pp{pp}_{'recompute' if ac else 'plain'}"] = adapter_grads(engine, cfg, rt)
    torch.save(out, args.out / f"recompute_rank{rt.rank}.pt")


def tied(args: argparse.Namespace, rt: Runtime) -> None:
    """Llama 3.2's layout at tp1 pp2 dp2: the tied embedding frozen, its two stages' copies out of DeepSpeed's
    tied-gradient reduction (threed.parallel.staged), the adapter of `--peft` trained 5 steps in fp32 and in bf16
    (DeepSpeed's BF16_Optimizer, which has no fp32 gradient for a frozen weight); and the untied `gqa31` with the
    parity run's adapter (`--untied-peft`) at tp2 pp2 with SP in bf16."""
    tied_cfg = dataclasses.replace(
        lora_config(args.data, args.peft), model=tied_model_config(), parallel=ParallelConfig(tp=1, pp=2)
    )
    untied = lora_config(args.data, args.untied_peft, dtype="bf16")
    out = {}
    for name, cfg, hf in (
        ("fp32", tied_cfg, tied_hf_model),
        ("bf16", dataclasses.replace(tied_cfg, train=dataclasses.replace(tied_cfg.train, dtype="bf16")), tied_hf_model),
        ("untied_bf16", untied, lambda: hf_model("gqa31")),
    ):
        engine = build_engine(cfg, rt).engine
        load_hf_weights(engine, cfg, hf().state_dict())
        losses, norms = run_steps(engine, cfg, train_dataset(cfg, rt.world_size), 0, STEPS)
        adapters = sum(p.numel() for k, p in engine.module.named_parameters() if is_adapter_key(k))
        out[name] = {
            "losses": losses,
            "grad_norms": norms,
            "adapter_elements": adapters,
            "optimizer_elements": optimizer_elements(engine),
            "optimizer": type(engine.optimizer).__name__,
        }
    rank_json(args.out, "tied", out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", required=True)
    p.add_argument("--peft", required=True)
    p.add_argument("--base", help="parity: the base checkpoint the run starts from (--init-from)")
    p.add_argument("--untied-peft")
    p.add_argument("--layouts", nargs="*", default=["1x2"], help="universal: TPxPP layouts to resume at")


if __name__ == "__main__":
    raise SystemExit(
        run_worker({"parity": parity, "universal": universal, "recompute": recompute, "tied": tied}, add_arguments)
    )
