"""LoRA on a built stage (`--lora-rank`): adapters put on this rank's blocks, the base frozen, before DeepSpeed's
engine and optimizer are made, so that ZeRO-1 holds only the adapters (no fp32 master, gradient or Adam state for
a base weight: threed.engine.optimizer hands DeepSpeed the trainable parameters only).

The adapters start from PEFT's default init (B = 0: the base's outputs), or from an HF PEFT folder
(`--lora-init-from`; for `threed generate / eval-harness --lora` also a threed LoRA run's checkpoint); either way
each rank cuts its shards out of the unsharded tensors (threed.convert.lora), so any layout starts from the same
adapter. Each save's manifest names the base the adapters belong to (threed.checkpoint.lora_base).

A resume at another tp / pp / dp goes through DeepSpeed's universal checkpoint as a full run's does, for the
adapters (their fp32 master and Adam moments: the only optimizer state there is). The frozen base has no optimizer
state: it is read, sliced for this layout, from the base an adapter-only checkpoint names (its layer files hold only
the adapters: threed.checkpoint.save), or from the checkpoint's own layer files (a LoRA run from random init, or one
saved before checkpoints were adapter-only), before the engine is made (`load_frozen_base`). A resume at the same
layout reads the adapters, natively, from the layer files (threed.engine.load: not strictly, the base being absent).
"""

from __future__ import annotations

from pathlib import Path

import torch

from threed.checkpoint.format import open_checkpoint, read_run_json
from threed.checkpoint.lora_base import MODULE_ATTR
from threed.checkpoint.start import StartDecision
from threed.config import ConfigError, RunConfig
from threed.convert.into_stage import load_into_stage
from threed.convert.lora import fresh_adapters, read_adapters, shard, split_dims, target_slices
from threed.model.layers import EmbeddingPipe
from threed.model.lora import LoraAdapter, TargetShape, attach, freeze_base, input_requires_grad
from threed.model.spec import adapter_universal_patterns, universal_checkpoint_info
from threed.parallel.pipeline import local_modules


def attach_lora(module: torch.nn.Module, cfg: RunConfig, decision: StartDecision) -> int:
    """Under --lora-rank, adapters on every chosen linear of this stage's blocks and the rest frozen; returns the
    trainable elements (0: no LoRA, nothing done)."""
    lora = cfg.lora
    check_lora_start(cfg, decision)
    if not lora.lora_rank:
        return 0
    setattr(module, MODULE_ATTR, decision.lora_base)  # what each save's manifest names as the adapters' base
    tp, tp_rank = cfg.parallel.tp, module._grid.get_slice_parallel_rank()
    # A resume loads the adapters from its checkpoint: the PEFT folder it started from is not read again. A threed
    # LoRA run's checkpoint is read as well as a PEFT folder (`threed generate / eval-harness --lora`).
    imported = lora.lora_init_from and decision.mode != "resume"
    peft = read_adapters(lora.lora_init_from, cfg.model, lora) if imported else None
    for layer, fn in local_modules(module, cfg.model):
        if isinstance(fn, EmbeddingPipe):
            fn.register_forward_hook(input_requires_grad)
        if layer.kind != "block":
            continue
        full = peft if peft is not None else fresh_adapters(cfg.model, layer, lora, cfg.train.seed)
        by_module: dict[str, list] = {}
        for t in target_slices(cfg.model, layer, lora, tp, tp_rank):
            by_module.setdefault(t.module, []).append(t)
        for path, targets in by_module.items():
            linear = fn.get_submodule(path)
            adapter = LoraAdapter(
                {t.target: TargetShape(t.a.shape, t.b.shape, t.placement) for t in targets},
                row_parallel=targets[0].row_parallel,
                out_features=linear.weight.shape[0],
                scale=lora.lora_alpha / lora.lora_rank,
                dropout=lora.lora_dropout,
            )
            with torch.no_grad():
                for t in targets:
                    adapter.A[t.target].copy_(shard(full, t.a))
                    adapter.B[t.target].copy_(shard(full, t.b))
            attach(linear, adapter)
    # Each save's mp_rank files name how TP splits each adapter (only the adapters: the optimizer holds nothing else),
    # which is what ds_to_universal needs to resume this run at another tp / pp.
    module.universal_checkpoint_info = universal_checkpoint_info(
        cfg.model, adapter_universal_patterns(split_dims(cfg.model, lora))
    )
    trainable = freeze_base(module)
    if decision.mode == "resume" and (decision.universal or decision.adapters_only):
        load_frozen_base(module, cfg, decision, tp, tp_rank)
    return trainable


def load_frozen_base(module: torch.nn.Module, cfg: RunConfig, decision: StartDecision, tp: int, tp_rank: int) -> None:
    """The frozen base of a resume that does not read it with the adapters: a universal resume (the parameters come
    from the optimizer's fp32 state, which holds only the adapters, and DeepSpeed loads no layer file then) or an
    adapter-only checkpoint. Read from the base the decision names (adapter-only: checked by threed.checkpoint.start)
    or the checkpoint's own layer files, sliced for this rank's layout (threed.convert.into_stage, as --init-from at
    another layout), before DeepSpeed's engine is made; the adapters' keys are not in what is loaded, so they keep
    their values (threed.model.lora: `_keep_if_absent`) until the checkpoint's load sets them."""
    src = decision.source
    assert src is not None
    path, tag = (
        (decision.lora_base["path"], decision.lora_base["tag"]) if decision.adapters_only else (src.path, src.tag)
    )
    ck = open_checkpoint(path, model=cfg.model, tag=tag)
    with torch.no_grad():
        load_into_stage(ck, local_modules(module, cfg.model), tp, tp_rank)


def check_lora_start(cfg: RunConfig, decision: StartDecision) -> None:
    """What a LoRA checkpoint can start, in one line each: a run without --lora-rank would load its base and drop its
    adapters (threed generate, eval-harness, a full fine-tune from it); a LoRA run resumes at another tp / pp / dp
    through the universal checkpoint, but not with interleaved stages on either side (untested there)."""
    source = decision.source.path if decision.source is not None else None
    recorded = (read_run_json(Path(source)) or {}) if source else {}
    if (recorded.get("lora") or {}).get("lora_rank") and not cfg.lora.lora_rank:
        raise ConfigError(
            f"{source} is a LoRA run's checkpoint: starting from it without its adapters is not in this build; "
            f"resume it with its own --lora-* flags, run it with `--lora`, or export it with `threed export --merge`"
        )
    vpp = max(cfg.parallel.vpp, int((recorded.get("parallel") or {}).get("vpp") or 1))
    if cfg.lora.lora_rank and decision.mode == "resume" and decision.universal and vpp > 1:
        raise ConfigError(
            "resuming a LoRA run at another layout with --vpp > 1 (this run's or the checkpoint's) is not supported "
            "in this build; resume at the layout it was saved at, or at --vpp 1 on both sides"
        )
