"""Typed, validated configuration for a 3D-parallel Llama run.

One `RunConfig` holds everything; `RunConfig.validate(world_size)` checks the parallel and batch arithmetic with
messages that name the numbers and the fix; `deepspeed_config()` derives the DeepSpeed JSON (nothing else in the
repo writes it).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from threed.errors import ConfigError  # noqa: F401  (re-exported: the config's own error)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    rope_scaling: Optional[RopeScaling] = None
    # The embedding and LM head are padded to a multiple of this times TP so every TP rank holds an equal slice
    # (Megatron's --make-vocab-size-divisible-by). The LM head masks padded logits to -inf, so the loss and its
    # gradients are exactly those of the unpadded (HF) model.
    make_vocab_size_divisible_by: int = 128
    init_std: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_params(self) -> int:
        """Parameter count of the unpadded model (untied embeddings, no biases)."""
        h, f, v, d = self.hidden_size, self.ffn_hidden_size, self.vocab_size, self.head_dim
        attn = h * (self.num_heads * d) + 2 * h * (self.num_kv_heads * d) + (self.num_heads * d) * h
        block = attn + 3 * h * f + 2 * h
        return self.num_layers * block + 2 * v * h + h

    def validate(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}; "
                f"pick a hidden size that is a multiple of the head count"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads} (GQA groups "
                f"must be equal); use a kv head count that divides {self.num_heads}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism. dp is derived from the world size: dp = world / (tp * pp)."""

    tp: int = 1
    pp: int = 1

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp)

    def validate(self, model: ModelConfig, world_size: int) -> None:
        tp, pp = self.tp, self.pp
        if tp < 1 or pp < 1:
            raise ConfigError(f"tp={tp} and pp={pp} must both be >= 1")
        if world_size % (tp * pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
                f"world = tp x pp x dp, so launch a multiple of {tp * pp} ranks or change tp/pp"
            )
        for what, n in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads)):
            if n % tp:
                raise ConfigError(
                    f"tp={tp} does not divide {what}={n}; every TP rank must hold whole heads. "
                    f"Use a tp that divides {n}"
                )
        padded = model.padded_vocab_size(tp)
        if padded % tp:
            raise ConfigError(f"tp={tp} does not divide the padded vocab {padded}; fix make_vocab_size_divisible_by")
        if pp > model.num_layers:
            raise ConfigError(
                f"pp={pp} is larger than num_layers={model.num_layers}: a pipeline stage would hold no "
                f"transformer block. Use pp <= {model.num_layers}"
            )


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 1
    grad_accum_steps: Optional[int] = None  # derived from global_batch_size when None
    global_batch_size: Optional[int] = None  # derived as micro * gas * dp when None
    seq_length: int = 128
    steps: int = 10
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    dtype: Literal["bf16", "fp32"] = "bf16"
    grad_accum_dtype: Literal["fp32"] = "fp32"  # bf16 accumulation drifts under PP x GAS (DeepSpeed #1800)
    seed: int = 1234
    log_interval: int = 1
    activation_checkpointing: bool = False
    # Which stage holds which layers (threed.partition): balanced | layers:N1,N2,... | parameters | uniform | type:REGEX
    partition_method: str = "balanced"
    zero_stage: int = 1
    # Evaluation on the valid split (Megatron's flags). eval_interval None: every 1000 steps (Megatron's default)
    # when there is a valid split, else never; given explicitly without a valid split it is an error.
    eval_interval: Optional[int] = None
    eval_iters: int = 100

    def resolve_batch(self, dp: int) -> tuple[int, int, int]:
        """(micro, gas, global) with global = micro * gas * dp, checked, where dp is the data-parallel size."""
        micro, gas, glob = self.micro_batch_size, self.grad_accum_steps, self.global_batch_size
        if micro < 1:
            raise ConfigError(f"micro_batch_size must be >= 1, got {micro}")
        if gas is None and glob is None:
            gas = 1
        if gas is None:
            assert glob is not None
            if glob % (micro * dp):
                raise ConfigError(
                    f"global_batch_size {glob} is not divisible by micro_batch_size x dp = {micro} x {dp} = "
                    f"{micro * dp}; use a global batch that is a multiple of {micro * dp}"
                )
            gas = glob // (micro * dp)
        expected = micro * gas * dp
        if glob is not None and glob != expected:
            raise ConfigError(
                f"train_batch_size must equal micro x gas x dp = {micro} x {gas} x {dp} = {expected}, got "
                f"global_batch_size {glob}. dp is world / (tp x pp), not the world size; drop one of "
                f"grad_accum_steps / global_batch_size or make them agree"
            )
        if gas < 1:
            raise ConfigError(f"grad_accum_steps must be >= 1, got {gas}")
        return micro, gas, expected

    def validate(self, model: ModelConfig) -> None:
        if self.seq_length > model.max_position_embeddings:
            raise ConfigError(
                f"seq_length {self.seq_length} exceeds max_position_embeddings "
                f"{model.max_position_embeddings} of {model.name}; use seq_length <= "
                f"{model.max_position_embeddings}"
            )
        if self.dtype not in ("bf16", "fp32"):
            raise ConfigError(f"dtype must be 'bf16' or 'fp32', got {self.dtype!r}")
        if self.grad_accum_dtype != "fp32":
            raise ConfigError(
                f"grad_accum_dtype must be 'fp32' (got {self.grad_accum_dtype!r}): bf16 gradient accumulation "
                f"across micro-batches and pipeline stages loses precision and diverges"
            )
        if self.zero_stage not in (0, 1):
            raise ConfigError(
                f"zero_stage {self.zero_stage} is not allowed: DeepSpeed pipelines support ZeRO 0 or 1 only"
            )


