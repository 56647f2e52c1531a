"""`threed convert | export | reshard | verify | make-tiny-hf` (registered into `threed.cli` by `register`).

    threed convert --hf Meta-Llama-3-8B --tp 2 --pp 2 --out ckpt/l3-8b      # HF -> DeepSpeed pipeline ckpt
    threed train --model ckpt/l3-8b --init-from ckpt/l3-8b --tp 2 --pp 2 --data tokens.bin --save run
    threed export --ckpt run --out run-hf                                   # any ckpt -> HF directory
    threed export --merge --ckpt lora-run --out run-hf                      # LoRA adapters merged into the base
    threed reshard --ckpt ckpt/l3-8b --tp 4 --pp 1 --out ckpt/l3-8b-tp4      # change tp / pp
    threed verify --hf Meta-Llama-3-8B --ckpt ckpt/l3-8b                    # logits parity, exit 1 if off

Each command prints one line per failure naming the file / tensor and exits 2; verify exits 1 above --tol.
The work is imported when a command runs (torch, and megatron / deepspeed through the checkpoint layout): `threed
--help` and the other commands do not pay for it.
"""

from __future__ import annotations

import argparse
from typing import Callable

from threed.errors import ThreedError, guarded, os_error_line, torch_write_failed


def _guard(name: str, fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Bad input becomes one clear line and exit status 2 (the output directory was never created)."""

    def command(ns: argparse.Namespace) -> int:
        try:
            return fn(ns)
        except (OSError, RuntimeError) as e:  # disk full, a file-size limit, permissions: one line, as bad input
            if isinstance(e, RuntimeError) and not torch_write_failed(e):
                raise  # a bug: its traceback
            raise ThreedError(os_error_line(e)) from e

    return lambda ns: guarded(
        f"threed {name}", lambda: command(ns), interrupted="interrupted; no output was left behind"
    )


def _convert(ns: argparse.Namespace) -> int:
    from threed.convert.from_hf import convert_hf_checkpoint  # torch, megatron: heavy, only when it runs
    from threed.convert.io_utils import parse_dtype  # torch: heavy, only when a command runs

    convert_hf_checkpoint(
        ns.hf,
        ns.out,
        ns.tp,
        ns.pp,
        dtype=parse_dtype(ns.dtype),
        make_vocab_size_divisible_by=ns.make_vocab_size_divisible_by,
        workers=ns.workers,
        force=ns.force,
        show_progress=not ns.quiet,
    )
    return 0


def _export(ns: argparse.Namespace) -> int:
    if ns.lora and not ns.merge:
        from threed.convert.lora import export_lora  # torch (and peft): heavy, only when it runs

        export_lora(ns.ckpt, ns.out, force=ns.force)
        return 0
    from threed.convert.export import export  # torch, megatron: heavy, only when it runs
    from threed.convert.io_utils import parse_dtype  # torch: heavy, only when a command runs
    from threed.hf.write import parse_size  # torch: heavy, only when a command runs

    export(
        ns.ckpt,
        ns.out,
        dtype=parse_dtype(ns.dtype),
        max_shard_bytes=parse_size(ns.max_shard_size),
        tokenizer=ns.tokenizer,
        force=ns.force,
        show_progress=not ns.quiet,
        merge=ns.merge,
    )
    return 0


def _reshard(ns: argparse.Namespace) -> int:
    from threed.convert.io_utils import parse_dtype  # torch: heavy, only when a command runs
    from threed.convert.reshard import reshard  # torch, megatron: heavy, only when it runs

    reshard(ns.ckpt, ns.out, ns.tp, ns.pp, dtype=parse_dtype(ns.dtype), force=ns.force, show_progress=not ns.quiet)
    return 0


def _verify(ns: argparse.Namespace) -> int:
    from threed.verify.parity import verify  # torch, transformers: heavy, only when it runs

    result = verify(ns.hf, ns.ckpt, tol=ns.tol, seq_length=ns.seq_length, batch=ns.batch, seed=ns.seed)
    print(result.line())
    return 0 if result.ok else 1


def _make_tiny(ns: argparse.Namespace) -> int:
    from threed.convert.tiny import make_tiny_hf  # torch, transformers: heavy, only when it runs

    print(
        make_tiny_hf(
            ns.out,
            like=ns.like,
            vocab_size=ns.vocab_size,
            seed=ns.seed,
            dtype=ns.dtype,
            tokenizer=ns.tokenizer,
            force=ns.force,
        )
    )
    return 0


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1 (argparse then prints one usage line and exits 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def shard_size(text: str) -> str:
    """argparse type for --max-shard-size: 5GB, 500MB, 2GiB, 1000000 (bytes)."""
    from threed.hf.write import parse_size  # torch: heavy, only when export's flags are parsed

    try:
        ok = parse_size(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 500MB or 2GiB, got {text!r}")
    return text


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    """`threed export`'s two forms of a LoRA run's checkpoint: its adapters alone, or merged into its weights."""
    p.add_argument("--lora", action="store_true", help="a LoRA run's adapters as an HF PEFT folder (not the weights)")
    p.add_argument("--merge", action="store_true", help="a LoRA run's weights with its adapters merged in (HF Llama)")


def register(sub: argparse._SubParsersAction) -> None:
    def common(p: argparse.ArgumentParser, dtype_help: str) -> None:
        p.add_argument("--force", action="store_true", help="replace --out if it exists")
        p.add_argument("--quiet", action="store_true", help="no progress bar or summary line")
        p.add_argument("--dtype", default="keep", choices=["keep", "bf16", "fp32", "fp16"], help=dtype_help)

    p = sub.add_parser("convert", help="HF Llama directory -> DeepSpeed pipeline checkpoint for tp x pp")
    p.add_argument("--hf", required=True, help="HF model dir (config.json + safetensors or pytorch_model*.bin)")
    p.add_argument("--tp", type=int, required=True)  # range checked with the model (one message for both)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=positive_int,
        default=128,
        help="pad the vocab to a multiple of this x tp (Megatron's default 128)",
    )
    p.add_argument("--workers", type=positive_int, default=1, help="writer processes (each holds one layer)")
    common(p, "dtype of the layer files (default: the source's)")
    p.set_defaults(run=_guard("convert", _convert))

    p = sub.add_parser("export", help="DeepSpeed pipeline checkpoint -> HF Llama directory")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-shard-size", type=shard_size, default="5GB", help="largest safetensors file (5GB)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer dir, tokenizer.json or sentencepiece .model (default: the run's, or the converted source's)",
    )
    add_lora_flags(p)
    common(p, "dtype of the safetensors (default: the checkpoint's)")
    p.set_defaults(run=_guard("export", _export))

    p = sub.add_parser("reshard", help="change the tp / pp of a checkpoint (weights only)")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tp", type=int, required=True)  # range checked with the model (one message for both)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--out", required=True)
    common(p, "dtype of the new layer files (default: unchanged)")
    p.set_defaults(run=_guard("reshard", _reshard))

    p = sub.add_parser("verify", help="HF vs checkpoint logits on CPU; exit 1 above the tolerance")
    p.add_argument("--hf", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tol", type=positive_float, default=1e-5, help="max relative logits difference (fp32)")
    p.add_argument("--seq-length", type=positive_int, default=32)
    p.add_argument("--batch", type=positive_int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_guard("verify", _verify))

    p = sub.add_parser("make-tiny-hf", help="save a small random HF Llama locally (demo, tests)")
    p.add_argument("--out", required=True)
    p.add_argument("--like", default="tiny", help="preset whose shape to use (default tiny)")
    p.add_argument("--vocab-size", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="sentencepiece .model to save with it")
    p.add_argument("--dtype", default="fp32", choices=["bf16", "fp32", "fp16"])
    p.add_argument("--force", action="store_true")
    p.set_defaults(run=_guard("make-tiny-hf", _make_tiny))
