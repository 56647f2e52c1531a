"""HF Llama directory -> DeepSpeed pipeline checkpoint for a tp x pp run, one layer at a time.

    threed convert --hf Meta-Llama-3-70B --tp 8 --pp 4 --out ckpt/llama3-70b-tp8pp4 [--workers 2] [--dtype bf16]
    threed train --model Meta-Llama-3-70B --init-from ckpt/llama3-70b-tp8pp4 --tp 8 --pp 4 ...

(`--model` must pad the vocab as the conversion did: the HF directory does at the default
--make-vocab-size-divisible-by 128; `threed_run.json` in the output records the exact ModelConfig, see
threed.checkpoint.format.read_model_config.)

A tied model (config.json `tie_word_embeddings: true`, Llama 3.2 1B / 3B) converts to its stored layers only
(`threed.model.spec.stored_layers`): the LM head runs with the embedding's weight and has no file. Its HF files
need no lm_head.weight (transformers saves none); one that is there must equal model.embed_tokens.weight.

Peak memory is one TP rank's shard of one pipeline layer (read slice by slice straight into place, saved,
freed; see threed.convert.slices), never the model. Nothing is written before the whole source has been checked
against its config.json, and the output appears under its name only when complete (io_utils.atomic_output_dir).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from collections import OrderedDict
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from threed.checkpoint.format import CONVERT_TAG, HF_EXTRA_DIR, layer_file
from threed.config import ModelConfig, ParallelConfig, RunConfig
from threed.convert.ds_checkpoint import convert_manifest, model_to_dict, with_extra_state, write_metadata
from threed.convert.io_utils import (
    ConvertError,
    atomic_output_dir,
    check_free_space,
    dtype_name,
    progress,
    refuse_existing,
)
from threed.convert.slices import BufferPool, PartReader, materialize, rank_slices
from threed.hf.config import from_hf_config
from threed.hf.format import SIDE_FILES
from threed.hf.names import hf_names, hf_shapes, tied_hf_names
from threed.hf.read import HFSource
from threed.model.spec import PipelineLayer, pipeline_layers, stored_layers
from threed.units import human_bytes

StateDict = OrderedDict[str, Any]
TIED_NOTE = " (LM head tied to the embedding: no file of its own)"


def layer_hf_names(layer: PipelineLayer) -> list[str]:
    return [n for names in hf_names(layer).values() for n in names]


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor an HF directory of this model holds (what HFSource.check compares): those
    of the stored layers (a tied model's lm_head.weight is the embedding, see `check_source`)."""
    expected: dict[str, tuple[int, ...]] = {}
    for layer in stored_layers(cfg):
        expected.update(hf_shapes(cfg, layer))
    return expected


def check_source(source: HFSource, cfg: ModelConfig) -> None:
    """The source holds what its config.json implies; a tied model's lm_head.weight may be there too, if it is
    the embedding's values (compared block by block). Raises before anything is written."""
    expected, ties = expected_hf_shapes(cfg), tied_hf_names(cfg)
    untied_head = tied_hf_names(dataclasses.replace(cfg, tie_word_embeddings=True))
    missing_heads = [n for n in untied_head if n not in source.tensors and n in expected]
    if missing_heads:  # an untied config over a tied model's files (transformers saves no lm_head.weight then)
        raise ConvertError(
            f"{source.path} has no {missing_heads[0]} and its config.json says "
            f"tie_word_embeddings=false; if the model ties it to {untied_head[missing_heads[0]]} "
            f"(Llama 3.2 1B / 3B), set tie_word_embeddings: true in config.json"
        )
    source.check(cfg, expected, optional={n: expected[owner] for n, owner in ties.items()})
    for name, owner in ties.items():
        if name in source.tensors and not source.same_values(name, owner):
            raise ConvertError(
                f"{source.path}: {name} differs from {owner} although config.json says "
                f"tie_word_embeddings=true; set it to false to convert both weights, or remove "
                f"{name} from the safetensors to convert the tied model"
            )


