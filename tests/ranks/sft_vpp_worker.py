"""SFT with packed rows at --vpp 2, for tests/ranks/test_interleaved.py: sft_worker.py's packed run (5 fp32 steps
through threed.train, the loss over the response tokens of the global batch, validation after the last step) at
tp1 pp2 vpp2 dp2 on 4 ranks, whose global batch (micro 2 x gas 2 x dp 2 rows) is sft_worker's, so the test holds
it to the same single-process HF reference.

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/sft_vpp_worker.py --out /tmp/x \
        --data PREFIX_text_document
"""

from __future__ import annotations

import argparse
import dataclasses

# worker_setup first: it puts tests/ on sys.path (helpers, reference)
from worker_setup import rank_json, run_worker, train
from sft_worker import add_arguments, sft_config
from threed.config import ParallelConfig
from threed.parallel.distributed import Runtime


def main(args: argparse.Namespace, rt: Runtime) -> None:
    cfg = sft_config(args.data, True, 5)
    cfg = dataclasses.replace(cfg, parallel=ParallelConfig(tp=1, pp=2, vpp=2))
    r = train(cfg)
    result = {"losses": r.losses, "grad_norms": r.grad_norms, "evals": r.evals, "loss_tokens": r.loss_tokens}
    rank_json(args.out, "sft_vpp", result)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}, add_arguments))
