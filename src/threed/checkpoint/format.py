"""What a DeepSpeed pipeline checkpoint directory holds, in one place: the file names, reading them back, the model
it records, and whether a run can load it. `threed train` and the converters (`threed convert / export / reshard /
verify`) both read and write this layout, so every name and every check of it lives here.

    <dir>/latest                           the tag of the newest complete checkpoint (written last, atomically)
    <dir>/threed_run.json                  the run config (model, layout): RunConfig.from_dict-compatible
    <dir>/threed_convert.json              `threed convert` / `threed reshard` only: source, dtype, true/padded vocab
    <dir>/hf/                              `threed convert` only: the HF source's tokenizer / generation config
    <dir>/universal/<tag>-from-<layout>/   a universal conversion made to resume at another layout
    <dir>/<tag>/layer_XX-model_YY-model_states.pt     weights of pipeline layer XX on TP rank YY
    <dir>/<tag>/mp_rank_MM_model_states.pt            one per stage x TP rank (step, client state, ...)
    <dir>/<tag>/*zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO-1 optimizer shards (dp x pp x tp)
    <dir>/<tag>/threed_manifest.json                  `threed train` only: every file above with its size

A LoRA run started from a base (`--lora-rank --init-from BASE`) writes adapter-only checkpoints: its layer files
hold only the adapters (the frozen base's tensors left out: DeepSpeed's `exclude_frozen_parameters`), and its
manifest says so (`ADAPTERS_ONLY`) and names the base (threed.checkpoint.lora_base), whence every reader takes the
base. `Checkpoint.adapters_only` tells a reader which form it holds.

The tag is `global_step<N>` (`global_step0` for converted checkpoints). Layer file indices are positions in the
pipeline's layer list (embedding, the blocks, final norm, LM head), so they do not depend on pp or the partition
method; mp_rank and optimizer files do. Only the layers that hold parameters of their own have files
(`threed.model.spec.stored_layers`): a tied LM head (Llama 3.2) runs with the embedding's weight, which is saved
once, in layer_00 (DeepSpeed broadcasts it to the last stage on load).

DeepSpeed itself loads a checkpoint only at the tp, pp and dp it was written at (at another tp it merges/splits
layer files with GPT-2 Megatron name rules and fails deep inside): `check_loadable` says so up front for a tool
that needs DeepSpeed's own load (`threed verify`), naming `threed reshard`. A run goes around it: weights at another
layout are read slice by slice (threed.convert.into_stage), a full resume goes through a universal checkpoint
(threed.checkpoint.start).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Optional, Protocol, Sequence

from threed.config import LoraConfig, ModelConfig, RunConfig
from threed.errors import ConfigError
from threed.hf.names import lora_block_elements
from threed.model.spec import (
    PipelineLayer,
    is_adapter_key,
    optimizer_parameters,
    parameter_count,
    pipeline_layers,
    shard_shapes,
    stage_parameters,
    stored_layers,
)

if TYPE_CHECKING:
    import torch

LATEST = "latest"
RUN_JSON = "threed_run.json"  # beside the checkpoints: written by `threed train` and the converters
CONVERT_MANIFEST = "threed_convert.json"  # beside the checkpoints: written by `threed convert` / `threed reshard`
MANIFEST_NAME = "threed_manifest.json"  # inside a tag directory: written last by `threed train`'s save
UNIVERSAL_DIR = "universal"  # <save>/universal/<tag>-from-<layout>: universal conversions
HF_EXTRA_DIR = "hf"  # tokenizer / generation config files carried over from the HF source, for export
CONVERT_TAG = "global_step0"  # the tag `threed convert` and `threed reshard` write
ADAPTERS_ONLY = "lora_adapters_only"  # the manifest's key: a LoRA checkpoint whose layer files hold only adapters

TAG_RE = re.compile(r"^global_step(\d+)$")
LAYER_RE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")
MP_RE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")

NO_CHECKPOINT = (
    "holds no DeepSpeed checkpoint (no 'latest' file); pass the directory that `threed train --save` "
    "or `threed convert --out` wrote"
)


class CheckpointError(ConfigError):
    """A checkpoint directory that is incomplete, damaged, or holds another model than the run's."""


