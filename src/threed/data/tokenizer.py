"""Tokenizers: a sentencepiece `.model` (Llama 2, the demo) or a local HF tokenizer directory / `tokenizer.json`
(Llama 3). Never downloads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

# Names Llama-family tokenizer.json files use for their document delimiters (Llama 3, Llama 2 / Mistral, Gemma,
# GPT-2 style). Only consulted for a bare tokenizer.json with no tokenizer_config.json beside it, because a bare
# tokenizer.json does not record which of its special tokens is BOS / EOS.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>")


def train_tokenizer(text_files: Sequence[str], vocab_size: int, out_prefix: str) -> str:
    """Train a BPE sentencepiece model with Llama's special ids (unk 0, bos 1, eos 2). Returns the .model path."""
    import sentencepiece as spm  # sentencepiece: native, only for sentencepiece tokenizers

    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=",".join(text_files),
        model_prefix=out_prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    return out_prefix + ".model"


def _token_name(value: Any) -> Optional[str]:
    """tokenizer_config.json writes special tokens as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _json_special_ids(path: Path, tok: Any) -> tuple[Optional[int], Optional[int]]:
    """BOS / EOS ids of a bare tokenizer.json: from a tokenizer_config.json beside it, else by Llama's names."""
    config = path.with_name("tokenizer_config.json")
    bos_name = eos_name = None
    if config.is_file():
        cfg = json.loads(config.read_text(encoding="utf-8"))
        bos_name, eos_name = _token_name(cfg.get("bos_token")), _token_name(cfg.get("eos_token"))
    vocab = tok.get_vocab()
    bos_name = bos_name or next((n for n in _BOS_NAMES if n in vocab), None)
    eos_name = eos_name or next((n for n in _EOS_NAMES if n in vocab), None)
    return vocab.get(bos_name) if bos_name else None, vocab.get(eos_name) if eos_name else None


class Tokenizer:
    """A sentencepiece `.model` (Llama 2, the demo) or a local HF tokenizer directory / `tokenizer.json`
    (Llama 3's tiktoken-based tokenizer is not a sentencepiece model). Never downloads.

    Picklable by path (`__reduce__`), so worker processes started with `spawn` rebuild it themselves instead of
    receiving native tokenizer objects."""

    def __init__(self, path: str):
        self.path = str(Path(path).resolve())
        self._sp: Any = None  # sentencepiece processor, when that is the kind
        self._fast: Any = None  # the Rust `tokenizers.Tokenizer` behind an HF fast tokenizer, for batch encoding
        self._hf: Any = None  # the HF tokenizer itself: its vocabulary (pieces)
        if Path(path).is_file() and path.endswith(".model"):
            import sentencepiece as spm  # sentencepiece: native, only for sentencepiece tokenizers

            sp = spm.SentencePieceProcessor(model_file=path)
            self.vocab_size, self.bos_id, self.eos_id = sp.get_piece_size(), sp.bos_id(), sp.eos_id()
            self._sp = sp
            self._encode = sp.encode
        elif Path(path).exists():
            # transformers: heavy (seconds to import), only for HF tokenizers
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            tok = (
                PreTrainedTokenizerFast(tokenizer_file=path)
                if Path(path).is_file()
                else AutoTokenizer.from_pretrained(path, local_files_only=True)
            )
            self.vocab_size, self.bos_id, self.eos_id = len(tok), tok.bos_token_id, tok.eos_token_id
            if Path(path).is_file() and (self.bos_id is None or self.eos_id is None):
                bos, eos = _json_special_ids(Path(path), tok)
                self.bos_id = bos if self.bos_id is None else self.bos_id
                self.eos_id = eos if self.eos_id is None else self.eos_id
            self._fast = getattr(tok, "backend_tokenizer", None)
            self._hf = tok
            self._encode = lambda text: tok.encode(text, add_special_tokens=False)
        else:
            raise FileNotFoundError(
                f"no tokenizer at {path}: pass a sentencepiece .model, a tokenizer.json or "
                f"a local HF tokenizer directory"
            )
        if self.bos_id is None or self.eos_id is None or self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"tokenizer {path} has no BOS/EOS token; Llama training needs both")

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (Tokenizer, (self.path,))

    def pieces(self) -> list[str]:
        """The vocabulary by id (a dataset's sidecar records its hash: threed.data.sidecar)."""
        if self._sp is not None:
            return [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())]
        out = [""] * self.vocab_size
        for piece, i in self._hf.get_vocab().items():
            if 0 <= i < len(out):
                out[i] = piece
        return out

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`[encode(t) for t in texts]`, with one native call per batch where the tokenizer has one.

        sentencepiece is held to one thread: parallelism comes from worker processes, and a thread pool per call
        would oversubscribe the cores they already fill."""
        if self._sp is not None:
            return self._sp.encode(list(texts), num_threads=1)
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(list(texts), add_special_tokens=False)]
        return [self.encode(t) for t in texts]
