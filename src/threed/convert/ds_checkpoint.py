"""The DeepSpeed pipeline checkpoint layout this repo reads and writes, and the checks around it.

    <dir>/latest                                              "global_step0"
    <dir>/global_step0/layer_{idx:02d}-model_{tp:02d}-model_states.pt   torch.save(state dict of layer idx, TP rank)
    <dir>/global_step0/mp_rank_{stage*TP+tp:02d}_model_states.pt        {"module": None, ...} one per stage x TP rank
    <dir>/threed_run.json      {"model": ..., "parallel": {"tp", "pp"}}  (RunConfig.from_dict-compatible)
    <dir>/threed_convert.json  the converter's manifest (source, dtype, true and padded vocab)

`idx` is the position in `threed.pipeline.pipeline_layers`, so layer files do not depend on pp or on the
partition method (which stage owns a layer is decided at load time). DeepSpeed loads them only at the TP size
they were written for: at another it merges/splits them with GPT-2 Megatron name rules and fails deep inside;
`threed.checkpoint.layout.check_loadable` refuses that up front, naming `threed reshard`.
"""
from __future__ import annotations

import json
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

import torch

from threed.config import ModelConfig, RunConfig
from threed.convert.io_utils import ConvertError
from threed.convert.mapping import layer_from_hf
from threed.convert.slices import ShardReader
from threed.hf.names import hf_shapes
from threed.model.spec import PipelineLayer, pipeline_layers

TAG = "global_step0"
RUN_JSON = "threed_run.json"  # the name threed.train writes beside its checkpoints
MANIFEST = "threed_convert.json"
HF_EXTRA_DIR = "hf"  # tokenizer / generation config files carried over from the HF source, for export
# megatron-core linears define get_extra_state(); their state dicts hold `<module>._extra_state = None`, and a
# strict load_state_dict insists on the key, so converted layer files carry it as DeepSpeed's own files do.
EXTRA_STATE = {"embedding": (), "final_norm": (), "lm_head": ("lm_head",),
               "block": ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
                         "mlp.linear_fc2")}
_LAYER_RE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


def layer_file(idx: int, tp_rank: int) -> str:
    return f"layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt"


def mp_rank_file(stage: int, tp_rank: int, tp: int) -> str:
    return f"mp_rank_{stage * tp + tp_rank:02d}_model_states.pt"


def with_extra_state(layer: PipelineLayer, sd: dict[str, torch.Tensor]) -> "OrderedDict[str, Any]":
    out: OrderedDict[str, Any] = OrderedDict(sd)
    for module in EXTRA_STATE[layer.kind]:
        out[f"{module}._extra_state"] = None
    return out


def expected_shard_shapes(cfg: ModelConfig, layer: PipelineLayer, tp: int) -> list[dict[str, tuple[int, ...]]]:
    """Shapes of one layer's state dict on each TP rank, by running the converter on meta tensors (no memory)."""
    meta = {n: torch.empty(s, device="meta") for n, s in hf_shapes(cfg, layer).items()}
    return [{k: tuple(v.shape) for k, v in sd.items()} for sd in layer_from_hf(cfg, layer, meta, tp)]


def model_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    return RunConfig(model=cfg).to_dict()["model"]


def mp_rank_state(tp: int, pp: int, manifest: dict[str, Any]) -> dict[str, Any]:
    """What DeepSpeed reads from an mp_rank file under load_module_only: `module` None (a pipeline loads its
    layer files instead), `dp_world_size`; `mp_world_size` must equal the number of mp_rank files (it asserts)."""
    try:
        ds_version = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        ds_version = "unknown"
    return {"module": None, "buffer_names": [], "optimizer": None, "lr_scheduler": None, "data_sampler": None,
            "random_ltd": None, "skipped_steps": 0, "global_steps": 0, "global_samples": 0, "dp_world_size": 1,
            "mp_world_size": tp * pp, "checkpoint_parallel_dimensions": {"pp_degree": pp, "tp_degree": tp},
            "ds_version": ds_version, "threed_convert": manifest}


def write_metadata(out: Path, cfg: ModelConfig, tp: int, pp: int, manifest: dict[str, Any]) -> None:
    """Everything except the layer files: mp_rank files, run description, manifest, and `latest` last (it is
    what makes the directory a checkpoint)."""
    step_dir = out / TAG
    step_dir.mkdir(parents=True, exist_ok=True)
    state = mp_rank_state(tp, pp, manifest)
    for stage in range(pp):
        for rank in range(tp):
            torch.save(state, step_dir / mp_rank_file(stage, rank, tp))
    run = {"model": model_to_dict(cfg), "parallel": {"tp": tp, "pp": pp}}
    (out / RUN_JSON).write_text(json.dumps(run, indent=1) + "\n")
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "latest").write_text(TAG)


# ------------------------------------------------------------------------------------------------- reading

def read_run_json(path: Path) -> Optional[dict[str, Any]]:
    for name in (RUN_JSON, MANIFEST):
        if (path / name).is_file():
            try:
                return json.loads((path / name).read_text())
            except json.JSONDecodeError as e:
                raise ConvertError(f"{path / name} is not valid JSON: {e}") from None
    return None


def read_model_config(path: str | os.PathLike) -> Optional[ModelConfig]:
    """The ModelConfig recorded in a converted or trained checkpoint directory (None if it records none).
    This is what lets `threed train --model CKPT_DIR --init-from CKPT_DIR` pad the vocab exactly as converted."""
    run = read_run_json(Path(path))
    if run is None or "model" not in run:
        return None
    return RunConfig.from_dict({"model": run["model"]}).model


