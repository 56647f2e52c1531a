"""Writing a DeepSpeed pipeline checkpoint the way DeepSpeed itself would, for `threed convert` and `threed reshard`,
and reading one layer of it back as HF tensors (for `threed export` and `threed reshard`). What the directory holds
(file names, the recorded model, the checks) is threed.checkpoint.format; this module is the converters' side:

    <dir>/<tag>/layer_{idx:02d}-model_{tp:02d}-model_states.pt   torch.save(state dict of layer idx, TP rank): the
                                                                  converter's own (threed.convert.from_hf.save_rank)
    <dir>/<tag>/mp_rank_{stage*TP+tp:02d}_model_states.pt        {"module": None, ...} one per stage x TP rank
    <dir>/threed_run.json      {"model": ..., "parallel": {"tp", "pp"}}  (RunConfig.from_dict-compatible)
    <dir>/threed_convert.json  the converter's manifest (source, dtype, true and padded vocab)
    <dir>/latest               the tag, written last
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from threed.checkpoint.format import (
    CONVERT_MANIFEST,
    CONVERT_TAG,
    LATEST,
    RUN_JSON,
    Checkpoint,
    layer_file,
    mp_rank_file,
)
from threed.config import ModelConfig, RunConfig
from threed.convert.slices import ShardReader
from threed.model.spec import LAYER_KINDS, PipelineLayer, layer_parameters, pipeline_layers, stored_layers

# megatron-core linears define get_extra_state(); their state dicts hold `<module>._extra_state = None`, and a
# strict load_state_dict insists on the key, so converted layer files carry it as DeepSpeed's own files do.
EXTRA_STATE = {kind: tuple(p.module for p in layer_parameters(kind) if p.megatron_linear) for kind in LAYER_KINDS}


def with_extra_state(layer: PipelineLayer, sd: dict[str, torch.Tensor]) -> "OrderedDict[str, Any]":
    out: OrderedDict[str, Any] = OrderedDict(sd)
    for module in EXTRA_STATE[layer.kind]:
        out[f"{module}._extra_state"] = None
    return out


def model_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    return RunConfig(model=cfg).to_dict()["model"]


def mp_rank_state(tp: int, pp: int, manifest: dict[str, Any]) -> dict[str, Any]:
    """What DeepSpeed reads from an mp_rank file under load_module_only: `module` None (a pipeline loads its
    layer files instead), `dp_world_size`; `mp_world_size` must equal the number of mp_rank files (it asserts)."""
    try:
        ds_version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        ds_version = "unknown"
    return {
        "module": None,
        "buffer_names": [],
        "optimizer": None,
        "lr_scheduler": None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": 0,
        "global_steps": 0,
        "global_samples": 0,
        "dp_world_size": 1,
        "mp_world_size": tp * pp,
        "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp},
        "ds_version": ds_version,
        "threed_convert": manifest,
    }


def convert_manifest(
    command: str, cfg: ModelConfig, tp: int, pp: int, dtype: str, source: dict[str, Any], hf_files: list[str], t0: float
) -> dict[str, Any]:
    """The manifest of a `threed convert` / `threed reshard` output (threed_convert.json, and in every mp_rank file):
    the model and layout, true and padded vocab, the dtype(s) written, which pipeline layers have files, the
    `source` the command read, the HF side files carried along in hf/, and the seconds since `t0`."""
    return {
        "format": "threed-deepspeed-pipeline",
        "version": 1,
        "created_by": command,
        "model": model_to_dict(cfg),
        "tp": tp,
        "pp": pp,
        "vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.padded_vocab_size(tp),
        "make_vocab_size_divisible_by": cfg.make_vocab_size_divisible_by,
        "dtype": dtype,
        "tag": CONVERT_TAG,
        "num_pipeline_layers": len(pipeline_layers(cfg)),
        "stored_layers": [ly.index for ly in stored_layers(cfg)],
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "source": source,
        "hf_files": hf_files,
        "seconds": round(time.time() - t0, 2),
    }


def write_metadata(out: Path, cfg: ModelConfig, tp: int, pp: int, manifest: dict[str, Any]) -> None:
    """Everything except the layer files: mp_rank files, run description, manifest, and `latest` last (it is
    what makes the directory a checkpoint)."""
    step_dir = out / CONVERT_TAG
    step_dir.mkdir(parents=True, exist_ok=True)
    state = mp_rank_state(tp, pp, manifest)
    for stage in range(pp):
        for rank in range(tp):
            torch.save(state, step_dir / mp_rank_file(stage, rank, tp))
    run = {"model": model_to_dict(cfg), "parallel": {"tp": tp, "pp": pp}}
    (out / RUN_JSON).write_text(json.dumps(run, indent=1) + "\n")
    (out / CONVERT_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / LATEST).write_text(CONVERT_TAG)


def checkpoint_files(cfg: ModelConfig, tp: int, pp: int) -> list[str]:
    """Every file `threed convert` writes under the tag directory, in write order (layer files of the stored
    layers, then mp_rank)."""
    names = [layer_file(ly.index, r) for ly in stored_layers(cfg) for r in range(tp)]
    return names + [mp_rank_file(s, r, tp) for s in range(pp) for r in range(tp)]


def shard_reader(ck: Checkpoint, layer: PipelineLayer) -> ShardReader:
    """A PartReader of the layer's HF tensors, reading slices straight out of the (mapped, checked) TP files."""
    return ShardReader(ck.model, layer, ck.tp, lambda rank: ck.load_rank(layer, rank))