def convert_rank(
    cfg: ModelConfig,
    layer: PipelineLayer,
    reader: PartReader,
    tp: int,
    rank: int,
    dtype: Optional[torch.dtype] = None,
    device: str = "cpu",
    pool: Optional[BufferPool] = None,
) -> StateDict:
    """The state dict DeepSpeed loads for `layer` on TP rank `rank` (== mapping.layer_from_hf(...)[rank]),
    read slice by slice from `reader`, plus the `_extra_state` entries megatron's strict load expects.
    With a `pool`, the tensors are reused by the next call: save (or copy) them before making another."""
    specs = rank_slices(cfg, layer, tp, rank)
    if pool is not None:
        pool.start(specs)
    return with_extra_state(layer, {s.name: materialize(s, reader, dtype, device, pool) for s in specs})


def convert_stream(
    reader: PartReader,
    cfg: ModelConfig,
    tp: int,
    dtype: Optional[torch.dtype] = None,
    layers: Optional[list[PipelineLayer]] = None,
    device: str = "cpu",
    pool: Optional[BufferPool] = None,
) -> Iterator[tuple[PipelineLayer, int, StateDict]]:
    """Yield (layer, TP rank, state dict) for every output file, one at a time (with a pool, each is only
    valid until the next is made). With device="meta" and a reader over meta tensors this is the whole
    conversion at real shapes with no memory (tests/unit/test_convert_meta.py)."""
    for layer in layers if layers is not None else stored_layers(cfg):
        for rank in range(tp):
            yield layer, rank, convert_rank(cfg, layer, reader, tp, rank, dtype, device, pool)


@contextlib.contextmanager
def _no_crc32() -> Iterator[None]:
    """torch.save's zip CRC32 costs CPU time (~4 GB/s on one core) and torch.load does not verify it."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


def save_rank(step_dir: Path, layer: PipelineLayer, rank: int, sd: StateDict) -> int:
    path = step_dir / layer_file(layer.index, rank)
    with _no_crc32():
        torch.save(sd, path)
    return path.stat().st_size


# ---------------------------------------------------------------------------------------- writer processes
_WORKER: dict[str, Any] = {}


def _worker_init(hf_dir: str, cfg_json: str, tp: int, dtype: Optional[str], step_dir: str) -> None:
    torch.set_num_threads(1)  # the parallelism is across processes
    _WORKER.update(
        source=HFSource(hf_dir),
        cfg=RunConfig.from_dict({"model": json.loads(cfg_json)}).model,
        tp=tp,
        dtype=getattr(torch, dtype) if dtype else None,
        step_dir=Path(step_dir),
        pool=BufferPool(),
    )


def _worker_layer(index: int) -> int:
    w = _WORKER
    layer = pipeline_layers(w["cfg"])[index]  # a stored layer: _run_workers submits those only
    w["source"].prefetch(layer_hf_names(layer))
    for rank in range(w["tp"]):
        sd = convert_rank(w["cfg"], layer, w["source"], w["tp"], rank, w["dtype"], pool=w["pool"])
        save_rank(w["step_dir"], layer, rank, sd)
    return index


def _run_workers(
    source: HFSource, cfg: ModelConfig, tp: int, dtype: Optional[torch.dtype], step_dir: Path, workers: int, bar
) -> None:
    layers = {ly.index: ly for ly in stored_layers(cfg)}
    # Largest layers first, so the embedding and LM head do not end up alone at the tail.
    order = sorted(layers.values(), key=lambda ly: -source.nbytes(layer_hf_names(ly)))
    init = (
        str(source.path),
        json.dumps(model_to_dict(cfg)),
        tp,
        str(dtype).replace("torch.", "") if dtype else None,
        str(step_dir),
    )
    # spawn, not fork: a forked child of a process that has used torch's thread pools can hang.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_worker_init, initargs=init) as pool:
        futures = [pool.submit(_worker_layer, ly.index) for ly in order]
        try:
            for fut in as_completed(futures):
                idx = fut.result()
                bar.update(source.nbytes(layer_hf_names(layers[idx])))
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # do not convert the rest after a failure
            raise


def _run_here(source: HFSource, cfg: ModelConfig, tp: int, dtype: Optional[torch.dtype], step_dir: Path, bar) -> None:
    """`_run_workers` in this process: one TP rank's shard of one layer in memory at a time, the next layer's
    files read ahead while this one's are written."""
    layers = stored_layers(cfg)
    source.prefetch(layer_hf_names(layers[0]))
    following = dict(zip((ly.index for ly in layers), layers[1:]))
    for layer, rank, sd in convert_stream(source, cfg, tp, dtype, layers, pool=BufferPool()):
        if rank == 0 and layer.index in following:
            source.prefetch(layer_hf_names(following[layer.index]))  # overlap reads and writes
        save_rank(step_dir, layer, rank, sd)
        del sd  # one rank's shard of one layer in memory at a time
        if rank == tp - 1:
            bar.update(source.nbytes(layer_hf_names(layer)))


