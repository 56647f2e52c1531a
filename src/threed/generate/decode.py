"""Generation on the training engine's own stages: each rank runs only its stage's layers, hidden states go to the
next stage by point-to-point sends, and the last stage picks the token (`threed.generate.sampling`) and
broadcasts it over its pipeline, so the first stage embeds it next and every stage knows which rows are done.

Interleaved stages (`--vpp V`, threed.parallel.interleaved) are the same loop over chunks: a rank holds V chunks,
virtual stage k = chunk c x pp + rank r (`Chunk`), and one forward goes rank 0 chunk 0 -> rank 1 chunk 0 -> ...
-> rank pp - 1 chunk 0 -> rank 0 chunk 1 -> ... -> rank pp - 1 chunk V - 1, each hop a blocking send and receive.
Each rank runs its chunks in order, waiting for the previous virtual stage's hidden states before each: the
virtual stages form one chain, so every send finds its receiver waiting (or on its way to it), and nothing
deadlocks. V 1 is the one-chunk case of the same code.

Not through DeepSpeed's `eval_batch`: it keeps only the last micro-batch's logits and runs whole sequences. Here
each stage drives its modules itself:

- KV cache (default): megatron-core's own `StaticInferenceContext`. The prompts (left-padded to one length) run
  once; then each step feeds one token, so one token's hidden state `[1, b, h]` crosses each stage boundary.
  megatron's attention stores keys and values per layer and slices the RoPE angles by the context's offset; its
  buffers are allocated here (megatron allocates them on `torch.cuda.current_device()`) on the stage's device.
- no cache (`use_cache=False`): each step runs the whole sequence so far, the reference the cache must equal.

Masks are explicit boolean `[b, 1, sq, sk]` (SDPA's `is_causal` aligns top-left, wrong for a one-token query):
key j is visible to query i when j <= i and j is not left padding. Positions restart after each row's padding, so
a padded row sees the angles it would alone (what HF computes from its attention mask).

Sequence and context parallelism: a prompt, or one new token, cannot be cut over tp or into 2·cp chunks, so under
`evaluation` every module of the stage runs whole sequences (`threed.model.layers.whole_sequences`, switched back on
exit): the TP linears all-reduce instead of reduce-scatter / all-gather, and each CP rank, holding the full
weights, is a replica of its own (`replicas`: DeepSpeed's data axis, dp x cp).

    threed generate --load CKPT --prompt "The capital of France is" --max-new-tokens 16 --nproc-per-node 4 --tp 2 --pp 2
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.transformer.transformer_layer import TransformerLayer

from threed.config import ModelConfig
from threed.generate.prompts import Sampling
from threed.generate.sampling import VocabSlice, parallel_top2, pick
from threed.model.layers import token_losses, whole_sequences
from threed.model.spec import pipeline_layers


@dataclass
class Chunk:
    """One chunk of this rank's layers (its whole stage at vpp 1): virtual stage k = chunk c x pp + rank r."""

    funcs: list[tuple[str, Any]]  # (layer kind, the callable DeepSpeed's PipelineModule runs) of the chunk
    first: bool  # virtual stage 0: it embeds the tokens
    last: bool  # the last virtual stage: its head's logits pick the token
    prev_rank: Optional[int]  # global ranks of the virtual stages either side (same data-parallel and TP coordinates)
    next_rank: Optional[int]


@dataclass
class Stage:
    """This rank's part of the model, as generation drives it: its chunks, in virtual-stage order."""

    chunks: list[Chunk]
    last: bool  # this rank holds the last virtual stage (it picks the tokens)
    last_rank: int  # global rank of the last stage of this pipeline
    pipe_group: Any
    part: VocabSlice
    device: torch.device
    dtype: torch.dtype
    hidden_size: int
    blocks: list[Any] = field(default_factory=list)  # every chunk's blocks

    @property
    def funcs(self) -> list[tuple[str, Any]]:
        """(layer kind, callable) of every chunk, in order."""
        return [pair for chunk in self.chunks for pair in chunk.funcs]


