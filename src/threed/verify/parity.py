"""Logits parity between an HF Llama and a DeepSpeed pipeline checkpoint, on CPU (pinned: VERIFY_ENV).

    threed verify --hf Meta-Llama-3-8B --ckpt ckpt/llama3-8b-tp2pp2 [--tol 1e-5]

Starts the checkpoint's tp x pp local ranks (torchrun) that build the engine and load the checkpoint exactly
as `threed train --init-from` does, runs the same random tokens through HF's model in this process (fp32), and
prints the max absolute and relative difference. Exit status 1 above --tol (relative). HF's model is loaded
whole in this process: verify is a check for models that fit in RAM (or for a tiny copy of a recipe).

It lives above training, not in threed.convert: its ranks (threed.verify.worker) build the training engine.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from threed.checkpoint.format import Checkpoint, open_checkpoint
from threed.convert.io_utils import ConvertError
from threed.hf.config import from_hf_config
from threed.parallel.launch import run_ranks

WORKER = "threed.verify.worker"  # the module each of the tp x pp ranks runs (python -m)
# On CPU, whatever the machine has: HF's side runs on CPU in fp32 too, and the 1e-5 default tolerance is a CPU
# fp32 one (a GPU's kernels reduce in other orders, and TF32 would need its own tolerance). It also leaves a
# training job's GPUs alone when verify runs beside it. (threed.parallel.distributed reads THREED_DEVICE.)
VERIFY_ENV = {"THREED_DEVICE": "cpu"}


@dataclass
class VerifyResult:
    max_abs: float
    max_rel: float
    tol: float
    tp: int
    pp: int

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tol

    def line(self) -> str:
        verdict = "OK" if self.ok else "FAIL"
        return (
            f"threed verify: tp={self.tp} pp={self.pp}: max abs logits diff {self.max_abs:.3e}, max rel "
            f"{self.max_rel:.3e} (tolerance {self.tol:.1e}) {verdict}"
        )


def check_readable(ck: Checkpoint) -> None:
    """Open every file the ranks will load here, first (memory-mapped, so cheap): each layer file with its keys and
    shapes checked against the model (`Checkpoint.load_layer`), and the mp_rank files. A damaged or misplaced one is
    named in one line instead of a traceback from every rank."""
    for layer in ck.layers:
        ck.load_layer(layer)  # CheckpointError naming the file: unreadable, other keys, other shapes
    for f in sorted(ck.step_dir.glob("mp_rank_*.pt")):
        try:
            torch.load(f, map_location="cpu", mmap=True, weights_only=False)
        except Exception as e:  # a truncated zip, a file of another kind, an unreadable one: all mean "damaged"
            why = (str(e).strip().splitlines() or [""])[0].split(". ")[0][:160]
            raise ConvertError(
                f"{f} cannot be read ({type(e).__name__}: {why}): the checkpoint is damaged; copy it again, or "
                f"write it again (`threed convert` / `threed train --save`)"
            ) from None


# The last exception line of the ranks' output ("[rank0]: RuntimeError: ..."): what failed, without the tracebacks.
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception)\b.*)$")


def ranks_error(output: str) -> str:
    """One line for the ranks' failure: their last exception line (and the line after it when it ends in ':', as
    torch's "Error(s) in loading state_dict for ...:" does), never the tracebacks."""
    lines = output.splitlines()
    found = [(i, m.group(1)) for i, m in enumerate(map(_ERROR_LINE.match, lines)) if m]
    found = [(i, text) for i, text in found if "ChildFailedError" not in text]
    if not found:
        return (output.strip().splitlines() or ["no output"])[-1]
    i, text = found[-1]
    if text.endswith(":") and i + 1 < len(lines):
        text += " " + re.sub(r"^\[rank\d+\]:\s*", "", lines[i + 1]).strip()
    return text[:400]


def checkpoint_logits(
    ckpt: str | os.PathLike, tokens: torch.Tensor, timeout: Optional[float] = 900
) -> tuple[torch.Tensor, int, int]:
    """fp32 logits [b, s, vocab] of a checkpoint, computed by its own tp x pp ranks."""
    ck = open_checkpoint(ckpt)
    pp = ck.pp
    with tempfile.TemporaryDirectory(prefix="threed-verify-") as d:
        torch.save(tokens, Path(d) / "tokens.pt")
        try:
            run_ranks(
                ck.tp * pp,
                WORKER,
                [
                    "--ckpt",
                    str(Path(ckpt).absolute()),
                    "--tp",
                    str(ck.tp),
                    "--pp",
                    str(pp),
                    "--tokens",
                    str(Path(d) / "tokens.pt"),
                    "--out",
                    str(Path(d) / "logits.pt"),
                ],
                env=VERIFY_ENV,
                timeout=timeout,
            )
        except Exception as e:  # RanksFailed / CalledProcessError carry the ranks' output tail: its error line
            raise ConvertError(
                f"the {ck.tp * pp} verify ranks failed: {ranks_error(str(getattr(e, 'output', None) or e))}"
            ) from None
        return torch.load(Path(d) / "logits.pt")["logits"], ck.tp, pp


def hf_logits(hf_dir: str | os.PathLike, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM  # transformers: heavy, only to run the HF model

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def compare(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    if got.shape != ref.shape:
        raise ConvertError(
            f"logits shapes differ: checkpoint {list(got.shape)}, HF {list(ref.shape)} (another vocab size?)"
        )
    max_abs = (got - ref).abs().max().item()
    return max_abs, max_abs / max(ref.abs().max().item(), 1e-30)


def verify(
    hf_dir: str | os.PathLike,
    ckpt: str | os.PathLike,
    tol: float = 1e-5,
    seq_length: int = 32,
    batch: int = 2,
    seed: int = 0,
) -> VerifyResult:
    ck = open_checkpoint(ckpt)
    hf_cfg = from_hf_config(hf_dir)
    if hf_cfg.vocab_size != ck.model.vocab_size or hf_cfg.num_layers != ck.model.num_layers:
        raise ConvertError(
            f"{hf_dir} (vocab {hf_cfg.vocab_size}, {hf_cfg.num_layers} layers) is not the model "
            f"in {ckpt} (vocab {ck.model.vocab_size}, {ck.model.num_layers} layers)"
        )
    if hf_cfg.tie_word_embeddings != ck.model.tie_word_embeddings:
        flag = lambda tied: "true" if tied else "false"  # noqa: E731
        raise ConvertError(
            f"{hf_dir} says tie_word_embeddings={flag(hf_cfg.tie_word_embeddings)}, the model in "
            f"{ckpt} has tie_word_embeddings={flag(ck.model.tie_word_embeddings)}: not the same "
            f"model; compare against the HF model it was converted from, or export it with "
            f"`threed export --ckpt {ckpt} --out DIR` and pass --hf DIR"
        )
    check_readable(ck)
    seq = min(seq_length, ck.model.max_position_embeddings)
    tokens = torch.randint(0, ck.model.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))
    got, tp, pp = checkpoint_logits(ckpt, tokens)
    max_abs, max_rel = compare(got, hf_logits(hf_dir, tokens))
    return VerifyResult(max_abs, max_rel, tol, tp, pp)