class Layer(Protocol):
    """A pipeline layer as the layer files know it (threed.parallel.pipeline.PipelineLayer is one)."""

    @property
    def index(self) -> int: ...

    @property
    def kind(self) -> str: ...


def layer_file(idx: int, tp_rank: int) -> str:
    return f"layer_{idx:02d}-model_{tp_rank:02d}-model_states.pt"


def mp_rank_file(stage: int, tp_rank: int, tp: int) -> str:
    return f"mp_rank_{stage * tp + tp_rank:02d}_model_states.pt"


def checkpoint_bytes(cfg: RunConfig) -> int:
    """Bytes of one checkpoint of this run: the weights in the training dtype (vocabulary padded for its tp; a tied
    weight saved once) plus ZeRO's fp32 master copy and AdamW's two moments (12 B/param, in total over the dp
    shards; a tied weight's at pp > 1 twice: each stage's optimizer holds its copy). A LoRA run's holds only its
    adapters' weights and optimizer state when it starts from a base (--init-from: an adapter-only checkpoint),
    else the frozen base's weights too (a LoRA run from random init has no base to read them from)."""
    width = 2 if cfg.train.dtype == "bf16" else 4
    if cfg.lora.lora_rank:
        adapters = lora_block_elements(cfg.model, cfg.lora) * cfg.model.num_layers
        base = 0 if adapter_only_lora(cfg) else parameter_count(cfg.model, cfg.parallel.tp) * width
        return base + (width + 12) * adapters
    weights = parameter_count(cfg.model, cfg.parallel.tp) * width
    return weights + 12 * optimizer_parameters(cfg.model, cfg.parallel.tp, cfg.parallel.pp)


def adapter_only_lora(cfg: RunConfig) -> Optional[LoraConfig]:
    """The LoRA settings of a run whose checkpoints will be adapter-only (LoRA from a base: --init-from; a requeued
    job gives the same flags), else None: what the size estimates count."""
    return cfg.lora if cfg.lora.lora_rank and cfg.checkpoint.init_from else None