def stage_of(engine, model: ModelConfig) -> Stage:
    """The generation view of `engine`'s stage (a DeepSpeed PipelineEngine that threed built, at any vpp)."""
    module, grid = engine.module, engine.grid
    layers = pipeline_layers(model)
    stage, stages = grid.get_stage_id(), grid.get_pipe_parallel_world_size()
    total = stages * module.vpp  # virtual stages
    chunks = []
    for c, ((start, stop), fns) in enumerate(zip(module.chunk_bounds, module.chunk_funcs)):
        k = c * stages + stage
        chunks.append(
            Chunk(
                funcs=[(layers[i].kind, fn) for i, fn in zip(range(start, stop), fns)],
                first=k == 0,
                last=k == total - 1,
                prev_rank=grid.stage_to_global((k - 1) % stages) if k > 0 else None,
                next_rank=grid.stage_to_global((k + 1) % stages) if k < total - 1 else None,
            )
        )
    tp, tp_rank = grid.get_slice_parallel_world_size(), grid.get_slice_parallel_rank()
    columns = model.padded_vocab_size(tp) // tp
    param = next(module.parameters())
    return Stage(
        chunks=chunks,
        last=chunks[-1].last,
        last_rank=grid.stage_to_global(stages - 1),
        pipe_group=grid.get_pipe_parallel_group(),
        part=VocabSlice(tp_rank * columns, columns, model.vocab_size, grid.get_slice_parallel_group(), tp),
        device=param.device,
        dtype=param.dtype,
        hidden_size=model.hidden_size,
        blocks=[fn for chunk in chunks for kind, fn in chunk.funcs if kind == "block"],
    )


def kv_cache(stage: Stage, batch: int, length: int) -> StaticInferenceContext:
    """megatron's static KV cache for this stage's blocks, its buffers allocated on the stage's device."""
    ctx = StaticInferenceContext(max_batch_size=batch, max_sequence_length=length)
    for block in stage.blocks:
        attn = block.self_attention
        shape = (length, batch, attn.num_query_groups_per_partition, attn.hidden_size_per_attention_head)
        ctx.key_value_memory_dict[attn.layer_number] = tuple(
            torch.zeros(shape, dtype=stage.dtype, device=stage.device) for _ in range(2)
        )
    return ctx


def visible(key_ok: torch.Tensor, begin: int, length: int) -> torch.Tensor:
    """Boolean `[b, 1, length - begin, length]`: query i (positions begin..length-1) sees key j when j <= i and j is
    no padding; each query sees itself, so a padding query's row is never empty (its output is not used)."""
    q = torch.arange(begin, length, device=key_ok.device)[:, None]
    k = torch.arange(length, device=key_ok.device)[None, :]
    return ((k <= q)[None] & key_ok[:, None, :length] | (k == q)[None])[:, None]


def run_chunk(chunk: Chunk, x: torch.Tensor, mask, angles, ctx, last_only: bool = True) -> torch.Tensor:
    """This chunk's layers on `x` (tokens on the first virtual stage, else hidden `[s, b, h]`); with `last_only` the
    final norm and the head see only the last position (the one whose next token is picked)."""
    for kind, fn in chunk.funcs:
        if kind == "block":
            # megatron's TransformerLayer itself: LlamaBlock.forward takes one tensor (the pipeline's convention)
            x, _ = TransformerLayer.forward(fn, x, attention_mask=mask, rotary_pos_emb=angles, inference_context=ctx)
        elif kind == "embedding":
            x = fn(x)
        else:
            x = fn(x[-1:] if kind == "final_norm" and last_only else x)
    return x


