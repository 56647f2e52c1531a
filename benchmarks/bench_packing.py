"""Packing vs padding for SFT: real (non-padding) tokens per training step, and real tokens per second.

    .venv/bin/python benchmarks/bench_packing.py

1. Counts, at the recipes' shapes (seq 8192 and 4096, 64 rows per step), the real tokens per step of threed's SFT
   dataset (`threed.data.sft_dataset`) with `--pack true` vs one example per padded row, for two example-length
   distributions: "chat" (log-normal, median 350 tokens, sigma 1.0: multi-turn chat data such as UltraChat /
   ShareGPT have medians of a few hundred tokens and a long tail) and "short" (median 120, sigma 0.7: single-turn
   instruction data such as Alpaca / FLAN). Lengths are capped at the sequence (what `threed preprocess --sft
   --truncate-long` does).
2. Times real training steps of the `tiny` model in this process (a world of one, fp32, seq 256 (its longest), 8 rows
   per step) on both layouts of the same examples (median 40 tokens, scaled with the sequence), and reports real tokens
   per second: packing pays a block-diagonal attention mask (on CPU; `varlen_attn` on CUDA), padding pays for
   the padding.
Ratios are measured in one run on this machine; nothing is asserted.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import gpt_dataset, write_sft_dataset  # noqa: E402
from threed.config import DataConfig, RunConfig, TrainConfig  # noqa: E402
from threed.convert.resolve import model_config  # noqa: E402

DISTRIBUTIONS = {"chat": (350, 1.0), "short": (120, 0.7)}  # median tokens, log-normal sigma


def lengths(n: int, median: float, sigma: float, cap: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(median), sigma, n).astype(np.int64), 8, cap)


def examples(lens: np.ndarray, vocab: int, seed: int = 0) -> list[tuple]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lens.tolist():
        prompt = max(1, n // 3)
        out.append((rng.integers(0, vocab, n), np.r_[np.zeros(prompt), np.ones(n - prompt)].astype(np.uint8)))
    return out


def config(prefix: str, seq: int, pack: bool, rows: int, steps: int) -> RunConfig:
    return RunConfig(
        model=model_config("tiny"),
        train=TrainConfig(dtype="fp32", seq_length=seq, micro_batch_size=rows, steps=steps, eval_interval=0),
        data=DataConfig(data_path=(prefix,), split="100,0,0", pack=pack),
    )


def real_tokens_per_step(prefix: str, seq: int, pack: bool, rows: int, steps: int) -> float:
    ds = gpt_dataset(config(prefix, seq, pack, rows, steps), rows).train
    return statistics.mean(sum(ds.real_tokens(k * rows + i) for i in range(rows)) for k in range(steps))


def count_table(tmp: Path) -> None:
    rows, steps = 64, 20
    for name, (median, sigma) in DISTRIBUTIONS.items():
        for seq in (8192, 4096):
            lens = lengths(rows * steps * (seq // median) * 2, median, sigma, seq)
            prefix = write_sft_dataset(tmp / f"{name}{seq}", examples(lens, 512), 512)
            packed = real_tokens_per_step(prefix, seq, True, rows, steps)
            padded = real_tokens_per_step(prefix, seq, False, rows, steps)
            print(
                f"{name:5s} seq {seq}: median example {int(np.median(lens))} tokens; real tokens per step "
                f"(64 rows): packed {packed:,.0f} ({packed / (rows * seq):.1%} of the positions), padded "
                f"{padded:,.0f} ({padded / (rows * seq):.1%}) -> packing x{packed / padded:.2f}",
                flush=True,
            )


def timed_run(prefix: str, seq: int, pack: bool, rows: int, steps: int) -> tuple[float, float]:
    """(median seconds per step, real tokens per step) over `steps` steps after two warm-up steps."""
    from threed.data.loader import micro_batches
    from threed.parallel.distributed import init_distributed
    from threed.engine.build import build_engine
    from threed.engine.resolved import resolve
    from threed.train.loop import step_batches

    cfg = config(prefix, seq, pack, rows, steps + 2)
    rt = init_distributed()
    ds = gpt_dataset(cfg, rows).train
    engine = build_engine(resolve(cfg, rt.world_size), rt, token_weighted=True).engine
    batches = micro_batches(ds, rows, rows, 1, 0, 0, cfg.model.vocab_size)
    times = []
    for step in range(steps + 2):
        t0 = time.perf_counter()
        engine.train_batch(data_iter=step_batches(batches, 1, True, engine, rt.device)[0])
        times.append(time.perf_counter() - t0)
    real = statistics.mean(sum(ds.real_tokens(k * rows + i) for i in range(rows)) for k in range(steps + 2))
    return statistics.median(times[2:]), real


def timed_table(tmp: Path) -> None:
    seq, rows, steps = 256, 8, 6
    # Examples of median 40 tokens in rows of 256 (the "chat" distribution's 350 in rows of ~2,200): the tiny model's
    # longest sequence is 256, so the lengths are scaled down with it.
    lens = lengths(4000, 40, 0.7, seq)
    prefix = write_sft_dataset(tmp / "timed", examples(lens, 512), 512)
    result = {}
    for pack in (True, False):
        seconds, real = timed_run(prefix, seq, pack, rows, steps)
        result[pack] = real / seconds
        print(
            f"tiny, seq {seq}, {rows} rows/step, {'packed' if pack else 'padded'}: {seconds * 1e3:.0f} ms/step, "
            f"{real:,.0f} real tokens/step, {real / seconds:,.0f} real tokens/s",
            flush=True,
        )
    print(f"packing x{result[True] / result[False]:.2f} real tokens/s (median example {int(np.median(lens))} tokens)")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        count_table(Path(d))
        timed_table(Path(d))