def _help(text: str, **extra: Any) -> dict[str, Any]:
    """Field metadata: the one-line `threed train --help` text (and `flag`, `nargs`, `metavar` where needed)."""
    return {"help": text, **extra}


@dataclass(frozen=True)
class DataConfig:
    """Megatron-LM's data flags, verbatim (a Megatron command line's data fragment works unchanged); read with
    megatron-core's own datasets (`threed.data.datasets`)."""

    data_path: Optional[tuple[str, ...]] = field(default=None, metadata=_help(
        "PREFIX, or a blend WEIGHT PREFIX WEIGHT PREFIX ... of .bin/.idx datasets split by --split",
        nargs="+", metavar="[WEIGHT] PREFIX"))
    split: str = field(default="969,30,1", metadata=_help(
        "train,valid,test proportions of each --data-path dataset's documents", metavar="T,V,T"))
    train_data_path: Optional[tuple[str, ...]] = field(default=None, metadata=_help(
        "train blend (instead of --data-path + --split)", nargs="+", metavar="[WEIGHT] PREFIX"))
    valid_data_path: Optional[tuple[str, ...]] = field(default=None, metadata=_help(
        "validation blend (instead of --data-path + --split)", nargs="+", metavar="[WEIGHT] PREFIX"))
    test_data_path: Optional[tuple[str, ...]] = field(default=None, metadata=_help(
        "test blend (instead of --data-path + --split)", nargs="+", metavar="[WEIGHT] PREFIX"))
    data_cache_path: Optional[str] = field(default=None, metadata=_help(
        "where dataset index caches go (shared by all nodes); default: a cache/ folder beside the data",
        metavar="DIR"))
    eod_mask_loss: bool = field(default=False, metadata=_help("no loss on end-of-document tokens"))
    tokenizer: Optional[str] = field(default=None, metadata=_help(
        "the data's tokenizer (sentencepiece .model, HF dir or tokenizer.json): its EOD id, recorded for export",
        metavar="PATH"))
    # SFT data (`threed preprocess --sft`: PREFIX_text_document + PREFIX_mask_document) is recognised by its mask
    # dataset and trained with the response-only loss; --pack is how its examples fill the sequences.
    pack: bool = field(default=False, metadata=_help(
        "SFT data: fill each sequence with whole examples (attention never crosses an example, RoPE restarts at "
        "each); without it, one example per sequence, padded"))


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    save_interval: int = 0  # 0: only at the end
    load: Optional[str] = None  # full resume (weights, optimizer, scheduler, step); must exist
    init_from: Optional[str] = None  # weights only, e.g. a converted HF checkpoint; must exist
    auto_resume: bool = True  # resume from `save` when it already holds a checkpoint (preemption / requeue)
    # Training from scratch into a `save` that holds a run is refused unless asked for in so many words.
    overwrite: bool = field(default=False, metadata=_help(
        "delete the checkpoints in --save and start over (otherwise a run there is resumed, never overwritten)"))
    keep_last: int = field(default=0, metadata=_help("keep the newest N complete checkpoints in --save; 0: all"))
    # Run control (threed.guard): what stops a run, and how loudly.
    skip_nonfinite: int = field(default=0, metadata=_help(
        "batches with a non-finite loss / grad norm to skip (step not applied) before the run stops with exit 3"))
    exit_duration_in_mins: float = field(default=0.0, metadata=_help(
        "save and exit 0 before this much wall time has passed (slurm/ passes the job's limit); 0: no limit"))
    dist_timeout_minutes: float = field(default=30.0, metadata=_help(
        "a collective waiting longer than this for its peers fails instead of hanging"))
    watchdog_factor: float = field(default=20.0, metadata=_help(
        "a step longer than this x the median step (and --watchdog-min-seconds) prints every rank's Python "
        "stacks and exits 4; 0: off"))
    watchdog_min_seconds: float = field(default=600.0, metadata=_help("the watchdog never fires sooner than this"))