def node_checkpoint_bytes(
    model: ModelConfig,
    dtype: str,
    layout: tuple[int, int, int],
    stage_kinds: Sequence[list],
    ranks: Iterable[int],
    lora: Optional[LoraConfig] = None,
) -> int:
    """Bytes the ranks `ranks` (one node's, or one rank) write of a checkpoint: what --async-save copies into their
    host memory (threed.checkpoint.async_save refuses a node that cannot hold it; `threed memory` and `threed
    check-config` report it per node through threed.memory.model, from this same function). `layout` is (tp, dp,
    cp); `stage_kinds[s]` the layer kinds pipeline rank s holds (threed.memory.model.stage_kinds: one entry per
    layer). Each rank writes its ZeRO-1 shard of the fp32 master weights and AdamW's two moments (12 B per
    parameter of its stage over the dp x cp ranks that share it); the first of those ranks also the stage's weights
    in the training dtype (DeepSpeed writes a stage's layer files from data-parallel rank 0 only). Under LoRA
    (`lora` with a rank) both count the adapters only: an adapter-only checkpoint. Rank order:
    threed.parallel.distributed.grid_coordinates (tp fastest, then cp, dp, pp)."""
    tp, dp, cp = layout
    shards, width = dp * cp, 4 if dtype == "fp32" else 2
    per_block = lora_block_elements(model, lora, tp) if lora is not None and lora.lora_rank else None
    total = 0
    for rank in ranks:
        kinds = stage_kinds[rank // (tp * shards)]
        if per_block is None:
            groups = [n for n in stage_parameters(model, tp, kinds) if n]
        else:
            groups = [per_block * sum(kind == "block" for kind in kinds)]
        writes_layers = rank // tp % shards == 0
        total += 12 * sum(-(-n // shards) for n in groups) + (width * sum(groups) if writes_layers else 0)
    return total


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes on `path`'s file system: the start's space check and a failed save's diagnosis ask here, one
    place for tests to fake a full disk."""
    return shutil.disk_usage(path).free


def pipeline_layer_count(model: ModelConfig) -> int:
    """Layers of the PipelineModule (`threed.model.spec.pipeline_layers`), with a file or not."""
    return len(pipeline_layers(model))


def stored_layer_indices(model: ModelConfig) -> list[int]:
    """The layer indices with one file per TP rank (`threed.model.spec.stored_layers`; a tied LM head has none)."""
    return [layer.index for layer in stored_layers(model)]


# ------------------------------------------------------------------------------------------- tags and layout


def read_latest(path: str | os.PathLike) -> Optional[str]:
    f = Path(path) / LATEST
    return f.read_text().strip() if f.is_file() else None


def empty_latest(path: str | os.PathLike) -> Optional[str]:
    """Why `path/latest` names no checkpoint although it exists (empty: a write cut short by another tool, or a
    truncation by hand), with the fix: the newest tag there, or deleting the file; None when it names one or is
    absent. Said instead of the missing layer files a reader would otherwise find under the tag ''."""
    if read_latest(path) != "":
        return None
    tags = list_tags(path)
    fix = (
        f"write the tag of the checkpoint to use into it (the newest there: `echo {tags[0]} > {path}/{LATEST}`) "
        f"or delete it"
        if tags
        else "delete it (no global_step<N> directory is there either)"
    )
    return f"{path}/{LATEST} is empty: it names no checkpoint (a write cut short, or emptied by hand); {fix}"


def latest_tag(path: str | os.PathLike) -> Optional[str]:
    """The tag `latest` names, None without the file; CheckpointError for an empty one (`empty_latest`)."""
    empty = empty_latest(path)
    if empty:
        raise CheckpointError(empty)
    return read_latest(path)


def has_checkpoint(path: Optional[str]) -> bool:
    return bool(path) and (Path(path) / LATEST).is_file()


def step_of(tag: str) -> Optional[int]:
    m = TAG_RE.match(tag)
    return int(m.group(1)) if m else None


def list_tags(path: str | os.PathLike) -> list[str]:
    """Tag directories (`global_step<N>`) under `path`, newest step first."""
    p = Path(path)
    if not p.is_dir():
        return []
    tags = [d.name for d in p.iterdir() if d.is_dir() and TAG_RE.match(d.name)]
    return sorted(tags, key=lambda t: step_of(t) or 0, reverse=True)


def layer_ranks(names: list[str]) -> dict[int, set[int]]:
    """Layer index -> the TP ranks that have a layer file, from a tag directory's file names."""
    ranks: dict[int, set[int]] = {}
    for name in names:
        m = LAYER_RE.match(name)
        if m:
            ranks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return ranks


def incomplete_layers(ranks: dict[int, set[int]], tp: int, indices: Iterable[int]) -> list[int]:
    """Those of the layer `indices` that do not have exactly one file per TP rank (all of them when tp is 0)."""
    return [i for i in indices if tp == 0 or ranks.get(i, set()) != set(range(tp))]


@dataclass(frozen=True)
class CheckpointLayout:
    tag: str
    tp: int  # files per pipeline layer
    model_parallel_files: int  # mp_rank_XX files = pp x tp
    optimizer_files: int  # ZeRO optimizer shards = dp x cp x pp x tp (0 for converted, weights-only checkpoints)
    layers: int = 0  # distinct layer indices with files

    @property
    def pp(self) -> int:
        return self.model_parallel_files // self.tp if self.tp else 0

    @property
    def dp(self) -> int:
        return self.optimizer_files // self.model_parallel_files if self.model_parallel_files else 0

    def describe(self) -> str:
        return f"tp={self.tp}, pp={self.pp}" + (f", dp={self.dp}" if self.optimizer_files else " (weights only)")


def layout_of_files(tag: str, names: list[str]) -> CheckpointLayout:
    ranks = layer_ranks(names)
    return CheckpointLayout(
        tag=tag,
        tp=len(ranks.get(0, ())),
        layers=len(ranks),
        model_parallel_files=sum(1 for n in names if MP_RE.match(n)),
        optimizer_files=sum(1 for n in names if OPTIM_RE.match(n)),
    )


def checkpoint_layout(path: str | os.PathLike, tag: Optional[str] = None) -> CheckpointLayout:
    tag = tag or latest_tag(path)
    if tag is None:
        raise CheckpointError(f"{path} {NO_CHECKPOINT}")
    step_dir = Path(path) / tag
    if not step_dir.is_dir():
        raise CheckpointError(
            f"{path}/latest names {tag!r}, but {step_dir} does not exist: the checkpoint is incomplete"
        )
    return layout_of_files(tag, [f.name for f in step_dir.iterdir()])


def missing_files(layout: CheckpointLayout, names: list[str]) -> Optional[str]:
    """Why a checkpoint without a manifest (written before manifests existed, or by `threed convert`) is not
    complete, judged by its file counts; None when every layer has every TP rank and the shards divide."""
    ranks = layer_ranks(names)
    if not ranks:
        return "no layer files"
    if layout.tp == 0:  # the TP size is read off layer 0, which every model stores (the embedding)
        return f"{layer_file(0, 0)} is missing"
    # Without the model, the layers are 0 .. the highest file's index: a tied LM head (no file) is the last layer.
    bad = incomplete_layers(ranks, layout.tp, range(max(ranks) + 1))
    if bad:
        missing = sorted(set(range(layout.tp)) - ranks.get(bad[0], set()))
        return f"{layer_file(bad[0], missing[0] if missing else 0)} is missing"
    if layout.model_parallel_files == 0 or layout.model_parallel_files % layout.tp:
        return f"{layout.model_parallel_files} mp_rank files for tp={layout.tp}"
    if layout.optimizer_files % layout.model_parallel_files:
        return (
            f"{layout.optimizer_files} optimizer shards is not a multiple of the "
            f"{layout.model_parallel_files} mp_rank files"
        )
    return None


# ------------------------------------------------------------------------------------------- the recorded model


def read_run_json(path: Path) -> Optional[dict[str, Any]]:
    """The run description beside the checkpoints: threed_run.json, else a converter's threed_convert.json."""
    for name in (RUN_JSON, CONVERT_MANIFEST):
        if (path / name).is_file():
            try:
                return json.loads((path / name).read_text())
            except json.JSONDecodeError as e:
                raise CheckpointError(f"{path / name} is not valid JSON: {e}") from None
    return None


def read_model_config(path: str | os.PathLike) -> Optional[ModelConfig]:
    """The ModelConfig recorded in a converted or trained checkpoint directory (None if it records none).
    This is what lets `threed train --model CKPT_DIR --init-from CKPT_DIR` pad the vocab exactly as converted."""
    run = read_run_json(Path(path))
    if run is None or "model" not in run:
        return None
    return RunConfig.from_dict({"model": run["model"]}).model


# ------------------------------------------------------------------------------------------- reading layer files


@dataclass
class Checkpoint:
    path: Path
    tag: str
    model: ModelConfig
    tp: int
    pp: int  # the pp it was written at (mp_rank files); layer files themselves do not depend on it
    run: dict[str, Any] = field(default_factory=dict)
    # a LoRA checkpoint whose layer files hold only the adapters: the base is the one its manifest names
    adapters_only: bool = False

    @property
    def step_dir(self) -> Path:
        return self.path / self.tag

    @property
    def num_pipeline_layers(self) -> int:
        return pipeline_layer_count(self.model)

    @property
    def layers(self) -> list[PipelineLayer]:
        """The layers with files (`threed.model.spec.stored_layers`), in index order: what readers iterate."""
        return stored_layers(self.model)

    def layer_path(self, idx: int, tp_rank: int) -> Path:
        return self.step_dir / layer_file(idx, tp_rank)

    def nbytes(self, idx: int) -> int:
        return sum(self.layer_path(idx, r).stat().st_size for r in range(self.tp))

    def load_rank(self, layer: Layer, rank: int) -> dict[str, "torch.Tensor"]:
        """One layer file, memory-mapped (no data read yet), with its keys and shapes checked."""
        if layer.index not in stored_layer_indices(self.model):
            raise CheckpointError(
                f"internal: layer {layer.index} ({layer.kind}) of {self.model.name} has no file "
                f"(tied to the embedding); read the stored layers only (Checkpoint.layers)"
            )
        expected = shard_shapes(self.model, layer.kind, self.tp)
        path = self.layer_path(layer.index, rank)
        try:
            import torch  # heavy: only where a layer file is read, so --model resolution and check-config stay light

            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:
            msg = f"{e.__class__.__name__}: {str(e).split('. ')[0][:300]}"
            raise CheckpointError(f"cannot read {path}: {msg} (truncated or corrupt)") from None
        tensors = {k: v for k, v in sd.items() if not k.endswith("._extra_state")}
        if self.adapters_only:  # the adapters alone (threed.convert.lora reads them); the base is elsewhere
            base = sorted(k for k in tensors if not is_adapter_key(k))
            if base:
                raise CheckpointError(f"{path} holds base weights {base[:3]}, but its manifest says adapters only")
            return tensors
        # A LoRA run's files also hold its adapters (threed.convert.lora reads them); the base is checked as always.
        if {k for k in tensors if not is_adapter_key(k)} != set(expected):
            raise CheckpointError(
                f"{path} holds {sorted(tensors)}, expected {sorted(expected)} for layer {layer.index} ({layer.kind})"
            )
        for k in expected:
            v = tensors[k]
            if tuple(v.shape) != expected[k]:
                raise CheckpointError(
                    f"{path}: {k} is {list(v.shape)}, expected {list(expected[k])} for "
                    f"{self.model.name} at tp={self.tp}"
                )
        return tensors

    def load_layer(self, layer: Layer) -> list[dict[str, "torch.Tensor"]]:
        """The layer's state dict on every TP rank, memory-mapped, checked."""
        return [self.load_rank(layer, rank) for rank in range(self.tp)]


def open_checkpoint(
    path: str | os.PathLike, model: Optional[ModelConfig] = None, tag: Optional[str] = None
) -> Checkpoint:
    """Find the tag (the one `latest` names unless `tag` says), TP size and layer files of a DeepSpeed pipeline
    checkpoint written by this repo."""
    p = Path(path)
    tag = tag or latest_tag(p)
    if tag is None:
        raise CheckpointError(f"{p} {NO_CHECKPOINT}")
    step_dir = p / tag
    if not step_dir.is_dir():
        raise CheckpointError(f"{p}/latest names {tag!r}, but {step_dir} does not exist")
    run = read_run_json(p) or {}
    if model is None:
        if "model" not in run:
            raise CheckpointError(f"{p} has no {RUN_JSON} or {CONVERT_MANIFEST}: the model config is unknown")
        model = RunConfig.from_dict({"model": run["model"]}).model
    ranks = layer_ranks([f.name for f in step_dir.iterdir()])
    stored = stored_layer_indices(model)
    tp = max((len(ranks.get(i, ())) for i in stored), default=0)  # the layers that are complete say it
    problems = [f"layer {i}: TP ranks {sorted(ranks.get(i, ()))}" for i in incomplete_layers(ranks, tp, stored)]
    extra = sorted(set(ranks) - set(stored))
    if problems or extra:
        tied = " (its LM head is tied to the embedding: no file)" if len(stored) < pipeline_layer_count(model) else ""
        raise CheckpointError(
            f"{step_dir} does not hold one file per TP rank for each of the {len(stored)} stored "
            f"layers of {model.name}{tied}: {'; '.join(problems[:6])}"
            + (f"; unexpected layers {extra}" if extra else "")
        )
    mp_files = len(list(step_dir.glob("mp_rank_*_model_states.pt")))
    # The run's record describes the checkpoint `latest` names; an older tag may predate a resume at another layout.
    recorded = run.get("parallel", {}) if tag == read_latest(p) else {}
    pp = int(recorded.get("pp", 0)) or max(1, mp_files // tp)
    if int(recorded.get("tp", tp)) != tp:
        raise CheckpointError(f"{p}: {RUN_JSON} says tp={run['parallel']['tp']}, the layer files are for tp={tp}")
    return Checkpoint(path=p, tag=tag, model=model, tp=tp, pp=pp, run=run, adapters_only=holds_adapters_only(step_dir))


def holds_adapters_only(step_dir: Path) -> bool:
    """Whether the checkpoint in `step_dir` is a LoRA run's adapter-only one (its manifest says so)."""
    try:
        return bool(json.loads((step_dir / MANIFEST_NAME).read_text()).get(ADAPTERS_ONLY))
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------- can this run load it

_IGNORED_FIELDS = {"name", "init_std"}  # do not change the weights' layout


def check_model(path: str | os.PathLike, recorded: Optional[ModelConfig], model: ModelConfig) -> None:
    """The recorded model must equal the run's, or DeepSpeed reports a size mismatch deep in load_state_dict."""
    if recorded is None:
        return
    diffs = [
        f"{f.name} {getattr(recorded, f.name)} != {getattr(model, f.name)}"
        for f in fields(ModelConfig)
        if f.name not in _IGNORED_FIELDS and getattr(recorded, f.name) != getattr(model, f.name)
    ]
    if recorded.tie_word_embeddings != model.tie_word_embeddings:
        # The layer files differ (a tied checkpoint has no LM head file): say which side ties, not just "differs".
        tied_side, untied = (
            (f"checkpoint {path}", "this run's model")
            if recorded.tie_word_embeddings
            else ("this run's model", f"checkpoint {path}")
        )
        raise CheckpointError(
            f"{tied_side} ties the LM head to the embedding (tie_word_embeddings=true), "
            f"{untied} does not (tie_word_embeddings=false); pass --model {path} to train the "
            f"model the checkpoint holds"
        )
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} holds another model than this run's ({'; '.join(diffs)}); pass "
            f"--model {path} to train the model it holds"
        )


def check_loadable(path: str | os.PathLike, model: ModelConfig, tp: int, pp: int, weights_only: bool = True) -> None:
    """Raise a CheckpointError unless `path` holds `model` written at tp x pp (its layer files checked one by
    one). Used for weights-only loads (`--init-from`, `threed verify`) and before a native resume."""
    ck = open_checkpoint(path)
    check_model(path, ck.model, model)
    if (ck.tp, ck.pp) != (tp, pp):
        raise CheckpointError(
            f"checkpoint {path} was written at tp={ck.tp} pp={ck.pp}; this run has tp={tp} "
            f"pp={pp}. Reshard it: threed reshard --ckpt {path} --tp {tp} --pp {pp} --out NEW_DIR"
        )
    if not weights_only and ck.tag == CONVERT_TAG and (Path(path) / CONVERT_MANIFEST).is_file():
        raise CheckpointError(
            f"{path} is a converted checkpoint (weights only, no optimizer state): use it with "
            f"--init-from, not --load or --save"
        )
