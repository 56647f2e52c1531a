"""LoRA adapters between HF PEFT's files and threed's TP shards, both ways, from the base weights' own slices.

HF PEFT holds one `lora_A [r, in]` and one `lora_B [out, r]` per target module (q_proj, k_proj, ... down_proj),
named `base_model.model.<the base weight's HF name without .weight>.lora_A.weight`. Which of their rows and columns
a TP rank holds is read off the base weight's slices (`threed.convert.slices.rank_slices`: megatron's grouped QKV,
the [gate_r; up_r] halves, the row-parallel column blocks), so the adapter follows the base's layout and cannot
drift from it:

    column-parallel base (q k v gate up):  A rows = the rank dimension cut evenly over TP; B rows = the rows of the
                                           base's HF tensor this rank's base shard holds, placed where the fused
                                           output holds them (`TargetSlices.placement`)
    row-parallel base (o down):            A columns = the base shard's input columns; B rows cut evenly over TP

    target_slices(cfg, layer, lora, tp, rank)   what one rank holds of one block (names, shapes, PEFT slices)
    split_dims(cfg, lora)                        the dim TP splits each adapter on (universal checkpoints)
    read_peft(folder) / write_peft(...)          the HF PEFT folder (adapter_config.json, adapter_model.safetensors)
    gather_adapters(...)                         TP shards -> PEFT tensors
    read_adapters(source, ...)                   the adapters of an HF PEFT folder or of a threed LoRA checkpoint
    export_lora(ckpt, out)                       `threed export --lora`: a LoRA run's checkpoint -> HF PEFT folder
    merge_deltas(ck)                             `threed export --merge`: alpha/r * B A per HF base weight
    merge_base(ck)                               ... and the base they go into (an adapter-only one's: the named base)

PEFT itself (a heavy optional dependency, the `peft` extra) is imported only where its config class is wanted, in
`write_peft`; reading a folder needs only json and safetensors.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from threed.checkpoint.format import LATEST, RUN_JSON, Checkpoint, check_model, open_checkpoint
from threed.checkpoint.lora_base import open_base, recorded_base
from threed.checkpoint.manifest import read_manifest
from threed.config import LORA_TARGETS, ConfigError, LoraConfig, ModelConfig
from threed.convert.io_utils import ConvertError, atomic_output_dir, refuse_existing
from threed.convert.slices import DictReader, Piece, ShardSpec, materialize, rank_slices
from threed.hf.names import hf_names, hf_shapes
from threed.model.spec import PipelineLayer, parameter, pipeline_layers, tp_segments

# threed's target -> HF PEFT's target module (the base weight's module name in HF's Llama).
PEFT_MODULES = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
assert tuple(PEFT_MODULES) == LORA_TARGETS
PEFT_PREFIX = "base_model.model."  # what PeftModel's state dict puts before the base model's names
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class TargetSlices:
    """One target's adapter on one TP rank of one block."""

    target: str
    module: str  # the base linear's module path in the block (self_attention.linear_qkv)
    row_parallel: bool
    a: ShardSpec  # this rank's A: its shape and the slices of PEFT's lora_A it is made of
    b: ShardSpec
    placement: tuple[tuple[int, int, int], ...]  # column bases: (B row, length, row of the base's output shard)

    def key(self, which: str) -> str:
        """The adapter parameter's name in the block's state dict (threed.model.lora)."""
        return f"{self.module}.lora.{which}.{self.target}"


def peft_name(hf_weight: str, which: str) -> str:
    """PEFT's name of the lora_A / lora_B weight on an HF base weight (`model.layers.3.self_attn.q_proj.weight`)."""
    return PEFT_PREFIX + hf_weight[: -len(".weight")] + f".{which}.weight"


def _base_of(layer: PipelineLayer, target: str) -> tuple[str, str]:
    """(our base parameter, its HF tensor) of `target` in a block."""
    suffix = f".{PEFT_MODULES[target]}.weight"
    for ours, names in hf_names(layer).items():
        for name in names:
            if name.endswith(suffix):
                return ours, name
    raise KeyError(f"no base weight for LoRA target {target!r}")


