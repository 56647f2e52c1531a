"""Multi-rank scenario for tests/ranks/test_context_attention.py, fp64: on 4 ranks, cp 4 over the world and cp 2 over
each pair of consecutive ranks (one launch for both, and CP groups that are not the world). Every rank
builds the same full rows (same seeds), computes the full-sequence reference itself (SDPACoreAttention and its
gradients; the single-process token mean), runs its own share through threed.model.context, gathers the result
back to the full row and writes the relative errors as OUT/context_rank<R>.json.

    python -m torch.distributed.run --nproc-per-node 4 tests/ranks/context_worker.py --out /tmp/cp
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

# worker_setup first: the shared start of every worker
from worker_setup import rank_json, run_worker
from threed.model.attention import SDPACoreAttention, document_segments
from threed.model import context as cpx
from threed.parallel.distributed import Runtime

SEQ, BATCH, HEAD_DIM, SCALE = 48, 2, 8, 0.3
# Document lengths per row: edges inside chunks and on them (chunks of 12 at cp 2, 6 at cp 4), documents of one
# token, and one that spans several chunks (and CP ranks).
DOC_LENGTHS = ([5, 14, 1, 3, 25], [12, 12, 6, 18])
# name -> (heads, kv_heads, packed documents, segment ids given as this rank's share rather than the full row)
CASES = {
    "causal_gqa": (4, 2, False, False),
    "causal_mha": (4, 4, False, False),
    "documents_gqa": (4, 2, True, False),
    "documents_mha": (4, 4, True, False),
    "documents_gqa_local_segments": (4, 2, True, True),
}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def full_row_inputs(heads: int, kv_heads: int, device: torch.device, seed: int) -> list[torch.Tensor]:
    """q `[s, b, heads, d]`, k and v `[s, b, kv_heads, d]`, and the output's gradient weight `[s, b, heads*d]`."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(heads, HEAD_DIM), (kv_heads, HEAD_DIM), (kv_heads, HEAD_DIM), (heads * HEAD_DIM,)]
    return [torch.randn(SEQ, BATCH, *shape, generator=g, dtype=torch.float64).to(device) for shape in shapes]


def segment_ids(device: torch.device) -> torch.Tensor:
    rows = [torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]) for lengths in DOC_LENGTHS]
    return document_segments(torch.stack(rows)).to(device)


def attention_case(name: str, rt: Runtime, group) -> dict[str, float]:
    """out, dQ, dK, dV of the CP attention, gathered to the full row, against full-sequence SDPACoreAttention."""
    heads, kv_heads, documents, local_segments = CASES[name]
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    q, k, v, weight = full_row_inputs(heads, kv_heads, rt.device, seed=len(name))
    segments = segment_ids(rt.device) if documents else None

    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = SDPACoreAttention(None, 1, softmax_scale=SCALE)(*ref, attention_mask=segments)
    (want * weight).sum().backward()

    mine = [cpx.split(t, cp, rank, dim=0).requires_grad_() for t in (q, k, v)]
    seg = cpx.split(segments, cp, rank) if local_segments else segments
    out = cpx.context_parallel_attention(*mine, group, segments=seg, scale=SCALE)
    (out * cpx.split(weight, cp, rank, dim=0)).sum().backward()

    got = [out.detach()] + [t.grad for t in mine]
    return {
        what: rel(cpx.gather(g, group, dim=0), w)
        for what, g, w in zip(("out", "dq", "dk", "dv"), got, [want.detach()] + [t.grad for t in ref])
    }


def loss_case(rt: Runtime, group) -> dict[str, float]:
    """Two micro-batches of token losses with SFT-style loss masks that cover the chunks unevenly: the exact mean
    (threed.model.context.exact_token_mean) against the single-process mean, and the mean of per-rank means."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(7)
    easier_later = 2.0 - torch.arange(SEQ, dtype=torch.float64) / SEQ  # as in text: later tokens are easier
    losses = [(torch.rand(BATCH, SEQ, generator=g, dtype=torch.float64) + easier_later).to(rt.device) for _ in range(2)]
    masks = [torch.zeros(BATCH, SEQ, device=rt.device) for _ in range(2)]
    masks[0][0, 14:17], masks[0][1, 24:], masks[1][0, 3:44] = 1, 1, 1  # responses: 29 vs 39 tokens on cp 2's ranks
    single_process = sum((x * m).sum() for x, m in zip(losses, masks)) / sum(m.sum() for m in masks)

    pairs = [cpx.token_weighted_loss_sum(cpx.split(x, cp, rank), cpx.split(m, cp, rank)) for x, m in zip(losses, masks)]
    exact, count = cpx.exact_token_mean(pairs, group)
    per_rank = (sum(s for s, _ in pairs) / sum(c for _, c in pairs)).reshape(1)
    dist.all_reduce(per_rank, group=group)
    return {
        "exact_vs_single_process": abs(exact.item() - single_process.item()) / single_process.item(),
        "count": count.item(),
        "want_count": sum(m.sum() for m in masks).item(),
        "mean_of_rank_means_vs_single_process": abs(per_rank.item() / cp - single_process.item())
        / single_process.item(),
    }


def gather_case(rt: Runtime, group) -> bool:
    """split then gather is the identity, with real collectives: int `[b, s]` rows and float `[s, b, h]`."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    ids = torch.arange(BATCH * SEQ, device=rt.device).reshape(BATCH, SEQ)
    acts = full_row_inputs(2, 2, rt.device, seed=3)[0]
    return torch.equal(cpx.gather(cpx.split(ids, cp, rank), group), ids) and torch.equal(
        cpx.gather(cpx.split(acts, cp, rank, dim=0), group, dim=0), acts
    )


def cp_groups() -> dict[int, object]:
    """cp -> this rank's CP group: the whole world, and groups of 2 consecutive ranks (megatron's order tp-cp-dp-pp
    at tp 1), whose group ranks differ from the global ones on all but the first pair."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = {world: dist.group.WORLD}
    if world > 2 and world % 2 == 0:
        pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]  # every rank makes every group
        groups[2] = pairs[rank // 2]
    return groups


def main(args: argparse.Namespace, rt: Runtime) -> None:
    results = {
        str(cp): {
            "attention": {name: attention_case(name, rt, group) for name in CASES},
            "loss": loss_case(rt, group),
            "gather_round_trip": gather_case(rt, group),
        }
        for cp, group in cp_groups().items()
    }
    rank_json(args.out, "context", results)


if __name__ == "__main__":
    raise SystemExit(run_worker({"main": main}))