@dataclass
class Checkpoint:
    path: Path
    tag: str
    model: ModelConfig
    tp: int
    pp: int  # the pp it was written at (mp_rank files); layer files themselves do not depend on it
    layers: list[PipelineLayer]
    run: dict[str, Any] = field(default_factory=dict)

    @property
    def step_dir(self) -> Path:
        return self.path / self.tag

    def layer_path(self, idx: int, tp_rank: int) -> Path:
        return self.step_dir / layer_file(idx, tp_rank)

    def nbytes(self, idx: int) -> int:
        return sum(self.layer_path(idx, r).stat().st_size for r in range(self.tp))

    def load_rank(self, layer: PipelineLayer, rank: int,
                  expected: Optional[list[dict[str, tuple[int, ...]]]] = None) -> dict[str, torch.Tensor]:
        """One layer file, memory-mapped (no data read yet), with its keys and shapes checked."""
        expected = expected or expected_shard_shapes(self.model, layer, self.tp)
        path = self.layer_path(layer.index, rank)
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            msg = f"{e.__class__.__name__}: {str(e).split('. ')[0][:300]}"
            raise ConvertError(f"cannot read {path}: {msg} (truncated or corrupt)") from None
        tensors = {k: v for k, v in sd.items() if not k.endswith("._extra_state")}
        if set(tensors) != set(expected[rank]):
            raise ConvertError(f"{path} holds {sorted(tensors)}, expected {sorted(expected[rank])} for "
                               f"layer {layer.index} ({layer.kind})")
        for k, v in tensors.items():
            if tuple(v.shape) != expected[rank][k]:
                raise ConvertError(f"{path}: {k} is {list(v.shape)}, expected {list(expected[rank][k])} for "
                                   f"{self.model.name} at tp={self.tp}")
        return tensors

    def load_layer(self, layer: PipelineLayer) -> list[dict[str, torch.Tensor]]:
        """The layer's state dict on every TP rank, memory-mapped, checked."""
        expected = expected_shard_shapes(self.model, layer, self.tp)
        return [self.load_rank(layer, rank, expected) for rank in range(self.tp)]

    def reader(self, layer: PipelineLayer) -> ShardReader:
        """A PartReader of the layer's HF tensors, reading slices straight out of the (mapped) TP files."""
        expected = expected_shard_shapes(self.model, layer, self.tp)
        return ShardReader(self.model, layer, self.tp, lambda rank: self.load_rank(layer, rank, expected))


def open_checkpoint(path: str | os.PathLike, model: Optional[ModelConfig] = None) -> Checkpoint:
    """Find the tag, TP size and layer files of a DeepSpeed pipeline checkpoint written by this repo."""
    p = Path(path)
    if not (p / "latest").is_file():
        raise ConvertError(f"{p} holds no DeepSpeed checkpoint (no 'latest' file); pass the directory that "
                           f"`threed train --save` or `threed convert --out` wrote")
    tag = (p / "latest").read_text().strip()
    step_dir = p / tag
    if not step_dir.is_dir():
        raise ConvertError(f"{p}/latest names {tag!r}, but {step_dir} does not exist")
    run = read_run_json(p) or {}
    if model is None:
        if "model" not in run:
            raise ConvertError(f"{p} has no {RUN_JSON} or {MANIFEST}: the model config is unknown")
        model = RunConfig.from_dict({"model": run["model"]}).model
    ranks: dict[int, set[int]] = {}
    for f in step_dir.iterdir():
        m = _LAYER_RE.match(f.name)
        if m:
            ranks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    layers = pipeline_layers(model)
    tp = len(ranks.get(0, ()))
    problems = [f"layer {i}: TP ranks {sorted(ranks.get(i, ()))}" for i in range(len(layers))
                if ranks.get(i, set()) != set(range(tp)) or tp == 0]
    extra = sorted(set(ranks) - set(range(len(layers))))
    if problems or extra:
        raise ConvertError(f"{step_dir} does not hold one file per TP rank for each of the {len(layers)} layers "
                           f"of {model.name}: {'; '.join(problems[:6])}"
                           + (f"; unexpected layers {extra}" if extra else ""))
    mp_files = len(list(step_dir.glob("mp_rank_*_model_states.pt")))
    pp = int(run.get("parallel", {}).get("pp", 0)) or max(1, mp_files // tp)
    if int(run.get("parallel", {}).get("tp", tp)) != tp:
        raise ConvertError(f"{p}: {RUN_JSON} says tp={run['parallel']['tp']}, the layer files are for tp={tp}")
    return Checkpoint(path=p, tag=tag, model=model, tp=tp, pp=pp, layers=layers, run=run)


def check_loadable(path: str | os.PathLike, model: ModelConfig, tp: int, pp: int, weights_only: bool = True) -> None:
    """Raise a ConfigError unless `path` holds `model` written at tp x pp: see threed.checkpoint.layout, which
    owns the checkpoint layout checks for training and the converters alike."""
    from threed.checkpoint.layout import check_loadable as check

    check(path, model, tp, pp, weights_only=weights_only)


def checkpoint_files(cfg: ModelConfig, tp: int, pp: int) -> list[str]:
    """Every file `threed convert` writes under the tag directory, in write order (layer files, then mp_rank)."""
    names = [layer_file(l.index, r) for l in pipeline_layers(cfg) for r in range(tp)]
    return names + [mp_rank_file(s, r, tp) for s in range(pp) for r in range(tp)]