def target_slices(cfg: ModelConfig, layer: PipelineLayer, lora: LoraConfig, tp: int, rank: int) -> list[TargetSlices]:
    """What TP rank `rank` holds of each chosen target's adapter in block `layer`, targets in LORA_TARGETS order."""
    base_specs = {s.name: s for s in rank_slices(cfg, layer, tp, rank)}
    shapes, r = hf_shapes(cfg, layer), lora.lora_rank
    out = []
    for target in (t for t in LORA_TARGETS if t in lora.lora_targets):
        ours, hf = _base_of(layer, target)
        a_name, b_name = peft_name(hf, "lora_A"), peft_name(hf, "lora_B")
        rows, columns = shapes[hf]
        pieces = [p for p in base_specs[ours].pieces if p.hf_name == hf]
        row_parallel = parameter("block", ours).split == "row"
        if row_parallel:  # the base shard is one block of input columns
            (piece,) = pieces
            a = ShardSpec(a_name, (r, piece.length), (Piece(a_name, 1, piece.start, piece.length),), a_name)
            (seg,) = tp_segments("column", rows, tp, rank)
            b = ShardSpec(b_name, (seg.length, r), (Piece(b_name, 0, seg.start, seg.length),), b_name)
            placement: tuple[tuple[int, int, int], ...] = ()
        else:  # the base shard's rows of this HF tensor, wherever the fused output puts them
            (seg,) = tp_segments("column", r, tp, rank)
            a = ShardSpec(a_name, (seg.length, columns), (Piece(a_name, 0, seg.start, seg.length),), a_name)
            b_pieces, places, row = [], [], 0
            for p in pieces:
                b_pieces.append(Piece(b_name, 0, p.start, p.length, dst=row))
                places.append((row, p.length, p.dst))
                row += p.length
            b = ShardSpec(b_name, (row, r), tuple(b_pieces), b_name)
            placement = tuple(places)
        out.append(TargetSlices(target, ours.rsplit(".", 1)[0], row_parallel, a, b, placement))
    return out


def split_dims(cfg: ModelConfig, lora: LoraConfig) -> list[tuple[str, int]]:
    """(adapter parameter's name in a block, the dim TP splits it on) for every chosen target: what a LoRA run's
    universal checkpoint patterns say (threed.model.spec.adapter_universal_patterns). A row-parallel base's A is
    split on its input columns; every other adapter tensor on dim 0 (A's rank rows, B's output rows). Each rank's
    shard is an even range of the unsharded tensor in rank order, also a column base's B (a rank's base shard holds
    whole KV groups, or its gate / up halves' rows in order): DeepSpeed concatenates and re-splits them as such."""
    block = next(ly for ly in pipeline_layers(cfg) if ly.kind == "block")
    return [
        (t.key(which), 1 if t.row_parallel and which == "A" else 0)
        for t in target_slices(cfg, block, lora, 1, 0)
        for which in ("A", "B")
    ]


def full_shapes(cfg: ModelConfig, layer: PipelineLayer, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """PEFT tensor name -> its (unsharded) shape, for the chosen targets of one block."""
    shapes, out = hf_shapes(cfg, layer), {}
    for target in (t for t in LORA_TARGETS if t in lora.lora_targets):
        _, hf = _base_of(layer, target)
        rows, columns = shapes[hf]
        out[peft_name(hf, "lora_A")] = (lora.lora_rank, columns)
        out[peft_name(hf, "lora_B")] = (rows, lora.lora_rank)
    return out


def fresh_adapters(cfg: ModelConfig, layer: PipelineLayer, lora: LoraConfig, seed: int) -> dict[str, torch.Tensor]:
    """PEFT's default init of one block's adapters, unsharded: A kaiming-uniform (a = sqrt 5, i.e. U(+-1/sqrt(in))),
    B zero, so training starts at the base. Drawn from a generator of (seed, block) alone, so every layout draws
    the same numbers and no other random stream moves."""
    gen = torch.Generator().manual_seed(seed * 1000003 + layer.block)
    out = {}
    for name, shape in full_shapes(cfg, layer, lora).items():
        if name.endswith("lora_A.weight"):
            bound = 1.0 / math.sqrt(shape[1])
            out[name] = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1).mul_(bound).float()
        else:
            out[name] = torch.zeros(shape)
    return out


