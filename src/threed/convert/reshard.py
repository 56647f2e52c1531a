"""Change the tp / pp of a DeepSpeed pipeline checkpoint, one layer at a time, bit-exact.

    threed reshard --ckpt ckpt/llama3-70b-tp8pp4 --tp 4 --pp 8 --out ckpt/llama3-70b-tp4pp8

Each new TP file is built like `threed convert` builds it (threed.convert.slices), reading the HF tensors'
slices out of the old TP files instead of HF files: no layer is merged in memory, and a round trip is the
identity. The output holds weights only (tag global_step0): train from it with --init-from. Vocab padding rows
are re-created as zeros for the new tp (their values never reach a logit).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional

import torch

from threed.config import ModelConfig, ParallelConfig
from threed.convert.from_hf import convert_rank, layer_hf_names, save_rank
from threed.convert.export import write_side_files
from threed.checkpoint.format import CONVERT_TAG, HF_EXTRA_DIR, Checkpoint, open_checkpoint
from threed.convert.ds_checkpoint import convert_manifest, shard_reader, write_metadata
from threed.convert.lora import refuse_adapters
from threed.convert.io_utils import atomic_output_dir, check_free_space, dtype_name, progress, refuse_existing
from threed.convert.slices import BufferPool
from threed.model.spec import stored_layers
from threed.units import human_bytes


def reshard_layers(
    ck: Checkpoint, cfg: ModelConfig, tp: int, dtype: Optional[torch.dtype], step_dir: Path, bar
) -> set[str]:
    """Every stored layer's new TP files into step_dir, one layer's old files mapped at a time; returns the dtypes
    the old files hold."""
    dtypes: set[str] = set()
    pool = BufferPool()
    for layer in stored_layers(cfg):  # a tied LM head has no file to read or write
        reader = shard_reader(ck, layer)  # slices of the HF tensors, read out of the old TP files
        for rank in range(tp):
            save_rank(step_dir, layer, rank, convert_rank(cfg, layer, reader, tp, rank, dtype, pool=pool))
        dtypes.update(dtype_name(reader.dtype(n)) for n in layer_hf_names(layer))
        del reader  # unmaps this layer's files
        bar.update(ck.nbytes(layer.index))
    return dtypes


def reshard(
    ckpt: str | os.PathLike,
    out: str | os.PathLike,
    tp: int,
    pp: int,
    dtype: Optional[torch.dtype] = None,
    force: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """`threed reshard`: the checkpoint at `ckpt` as a tp x pp checkpoint at `out`; returns the manifest written to
    OUT/threed_convert.json."""
    t0 = time.time()
    refuse_existing(out, force)
    ck = open_checkpoint(ckpt)
    refuse_adapters(ck, "reshard")  # a LoRA run's: its adapters would be dropped
    cfg = ck.model
    ParallelConfig(tp=tp, pp=pp).validate(cfg, tp * pp)
    total = sum(ck.nbytes(ly.index) for ly in stored_layers(cfg))
    check_free_space(out, total)
    with atomic_output_dir(out, force) as tmp:
        step_dir = tmp / CONVERT_TAG
        step_dir.mkdir()
        with progress(total, "reshard", show_progress) as bar:
            dtypes = reshard_layers(ck, cfg, tp, dtype, step_dir, bar)
        (tmp / HF_EXTRA_DIR).mkdir()  # carry tokenizer / source config along, so export still finds them
        side = write_side_files(ck, tmp / HF_EXTRA_DIR, with_config=True)
        source = {
            "path": str(ck.path.absolute()),
            "format": "deepspeed",
            "tp": ck.tp,
            "pp": ck.pp,
            "tag": ck.tag,
            "bytes": total,
        }
        written = dtype_name(dtype) if dtype else "/".join(sorted(dtypes))
        manifest = convert_manifest("threed reshard", cfg, tp, pp, written, source, side, t0)
        write_metadata(tmp, cfg, tp, pp, manifest)
    if show_progress:
        print(
            f"threed reshard: {ckpt} (tp={ck.tp} pp={ck.pp}, {ck.tag}) -> {out} (tp={tp} pp={pp}), "
            f"{human_bytes(total)}, {time.time() - t0:.1f} s"
        )
    return manifest
