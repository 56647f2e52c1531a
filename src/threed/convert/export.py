"""DeepSpeed pipeline checkpoint (converted or trained, any tp/pp, bf16 or fp32) -> HF Llama directory.

    threed export --ckpt runs/demo/ckpt --out runs/demo/hf [--dtype bf16] [--max-shard-size 5GB]
    python -c "from transformers import AutoModelForCausalLM as A; A.from_pretrained('runs/demo/hf')"

A tied checkpoint (Llama 3.2) exports `tie_word_embeddings: true` and no lm_head.weight: transformers ties the
head to model.embed_tokens.weight on load, as for Meta's own files.

The weights are those of the layer files (what the model runs with; after bf16 training these are bf16 and the
fp32 master copy stays in the optimizer files). Padded vocab rows are dropped. Tokenizer files come from
--tokenizer, else the run's own data tokenizer (a sentencepiece model, an HF tokenizer directory or a
tokenizer.json), else the HF files a converted checkpoint carried along. HF tokenizer files are copied whole
(tokenizer_config.json and chat_template.jinja included), so a chat model's template still applies.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Optional

import torch

from threed.checkpoint.format import HF_EXTRA_DIR, Checkpoint, open_checkpoint, read_run_json
from threed.convert.ds_checkpoint import shard_reader
from threed.convert.lora import merge_base, merge_deltas, refuse_adapters
from threed.convert.io_utils import DTYPES, ConvertError, atomic_output_dir, check_free_space, progress, refuse_existing
from threed.convert.slices import Piece
from threed.hf.config import write_config
from threed.hf.format import TOKENIZER_FILES
from threed.hf.names import hf_names, hf_shapes
from threed.hf.write import Planned, ShardedSafetensorsWriter, copy_files, plan_shards, write_sentencepiece_tokenizer
from threed.model.spec import PipelineLayer
from threed.units import human_bytes


def _plan(ck: Checkpoint, dtype: Optional[torch.dtype]) -> list[Planned]:
    """Every HF tensor in write order with its dtype: reading each layer file's header (memory-mapped, no
    data) also checks names and shapes of the whole checkpoint before anything is written."""
    planned = []
    for layer in ck.layers:  # the stored layers: a tied model's lm_head.weight is not written (HF ties it on load)
        shards = ck.load_layer(layer)
        shapes = hf_shapes(ck.model, layer)
        for ours, names in hf_names(layer).items():
            for n in names:
                planned.append(Planned(n, dtype or shards[0][ours].dtype, shapes[n]))
        del shards
    return planned


def extra_dirs(ck: Checkpoint) -> list[Path]:
    """Where HF side files (tokenizer, the original config.json) may be: this checkpoint's hf/, then those of
    the checkpoints it was initialised or resumed from (following their threed_run.json, a few levels)."""
    dirs, todo, seen = [], [ck.path], set()
    while todo and len(seen) < 8:
        path = todo.pop(0)
        if path in seen:
            continue
        seen.add(path)
        dirs.append(path / HF_EXTRA_DIR)
        run = ck.run if path == ck.path else (read_run_json(path) or {})
        todo += [Path(p) for p in (run.get("checkpoint", {}).get(k) for k in ("init_from", "load")) if p]
    return [d for d in dirs if d.is_dir()]


def _copy_tokenizer(t: Path, dest: Path, what: str) -> list[str]:
    """An HF tokenizer directory's files (TOKENIZER_FILES: tokenizer.json, tokenizer_config.json with the special
    tokens, chat_template.jinja, ...), a tokenizer.json file with those beside it, or a sentencepiece .model
    (written as an HF Llama tokenizer). Returns the names written; raises for anything else."""
    if t.is_dir():
        return copy_files([t / f for f in TOKENIZER_FILES], dest)
    if t.is_file() and t.suffix == ".model":
        return write_sentencepiece_tokenizer(t, dest)
    if t.is_file() and t.suffix == ".json":  # threed.data.tokenizer reads tokenizer_config.json beside it too
        shutil.copyfile(t, dest / "tokenizer.json")
        return ["tokenizer.json"] + copy_files([t.parent / f for f in TOKENIZER_FILES if f != "tokenizer.json"], dest)
    raise ConvertError(
        f"{what} {t}: {'not found' if not t.exists() else 'not a tokenizer'}; pass an HF tokenizer "
        f"directory, a tokenizer.json or a sentencepiece .model file"
    )


def write_side_files(
    ck: Checkpoint, dest: Path, tokenizer: Optional[str] = None, with_config: bool = False
) -> list[str]:
    """Tokenizer files (--tokenizer, else the tokenizer the run's data was made with when it is still there,
    else the HF source's), the source's generation_config.json, and with_config its config.json, into dest.
    Returns the names written."""
    dirs = extra_dirs(ck)
    written: list[str] = []
    run_tok = ck.run.get("data", {}).get("tokenizer")
    if tokenizer:
        written += _copy_tokenizer(Path(tokenizer), dest, "--tokenizer")
    elif run_tok and Path(run_tok).exists():
        try:
            written += _copy_tokenizer(Path(run_tok), dest, "the run's tokenizer")
        except ConvertError:
            pass  # not a tokenizer export can copy: fall back to the HF source's files
    if not tokenizer and not written:
        for d in dirs:
            written += copy_files([d / f for f in TOKENIZER_FILES], dest)
            if written:
                break
    for name in ("generation_config.json",) + (("config.json",) if with_config else ()):
        for d in dirs:
            if (d / name).is_file():
                written += copy_files([d / name], dest)
                break
    return written


def source_config(ck: Checkpoint) -> Optional[dict]:
    for d in extra_dirs(ck):
        if (d / "config.json").is_file():
            return json.loads((d / "config.json").read_text())
    return None


def _has_protobuf() -> bool:
    try:
        return importlib.util.find_spec("google.protobuf") is not None
    except ModuleNotFoundError:
        return False


def _write_layer(
    ck: Checkpoint,
    layer: PipelineLayer,
    writer: ShardedSafetensorsWriter,
    buffers: dict,
    deltas: dict,
    trained: Optional[torch.dtype] = None,
) -> None:
    """One layer's HF tensors into the writer, each read from the TP shards' slices; a tensor in `deltas` (--merge)
    is written with its delta added (in fp32, then the tensor's dtype: `trained`, the LoRA run's, when given)."""
    reader = shard_reader(ck, layer)
    for name, shape in hf_shapes(ck.model, layer).items():
        dim = reader.split_dim(name)
        if name in deltas:
            whole = torch.empty(shape, dtype=reader.dtype(name))
            reader.read_into(Piece(name, dim, 0, shape[dim]), whole)
            whole = whole.to(trained or whole.dtype)  # the base as the run held it (an adapter-only one's: named)
            writer.write(name, (whole.float() + deltas[name]).to(whole.dtype))
        elif dim == 0:  # rows: each shard's slice goes straight to the file
            for part, _ in reader.parts(name, 0, 0, shape[0]):
                writer.write_part(name, part)
        else:  # columns (o_proj, down_proj): interleave the shards' blocks in one buffer
            key = (shape, reader.dtype(name))
            if key not in buffers:
                buffers[key] = torch.empty(shape, dtype=key[1])
            reader.read_into(Piece(name, 1, 0, shape[1]), buffers[key])
            writer.write(name, buffers[key])
    del reader  # unmaps this layer's files


def export(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = 5 * 10**9,
    tokenizer: Optional[str] = None,
    force: bool = False,
    show_progress: bool = True,
    merge: bool = False,
) -> dict[str, Any]:
    """`threed export`; `merge` (--merge): a LoRA run's checkpoint, its adapters merged into the weights."""
    t0 = time.time()
    refuse_existing(out, force)
    source = open_checkpoint(ckpt)
    deltas = merge_deltas(source) if merge else None  # --merge: a LoRA run's adapters merged into its base
    if deltas is None:
        refuse_adapters(source, "export")  # a LoRA run's: its adapters would be dropped
    # The weights: an adapter-only LoRA checkpoint's base is the one it names, held in the run's dtype (what a
    # checkpoint saving its frozen base wrote).
    ck = merge_base(source) if merge else source
    trained = DTYPES.get((source.run.get("train") or {}).get("dtype", "")) if ck is not source else None
    planned = _plan(ck, dtype or trained)
    total = sum(t.nbytes for t in planned)
    check_free_space(out, total)
    with atomic_output_dir(out, force) as tmp:
        writer = ShardedSafetensorsWriter(tmp, plan_shards(planned, max_shard_bytes))
        buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
        layers = ck.layers
        with progress(sum(ck.nbytes(ly.index) for ly in layers), "export", show_progress) as bar:
            for layer in layers:
                _write_layer(ck, layer, writer, buffers, deltas(layer) if deltas else {}, trained)
                bar.update(ck.nbytes(layer.index))
        writer.close()
        out_dtype = planned[0].dtype if len({t.dtype for t in planned}) == 1 else torch.float32
        write_config(tmp, ck.model, out_dtype, source_config(source))
        tok_files = write_side_files(source, tmp, tokenizer)
    if show_progress:
        print(
            f"threed export: {ckpt} (tp={ck.tp}, {ck.tag}) -> {out}: {len(writer.file_names)} safetensors "
            f"shard(s), {human_bytes(total)}, vocab {ck.model.vocab_size}, tokenizer: "
            f"{', '.join(tok_files) or 'none known (pass --tokenizer)'}; {time.time() - t0:.1f} s"
        )
        if "tokenizer.model" in tok_files and "tokenizer.json" not in tok_files and not _has_protobuf():
            print("  (AutoTokenizer needs `protobuf` to read tokenizer.model; without it use sentencepiece on it)")
    return {"files": writer.file_names, "bytes": total, "tokenizer_files": tok_files, "tp": ck.tp}