def shard(adapters: dict[str, torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """This rank's piece of a PEFT tensor."""
    return materialize(spec, DictReader(adapters))


def gather_adapters(
    cfg: ModelConfig, layer: PipelineLayer, lora: LoraConfig, shards: list[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """The PEFT tensors of one block from its TP ranks' state dicts (`shards[rank]`, adapter keys as
    `TargetSlices.key`): the inverse of `shard`."""
    tp = len(shards)
    out = {name: torch.zeros(shape) for name, shape in full_shapes(cfg, layer, lora).items()}
    for rank, state in enumerate(shards):
        for t in target_slices(cfg, layer, lora, tp, rank):
            for spec, which in ((t.a, "A"), (t.b, "B")):
                local = state[t.key(which)].detach().float().cpu()
                for p in spec.pieces:
                    src = local.narrow(p.dim, 0, p.length) if p.dim == 1 else local.narrow(0, p.dst, p.length)
                    out[p.hf_name].narrow(p.dim, p.start, p.length).copy_(src)
    return out


def refuse_unsupported(config: dict, folder: Path, flag: str) -> None:
    """PEFT options threed's adapters do not implement, refused in one line: run as plain LoRA they would give other
    outputs without a word (rsLoRA scales by alpha/sqrt(r), DoRA rescales the weight, per-module ranks or alphas,
    modules saved whole, trained biases)."""
    options = ("use_rslora", "use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "lora_bias")
    unsupported = [k for k in options if config.get(k)]
    unsupported += [f"bias={config['bias']}"] if config.get("bias", "none") != "none" else []
    if unsupported:
        raise ConfigError(
            f"{flag} {folder}: {', '.join(unsupported)} in its {CONFIG_FILE} is not supported by threed's LoRA "
            f"(plain LoRA: y = W x + alpha/r B A x); merge it with PEFT and convert the merged model instead"
        )


def read_peft(
    folder: str | Path, model: ModelConfig, lora: LoraConfig, flag: str = "--lora-init-from"
) -> dict[str, torch.Tensor]:
    """An HF PEFT LoRA folder's tensors, checked against the run: rank, alpha and targets as --lora-* say, every
    tensor present with the shape this base needs (one ConfigError line otherwise, naming the folder as `flag`)."""
    folder = Path(folder)
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise ConfigError(f"{flag} {folder}: needs {CONFIG_FILE} and {WEIGHTS_FILE} (an HF PEFT LoRA folder)")
    config = json.loads((folder / CONFIG_FILE).read_text())
    refuse_unsupported(config, folder, flag)
    theirs = sorted(t for t, m in PEFT_MODULES.items() if m in (config.get("target_modules") or []))
    checks = (
        ("peft_type", config.get("peft_type"), "LORA"),
        ("r (--lora-rank)", config.get("r"), lora.lora_rank),
        ("lora_alpha (--lora-alpha)", float(config.get("lora_alpha", 0)), float(lora.lora_alpha)),
        ("target_modules (--lora-targets)", theirs, sorted(lora.lora_targets)),
    )
    for what, got, want in checks:
        if got != want:
            raise ConfigError(f"{flag} {folder}: its {what} is {got}, this run's is {want}; make them agree")
    tensors = load_file(str(folder / WEIGHTS_FILE))
    for layer in (ly for ly in pipeline_layers(model) if ly.kind == "block"):
        for name, shape in full_shapes(model, layer, lora).items():
            got = tuple(tensors[name].shape) if name in tensors else None
            if got != shape:
                raise ConfigError(
                    f"{flag} {folder}: {name} is {got or 'missing'}, this base needs {shape}: the adapter "
                    f"was made for another base model"
                )
    return {k: v.float() for k, v in tensors.items()}


def write_peft(
    folder: str | Path, tensors: dict[str, torch.Tensor], lora: LoraConfig, base: Optional[str] = None
) -> None:
    """An HF PEFT folder `peft.PeftModel.from_pretrained(base_model, folder)` loads."""
    import peft  # heavy optional dependency (the `lora` extra): only `threed export --lora` needs it

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = peft.LoraConfig(
        r=lora.lora_rank,
        lora_alpha=lora.lora_alpha,
        lora_dropout=lora.lora_dropout,
        target_modules=[PEFT_MODULES[t] for t in LORA_TARGETS if t in lora.lora_targets],
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base,
    )
    config.save_pretrained(str(folder))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE))


def refuse_adapters(ck: Checkpoint, command: str) -> None:
    """A LoRA run's checkpoint given to a command that reads only the base weights: refused in one line, so that its
    adapters are never silently dropped."""
    if (ck.run.get("lora") or {}).get("lora_rank"):
        raise ConvertError(
            f"{ck.path} is a LoRA run's checkpoint: `threed {command}` reads only the base weights and would drop its "
            f"adapters; export them with `threed export --lora`, or merged into the weights with `--merge`"
        )


def checkpoint_lora(ck: Checkpoint, flag: str) -> LoraConfig:
    """The LoRA settings of the run that wrote `ck` (its threed_run.json), or one line: it trained no adapters."""
    section = dict(ck.run.get("lora") or {})
    if not section.get("lora_rank"):
        raise ConvertError(
            f"{ck.path}: its run trained no LoRA adapters (no lora_rank in its {RUN_JSON}); {flag} needs a LoRA "
            f"run's checkpoint"
        )
    return LoraConfig(**{**section, "lora_targets": tuple(section["lora_targets"])})


def checkpoint_adapters(ck: Checkpoint, lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Every block's adapters of a LoRA run's checkpoint, as PEFT tensors."""
    tensors: dict[str, torch.Tensor] = {}
    for layer in (ly for ly in ck.layers if ly.kind == "block"):
        tensors.update(gather_adapters(ck.model, layer, lora, ck.load_layer(layer)))
    return tensors


def peft_settings(folder: str | Path) -> LoraConfig:
    """The LoRA settings an HF PEFT folder's adapter_config.json holds (rank, alpha, targets), for running it as it
    is (`threed generate / eval-harness --lora`); one line for a folder threed cannot run."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    unknown = sorted(set(modules) - set(PEFT_MODULES.values()))
    if config.get("peft_type") != "LORA" or not config.get("r"):
        raise ConfigError(f"--lora {folder}: not a LoRA adapter (peft_type {config.get('peft_type')})")
    if unknown or not modules:
        raise ConfigError(
            f"--lora {folder}: target modules {' '.join(unknown) or '(none)'}; threed runs LoRA adapters on "
            f"{' '.join(PEFT_MODULES.values())}"
        )
    refuse_unsupported(config, folder, "--lora")
    targets = tuple(t for t, m in PEFT_MODULES.items() if m in modules)
    return LoraConfig(lora_rank=int(config["r"]), lora_alpha=float(config.get("lora_alpha", 8)), lora_targets=targets)


def read_adapters(
    source: str | Path, model: ModelConfig, lora: LoraConfig, flag: str = "--lora-init-from"
) -> dict[str, torch.Tensor]:
    """The unsharded adapters to start from: an HF PEFT folder's (`read_peft`), or a threed LoRA run's checkpoint's
    (`threed generate / eval-harness --lora CKPT`), checked against the model and the LoRA settings."""
    if not (Path(source) / LATEST).is_file():
        return read_peft(source, model, lora, flag)
    ck = open_checkpoint(source)
    check_model(source, ck.model, model)
    theirs = checkpoint_lora(ck, "--lora")
    settings = (lora.lora_rank, lora.lora_alpha, sorted(lora.lora_targets))
    if (theirs.lora_rank, theirs.lora_alpha, sorted(theirs.lora_targets)) != settings:
        raise ConfigError(
            f"{source}: its adapters are rank {theirs.lora_rank}, alpha {theirs.lora_alpha} on "
            f"{' '.join(theirs.lora_targets)}; this run's are {settings}: make them agree"
        )
    return checkpoint_adapters(ck, theirs)


def merge_deltas(ck: Checkpoint) -> Callable[[PipelineLayer], dict[str, torch.Tensor]]:
    """`threed export --merge`: for one layer, what each adapted HF base weight gains when its adapter is merged
    in, alpha/r * B @ A in fp32 (PEFT's merge_and_unload). q/k/v and gate/up are separate HF tensors, so each gets
    its own adapter's product; the export reads the fused base through the converter's slices as always."""
    lora = checkpoint_lora(ck, "--merge")
    scale = lora.lora_alpha / lora.lora_rank

    def deltas(layer: PipelineLayer) -> dict[str, torch.Tensor]:
        if layer.kind != "block":
            return {}
        adapters = gather_adapters(ck.model, layer, lora, ck.load_layer(layer))
        out = {}
        for target in (t for t in LORA_TARGETS if t in lora.lora_targets):
            _, hf = _base_of(layer, target)
            out[hf] = (adapters[peft_name(hf, "lora_B")] @ adapters[peft_name(hf, "lora_A")]) * scale
        return out

    return deltas


def merge_base(ck: Checkpoint) -> Checkpoint:
    """The base `threed export --merge` merges `ck`'s adapters into: an adapter-only checkpoint's is the base its
    manifest names (fingerprint checked: one line when it is missing or changed), a whole one holds its own."""
    if not ck.adapters_only:
        return ck
    recorded = recorded_base(read_manifest(ck.step_dir))
    if recorded is None:
        raise ConvertError(f"{ck.step_dir} holds only LoRA adapters but names no base: nothing to merge them into")
    fix = f"put it back at {recorded['path']} to merge the adapters into it, or export them alone with --lora"
    return open_base(recorded, str(ck.step_dir), fix)


def export_lora(ckpt: str | os.PathLike, out: str | os.PathLike, force: bool = False) -> dict[str, Any]:
    """`threed export --lora`: a LoRA run's checkpoint -> an HF PEFT folder of its adapters (the base is not
    written: it is the base the run started from, which its threed_run.json names)."""
    refuse_existing(out, force)
    ck = open_checkpoint(ckpt)
    lora = checkpoint_lora(ck, "--lora")
    tensors = checkpoint_adapters(ck, lora)
    base = (ck.run.get("checkpoint") or {}).get("init_from")
    with atomic_output_dir(out, force) as tmp:
        write_peft(tmp, tensors, lora, base=base)
    return {"out": str(out), "tensors": len(tensors), "rank": lora.lora_rank, "base": base}