def run_stage(stage: Stage, tokens: torch.Tensor, mask, angles, ctx, last_only: bool = True) -> Optional[torch.Tensor]:
    """One forward through this rank's chunks, in order: each runs on the tokens `[b, s]` (virtual stage 0) or on
    the hidden states `[s, b, h]` the previous virtual stage sends, and sends its output to the next. The last
    virtual stage's output (the head's logits) on the rank that runs it, None elsewhere. Every rank of the pipeline
    calls it with the same tokens."""
    b, s = tokens.shape
    out = None
    for chunk in stage.chunks:
        x = tokens if chunk.first else receive(stage, chunk.prev_rank, (s, b, stage.hidden_size))
        x = run_chunk(chunk, x, mask, angles, ctx, last_only)
        if chunk.last:
            out = x
        else:
            dist.send(x.contiguous(), dst=chunk.next_rank)
    return out


def score_batch(stage: Stage, rows: Sequence[Sequence[int]], scored: Sequence[int]) -> Optional[list[tuple]]:
    """Log-probabilities of token sequences, as training computes them: row r's last `scored[r]` tokens are scored
    given everything before them. One causal forward of the right-padded batch (SDPA `is_causal`, the training
    path: padding after a row cannot change it), then on the last stage megatron's vocab-parallel cross entropy
    (`threed.model.layers.token_losses`) and a vocab-parallel argmax for "is greedy": the full logits are never
    gathered. Returns (sum of log-probabilities (float64), every scored token the argmax) per row on the last
    stage, None elsewhere. Every rank of the pipeline calls it with the same rows."""
    b, s = len(rows), max(len(r) for r in rows) - 1
    tokens = torch.zeros(b, s, dtype=torch.long, device=stage.device)
    labels = torch.zeros(b, s, dtype=torch.long, device=stage.device)
    for i, r in enumerate(rows):
        tokens[i, : len(r) - 1] = torch.tensor(list(r[:-1]), dtype=torch.long)
        labels[i, : len(r) - 1] = torch.tensor(list(r[1:]), dtype=torch.long)
    angles = stage.blocks[0].rotary(s, stage.device) if stage.blocks else None
    x = run_stage(stage, tokens, None, angles, None, last_only=False)
    if x is None:  # not the last stage
        return None
    logprobs = -token_losses(x, labels).double()  # [b, s]
    best, _ = parallel_top2(x.reshape(s * b, -1), stage.part)
    greedy = best.reshape(s, b).transpose(0, 1) == labels
    out = []
    for i, r in enumerate(rows):
        end, n = len(r) - 1, scored[i]
        out.append((float(logprobs[i, end - n : end].sum()), bool(greedy[i, end - n : end].all())))
    return out


def receive(stage: Stage, src: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A chunk's input `shape` from the previous virtual stage, on global rank `src` (every chunk but the first)."""
    buf = torch.empty(shape, dtype=stage.dtype, device=stage.device)
    dist.recv(buf, src=src)
    return buf


@dataclass
class Generated:
    tokens: list[list[int]]  # per row, the new ids up to and including the first stop id
    margins: list[list[float]]  # per row and step, the winning score's margin (last stage only; else empty)
    steps: int  # forward steps run


def generate_batch(
    stage: Stage,
    prompts: Sequence[Sequence[int]],
    indices: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int] = (),
    use_cache: bool = True,
) -> Generated:
    """Every rank of one pipeline calls this with the same prompts (token ids, no padding) and their global
    `indices` (the sampling noise is keyed by them). Rows stop at a stop id or after `max_new_tokens`."""
    b, longest = len(prompts), max(len(p) for p in prompts)
    total = longest + max_new_tokens
    pad = torch.tensor([longest - len(p) for p in prompts], device=stage.device)
    tokens = torch.zeros(b, total, dtype=torch.long, device=stage.device)
    for i, p in enumerate(prompts):
        tokens[i, longest - len(p) : longest] = torch.tensor(list(p), dtype=torch.long)
    span = torch.arange(total, device=stage.device)[None, :]
    key_ok = span >= pad[:, None]
    angles = stage.blocks[0].rotary.at_positions((span - pad[:, None]).clamp(min=0)) if stage.blocks else None
    ctx = kv_cache(stage, b, total) if use_cache else None
    stops = torch.tensor(list(stop_ids) or [-1], device=stage.device)
    done = torch.zeros(b, dtype=torch.bool, device=stage.device)
    new: list[list[int]] = [[] for _ in range(b)]
    margins: list[list[float]] = [[] for _ in range(b)]
    length, step = longest, 0
    while step < max_new_tokens and not bool(done.all()):
        begin = length - 1 if use_cache and step > 0 else 0
        if ctx is not None:
            ctx.sequence_len_offset = begin
            if step == 1:
                ctx.enable_decode_mode()
        step_angles = angles if ctx is not None or angles is None else angles[:length]
        x = run_stage(stage, tokens[:, begin:length], visible(key_ok, begin, length), step_angles, ctx)
        token = torch.empty(b, dtype=torch.long, device=stage.device)
        live = (~done).nonzero().flatten().tolist()
        if stage.last:
            token, margin = pick(x[-1], stage.part, sampling, [(i, step) for i in indices])
            for r in live:
                margins[r].append(float(margin[r]))
        dist.broadcast(token, src=stage.last_rank, group=stage.pipe_group)
        tokens[:, length] = token
        for r in live:
            new[r].append(int(token[r]))
        done |= torch.isin(token, stops)
        length, step = length + 1, step + 1
    return Generated(tokens=new, margins=margins if stage.last else [], steps=step)


