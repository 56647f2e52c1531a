"""Tokenizers: a sentencepiece `.model` (Llama 2, the demo) or a local HF tokenizer directory / `tokenizer.json`
(Llama 3). Never downloads."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence


def train_tokenizer(text_files: Sequence[str], vocab_size: int, out_prefix: str) -> str:
    """Train a BPE sentencepiece model with Llama's special ids (unk 0, bos 1, eos 2). Returns the .model path."""
    import sentencepiece as spm

    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=",".join(text_files), model_prefix=out_prefix, vocab_size=vocab_size, model_type="bpe",
        character_coverage=1.0, byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1,
        minloglevel=2,
    )
    return out_prefix + ".model"


class Tokenizer:
    """A sentencepiece `.model` (Llama 2, the demo) or a local HF tokenizer directory / `tokenizer.json`
    (Llama 3's tiktoken-based tokenizer is not a sentencepiece model). Never downloads."""

    def __init__(self, path: str):
        self.path = str(Path(path).resolve())
        if Path(path).is_file() and path.endswith(".model"):
            import sentencepiece as spm

            sp = spm.SentencePieceProcessor(model_file=path)
            self.vocab_size, self.bos_id, self.eos_id = sp.get_piece_size(), sp.bos_id(), sp.eos_id()
            self._encode = sp.encode
        elif Path(path).exists():
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            tok = (PreTrainedTokenizerFast(tokenizer_file=path) if Path(path).is_file()
                   else AutoTokenizer.from_pretrained(path, local_files_only=True))
            self.vocab_size, self.bos_id, self.eos_id = len(tok), tok.bos_token_id, tok.eos_token_id
            self._encode = lambda text: tok.encode(text, add_special_tokens=False)
        else:
            raise FileNotFoundError(f"no tokenizer at {path}: pass a sentencepiece .model, a tokenizer.json or "
                                    f"a local HF tokenizer directory")
        if self.bos_id is None or self.eos_id is None or self.bos_id < 0 or self.eos_id < 0:
            raise ValueError(f"tokenizer {path} has no BOS/EOS token; Llama training needs both")

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))
