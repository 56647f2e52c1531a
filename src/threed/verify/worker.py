"""One rank of `threed verify`: build the tp x pp engine, load the checkpoint with DeepSpeed's own
`load_checkpoint(load_module_only=True)` (the path `threed train --init-from` takes), run the tokens, and save
the full-vocab fp32 logits from the last stage.

    python -m torch.distributed.run --nproc-per-node 4 -m threed.verify.worker \
        --ckpt DIR --tp 2 --pp 2 --tokens tokens.pt --out logits.pt
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

import torch

from threed.config import CheckpointConfig, ParallelConfig, RunConfig, TrainConfig
from threed.checkpoint.format import check_loadable, read_model_config
from threed.parallel.distributed import init_distributed
from threed.engine.build import build_engine
from threed.engine.resolved import resolve
from threed.verify.logits import pipeline_logits


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="threed.verify.worker")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--tokens", required=True, help="a torch file holding int64 tokens [b, s]")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    tokens = torch.load(args.tokens)
    model = read_model_config(args.ckpt)
    assert model is not None, f"{args.ckpt} records no model config"
    check_loadable(args.ckpt, model, args.tp, args.pp)
    cfg = RunConfig(
        model=model,
        parallel=ParallelConfig(tp=args.tp, pp=args.pp),
        train=TrainConfig(dtype="fp32", seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], steps=1),
        checkpoint=CheckpointConfig(init_from=args.ckpt),
    )
    rt = init_distributed()
    built = build_engine(resolve(cfg, rt.world_size), rt)
    engine = built.engine
    with torch.no_grad():
        logits = pipeline_logits(engine, tokens, model.vocab_size)
    if logits is not None and engine.grid.get_slice_parallel_rank() == 0:
        torch.save({"logits": logits, "tokens": tokens, "rank": rt.rank}, args.out)
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
