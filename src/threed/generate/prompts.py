"""What `threed generate` is asked, checked before any rank builds an engine: the checkpoint and its model, the
prompts (`--prompt TEXT` or a JSONL file of `{"prompt": ...}` lines), the tokenizer (`--tokenizer`, else the one the
checkpoint holds), the lengths against the model's context, the sampling settings, and `--lora`'s adapters
(`lora_request`, `check_adapters`). Each problem is one line (`ThreedError`). No torch here but in the adapters'
checks, which read tensors (imported there): the refusals cost no engine.

    threed generate --load CKPT --prompts prompts.jsonl --max-new-tokens 32 --output out.jsonl
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from threed.atomic import temp_name, unwritable, write_atomic
from threed.checkpoint.format import has_checkpoint, holds_adapters_only, open_checkpoint, read_latest, read_run_json
from threed.checkpoint.lora_base import check_base, is_lora_checkpoint, open_base, recorded_base
from threed.checkpoint.manifest import read_manifest
from threed.config import LoraConfig, ModelConfig, ParallelConfig, TrainConfig
from threed.errors import ThreedError

HF_SIDE_DIR = "hf"  # where `threed convert` keeps the HF source's tokenizer files (threed.checkpoint.format)
ALLOW_OTHER_TOKENIZER = "--allow-other-tokenizer"  # the flag that says a tokenizer not the checkpoint's is intended
PEFT_CONFIG = "adapter_config.json"  # what makes a folder an HF PEFT adapter (threed.convert.lora.CONFIG_FILE)


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


def read_prompts(prompt: Optional[str], prompts_file: Optional[str], flag: str = "--prompts") -> list[str]:
    """`--prompt TEXT` or `--prompts FILE.jsonl` (exactly one), as a list of texts. `flag`: how the file was given
    (training's is --generate-prompts)."""
    if (prompt is None) == (prompts_file is None):
        raise ThreedError(f"give exactly one of --prompt TEXT and {flag} FILE.jsonl")
    if prompt is not None:
        return [prompt]
    path = Path(prompts_file)
    if not path.is_file():
        raise ThreedError(f'{flag} {path}: no such file; give a JSONL file of {{"prompt": ...}} lines')
    texts = []
    for n, line in enumerate(read_utf8(path, flag).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ThreedError(f'{flag} {path}:{n}: not JSON ({e.msg}); each line is {{"prompt": ...}}') from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ThreedError(f'{flag} {path}:{n}: no "prompt" string; each line is {{"prompt": ...}}')
        texts.append(row["prompt"])
    if not texts:
        raise ThreedError(f"{flag} {path}: no prompts in it")
    return texts


def read_utf8(path: Path, flag: str) -> str:
    """A text file's content, or one line naming the first byte that is not UTF-8 (a file saved as Latin-1 or
    UTF-16 by an editor) and how to convert it."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        source = "utf-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "latin1"  # a BOM says UTF-16
        raise ThreedError(
            f"{flag} {path}:{line}: not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8, "
            f"e.g. `iconv -f {source} -t utf-8 {path} > {path.stem}.utf8{path.suffix}`"
        ) from None


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
    tag: Optional[str] = None  # the checkpoint's tag, pinned when the command started (`pinned_checkpoint`)
    lora: Optional[LoraConfig] = None  # --lora: the adapters put on the base (`lora_request`)


def check_checkpoint(load: str, tp: Optional[int], pp: Optional[int]) -> tuple[ModelConfig, int, int]:
    """The checkpoint's model and the layout to run it at (its own unless --tp / --pp say otherwise)."""
    return pinned_checkpoint(load, tp, pp)[:3]


def pinned_checkpoint(load: str, tp: Optional[int], pp: Optional[int]) -> tuple[ModelConfig, int, int, str]:
    """`check_checkpoint` and the tag `latest` names now, read once: a run that is still training may save a newer
    one while this command works, and every later step (the weights loaded, the results' name) uses this tag."""
    if not Path(load).is_dir():
        raise ThreedError(f"--load {load}: no such directory; give a checkpoint `threed train` or `convert` wrote")
    if not has_checkpoint(load):
        raise ThreedError(f"--load {load}: holds no checkpoint (no `latest` file); give a checkpoint directory")
    ck = open_checkpoint(load)
    return ck.model, tp or ck.tp, pp or ck.pp, ck.tag


def lora_request(load: Optional[str], lora: Optional[str]) -> tuple[str, Optional[LoraConfig]]:
    """--load and --lora: the checkpoint whose base weights the engine loads, and the adapters put on it at any
    tp / pp (a LoraConfig whose lora_init_from is the --lora directory: threed.engine.lora reads an HF PEFT folder or
    a threed LoRA run's checkpoint), or one line. A LoRA checkpoint names its base: --load may be left out (an
    adapter-only checkpoint's base is read from where it names, fingerprint checked; an older or random-init one
    holds its frozen base), and a --load given must be the base its adapters name (threed.checkpoint.lora_base)."""
    if lora is None:
        if load is None:
            raise ThreedError("give --load CKPT (or --lora DIR: a LoRA run's checkpoint, or a PEFT folder with --load)")
        if is_lora_checkpoint(load):
            raise ThreedError(
                f"--load {load} is a LoRA run's checkpoint: pass --lora {load} to run it with its adapters"
            )
        return load, None
    folder = Path(lora)
    if has_checkpoint(lora):
        if not is_lora_checkpoint(lora):
            raise ThreedError(f"--lora {lora} is the checkpoint of a run without LoRA adapters; pass it as --load")
        run = read_run_json(folder) or {}
        settings = {**run["lora"], "lora_targets": tuple(run["lora"]["lora_targets"]), "lora_dropout": 0.0}
        tag_dir = folder / (read_latest(folder) or "")
        recorded = recorded_base(read_manifest(tag_dir))
        if load is not None and os.path.realpath(load) != os.path.realpath(lora):
            fix = "leave --load out (the checkpoint names its base), or give the base it names"
            check_base(recorded, load, lora, fix)
        elif recorded is not None and holds_adapters_only(tag_dir):  # its base is the one it names: read there
            return adapters_base(recorded, lora), LoraConfig(**{**settings, "lora_init_from": lora})
        return load or lora, LoraConfig(**{**settings, "lora_init_from": lora})
    if (folder / PEFT_CONFIG).is_file():
        if load is None:
            raise ThreedError(f"--lora {lora} is an HF PEFT folder: give the base it was trained on with --load BASE")
        from threed.convert.lora import peft_settings  # torch, safetensors (threed.convert): only with --lora

        return load, dataclasses.replace(peft_settings(folder), lora_init_from=lora)
    raise ThreedError(
        f"--lora {lora}: neither a threed LoRA run's checkpoint (no `latest` file) nor an HF PEFT folder (no "
        f"{PEFT_CONFIG}); give one of those"
    )


def adapters_base(recorded: dict, lora: str) -> str:
    """Where the base an adapter-only LoRA checkpoint names is read: its recorded directory, holding those weights
    (fingerprint) under the tag `latest` names there (the tag generation loads); else one line."""
    fix = f"put the base back at {recorded['path']}, or give where it is now with --load BASE"
    path = str(open_base(recorded, lora, fix).path)
    latest = read_latest(path)
    if latest != recorded["tag"]:
        raise ThreedError(
            f"--lora {lora}: its base {path} now names {latest} as latest, the adapters were trained on its "
            f"{recorded['tag']}; write {recorded['tag']} into {path}/latest, or give a copy of that checkpoint alone "
            f"as --load BASE"
        )
    return path


def check_adapters(lora: Optional[LoraConfig], model: ModelConfig, tp: int, pp: int) -> None:
    """The adapters against the base model (every tensor's shape) and the layout (a rank tp divides), before any
    engine is built."""
    if lora is None:
        return
    from threed.convert.lora import read_adapters  # torch, safetensors: only with --lora

    try:
        lora.validate(ParallelConfig(tp=tp, pp=pp), TrainConfig())
    except ThreedError as e:
        raise ThreedError(f"--lora {lora.lora_init_from}: {e}") from None
    read_adapters(lora.lora_init_from, model, lora, flag="--lora")


def check_lengths(prompt_ids: list[list[int]], max_new_tokens: int, model: ModelConfig) -> None:
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ThreedError(f"prompt {i + 1} is empty after tokenizing; give some text")
        context = model.max_position_embeddings
        if len(ids) >= context:  # no --max-new-tokens fits: the prompt itself must be cut
            raise ThreedError(
                f"prompt {i + 1} has {len(ids)} tokens, the model's context is {context}: no new token fits; "
                f"shorten the prompt to at most {context - 1} tokens (then --max-new-tokens <= {context} minus its "
                f"length)"
            )
        if len(ids) + max_new_tokens > context:
            raise ThreedError(
                f"prompt {i + 1} has {len(ids)} tokens; with --max-new-tokens {max_new_tokens} that is "
                f"{len(ids) + max_new_tokens}, past the model's context of {context}: "
                f"use --max-new-tokens <= {context - len(ids)}"
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


def check_tokenizer(load: str, given: Optional[str], model: ModelConfig, allow: bool) -> None:
    """A --tokenizer that is not the checkpoint's: its ids would mean other tokens (garbage text, plausible-looking
    scores). Compared as the data sidecar compares (threed.data.sidecar: vocabulary size and a hash of every piece
    by id) against the tokenizer the checkpoint records (`checkpoint_tokenizer`); where it records none that is
    still there, against the model's vocabulary size. One line unless `allow` (--allow-other-tokenizer)."""
    if given is None or allow:
        return
    from threed.data.sidecar import run_tokenizer_identity  # sentencepiece / transformers: loads the tokenizers

    mine = run_tokenizer_identity(given)
    fix = f"leave --tokenizer out to use the checkpoint's, or pass {ALLOW_OTHER_TOKENIZER} if this is intended"
    recorded = checkpoint_tokenizer(load)
    if recorded is not None and os.path.realpath(recorded) != os.path.realpath(given):
        theirs = run_tokenizer_identity(recorded)
        same = theirs["vocab_size"] == mine["vocab_size"] and theirs["vocab_sha256"] == mine["vocab_sha256"]
        if theirs["vocab_sha256"] and not same:
            raise ThreedError(
                f"--tokenizer {given} (vocab {mine['vocab_size']}, hash {(mine['vocab_sha256'] or '?')[:12]}) is "
                f"not the tokenizer --load {load} records ({recorded}: vocab {theirs['vocab_size']}, hash "
                f"{theirs['vocab_sha256'][:12]}): its ids would mean other tokens; {fix}"
            )
    elif recorded is None and (mine["vocab_size"] or 0) > model.vocab_size:
        raise ThreedError(
            f"--tokenizer {given} has {mine['vocab_size']} tokens, more than the vocabulary of {model.vocab_size} "
            f"the checkpoint {load} was trained with: not its tokenizer; {fix}"
        )


def check_output(path: Optional[str], flag: str, makes_parent: bool = False) -> None:
    """An output file that can be written, checked before any engine is built: not a directory, its folder there
    (or, `makes_parent`, creatable) and writable by this user, on a file system with free space."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise ThreedError(f"{flag} {out} is a directory; give a file path, e.g. {out / 'out.json'}")
    folder = out.parent
    if not folder.exists() and not makes_parent:
        raise ThreedError(f"{flag} {out}: its folder {folder} does not exist; create it (mkdir -p {folder}) first")
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ThreedError(f"{flag} {out}: {folder} is a file, not a directory; choose another path")
    why = unwritable(folder)
    if why == "not writable":
        raise ThreedError(f"{flag} {out}: {folder} is not writable by this user; choose a path you can write to")
    if why:
        raise ThreedError(f"{flag} {out}: the file system of {folder} is full; free space or choose another path")


def keep_output(path: str, text: str, what: str) -> Optional[str]:
    """Write `text` to `path` atomically (threed.atomic: a temporary file beside it, then a rename). When that
    fails late (the folder made read-only or full while the work ran), the text is kept in a file of the temporary
    directory (else the working directory) and the one line to say is returned; None when `path` was written."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, text)
        return None
    except OSError as e:
        temp_name(out).unlink(missing_ok=True)
        why = e.strerror or type(e).__name__
    name = f"threed-{out.stem}-{os.getpid()}{out.suffix}"
    for folder in (tempfile.gettempdir(), os.getcwd()):
        try:
            write_atomic(Path(folder) / name, text)
        except OSError:
            continue
        return f"could not write {path} ({why}); the {what} are kept in {Path(folder) / name}: move it into place"
    return f"could not write {path} ({why}), nor a copy in {tempfile.gettempdir()} or {os.getcwd()}: {what} lost"
