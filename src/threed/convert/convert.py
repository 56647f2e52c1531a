"""HF Llama directory -> DeepSpeed pipeline checkpoint for a tp x pp run, one layer at a time.

    threed convert --hf Meta-Llama-3-70B --tp 8 --pp 4 --out ckpt/llama3-70b-tp8pp4 [--workers 2] [--dtype bf16]
    threed train --model ckpt/llama3-70b-tp8pp4 --init-from ckpt/llama3-70b-tp8pp4 --tp 8 --pp 4 ...

Peak memory is one pipeline layer's tensors (read, fused, sharded, saved, freed), never the model. Nothing is
written before the whole source has been checked against its config.json, and the output appears under its
name only when complete (see io_utils.atomic_output_dir).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from threed.config import ModelConfig, ParallelConfig
from threed.convert.ds_checkpoint import (HF_EXTRA_DIR, TAG, layer_file, model_to_dict, with_extra_state,
                                          write_metadata)
from threed.convert.hf_source import TOKENIZER_FILES, HFSource
from threed.convert.io_utils import (ConvertError, atomic_output_dir, check_free_space, compact, dtype_name,
                                     human, progress)
from threed.convert.mapping import hf_names, layer_from_hf
from threed.pipeline import PipelineLayer, pipeline_layers

LayerShards = list[dict[str, Any]]


def layer_hf_names(layer: PipelineLayer) -> list[str]:
    return [n for names in hf_names(layer).values() for n in names]


def convert_layer(cfg: ModelConfig, layer: PipelineLayer, hf: dict[str, torch.Tensor], tp: int,
                  dtype: Optional[torch.dtype] = None) -> LayerShards:
    """One layer's HF tensors -> the state dict DeepSpeed loads on each TP rank (compact, with extra state)."""
    if dtype is not None:
        hf = {k: v.to(dtype) for k, v in hf.items()}
    shards = layer_from_hf(cfg, layer, hf, tp)
    return [with_extra_state(layer, {k: compact(v) for k, v in sd.items()}) for sd in shards]


def convert_stream(read: Callable[[list[str]], dict[str, torch.Tensor]], cfg: ModelConfig, tp: int,
                   dtype: Optional[torch.dtype] = None,
                   layers: Optional[list[PipelineLayer]] = None) -> Iterator[tuple[PipelineLayer, LayerShards]]:
    """Yield (layer, per-TP-rank state dicts) for each pipeline layer; `read` fetches a list of HF tensors.
    With a `read` that returns meta tensors this is the whole conversion at real shapes with no memory."""
    for layer in layers if layers is not None else pipeline_layers(cfg):
        yield layer, convert_layer(cfg, layer, read(layer_hf_names(layer)), tp, dtype)


def save_layer(step_dir: Path, layer: PipelineLayer, shards: LayerShards) -> int:
    written = 0
    for rank, sd in enumerate(shards):
        path = step_dir / layer_file(layer.index, rank)
        torch.save(sd, path)
        written += path.stat().st_size
    return written


# ---------------------------------------------------------------------------------------- writer processes
_WORKER: dict[str, Any] = {}


def _worker_init(hf_dir: str, cfg_json: str, tp: int, dtype: Optional[str], step_dir: str) -> None:
    from threed.config import RunConfig

    torch.set_num_threads(1)  # the parallelism is across processes
    _WORKER.update(source=HFSource(hf_dir), cfg=RunConfig.from_dict({"model": json.loads(cfg_json)}).model,
                   tp=tp, dtype=getattr(torch, dtype) if dtype else None, step_dir=Path(step_dir))


def _worker_layer(index: int) -> int:
    w = _WORKER
    layer = pipeline_layers(w["cfg"])[index]
    shards = convert_layer(w["cfg"], layer, w["source"].read_many(layer_hf_names(layer)), w["tp"], w["dtype"])
    save_layer(w["step_dir"], layer, shards)
    return index