@dataclass(frozen=True)
class MetricsConfig:
    """Where a run's metrics go (see `threed.metrics.writer`): stdout always; metrics.jsonl and run_config.json in
    the run directory (--save, else the parent of --tensorboard-dir); TensorBoard; W&B when asked for."""

    tensorboard_dir: Optional[str] = None  # default: <save>/tensorboard when --save is given
    tensorboard: bool = True  # false: no TensorBoard events (metrics.jsonl and stdout stay)
    wandb_project: Optional[str] = None  # Weights & Biases project; needs `pip install wandb` (optional)
    wandb_name: Optional[str] = None  # W&B run name (Megatron's --wandb-exp-name)
    wandb_mode: Optional[str] = None  # online | offline (no network; `wandb sync` later) | disabled; None: wandb's own
    stage_timing: bool = True  # time pipeline instructions per stage (compute / p2p wait / idle fraction)


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self, world_size: int) -> None:
        from threed.ranges import check_ranges  # every numeric field's range, before the arithmetic below

        check_ranges(self)
        self.model.validate()
        self.parallel.validate(self.model, world_size)
        self.train.validate(self.model)
        self.train.resolve_batch(self.parallel.dp(world_size))
        if self.checkpoint.load and self.checkpoint.init_from:
            raise ConfigError("give either load (full resume) or init_from (weights only), not both")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RunConfig":
        m = dict(d["model"])
        if m.get("rope_scaling"):
            m["rope_scaling"] = RopeScaling(**m["rope_scaling"])
        return RunConfig(
            model=ModelConfig(**m),
            parallel=ParallelConfig(**d.get("parallel", {})),
            train=TrainConfig(**d.get("train", {})),
            data=DataConfig(**d.get("data", {})),
            checkpoint=CheckpointConfig(**d.get("checkpoint", {})),
            metrics=MetricsConfig(**d.get("metrics", {})),
        )


def deepspeed_config(cfg: RunConfig, world_size: int, load_universal: bool = False) -> dict[str, Any]:
    """The one place that writes DeepSpeed's config. The optimizer and LR schedule are client objects
    (see `threed.optim`), so they are not in here."""
    micro, gas, glob = cfg.train.resolve_batch(cfg.parallel.dp(world_size))
    ds: dict[str, Any] = {
        "train_batch_size": glob,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": cfg.train.grad_clip,
        "zero_optimization": {"stage": cfg.train.zero_stage},
        # A torch AdamW under ZeRO-1 is exact (elementwise on flat partitions) and matches a plain torch run.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # we log ourselves, with tokens/s and MFU
        "wall_clock_breakdown": False,
    }
    if cfg.train.dtype == "bf16":
        ds["bf16"] = {
            "enabled": True,
            # Each micro-batch's bf16 gradient is added into the fp32 accumulator by a hook as soon as it is
            # produced and the bf16 .grad is freed (DeepSpeed 0.19's default, stated so it cannot change under
            # us): 2 B/param less at the peak, and the same sums in the same order as the deferred copy.
            "immediate_grad_update": True,
        }
        # fp32 gradient accumulation selects DeepSpeed's BF16_Optimizer (fp32 master weights and grads).
        ds["data_types"] = {"grad_accum_dtype": cfg.train.grad_accum_dtype}
    # The data-parallel all-reduce runs on the fp32 accumulated gradients. DeepSpeed's default is the compute
    # dtype (bf16 when bf16 is on), which rounds the fp32 sums to bf16 before reducing and allocates a 2 B/param
    # temporary every step; fp32 keeps dp2 x gas1 equal to dp1 x gas2 (tests/test_training.py).
    ds["communication_data_type"] = "fp32"
    if cfg.data.pack:
        # Packed rows send (hidden, doc_ids) between stages: DeepSpeed's reentrant activation checkpointing needs
        # every input of a checkpointed block to require grad, which the integer ids cannot (the first stage fails
        # with "element 0 of tensors does not require grad"); the non-reentrant variant takes them as they are.
        ds["pipeline"] = {"use_reentrant": False}
    if load_universal:  # resuming at another layout: threed.checkpoint.universal
        ds["checkpoint"] = {"load_universal": True}
    return ds
