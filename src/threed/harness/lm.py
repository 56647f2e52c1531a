"""`ThreedLM`: lm-evaluation-harness's `TemplateLM` run on threed's engine, whatever its tp / pp / dp / cp, with or
without sequence parallelism.

lm-eval's evaluator runs in every rank alike (the model says rank 0 of a world of 1, so each rank sees every
request); the requests are split here, over the replicas (the data-parallel ones and, under context parallelism,
each CP rank too: `threed.generate.decode.replicas`), and the answers all-gathered, so every rank returns the same
list and computes the same scores. Each replica runs whole rows, split neither over tp nor over cp
(`threed.generate.decode.evaluation`). What each request asks is what lm-eval's own HF backend
(`HFLM`) asks of its model, token for token: the same encoding of (context, continuation), the same left truncation
to `max_length + 1` tokens, the same rolling windows; tests/ranks/test_harness.py holds the two to 1e-5.

Imported only by `threed eval-harness` (and during training by --harness-interval): lm-eval is an optional extra.

    threed eval-harness --load CKPT --tasks arc_easy --limit 50
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch.distributed as dist
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM

from threed.config import ModelConfig
from threed.generate.decode import Stage, evaluation, generate_all, replicas, score_batch, stage_of
from threed.generate.prompts import Sampling


def score_all(engine, stage: Stage, rows: list[list[int]], scored: list[int], batch_size: int) -> list[tuple]:
    """(sum of log-probabilities, is greedy) of each row's last `scored` tokens, on every rank: replica d of n
    (`threed.generate.decode.replicas`: dp x cp, the CP ranks run whole rows) scores rows d, d + n, ..., longest
    first, in batches, under `evaluation` (no sequence- or context-parallel split)."""
    grid = engine.grid
    n, replica = replicas(engine)
    mine = sorted(range(replica, len(rows), n), key=lambda i: -len(rows[i]))
    local: list[tuple[int, tuple]] = []
    with evaluation(engine, stage):
        for k in range(0, len(mine), batch_size):
            idx = mine[k : k + batch_size]
            out = score_batch(stage, [rows[i] for i in idx], [scored[i] for i in idx])
            if out is not None:
                local += list(zip(idx, out))
    speaker = stage.last and grid.get_slice_parallel_rank() == 0
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local if speaker else None)
    answers = dict(pair for part in gathered if part for pair in part)
    return [answers[i] for i in range(len(rows))]


class ThreedLM(TemplateLM):
    """lm-eval's model interface over a built threed engine (every rank of it builds one of these)."""

    def __init__(self, engine, model: ModelConfig, tokenizer: Any, batch_size: int = 16, max_gen_toks: int = 256):
        super().__init__()
        self.engine, self.model_config, self.tokenizer = engine, model, tokenizer
        self.stage = stage_of(engine, model)
        self.batch_size, self.max_gen_toks = batch_size, max_gen_toks

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # HFLM's choice: BOS when the tokenizer has one (the context of an empty context), else EOS
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.model_config.max_position_embeddings

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        """HFLM's encoding: the tokenizer's own special tokens (BOS for Llama) unless told otherwise, or when the
        string already starts with the prefix token's text."""
        special = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        prefix = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and string.startswith(prefix):
            special = {"add_special_tokens": False}
        ids = self.tokenizer.encode(string, **special)
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        rows, scored = [], []
        for _, context_enc, continuation_enc in requests:
            rows.append((list(context_enc) + list(continuation_enc))[-(self.max_length + 1) :])
            scored.append(len(continuation_enc))
        return score_all(self.engine, self.stage, rows, scored, self.batch_size)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """HFLM's disjoint rolling windows of `max_length` tokens (the first after the prefix token), scored in one
        pass over all documents' windows; each document's total."""
        windows, owner = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                lm_utils.make_disjoint_window,
                lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[n] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, when a request's gen_kwargs say do_sample with a temperature) continuations through
        `threed generate`'s decode loop, cut at the first `until` string."""
        answers: list[Optional[str]] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for n, req in enumerate(requests):
            kw = dict(req.args[1])
            groups.setdefault(self._generation_key(kw), []).append(n)
        for (max_new, sampling, until), members in groups.items():
            prompts = [self._prompt(requests[n].args[0], max_new) for n in members]
            results = generate_all(
                self.engine, self.model_config, prompts, max_new, sampling, (self.eot_token_id,), True, self.batch_size
            )
            for n, r in zip(members, results):
                answers[n] = cut(self.tokenizer.decode(r.tokens, skip_special_tokens=True), until)
        return [a or "" for a in answers]

    def _generation_key(self, kw: dict) -> tuple:
        until = kw.get("until") or [self.tokenizer.decode(self.eot_token_id)]
        until = (until,) if isinstance(until, str) else tuple(until)
        max_new = int(kw.get("max_gen_toks", self.max_gen_toks))
        temperature = float(kw.get("temperature", 0.0) or 0.0) if kw.get("do_sample", False) else 0.0
        return max_new, Sampling(temperature=temperature, top_p=float(kw.get("top_p", 1.0) or 1.0)), until

    def _prompt(self, context: str, max_new: int) -> list[int]:
        # HFLM left-truncates the context so that it and the new tokens fit the model's context
        return self.tok_encode(context, left_truncate_len=max(1, self.max_length - max_new))


def cut(text: str, until: Sequence[str]) -> str:
    """`text` up to the first of the stop strings (lm-eval's convention for generate_until)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