def replicas(engine) -> tuple[int, int]:
    """(how many, which one): the pipelines that generate or score separately, each its share of the rows. DeepSpeed's
    data axis: dp x cp ranks (threed.parallel.pipeline.make_topology). Under context parallelism the CP ranks of a
    data-parallel rank hold the same weights, and `evaluation` has each run whole rows, so they are replicas of
    their own: no row is run twice, and each rank's pipeline (its stages' send / receive peers, its TP group) is
    the one DeepSpeed's grid gives it at that data coordinate."""
    grid = engine.grid
    return grid.get_data_parallel_world_size(), grid.get_data_parallel_rank()


@contextlib.contextmanager
def evaluation(engine, stage: Stage) -> Iterator[None]:
    """What generation and scoring run under: the engine's module in eval mode, no autograd, and every module of
    the stage running whole sequences (`threed.model.layers.whole_sequences`: no sequence-parallel split over tp,
    no context-parallel chunks and K/V exchange), all put back on exit, however it is left: a run that generates
    every N steps goes on training exactly as it would have (tests/ranks/test_samples_split.py)."""
    was_training = engine.module.training
    engine.module.eval()
    try:
        with torch.no_grad(), whole_sequences(fn for _, fn in stage.funcs):
            yield
    finally:
        engine.module.train(was_training)


@dataclass
class Result:
    index: int  # the prompt's position in the input
    tokens: list[int]
    margins: list[float]


def generate_all(
    engine,
    model: ModelConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling,
    stop_ids: Sequence[int] = (),
    use_cache: bool = True,
    batch_size: int = 8,
) -> list[Result]:
    """Every rank calls this with the same prompts; each replica (`replicas`) generates prompts r, r + n, ... in
    batches, and every rank gets all the results, in prompt order. The engine is left in the mode it was in
    (training's, for generation during a run; `evaluation`)."""
    grid = engine.grid
    n, replica = replicas(engine)
    stage = stage_of(engine, model)
    mine = list(range(replica, len(prompts), n))
    local: list[Result] = []
    with evaluation(engine, stage):
        for i in range(0, len(mine), batch_size):
            idx = mine[i : i + batch_size]
            out = generate_batch(stage, [prompts[j] for j in idx], idx, max_new_tokens, sampling, stop_ids, use_cache)
            margins = out.margins or [[] for _ in idx]
            local += [Result(j, t, m) for j, t, m in zip(idx, out.tokens, margins)]
    speaker = stage.last and grid.get_slice_parallel_rank() == 0  # one rank per replica holds the margins
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local if speaker else None)
    return sorted((r for part in gathered if part for r in part), key=lambda r: r.index)
