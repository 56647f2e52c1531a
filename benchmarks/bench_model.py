"""Forward + backward time of our model (tp=1, pp=1, one process: megatron-core layers + our SDPA attention and
RoPE, inside the DeepSpeed PipelineModule) against transformers' LlamaForCausalLM of the same config, same
threads, same batch, fp32, same weights. Prints both median times and the ratio ours / HF.

    .venv/bin/python benchmarks/bench_model.py [--hidden 512 --layers 8 --seq 256 --batch 4 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F


def _sync() -> None:
    if torch.cuda.is_available():  # GPU kernels are asynchronous: time them to completion
        torch.cuda.synchronize()


def median_times(fns, warmup: int, iters: int) -> list[float]:
    """Median seconds per call of each fn, calls interleaved so background load hits both alike."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(a.threads)

    from transformers import LlamaConfig, LlamaForCausalLM

    from threed.config import ParallelConfig, RunConfig, TrainConfig
    from threed.convert.in_memory import load_hf_state
    from threed.parallel.distributed import init_distributed, init_megatron_parallel_state
    from threed.hf.config import from_hf_config
    from threed.parallel.dims import resolve_dims
    from threed.parallel.pipeline import build_pipeline_module

    hf_cfg = LlamaConfig(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        intermediate_size=a.ffn,
        max_position_embeddings=max(a.seq, 2048),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).train()
    model_cfg = from_hf_config(hf_cfg.to_dict(), name="bench")
    cfg = RunConfig(model=model_cfg, parallel=ParallelConfig(1, 1), train=TrainConfig(dtype="fp32", seq_length=a.seq))
    rt = init_distributed()
    init_megatron_parallel_state(1, 1)
    ours = build_pipeline_module(
        cfg.model,
        resolve_dims(cfg, rt.world_size),
        cfg.train,
        sequence_parallel=cfg.parallel.sequence_parallel,
        initialize=False,
    ).train()  # on rt.device
    load_hf_state(ours, model_cfg, hf.state_dict(), tp=1, tp_rank=0)
    hf = hf.to(rt.device)

    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=torch.Generator().manual_seed(0))
    inputs, labels = tokens[:, :-1].to(rt.device), tokens[:, 1:].to(rt.device)

    def step_hf():
        hf.zero_grad(set_to_none=True)
        logits = hf(inputs).logits
        F.cross_entropy(logits.reshape(-1, a.vocab), labels.reshape(-1)).backward()

    def step_ours():
        ours.zero_grad(set_to_none=True)
        ours.loss_fn(ours(inputs), labels).backward()

    # Same weights, so the same loss: a check that the two runs compute the same thing.
    with torch.no_grad():
        l_hf = F.cross_entropy(hf(inputs).logits.reshape(-1, a.vocab), labels.reshape(-1)).item()
        l_ours = ours.loss_fn(ours(inputs), labels).item()
    t_hf, t_ours = median_times([step_hf, step_ours], a.warmup, a.iters)
    tokens_per_step = a.batch * a.seq
    print(
        f"config: hidden {a.hidden}, layers {a.layers}, heads {a.heads}/{a.kv_heads}, ffn {a.ffn}, vocab {a.vocab}, "
        f"batch {a.batch} x seq {a.seq}, fp32, {a.threads} threads"
    )
    print(f"loss   ours {l_ours:.6f}  HF {l_hf:.6f}")
    print(
        f"fwd+bwd ours {t_ours * 1000:.1f} ms ({tokens_per_step / t_ours:.0f} tok/s)   "
        f"HF {t_hf * 1000:.1f} ms ({tokens_per_step / t_hf:.0f} tok/s)"
    )
    print(f"ratio ours / HF = {t_ours / t_hf:.3f}  (below 1: ours is faster)")


if __name__ == "__main__":
    main()
