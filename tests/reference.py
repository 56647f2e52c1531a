"""The single-process reference that 3D-parallel training must match, written once: HF's LlamaForCausalLM trained
in one process with plain torch (AdamW grouped as Megatron groups it, threed's warmup + cosine multiplier, gradient
clipping) on the very samples `threed train` reads. Pretraining reads each global batch as one batch; SFT runs each
example alone and divides the summed response-token losses by the global batch's response-token count.

tests/ranks/test_training.py, test_tied_training.py, test_sft_train.py and test_sequence_parallel.py compare their
8-rank runs with it; the workers that train those runs take PARITY from here, so both sides use the same settings."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from helpers import gpt_dataset, hf_model, model_config
from threed.config import DataConfig, RunConfig, TrainConfig
from threed.convert.in_memory import random_hf_state
from threed.data.loader import micro_batches
from threed.engine.optimizer import lr_lambda

# The optimizer and schedule of every parity run and of its reference: fp32, clipping active (the tests assert it).
PARITY = dict(dtype="fp32", lr=1e-3, min_lr=1e-4, warmup_steps=2, grad_clip=0.5)
GLOBAL_BATCH = 8  # sequences (or packed rows) per step in the 8-rank parity runs: micro 2 x gas 2 x dp 2


def plain_adamw(model, train: TrainConfig) -> tuple:
    """The reference's optimizer: torch AdamW (no decay on 1-D weights, as Megatron) and threed's warmup + cosine
    multiplier, for a TrainConfig `train`. It holds every trainable parameter once (a tied weight too; a PEFT model's
    adapters alone)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train.lr,
        betas=(train.beta1, train.beta2),
        eps=train.adam_eps,
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == trainable
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(train))


def plain_step(model, opt, sched, loss, grad_clip: float) -> float:
    """backward, clip, step: one reference step; returns the gradient norm before clipping."""
    opt.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item()
    opt.step()
    sched.step()
    return norm


def gpt_reference(model, mc, train: TrainConfig, data: str) -> tuple[list[float], list[float]]:
    """`model` (an HF Llama of ModelConfig `mc`'s shape) trained for train.steps steps on the dataset `data`: global
    batch k is samples [8k, 8k + 8) whatever the layout, read here as one batch. Losses and gradient norms."""
    model.train()
    opt, sched = plain_adamw(model, train)
    ds = gpt_dataset(RunConfig(model=mc, train=train, data=DataConfig(data_path=(data,))), GLOBAL_BATCH).train
    batches = micro_batches(ds, GLOBAL_BATCH, GLOBAL_BATCH, 1, 0, 0, mc.vocab_size)
    losses, norms = [], []
    for _ in range(train.steps):
        inputs, (labels, _) = next(batches)
        logits = model(inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        norms.append(plain_step(model, opt, sched, loss, train.grad_clip))
        losses.append(loss.item())
    return losses, norms


def gqa31_reference(data: str, steps: int = 5, state: Optional[dict] = None) -> tuple[list[float], list[float]]:
    """gpt_reference for the `gqa31` test Llama (HF's init, or `state`) at micro 2 x gas 2, sequence length 32: the
    run dist_worker's and sp_worker's 8 ranks train (tp2 pp2 dp2)."""
    model = hf_model("gqa31")
    if state is not None:
        model.load_state_dict(state)
    train = TrainConfig(**PARITY, micro_batch_size=2, grad_accum_steps=2, seq_length=32, steps=steps)
    return gpt_reference(model, model_config("gqa31"), train, data)


def example_loss_sum(model, tokens: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, float]:
    """HF on one example alone: summed next-token loss over its response tokens, and their count."""
    x = torch.as_tensor(tokens, dtype=torch.long)
    m = torch.as_tensor(mask[1:], dtype=torch.float32)
    logits = model(x[None, :-1]).logits[0]
    return (F.cross_entropy(logits, x[1:], reduction="none") * m).sum(), m.sum().item()


def masked_loss(model, dataset, rows: range, counts: Optional[list] = None):
    """sum of response-token losses / their count over `rows`, each example run alone (the count appended to
    `counts`)."""
    total, count = 0.0, 0.0
    for row in rows:
        for example in dataset.examples(row).tolist():
            s, c = example_loss_sum(model, dataset.dataset.tokens[example], dataset.dataset.mask[example])
            total, count = total + s, count + c
    if counts is not None:
        counts.append(int(count))
    return total / count


def sft_reference(model, cfg: RunConfig) -> tuple[list[float], list[float], float, list[int]]:
    """`model` (an HF Llama of cfg.model's shape) from threed's random init for cfg.train.seed (the one the ranks
    draw) trained for cfg.train.steps steps on the SFT rows `threed train` reads for `cfg`, built in this process:
    losses, gradient norms, the validation loss after the last step, and the response tokens each step counted."""
    model.load_state_dict(random_hf_state(cfg.model, cfg.train.seed))
    model.train()
    opt, sched = plain_adamw(model, cfg.train)
    datasets = gpt_dataset(cfg, GLOBAL_BATCH)
    losses, norms, counts = [], [], []
    for step in range(cfg.train.steps):
        loss = masked_loss(model, datasets.train, range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH), counts)
        norms.append(plain_step(model, opt, sched, loss, cfg.train.grad_clip))
        losses.append(loss.item())
    with torch.no_grad():
        valid = masked_loss(model.eval(), datasets.valid, range(GLOBAL_BATCH)).item()
    return losses, norms, valid, counts