def _run_workers(source: HFSource, cfg: ModelConfig, tp: int, dtype: Optional[torch.dtype], step_dir: Path,
                 workers: int, bar) -> None:
    layers = pipeline_layers(cfg)
    # Largest layers first, so the embedding and LM head do not end up alone at the tail.
    order = sorted(layers, key=lambda l: -source.nbytes(layer_hf_names(l)))
    init = (str(source.path), json.dumps(model_to_dict(cfg)), tp, str(dtype).replace("torch.", "") if dtype else None,
            str(step_dir))
    # spawn, not fork: a forked child of a process that has used torch's thread pools can hang.
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_worker_init,
                             initargs=init) as pool:
        futures = [pool.submit(_worker_layer, l.index) for l in order]
        for fut in as_completed(futures):
            idx = fut.result()
            bar.update(source.nbytes(layer_hf_names(layers[idx])))


# --------------------------------------------------------------------------------------------------- main

def convert(hf_dir: str | os.PathLike, out: str | os.PathLike, tp: int, pp: int,
            dtype: Optional[torch.dtype] = None, make_vocab_size_divisible_by: int = 128, workers: int = 1,
            force: bool = False, show_progress: bool = True) -> dict[str, Any]:
    """Convert; returns the manifest written to OUT/threed_convert.json."""
    from threed.presets import from_hf_config

    t0 = time.time()
    hf_dir = Path(hf_dir).absolute()
    cfg = from_hf_config(hf_dir)
    cfg = dataclasses.replace(cfg, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    ParallelConfig(tp=tp, pp=pp).validate(cfg, tp * pp)  # whole heads per TP rank, pp <= layers, ...
    if Path(out).exists() and not force:  # fail before reading anything
        raise ConvertError(f"{Path(out).absolute()} already exists; choose a new --out or pass --force")
    source = HFSource(hf_dir)
    source.check(cfg)
    layers = pipeline_layers(cfg)
    total = sum(source.nbytes(layer_hf_names(l)) for l in layers)
    scale = (dtype.itemsize / min(t.dtype.itemsize for t in source.tensors.values())) if dtype else 1.0
    Path(out).absolute().parent.mkdir(parents=True, exist_ok=True)
    check_free_space(Path(out).absolute().parent, int(total * scale))
    dtypes = sorted({dtype_name(dtype)} if dtype else {dtype_name(t.dtype) for t in source.tensors.values()})
    with atomic_output_dir(out, force) as tmp:
        step_dir = tmp / TAG
        step_dir.mkdir()
        with progress(total, "convert", show_progress) as bar:
            if workers > 1:
                _run_workers(source, cfg, tp, dtype, step_dir, workers, bar)
            else:
                for layer, shards in convert_stream(source.read_many, cfg, tp, dtype, layers):
                    save_layer(step_dir, layer, shards)
                    bar.update(source.nbytes(layer_hf_names(layer)))
                    del shards  # free this layer before reading the next
        source.close()
        extra = tmp / HF_EXTRA_DIR
        extra.mkdir()
        copied = [f for f in TOKENIZER_FILES + ("config.json",) if (hf_dir / f).is_file()]
        for f in copied:
            (extra / f).write_bytes((hf_dir / f).read_bytes())
        manifest = {
            "format": "threed-deepspeed-pipeline", "version": 1, "created_by": "threed convert",
            "model": model_to_dict(cfg), "tp": tp, "pp": pp, "vocab_size": cfg.vocab_size,
            "padded_vocab_size": cfg.padded_vocab_size(tp),
            "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by, "dtype": "/".join(dtypes),
            "tag": TAG, "num_pipeline_layers": len(layers),
            "source": {"path": str(hf_dir), "format": source.format, "files": [f.name for f in source.files],
                       "bytes": total},
            "hf_files": copied, "seconds": round(time.time() - t0, 2),
        }
        write_metadata(tmp, cfg, tp, pp, manifest)
    if show_progress:
        print(f"threed convert: {hf_dir} ({human(total)}, {source.format}) -> {out}: tp={tp} pp={pp}, "
              f"{len(layers)} pipeline layers x {tp} TP ranks, vocab {cfg.vocab_size} padded to "
              f"{cfg.padded_vocab_size(tp)}, {time.time() - t0:.1f} s")
    return manifest
