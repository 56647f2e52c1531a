"""The flat token file (to be replaced by megatron-core indexed datasets): a small data path: text -> sentencepiece tokenizer -> flat token file (numpy memmap) ->
fixed-shape micro-batches.

Sample `i` is the window `tokens[i*seq : i*seq + seq + 1]` (inputs and next-token labels). The order is a
seeded permutation per epoch, and which sample a rank reads is a pure function of (step, dp rank, micro-batch),
so a resumed run continues exactly, and a dp=1 run with dp x gas micro-batches reads the same global batch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np
import torch

from threed.data.tokenizer import Tokenizer

META_SUFFIX = ".json"


def _paragraphs(text: str) -> Iterable[str]:
    for para in text.split("\n\n"):
        para = para.strip()
        if para:
            yield para


def tokenize_files(text_files: Sequence[str], tokenizer: str, out_path: str) -> int:
    """Tokenize text files into a flat token file; each paragraph is a document `<bos> ... <eos>` (the BOS
    matters: a model trained without it generates badly after conversion, Megatron-DeepSpeed #280).
    Streams paragraph by paragraph to a temporary name, then renames. Returns the token count."""
    tok = Tokenizer(tokenizer)
    dtype = np.uint16 if tok.vocab_size < 2**16 else np.uint32
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    count = 0
    with open(tmp, "wb") as fh:
        for f in text_files:
            for para in _paragraphs(Path(f).read_text(encoding="utf-8", errors="replace")):
                ids = np.asarray([tok.bos_id, *tok.encode(para), tok.eos_id], dtype=dtype)
                ids.tofile(fh)
                count += ids.size
    meta = {"dtype": np.dtype(dtype).name, "num_tokens": count, "tokenizer": tok.path, "vocab_size": tok.vocab_size}
    Path(str(tmp) + META_SUFFIX).write_text(json.dumps(meta, indent=1))
    os.replace(str(tmp) + META_SUFFIX, str(out) + META_SUFFIX)
    os.replace(tmp, out)
    return count


class TokenDataset:
    def __init__(self, path: str, seq_length: int, vocab_size: Optional[int] = None):
        meta_path = Path(path + META_SUFFIX)
        if not Path(path).is_file() or not meta_path.is_file():
            raise FileNotFoundError(f"no token file at {path} (with {meta_path.name}); create it with "
                                    f"`threed tokenize --text FILE --tokenizer TOK.model --out {path}`")
        meta = json.loads(meta_path.read_text())
        if vocab_size is not None and meta["vocab_size"] > vocab_size:
            raise ValueError(f"token file {path} was made with a tokenizer of {meta['vocab_size']} pieces, more "
                             f"than the model's vocab_size {vocab_size}; use a matching tokenizer or model")
        self.tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        self.seq_length = seq_length
        self.num_samples = (len(self.tokens) - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"{path} holds {len(self.tokens)} tokens, fewer than one sample of seq_length "
                             f"{seq_length} + 1")

    def sample(self, i: int) -> np.ndarray:
        start = i * self.seq_length
        return np.asarray(self.tokens[start:start + self.seq_length + 1], dtype=np.int64)


def global_sample_index(step: int, dp_rank: int, micro: int, item: int, micro_batch: int, gas: int, dp: int) -> int:
    """Position in the sample stream: step-major, then dp rank, then micro-batch, then item."""
    return ((step * dp + dp_rank) * gas + micro) * micro_batch + item


def micro_batches(ds: TokenDataset, micro_batch: int, gas: int, dp: int, dp_rank: int, start_step: int,
                  seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, labels) micro-batches `[micro_batch, seq]` for this dp rank, from `start_step` on."""
    perms: dict[int, np.ndarray] = {}

    def sample_id(g: int) -> int:
        epoch, pos = divmod(g, ds.num_samples)
        if epoch not in perms:
            perms.clear()
            perms[epoch] = np.random.default_rng(seed + epoch).permutation(ds.num_samples)
        return int(perms[epoch][pos])

    step = start_step
    while True:
        for m in range(gas):
            rows = [ds.sample(sample_id(global_sample_index(step, dp_rank, m, j, micro_batch, gas, dp)))
                    for j in range(micro_batch)]
            batch = torch.from_numpy(np.stack(rows))
            yield batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        step += 1
