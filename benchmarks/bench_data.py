"""Data loading vs training step time: how much of a step the megatron-core data path costs a reading rank.

    .venv/bin/python benchmarks/bench_data.py            # tiny tp2 pp2 dp2 run (8 ranks) + loader timings

1. Trains the `tiny` preset at tp2 x pp2 x dp2 (8 gloo ranks; micro 4 x gas 4 -> global batch 32 x seq 128) for a
   few steps on a synthetic megatron dataset and takes the median step time from its log.
2. Times, in this process, what one reading rank's loader does per global batch: its dp share (GBS / dp samples)
   read from megatron-core's GPTDataset and collated into (tokens, (labels, loss_mask)) micro-batches.
3. Times the same at seq 8192 and a share of 64 samples (GBS 512 at dp 8), the shape of the Llama recipes, and
   prints the loader's cost per step there (compare with a 70B step of tens of seconds).
Prints the ratio loader / step for (1, 2): the goal is <= 2%.
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import gpt_dataset, write_dataset  # noqa: E402
from threed.config import DataConfig, RunConfig, TrainConfig  # noqa: E402
from threed.data.loader import micro_batches  # noqa: E402
from threed.convert.resolve import model_config  # noqa: E402


def loader_seconds(prefix: str, seq: int, gbs: int, micro: int, dp: int, steps: int, vocab: int) -> float:
    """Median seconds for one rank to read its share of one global batch."""
    cfg = RunConfig(
        model=model_config("tiny"),
        train=TrainConfig(seq_length=seq, steps=steps, eval_interval=0),
        data=DataConfig(data_path=(prefix,), split="100,0,0"),
    )
    ds = gpt_dataset(cfg, gbs).train
    it = micro_batches(ds, gbs, micro, dp, 0, 0, vocab)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(gbs // dp // micro):
            next(it)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    vocab = model_config("tiny").vocab_size
    with tempfile.TemporaryDirectory() as d:
        rng = np.random.default_rng(0)
        prefix = write_dataset(Path(d) / "tiny", rng.integers(0, vocab, 400_000), vocab)
        steps = 12
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "8",
                "-m",
                "threed.train",
                "--model",
                "tiny",
                "--tp",
                "2",
                "--pp",
                "2",
                "--micro-batch-size",
                "4",
                "--grad-accum-steps",
                "4",
                "--seq-length",
                "128",
                "--steps",
                str(steps),
                "--dtype",
                "bf16",
                "--data-path",
                prefix,
                "--split",
                "100,0,0",
                "--stage-timing",
                "false",
                "--tensorboard",
                "false",
            ],
            capture_output=True,
            text=True,
            timeout=900,
        )
        ms = [float(m) for m in re.findall(r"^step \d+/\d+ \| .*?\| (\d+) ms \|", proc.stdout, re.M)]
        if len(ms) < steps:
            sys.exit(f"training run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        step_s = statistics.median(ms[2:]) / 1000
        load_s = loader_seconds(prefix, 128, 32, 4, 2, 30, vocab)
        print(
            f"tiny tp2 pp2 dp2, global batch 32 x 128: step {step_s * 1000:.1f} ms (median of steps 3-{steps}), "
            f"one reading rank's loader {load_s * 1000:.2f} ms per global batch"
        )
        print(f"ratio loader / step = {load_s / step_s:.4f} ({load_s / step_s * 100:.2f}%; goal <= 2%)")
        big = write_dataset(Path(d) / "big", rng.integers(0, 32000, 8_000_000), 32000, doc_len=(500, 20000))
        big_s = loader_seconds(big, 8192, 512, 1, 8, 6, 32000)
        print(
            f"seq 8192, global batch 512 at dp 8 (64 samples per reading rank): loader {big_s * 1000:.1f} ms per "
            f"step on this CPU"
        )


if __name__ == "__main__":
    main()
