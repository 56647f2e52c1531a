"""Picking the next token from vocabulary-parallel logits without gathering them: each TP rank of the last stage
holds the logits of its slice of the vocabulary `[b, v/tp]` (padding rows at -inf), and only a few numbers per row
cross the TP group.

- greedy: each rank's two best (value, global id) are all-gathered (`[tp, b, 2]`); the best wins, ties to the lower
  id (what `torch.argmax` and HF's greedy search pick). The gap to the second best, the margin, comes back too: a
  parity test checks it exceeds its tolerance, so a near-tie cannot pass by luck.
- sampling (temperature, top-p): the Gumbel-max trick, argmax(logits / T + Gumbel noise) over the nucleus, is an
  exact draw from the renormalised nucleus distribution, and it is an argmax, so it is vocabulary-parallel like
  greedy. The noise of (seed, prompt, step) is drawn over the whole (unpadded) vocabulary on every rank from its own
  generator and sliced: the same tokens at every tp / pp / dp and in any batch. The nucleus threshold comes from a
  search over probability thresholds with one small all-reduce per round (the mass above each candidate).

Used by `threed.generate.decode`; tests: tests/ranks/test_generate.py.

    threed generate --load CKPT --prompt "Once upon a time" --max-new-tokens 32 --temperature 0.8 --top-p 0.9 --seed 1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from threed.generate.prompts import Sampling

# The nucleus threshold search: CANDIDATES thresholds a round (one all-reduce of [b, CANDIDATES] each), ROUNDS
# rounds narrow it to (1 / (CANDIDATES - 1)) ** ROUNDS of the best token's probability.
CANDIDATES = 64
ROUNDS = 6


@dataclass(frozen=True)
class VocabSlice:
    """This TP rank's part of the vocabulary: global ids [start, start + columns); ids >= vocab_size are padding."""

    start: int
    columns: int
    vocab_size: int
    group: Optional[dist.ProcessGroup] = None  # the TP group (None: the world, or no TP)
    size: int = 1


def parallel_top2(scores: torch.Tensor, part: VocabSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """The best global id of each row of vocab-parallel `scores` `[b, v/tp]` and its margin over the second best
    (float64), on every TP rank. Ties go to the lower id."""
    values, index = scores.double().topk(2, dim=-1)  # [b, 2]
    ids = index + part.start
    if part.size > 1:
        all_values = [torch.empty_like(values) for _ in range(part.size)]
        all_ids = [torch.empty_like(ids) for _ in range(part.size)]
        dist.all_gather(all_values, values.contiguous(), group=part.group)
        dist.all_gather(all_ids, ids.contiguous(), group=part.group)
        values, ids = torch.cat(all_values, dim=-1), torch.cat(all_ids, dim=-1)  # [b, 2 * tp]
    best = values.max(dim=-1, keepdim=True).values
    big = torch.iinfo(ids.dtype).max
    token = torch.where(values == best, ids, torch.full_like(ids, big)).min(dim=-1).values
    rest = values.masked_fill(ids == token[:, None], float("-inf"))
    margin = best[:, 0] - rest.max(dim=-1).values
    return token, margin


def _all_reduce(t: torch.Tensor, part: VocabSlice, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if part.size > 1:
        dist.all_reduce(t, op=op, group=part.group)
    return t


def nucleus_floor(probs: torch.Tensor, top_p: float, part: VocabSlice) -> torch.Tensor:
    """Per row, the probability threshold t (float64 `[b, 1]`) of the smallest set of most probable tokens whose
    mass reaches `top_p`: the largest t with mass(p >= t) >= top_p, searched over the vocab-parallel `probs`."""
    p = probs.double()
    hi = _all_reduce(p.max(dim=-1, keepdim=True).values.clone(), part, dist.ReduceOp.MAX)
    lo = torch.zeros_like(hi)  # mass(p >= 0) = 1 >= top_p
    steps = torch.linspace(0.0, 1.0, CANDIDATES, dtype=torch.float64, device=p.device)
    for _ in range(ROUNDS):
        cand = lo + (hi - lo) * steps  # [b, C]
        mass = _all_reduce((p[:, None, :] * (p[:, None, :] >= cand[:, :, None])).sum(dim=-1), part)
        ok = mass >= top_p  # true up to some candidate, false beyond (mass falls as t rises)
        last = ok.sum(dim=-1, keepdim=True).clamp(min=1) - 1
        lo = cand.gather(1, last)
        hi = cand.gather(1, (last + 1).clamp(max=CANDIDATES - 1))
    return lo


def gumbel_noise(keys: Sequence[tuple[int, int]], sampling: Sampling, part: VocabSlice, device) -> torch.Tensor:
    """Gumbel noise `[b, v/tp]` for this rank's slice: row i from a generator of (seed, prompt, step) = keys[i],
    drawn over the whole unpadded vocabulary, so that every layout and batch draws the same numbers."""
    rows = []
    stop = min(part.start + part.columns, part.vocab_size)
    for prompt, step in keys:
        gen = torch.Generator().manual_seed((sampling.seed << 40) ^ (prompt << 20) ^ step)
        u = torch.rand(part.vocab_size, generator=gen, dtype=torch.float64)[part.start : stop]
        row = torch.full((part.columns,), float("-inf"), dtype=torch.float64)
        row[: stop - part.start] = -torch.log(-torch.log(u.clamp(min=1e-300)))
        rows.append(row)
    return torch.stack(rows).to(device)


def pick(
    logits: torch.Tensor, part: VocabSlice, sampling: Sampling, keys: Sequence[tuple[int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row from vocab-parallel `logits` `[b, v/tp]` (same on every TP rank) and the margin
    of the winning score. `keys`: (prompt index, step) of each row, for the sampling noise."""
    if sampling.greedy:
        return parallel_top2(logits, part)
    x = logits.double() / sampling.temperature
    top = _all_reduce(x.max(dim=-1, keepdim=True).values.clone(), part, dist.ReduceOp.MAX)
    e = torch.exp(x - top)
    probs = e / _all_reduce(e.sum(dim=-1, keepdim=True), part)
    if sampling.top_p < 1.0:
        x = x.masked_fill(probs < nucleus_floor(probs, sampling.top_p, part), float("-inf"))
    return parallel_top2(x + gumbel_noise(keys, sampling, part, logits.device), part)
