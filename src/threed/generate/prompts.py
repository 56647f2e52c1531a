"""What `threed generate` is asked, checked before any rank builds an engine: the checkpoint and its model, the
prompts (`--prompt TEXT` or a JSONL file of `{"prompt": ...}` lines), the tokenizer (`--tokenizer`, else the one the
checkpoint holds), the lengths against the model's context, and the sampling settings. Each problem is one line
(`ThreedError`). No torch here: the refusals cost no engine.

    threed generate --load CKPT --prompts prompts.jsonl --max-new-tokens 32 --output out.jsonl
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from threed.checkpoint.format import has_checkpoint, open_checkpoint, read_run_json
from threed.config import ModelConfig
from threed.errors import ThreedError

HF_SIDE_DIR = "hf"  # where `threed convert` keeps the HF source's tokenizer files (threed.checkpoint.format)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (`threed.generate.sampling`): greedy when `temperature` is 0, else sampled
    with `top_p` and `seed`."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Tokenizer:
    """Encode a prompt as the model was trained (BOS first, as HF's Llama tokenizers do), decode the new ids, and
    the ids that end a row (EOS). An HF tokenizer directory or tokenizer.json, or a sentencepiece `.model`."""

    def __init__(self, path: str):
        self.path = path
        p = Path(path)
        if p.is_file() and p.suffix == ".model":
            import sentencepiece as spm  # sentencepiece: native, only for sentencepiece tokenizers

            self._sp: Any = spm.SentencePieceProcessor(model_file=path)
            self._hf: Any = None
            self.bos_id, eos = self._sp.bos_id(), self._sp.eos_id()
        else:
            self._sp = None
            self._hf = hf_tokenizer(path)
            self.bos_id, eos = self._hf.bos_token_id, self._hf.eos_token_id
        self.stop_ids: tuple[int, ...] = (eos,) if eos is not None and eos >= 0 else ()

    def encode(self, text: str) -> list[int]:
        if self._sp is not None:
            return ([self.bos_id] if self.bos_id >= 0 else []) + list(self._sp.encode(text))
        return list(self._hf.encode(text))

    def decode(self, ids: list[int]) -> str:
        if self._sp is not None:
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=True)


def hf_tokenizer(path: str) -> Any:
    """transformers' tokenizer of an HF tokenizer directory or a tokenizer.json (with tokenizer_config.json beside
    it, when there is one), local files only."""
    # transformers: heavy (seconds to import), only for HF tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    if p.is_dir():
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    if (p.parent / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(p.parent), local_files_only=True)
    return PreTrainedTokenizerFast(tokenizer_file=path)


def checkpoint_tokenizer(load: str) -> Optional[str]:
    """The tokenizer a checkpoint holds: the one its run's data was made with (threed_run.json) when it is still
    there, else the HF source's files a converted checkpoint (or the one it was initialised from) carried along."""
    from threed.hf.format import TOKENIZER_FILES  # torch (threed.hf.format's dtype table): kept off the module top

    todo, seen = [Path(load)], set()
    while todo and len(seen) < 8:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        run = read_run_json(path) or {}
        tok = run.get("data", {}).get("tokenizer")
        if tok and Path(tok).exists():
            return str(tok)
        side = path / HF_SIDE_DIR
        if any((side / f).is_file() for f in TOKENIZER_FILES):
            return str(side)
        todo += [Path(p) for p in (run.get("checkpoint", {}).get(k) for k in ("init_from", "load")) if p]
    return None


def tokenizer_path(load: str, given: Optional[str], kinds: str) -> str:
    """`--tokenizer` when given, else the one the checkpoint holds (`checkpoint_tokenizer`); when neither, one line
    asking for a --tokenizer of the `kinds` the command reads."""
    tok = given or checkpoint_tokenizer(load)
    if tok is None:
        raise ThreedError(f"--load {load} holds no tokenizer: pass --tokenizer ({kinds})")
    return tok


def read_prompts(prompt: Optional[str], prompts_file: Optional[str]) -> list[str]:
    """`--prompt TEXT` or `--prompts FILE.jsonl` (exactly one), as a list of texts."""
    if (prompt is None) == (prompts_file is None):
        raise ThreedError("give exactly one of --prompt TEXT and --prompts FILE.jsonl")
    if prompt is not None:
        return [prompt]
    path = Path(prompts_file)
    if not path.is_file():
        raise ThreedError(f'--prompts {path}: no such file; give a JSONL file of {{"prompt": ...}} lines')
    texts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ThreedError(f'--prompts {path}:{n}: not JSON ({e.msg}); each line is {{"prompt": ...}}') from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ThreedError(f'--prompts {path}:{n}: no "prompt" string; each line is {{"prompt": ...}}')
        texts.append(row["prompt"])
    if not texts:
        raise ThreedError(f"--prompts {path}: no prompts in it")
    return texts


@dataclass
class GenerateRequest:
    load: str
    model: ModelConfig
    tp: int
    pp: int
    texts: list[str]
    prompt_ids: list[list[int]]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    output: Optional[str] = None
    batch_size: int = 8
    no_kv_cache: bool = False
    dtype: str = "fp32"


def check_checkpoint(load: str, tp: Optional[int], pp: Optional[int]) -> tuple[ModelConfig, int, int]:
    """The checkpoint's model and the layout to run it at (its own unless --tp / --pp say otherwise)."""
    if not Path(load).is_dir():
        raise ThreedError(f"--load {load}: no such directory; give a checkpoint `threed train` or `convert` wrote")
    if not has_checkpoint(load):
        raise ThreedError(f"--load {load}: holds no checkpoint (no `latest` file); give a checkpoint directory")
    ck = open_checkpoint(load)
    return ck.model, tp or ck.tp, pp or ck.pp


def check_lengths(prompt_ids: list[list[int]], max_new_tokens: int, model: ModelConfig) -> None:
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ThreedError(f"prompt {i + 1} is empty after tokenizing; give some text")
        if len(ids) + max_new_tokens > model.max_position_embeddings:
            raise ThreedError(
                f"prompt {i + 1} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                f"{len(ids) + max_new_tokens}, past the model's context of {model.max_position_embeddings}: "
                f"use --max-new-tokens <= {model.max_position_embeddings - len(ids)}"
            )
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if bad:
            raise ThreedError(f"prompt {i + 1}: token id {bad[0]} is outside the vocabulary of {model.vocab_size}")


def sampling_of(greedy: bool, temperature: Optional[float], top_p: Optional[float], seed: Optional[int]) -> Sampling:
    if greedy and (temperature is not None or top_p is not None or seed is not None):
        raise ThreedError("--greedy takes no --temperature / --top-p / --seed; give one or the other")
    if temperature is None:
        if top_p is not None or seed is not None:
            raise ThreedError("--top-p and --seed sample: give --temperature T (> 0) too")
        return Sampling()
    if not temperature > 0:
        raise ThreedError(f"--temperature must be > 0 (got {temperature}); --greedy picks the best token")
    if top_p is not None and not 0 < top_p <= 1:
        raise ThreedError(f"--top-p must be in (0, 1], got {top_p}")
    return Sampling(temperature=temperature, top_p=1.0 if top_p is None else top_p, seed=seed or 0)
