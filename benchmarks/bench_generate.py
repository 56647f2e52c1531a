"""Generation benchmark: tokens/s of `threed generate`'s decode loop with its KV cache, against the same loop
without it (the whole sequence each step) and against HF `generate` on the same weights, in one run on CPU
(one rank, tp1 pp1, fp32; greedy).

    .venv/bin/python benchmarks/bench_generate.py                       # 8 prompts of 64 tokens, 64 new tokens
    .venv/bin/python benchmarks/bench_generate.py --batch 4 --prompt-len 128 --new 128 --repeats 3

Prints each one's tokens/s (best of --repeats) and two ratios: cache / no cache, and threed / HF. The greedy tokens
of the three are checked equal first, so the three time the same work.
"""

from __future__ import annotations

import argparse
import time

import torch

from threed.config import ParallelConfig, RunConfig, TrainConfig
from threed.convert.in_memory import load_hf_state
from threed.generate.decode import generate_all
from threed.generate.prompts import Sampling
from threed.hf.config import from_hf_config
from threed.parallel.distributed import init_distributed
from threed.engine.build import build_engine
from threed.engine.resolved import resolve

SHAPE = dict(
    vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    intermediate_size=704, max_position_embeddings=512, rope_theta=500000.0,
)  # fmt: skip


def best_of(repeats: int, fn) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False)).eval()
    model = from_hf_config(hf.config.to_dict(), name="bench")
    cfg = RunConfig(model=model, parallel=ParallelConfig(), train=TrainConfig(dtype="fp32", seq_length=64, steps=1))
    rt = init_distributed()
    engine = build_engine(resolve(cfg, rt.world_size), rt).engine
    load_hf_state(engine.module, model, hf.state_dict(), 1, 0)
    prompts = torch.randint(
        0, SHAPE["vocab_size"], (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(1)
    )
    ids = prompts.tolist()
    new = args.batch * args.new

    def ours(cache: bool):
        return [
            r.tokens
            for r in generate_all(engine, model, ids, args.new, Sampling(), use_cache=cache, batch_size=args.batch)
        ]

    def theirs():
        with torch.no_grad():
            mask = torch.ones_like(prompts)
            out = hf.generate(prompts, attention_mask=mask, do_sample=False, max_new_tokens=args.new,
                              min_new_tokens=args.new, pad_token_id=0, eos_token_id=None)  # fmt: skip
        return out[:, args.prompt_len :].tolist()

    t_cache, a = best_of(args.repeats, lambda: ours(True))
    t_none, b = best_of(args.repeats, lambda: ours(False))
    t_hf, c = best_of(args.repeats, theirs)
    same = a == b == c
    print(
        f"bench_generate: {args.batch} prompts x {args.prompt_len} tokens, {args.new} new (greedy, fp32, CPU, "
        f"{torch.get_num_threads()} threads): KV cache {new / t_cache:.1f} tokens/s, no cache {new / t_none:.1f} "
        f"tokens/s, HF generate {new / t_hf:.1f} tokens/s | cache / no cache {t_none / t_cache:.2f}x, threed / HF "
        f"{t_hf / t_cache:.2f}x | same tokens: {same}",
        flush=True,
    )


if __name__ == "__main__":
    main()