# --------------------------------------------------------------------------------------------------- main


def checked_source(hf_dir: Path, cfg: ModelConfig) -> HFSource:
    """The HF directory's tensors, checked against its config.json (`check_source`); closed again if they fail."""
    source = HFSource(hf_dir)
    try:
        check_source(source, cfg)
    except BaseException:
        source.close()  # the tie check may have opened the files
        raise
    return source


def copy_side_files(hf_dir: Path, dest: Path) -> list[str]:
    """The HF directory's tokenizer and config files (SIDE_FILES) into a new `dest`; returns the names copied."""
    dest.mkdir()
    copied = [f for f in SIDE_FILES if (hf_dir / f).is_file()]
    for f in copied:
        (dest / f).write_bytes((hf_dir / f).read_bytes())
    return copied


def convert_hf_checkpoint(
    hf_dir: str | os.PathLike,
    out: str | os.PathLike,
    tp: int,
    pp: int,
    dtype: Optional[torch.dtype] = None,
    make_vocab_size_divisible_by: int = 128,
    workers: int = 1,
    force: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """`threed convert`: the HF directory as a tp x pp checkpoint at `out`; returns the manifest written to
    OUT/threed_convert.json."""
    t0 = time.time()
    hf_dir = Path(hf_dir).absolute()
    cfg = from_hf_config(hf_dir)
    cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    ParallelConfig(tp=tp, pp=pp).validate(cfg, tp * pp)  # whole heads per TP rank, pp <= layers, ...
    refuse_existing(out, force)  # fail before reading anything
    source = checked_source(hf_dir, cfg)
    layers = stored_layers(cfg)  # a tied LM head has no file (the embedding's weight is saved once, layer_00)
    total = sum(source.nbytes(layer_hf_names(ly)) for ly in layers)
    scale = (dtype.itemsize / min(t.dtype.itemsize for t in source.tensors.values())) if dtype else 1.0
    check_free_space(out, int(total * scale))
    dtypes = sorted({dtype_name(dtype)} if dtype else {dtype_name(t.dtype) for t in source.tensors.values()})
    with atomic_output_dir(out, force) as tmp, contextlib.closing(source):
        step_dir = tmp / CONVERT_TAG
        step_dir.mkdir()
        with progress(total, "convert", show_progress) as bar:
            if workers > 1:  # each worker process holds its own rank shard: memory x workers
                _run_workers(source, cfg, tp, dtype, step_dir, workers, bar)
            else:
                _run_here(source, cfg, tp, dtype, step_dir, bar)
        copied = copy_side_files(hf_dir, tmp / HF_EXTRA_DIR)
        files = [f.name for f in source.files]
        read = {"path": str(hf_dir), "format": source.format, "files": files, "bytes": total}
        manifest = convert_manifest("threed convert", cfg, tp, pp, "/".join(dtypes), read, copied, t0)
        write_metadata(tmp, cfg, tp, pp, manifest)
    if show_progress:
        print(
            f"threed convert: {hf_dir} ({human_bytes(total)}, {source.format}) -> {out}: tp={tp} pp={pp}, "
            f"{len(layers)} layer files x {tp} TP ranks{TIED_NOTE if cfg.tie_word_embeddings else ''}, vocab "
            f"{cfg.vocab_size} padded to {cfg.padded_vocab_size(tp)}, {time.time() - t0:.1f} s"
        )
    return manifest
