"""Typed, validated configuration for a 3D-parallel Llama run: the one place a setting is said.

One `RunConfig` holds everything, in sections (model, parallel, train, data, checkpoint, control, metrics). Each
field carries its own metadata (`meta(...)`): the one-line `threed train --help` text, Megatron-LM's name for the
flag where it differs (accepted as an alias), and its range. `RunConfig.validate(world_size)` checks every range,
then the parallel and batch arithmetic, with messages that name the numbers and the fix. The command line is
generated from these fields (`threed.cli.flags`); the DeepSpeed JSON is derived in `threed.engine.build`.

Ranges: every int / float field must be finite and >= `at_least` (0 unless the field says otherwise), and,
where the field says so, > `above` or < `below`. A range is stated on its field, never by name elsewhere.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from threed.errors import ConfigError  # noqa: F401  (re-exported: the config's own error)


@dataclass(frozen=True)
class Meta:
    """What a field says about itself besides its type and default."""

    help: str = ""  # the one line of `threed train --help`
    alias: Optional[str | tuple[str, ...]] = None  # Megatron-LM's flag(s), where they differ from ours
    metavar: Optional[str] = None  # argparse metavar (default: from the type)
    nargs: Optional[str] = None  # "+" for the Megatron blends (WEIGHT PREFIX ...)
    at_least: float = 0  # numeric fields: value >= at_least
    above: Optional[float] = None  # value > above
    below: Optional[float] = None  # value < below

    @property
    def aliases(self) -> tuple[str, ...]:
        """Every other name of the flag, in the order given."""
        return (self.alias,) if isinstance(self.alias, str) else tuple(self.alias or ())


def meta(help: str = "", **kw: Any) -> dict[str, Meta]:
    """Field metadata: `field(default=1, metadata=meta("help", at_least=1, alias="--megatron-name"))`."""
    return {"threed": Meta(help=help, **kw)}


def field_meta(f: dataclasses.Field) -> Meta:
    return f.metadata.get("threed", Meta())


def flag_name(f: dataclasses.Field) -> str:
    """The command-line flag of a field: `--micro-batch-size` for micro_batch_size."""
    return "--" + f.name.replace("_", "-")


AT_LEAST_ONE = meta(at_least=1)
POSITIVE = meta(above=0)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (HF `rope_type: llama3`)."""

    factor: float = field(default=8.0, metadata=POSITIVE)
    low_freq_factor: float = field(default=1.0, metadata=POSITIVE)
    high_freq_factor: float = field(default=4.0, metadata=POSITIVE)
    original_max_position_embeddings: int = field(default=8192, metadata=AT_LEAST_ONE)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int = field(metadata=AT_LEAST_ONE)
    hidden_size: int = field(metadata=AT_LEAST_ONE)
    num_layers: int = field(metadata=AT_LEAST_ONE)
    num_heads: int = field(metadata=AT_LEAST_ONE)
    num_kv_heads: int = field(metadata=AT_LEAST_ONE)
    ffn_hidden_size: int = field(metadata=AT_LEAST_ONE)
    max_position_embeddings: int = field(metadata=AT_LEAST_ONE)
    rope_theta: float = field(default=10000.0, metadata=POSITIVE)
    rms_norm_eps: float = field(default=1e-5, metadata=POSITIVE)
    rope_scaling: Optional[RopeScaling] = None
    # The embedding and LM head are padded to a multiple of this times TP so every TP rank holds an equal slice
    # (Megatron's --make-vocab-size-divisible-by). The LM head masks padded logits to -inf, so the loss and its
    # gradients are exactly those of the unpadded (HF) model.
    make_vocab_size_divisible_by: int = field(default=128, metadata=AT_LEAST_ONE)
    init_std: float = field(default=0.02, metadata=POSITIVE)
    # The LM head's weight is the input embedding's (Llama 3.2 1B / 3B; HF `tie_word_embeddings`): one parameter,
    # held by the first and the last pipeline stage, its gradient summed over both (threed.parallel.pipeline).
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def padded_vocab_size(self, tp: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

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


def check_sequence_parallel(tp: Optional[int], sequence_parallel: Optional[bool]) -> None:
    """Megatron's sequence parallelism splits the sequence over the tensor-parallel ranks: at tp 1 it has nothing to
    split (the rule of train, check-config, memory and plan, in one wording)."""
    if sequence_parallel and tp == 1:
        raise ConfigError(
            "--sequence-parallel needs tp > 1 (it splits the sequence over the tensor-parallel "
            "group); drop it or raise --tp"
        )


def check_lm_head_chunks(
    chunks: int, seq: int, tp: int = 1, cp: int = 1, sequence_parallel: bool = False, schedule: str = "1f1b"
) -> None:
    """`--lm-head-chunks N` cuts the tokens each rank's LM head takes from one sequence (seq / cp, and / tp under
    sequence parallelism, whose head gathers the TP ranks' parts chunk by chunk) into N equal chunks; ZB-H1 would keep
    every chunk's logits gradient for its deferred W pass, the whole logits again (training's, check-config's and
    `threed memory`'s rule, in one wording)."""
    if chunks < 1:
        raise ConfigError(f"--lm-head-chunks must be >= 1 (1: off), got {chunks}")
    if chunks == 1:
        return
    if schedule != "1f1b":
        raise ConfigError(
            f"--lm-head-chunks {chunks} with --pipeline-schedule {schedule}: ZB-H1 defers the LM head's weight "
            f"gradient and keeps every chunk's logits gradient for it, the whole logits; use 1f1b or drop "
            f"--lm-head-chunks"
        )
    sp = sequence_parallel and tp > 1
    rows = seq // (cp * (tp if sp else 1))
    if rows % chunks:
        split = (
            f"seq_length {seq}"
            + (f" over cp {cp}" if cp > 1 else "")
            + (f" and tp {tp} (--sequence-parallel)" if sp else "")
        )
        raise ConfigError(
            f"--lm-head-chunks {chunks} cuts the {rows} tokens each rank's LM head takes of a sequence ({split}) "
            f"into equal chunks: {chunks} does not divide {rows}; use a divisor of {rows}"
        )


def check_virtual_stages(pp: int, vpp: int, num_layers: int, schedule: str = "1f1b", gas: Optional[int] = None) -> None:
    """`--vpp V`: the rules of Megatron's interleaved 1F1B that a config can break (training's, check-config's,
    `threed memory`'s and the planner's, in one wording). Megatron spreads the blocks evenly over the pp x vpp
    virtual stages, and its interleaved schedule takes micro-batches in groups of pp (its
    microbatch_group_size_per_vp_stage, default pp): it refuses a last group of fewer than pp, so gas must be a
    multiple of pp. ZB-H1's deferred weight gradients are not built over chunks."""
    if vpp == 1:
        return
    if pp == 1:
        raise ConfigError(
            f"--vpp {vpp} needs pp > 1 (virtual stages interleave a pipeline; one stage has none); drop --vpp or "
            f"use --pipeline-model-parallel-size 2 or more"
        )
    if schedule != "1f1b":
        raise ConfigError(
            f"--vpp {vpp} with --pipeline-schedule {schedule} is not built (interleaving is 1F1B's); use "
            f"--pipeline-schedule 1f1b, or --vpp 1"
        )
    if num_layers % (pp * vpp):
        fits = [v for v in range(1, num_layers // pp + 1) if num_layers % (pp * v) == 0]
        raise ConfigError(
            f"--vpp {vpp} cuts the {num_layers} blocks into pp x vpp = {pp * vpp} virtual stages of equal blocks "
            f"(Megatron's rule): {pp * vpp} does not divide {num_layers}; at pp {pp} use --vpp "
            f"{' or '.join(str(v) for v in fits)}"
        )
    if gas is not None and gas % pp:
        raise ConfigError(
            f"--vpp {vpp}: interleaved 1F1B runs the micro-batches in groups of pp = {pp} (Megatron's "
            f"microbatch_group_size_per_vp_stage) and takes no smaller last group: {gas} micro-batches per step "
            f"is not a multiple of {pp}; use a multiple of {pp} micro-batches (--grad-accum-steps, or a "
            f"--global-batch-size of micro x dp x a multiple of {pp})"
        )


def check_torch_compile(mode: str, schedule: str = "1f1b") -> None:
    """`--torch-compile block` with ZB-H1 is refused because it is unchecked, not because it is known to fail: ZB-H1
    defers the linears' weight gradients from inside the block's backward (`threed.model.wgrad`), and the linears run
    eagerly between the compiled graphs (`threed.model.compiled`), so it may well work; no test has run it (training's
    and check-config's rule, in one wording)."""
    if mode == "block" and schedule != "1f1b":
        raise ConfigError(
            f"--torch-compile block with --pipeline-schedule {schedule} is not checked (ZB-H1 defers the weight "
            f"gradients from inside each block's backward); use --torch-compile rope-norm, or --pipeline-schedule 1f1b"
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Degrees of parallelism, and which stage holds which layers. dp is derived: dp = world / (tp * pp * cp)."""

    tp: int = field(
        default=1,
        metadata=meta(
            "tensor-parallel size (divides heads and KV heads)", at_least=1, alias="--tensor-model-parallel-size"
        ),
    )
    pp: int = field(
        default=1,
        metadata=meta("pipeline-parallel size (stages; <= layers)", at_least=1, alias="--pipeline-model-parallel-size"),
    )
    # Megatron-LM's --context-parallel-size: each sequence is split over cp ranks (2*cp chunks, load-balanced for the
    # causal mask); attention exchanges keys and values (threed.model.context). DP excludes CP: the data-parallel
    # degree is world / (tp * pp * cp), and the batch arithmetic counts only dp.
    cp: int = field(
        default=1,
        metadata=meta(
            "context-parallel size (splits each sequence over cp ranks)", at_least=1, alias="--context-parallel-size"
        ),
    )
    # threed.parallel.partition: balanced | layers:N1,N2,... | costs:KIND=X,... | parameters | uniform | type:REGEX
    partition_method: str = field(
        default="balanced",
        metadata=meta(
            "which stage holds which layers: balanced (evens out the LM head) | layers:N1,N2,... | "
            "costs:block=1,lm_head=X,... (measured: threed profile-layers) | parameters | uniform | type:REGEX",
            metavar="METHOD",
        ),
    )

    # Megatron-LM's --sequence-parallel (Korthikanti et al.): the norms and residual stream of each block are split
    # along the sequence over the TP group (megatron-core's own layers), so activations outside the matmuls shrink
    # by tp. threed.model.layers and threed.parallel.pipeline build it.
    sequence_parallel: bool = field(
        default=False,
        metadata=meta("split norms and residuals along the sequence over the TP group (Megatron's; needs tp > 1)"),
    )

    # threed.parallel.schedule: 1f1b (DeepSpeed's TrainSchedule) | zb-h1 (Zero Bubble's ZB-H1: weight gradients deferred
    # into the bubble). Checkpoints do not depend on it: a run can switch on resume.
    pipeline_schedule: Literal["1f1b", "zb-h1"] = field(
        default="1f1b",
        metadata=meta(
            "pipeline schedule: 1f1b (DeepSpeed's) | zb-h1 (weight gradients deferred into the bubble: less idle time; "
            "no stage holds more micro-batches than 1F1B's first stage)"
        ),
    )

    # Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, section 2.2): each rank holds vpp chunks of layers,
    # virtual stage c * pp + r on rank r (threed.parallel.schedule.interleaved_order, threed.parallel.dims). The bubble
    # falls by vpp, the sends between stages grow by vpp. As in Megatron it is no schedule name of its own: 1f1b
    # with vpp > 1 interleaves.
    vpp: int = field(
        default=1,
        metadata=meta(
            "virtual pipeline stages per rank: each rank holds vpp non-contiguous chunks of layers (interleaved "
            "1F1B: the bubble / vpp, vpp x the sends between stages); needs pp > 1, 1f1b, blocks divisible by pp x vpp "
            "and micro-batches by pp",
            at_least=1,
            # Megatron's older and newer names; the issue's --virtual-pipeline-stages
            alias=(
                "--virtual-pipeline-model-parallel-size",
                "--num-virtual-stages-per-pipeline-rank",
                "--virtual-pipeline-stages",
            ),
            metavar="V",
        ),
    )
    # Megatron-LM's other way to say it: blocks per virtual stage, vpp = num_layers / (pp x N); RunConfig sets vpp.
    num_layers_per_virtual_pipeline_stage: Optional[int] = field(
        default=None,
        metadata=meta("blocks per virtual pipeline stage: sets --vpp to blocks / (pp x N)", at_least=1, metavar="N"),
    )

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def validate(self, model: ModelConfig, world_size: int) -> None:
        tp, pp, cp = self.tp, self.pp, self.cp
        if tp < 1 or pp < 1 or cp < 1:
            raise ConfigError(f"tp={tp}, pp={pp} and cp={cp} must all be >= 1")
        if world_size % (tp * pp * cp):
            raise ConfigError(
                f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}; "
                f"world = tp x pp x cp x dp, so launch a multiple of {tp * pp * cp} ranks or change tp/pp/cp"
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
        if self.pipeline_schedule != "1f1b" and pp == 1:
            raise ConfigError(
                f"--pipeline-schedule {self.pipeline_schedule} needs pp > 1 (one stage has no pipeline "
                f"bubble to fill); drop it or use --pipeline-model-parallel-size 2 or more"
            )
        check_sequence_parallel(tp, self.sequence_parallel)
        if pp > model.num_layers:
            raise ConfigError(
                f"pp={pp} is larger than num_layers={model.num_layers}: a pipeline stage would hold no "
                f"transformer block. Use pp <= {model.num_layers}"
            )
        check_virtual_stages(pp, self.vpp, model.num_layers, self.pipeline_schedule)


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = field(
        default=1, metadata=meta("sequences per micro-batch per data-parallel rank", at_least=1)
    )
    grad_accum_steps: Optional[int] = field(
        default=None,
        metadata=meta(  # None: derived from global_batch_size
            "micro-batches per step (or give --global-batch-size)", at_least=1
        ),
    )
    global_batch_size: Optional[int] = field(
        default=None,
        metadata=meta(  # None: micro * gas * dp
            "sequences per step = micro x grad-accum x dp, dp = world / (tp x pp x cp)", at_least=1
        ),
    )
    seq_length: int = field(default=128, metadata=meta("tokens per sequence", at_least=1))
    steps: int = field(default=10, metadata=meta("optimizer steps to train to", alias="--train-iters"))
    lr: float = field(default=3e-4, metadata=meta("peak learning rate"))
    min_lr: float = field(default=3e-5, metadata=meta("learning rate at the end of the cosine decay"))
    warmup_steps: int = field(default=0, metadata=meta("linear warmup steps", alias="--lr-warmup-iters"))
    weight_decay: float = field(default=0.1, metadata=meta("AdamW weight decay (not on norms)"))
    beta1: float = field(default=0.9, metadata=meta("AdamW beta1", below=1, alias="--adam-beta1"))
    beta2: float = field(default=0.95, metadata=meta("AdamW beta2", below=1, alias="--adam-beta2"))
    adam_eps: float = field(default=1e-8, metadata=meta("AdamW epsilon", above=0))
    grad_clip: float = field(
        default=1.0, metadata=meta("clip the global gradient norm to this (0: off)", alias="--clip-grad")
    )
    dtype: Literal["bf16", "fp32"] = field(
        default="bf16", metadata=meta("compute dtype; bf16 keeps fp32 master weights and gradient accumulation")
    )
    # bf16 accumulation drifts under PP x GAS (DeepSpeed #1800)
    grad_accum_dtype: Literal["fp32"] = field(default="fp32", metadata=meta("gradient accumulation dtype (fp32 only)"))
    seed: int = field(default=1234, metadata=meta("seed of the weights' random init and the data order"))
    log_interval: int = field(default=1, metadata=meta("steps between log lines", at_least=1))
    activation_checkpointing: bool = field(
        default=False, metadata=meta("recompute each block in backward (less memory, ~1/3 more compute)")
    )
    # Megatron-LM's recompute flags. full: a block's input is kept and the block recomputed in backward, `uniform`
    # in chunks of N blocks (all blocks), `block`: only the first N blocks of each stage; selective: only the core
    # attention of every block. --activation-checkpointing is full / uniform / 1.
    recompute_granularity: Optional[Literal["full", "selective"]] = field(
        default=None,
        metadata=meta(
            "recompute in backward: full (whole blocks, with --recompute-method) | selective (core attention)"
        ),
    )
    recompute_method: Optional[Literal["uniform", "block"]] = field(
        default=None,
        metadata=meta("full recompute: uniform (every block, N per chunk) | block (the first N blocks of each stage)"),
    )
    recompute_num_layers: Optional[int] = field(
        default=None,
        metadata=meta("full recompute: blocks per chunk (uniform) or recomputed blocks per stage (block)", at_least=1),
    )
    # threed.model.layers.chunked_token_losses: the last stage runs its LM head and the cross-entropy on N chunks of
    # each sequence's tokens, one at a time, and recomputes each chunk's logits in backward, so the logits [s, b, V/tp]
    # and their fp32 softmax are never whole (1/N of them at a time). The loss only: generation and scoring get whole
    # logits (`whole_sequences`).
    lm_head_chunks: int = field(
        default=1,
        metadata=meta(
            "LM head + cross-entropy on N chunks of each sequence, recomputed in backward: 1/N of the logits in "
            "memory at a time (1: off, whole logits)",
            at_least=1,
        ),
    )
    # threed.model.compiled: torch.compile of the element-wise parts of every block (RMSNorm, RoPE's rotation) or of
    # whole blocks, applied to a stage's modules as they are built; "none" leaves torch's compiler unimported.
    torch_compile: Literal["none", "rope-norm", "block"] = field(
        default="none",
        metadata=meta(
            "torch.compile: none | rope-norm (the RMSNorms and RoPE's rotation) | block (each transformer block; "
            "not with zb-h1)"
        ),
    )
    zero_stage: int = field(
        default=1,
        metadata=meta(
            "ZeRO stage: 1 shards the optimizer state over data parallel (bf16 needs it); 0 shards nothing and is "
            "fp32 only; DeepSpeed pipelines allow no more"
        ),
    )
    # Evaluation on the valid split (Megatron's flags). eval_interval None: every 1000 steps (Megatron's default)
    # when there is a valid split, else never; given explicitly without a valid split it is an error.
    eval_interval: Optional[int] = field(
        default=None, metadata=meta("steps between validations (default 1000 with a valid split)")
    )
    eval_iters: int = field(default=100, metadata=meta("global batches per validation"))
    # What the model can do, during training, through the same engine (threed.train.samples): a few generations,
    # lm-evaluation-harness scores. 0: off. Neither touches the RNG, the data order or the pipeline's buffers.
    generate_interval: int = field(default=0, metadata=meta("steps between logged generations (0: none)"))
    generate_prompts: Optional[str] = field(
        default=None, metadata=meta('JSONL of {"prompt": ...} lines for --generate-interval', metavar="FILE")
    )
    generate_max_new_tokens: int = field(default=32, metadata=meta("new tokens per prompt (greedy)", at_least=1))
    harness_interval: int = field(default=0, metadata=meta("steps between lm-eval harness scores (0: none)"))
    harness_tasks: Optional[str] = field(
        default=None, metadata=meta("comma-separated lm-eval tasks for --harness-interval (needs threed[eval])")
    )
    harness_limit: Optional[int] = field(default=None, metadata=meta("documents per harness task", at_least=1))
    harness_include_path: Optional[str] = field(
        default=None, metadata=meta("folder of local lm-eval task YAML files", metavar="DIR")
    )

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
                f"global_batch_size {glob}. dp is world / (tp x pp x cp), not the world size; drop one of "
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
        self._validate_recompute()
        self._validate_samples()
        if self.zero_stage not in (0, 1):
            raise ConfigError(
                f"zero_stage {self.zero_stage} is not allowed: DeepSpeed pipelines support ZeRO 0 or 1 only"
            )
        if self.zero_stage == 0 and self.dtype == "bf16":
            # DeepSpeed keeps bf16 weights with fp32 master weights and fp32 gradient accumulation only in its ZeRO-1
            # BF16_Optimizer; at stage 0 it stops in the engine ("unsupported mix of model_dtype ...").
            raise ConfigError(
                "--zero-stage 0 with --dtype bf16 is not supported: DeepSpeed accumulates bf16 gradients in fp32 "
                "only under ZeRO 1; use --zero-stage 1 (the default), or --dtype fp32 with --zero-stage 0"
            )

    def _validate_samples(self) -> None:
        for interval, what, flag in (
            (self.generate_interval, self.generate_prompts, "--generate-prompts FILE.jsonl"),
            (self.harness_interval, self.harness_tasks, "--harness-tasks a,b"),
        ):
            name = "--generate-interval" if flag.startswith("--generate") else "--harness-interval"
            if interval < 0:
                raise ConfigError(f"{name} must be >= 0 (0: off), got {interval}")
            if interval > 0 and not what:
                raise ConfigError(f"{name} {interval} needs {flag}")
            if what and interval == 0:
                raise ConfigError(f"{flag.split()[0]} takes effect with {name} N (N >= 1); add it, or drop it")

    def _validate_recompute(self) -> None:
        granularity, method, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if self.activation_checkpointing and granularity is not None:
            raise ConfigError(
                "--activation-checkpointing is --recompute-granularity full --recompute-method uniform "
                "--recompute-num-layers 1; give one or the other, not both"
            )
        if granularity == "selective" and (method is not None or n is not None):
            raise ConfigError(
                "--recompute-granularity selective recomputes the core attention of every block; "
                "--recompute-method / --recompute-num-layers are for full recompute, drop them"
            )
        if granularity == "full" and (method is None or n is None):
            raise ConfigError(
                "--recompute-granularity full needs --recompute-method uniform|block and "
                "--recompute-num-layers N (Megatron-LM's flags); e.g. --recompute-method block "
                "--recompute-num-layers 4"
            )
        if granularity is None and (method is not None or n is not None):
            raise ConfigError(
                "--recompute-method / --recompute-num-layers take effect with --recompute-granularity "
                "full; add it, or drop them"
            )


@dataclass(frozen=True)
class DataConfig:
    """Megatron-LM's data flags, verbatim (a Megatron command line's data fragment works unchanged); read with
    megatron-core's own datasets (`threed.data.datasets`)."""

    data_path: Optional[tuple[str, ...]] = field(
        default=None,
        metadata=meta(
            "PREFIX, or a blend WEIGHT PREFIX WEIGHT PREFIX ... of .bin/.idx datasets split by --split",
            nargs="+",
            metavar="[WEIGHT] PREFIX",
        ),
    )
    split: str = field(
        default="969,30,1",
        metadata=meta("train,valid,test proportions of each --data-path dataset's documents", metavar="T,V,T"),
    )
    train_data_path: Optional[tuple[str, ...]] = field(
        default=None,
        metadata=meta("train blend (instead of --data-path + --split)", nargs="+", metavar="[WEIGHT] PREFIX"),
    )
    valid_data_path: Optional[tuple[str, ...]] = field(
        default=None,
        metadata=meta("validation blend (instead of --data-path + --split)", nargs="+", metavar="[WEIGHT] PREFIX"),
    )
    test_data_path: Optional[tuple[str, ...]] = field(
        default=None,
        metadata=meta("test blend (instead of --data-path + --split)", nargs="+", metavar="[WEIGHT] PREFIX"),
    )
    data_cache_path: Optional[str] = field(
        default=None,
        metadata=meta(
            "where dataset index caches go (shared by all nodes); default: a cache/ folder beside the data",
            metavar="DIR",
        ),
    )
    eod_mask_loss: bool = field(default=False, metadata=meta("no loss on end-of-document tokens"))
    tokenizer: Optional[str] = field(
        default=None,
        metadata=meta(
            "the data's tokenizer (sentencepiece .model, HF dir or tokenizer.json): its EOD id, recorded for export",
            metavar="PATH",
        ),
    )
    # SFT data (`threed preprocess --sft`: PREFIX_text_document + PREFIX_mask_document) is recognised by its mask
    # dataset and trained with the response-only loss; --pack is how its examples fill the sequences.
    pack: bool = field(
        default=False,
        metadata=meta(
            "SFT data: fill each sequence with whole examples (attention never crosses an example, RoPE restarts at "
            "each); without it, one example per sequence, padded"
        ),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and come from (`threed.checkpoint`)."""

    save: Optional[str] = field(
        default=None, metadata=meta("checkpoint directory (a run there is resumed)", metavar="DIR")
    )
    save_interval: int = field(default=0, metadata=meta("steps between checkpoints (0: only at the end)"))
    load: Optional[str] = field(
        default=None,
        metadata=meta(  # full resume; must exist
            "resume from this checkpoint directory (weights, optimizer, step, data position)", metavar="DIR"
        ),
    )
    init_from: Optional[str] = field(
        default=None,
        metadata=meta(  # weights only; must exist
            "start from these weights only (e.g. `threed convert` output)", metavar="DIR"
        ),
    )
    auto_resume: bool = field(
        default=True,
        metadata=meta(  # preemption / requeue
            "resume from --save when it holds a checkpoint"
        ),
    )
    # Training from scratch into a `save` that holds a run is refused unless asked for in so many words.
    overwrite: bool = field(
        default=False,
        metadata=meta(
            "delete the checkpoints in --save and start over (otherwise a run there is resumed, never overwritten)"
        ),
    )
    keep_last: int = field(default=0, metadata=meta("keep the newest N complete checkpoints in --save; 0: all"))
    # threed.checkpoint.async_save: training waits only for a host copy; `latest` moves once every rank has written.
    async_save: bool = field(
        default=False,
        metadata=meta(
            "save checkpoints in the background: training is blocked only while the states are copied to host "
            "memory, and `latest` names the checkpoint once every rank has written and flushed its files"
        ),
    )


@dataclass(frozen=True)
class RunControlConfig:
    """Run control (`threed.train.guard`, `threed.parallel.distributed`): what stops a run, and how loudly."""

    skip_nonfinite: int = field(
        default=0,
        metadata=meta(
            "batches with a non-finite loss / grad norm to skip (step not applied) before the run stops with exit 3"
        ),
    )
    exit_duration_in_mins: float = field(
        default=0.0,
        metadata=meta(
            "save and exit 0 before this much wall time has passed (slurm/ passes the job's limit); 0: no limit"
        ),
    )
    dist_timeout_minutes: float = field(
        default=30.0,
        metadata=meta("a collective waiting longer than this for its peers fails instead of hanging", above=0),
    )
    watchdog_factor: float = field(
        default=20.0,
        metadata=meta(
            "a step longer than this x the median step (and --watchdog-min-seconds) prints every rank's Python "
            "stacks and exits 4; 0: off"
        ),
    )
    watchdog_min_seconds: float = field(default=600.0, metadata=meta("the watchdog never fires sooner than this"))
    # Finite divergence (threed.train.guard): each stops the run with exit 3 before the step is saved. The defaults sit
    # far outside a healthy run's noise (the demo's worst spike is 1.4x its median loss, its updates move the
    # weight norm by a few percent): they catch blow-ups, not bumps.
    spike_factor: float = field(
        default=5.0,
        metadata=meta(
            "a loss above this x the median of the last 50 finite losses (after 10 steps) is a spike; one that lasts "
            "--spike-confirm-steps steps stops the run with exit 3; 0: off"
        ),
    )
    spike_confirm_steps: int = field(
        default=10,
        metadata=meta(
            "a loss spike stops the run only once the loss has stayed above --spike-factor's bound for this many "
            "steps in a row (a lone spike, e.g. a batch of a rarer, harder source, is logged and the run goes on); "
            "1: the first spike stops it",
            at_least=1,
        ),
    )
    dead_grad_norm: float = field(
        default=1e-6,
        metadata=meta(
            "a step with loss tokens whose gradient norm is at most this (a dead, saturated model) stops the run with "
            "exit 3; 0: off"
        ),
    )
    weight_jump_factor: float = field(
        default=10.0,
        metadata=meta(
            "a step that multiplies a rank's weight norm by more than this stops the run with exit 3; 0: off"
        ),
    )
    max_weight: float = field(
        default=1e4,
        metadata=meta(
            "a checkpoint save whose weights hold a non-finite value or one larger than this in magnitude is refused "
            "(exit 3, nothing written); 0: only the finiteness check"
        ),
    )


@dataclass(frozen=True)
class MetricsConfig:
    """Where a run's metrics go (see `threed.metrics.writer`): stdout always; metrics.jsonl and run_config.json in
    the run directory (--save, else the parent of --tensorboard-dir); TensorBoard; W&B when asked for."""

    tensorboard_dir: Optional[str] = field(
        default=None, metadata=meta("TensorBoard event directory (default: SAVE/tensorboard)", metavar="DIR")
    )
    tensorboard: bool = field(
        default=True,
        metadata=meta(  # false: metrics.jsonl and stdout stay
            "write TensorBoard events"
        ),
    )
    wandb_project: Optional[str] = field(
        default=None, metadata=meta("Weights & Biases project (optional; needs `pip install wandb`)")
    )
    wandb_name: Optional[str] = field(
        default=None,
        metadata=meta(  # Megatron's --wandb-exp-name
            "Weights & Biases run name"
        ),
    )
    wandb_mode: Optional[str] = field(
        default=None,
        metadata=meta(  # None: wandb's own
            "Weights & Biases mode: online, offline or disabled"
        ),
    )
    stage_timing: bool = field(
        default=True, metadata=meta("time compute and pipeline waits per stage (idle fraction vs the ideal bubble)")
    )


# LoRA's targets (HF PEFT's module names, short): the attention's q, k, v and output projections, the MLP's gate, up
# and down projections. q/k/v and gate/up are fused in the base (megatron's linear_qkv, linear_fc1) but each gets
# its own adapter, as an HF PEFT file holds them (threed.convert.lora).
LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
# Targets whose base is a column-parallel linear: their adapter's A shards its rank over TP (threed.model.lora).
LORA_COLUMN_TARGETS: tuple[str, ...] = ("q", "k", "v", "gate", "up")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA fine-tuning (threed.model.lora): the base weights frozen, rank-r adapters on the chosen linears trained.
    lora_rank 0: off (full fine-tuning)."""

    lora_rank: int = field(
        default=0, metadata=meta("LoRA adapter rank; > 0 freezes the base and trains only adapters (0: off)")
    )
    lora_alpha: float = field(default=16.0, metadata=meta("LoRA scale numerator: adapters add alpha / rank x B A x"))
    lora_dropout: float = field(default=0.0, metadata=meta("dropout on the adapters' input", below=1))
    lora_targets: tuple[str, ...] = field(
        default=LORA_TARGETS, metadata=meta("linears that get adapters: any of q k v o gate up down")
    )
    lora_init_from: Optional[str] = field(
        default=None, metadata=meta("start the adapters from an HF PEFT folder (adapter_config.json)", metavar="DIR")
    )

    def validate(self, parallel: "ParallelConfig", train: "TrainConfig") -> None:
        """One line per bad combination, before anything is built."""
        if self.lora_rank <= 0:  # off (a negative rank is refused by the field's range first)
            if self.lora_init_from:
                raise ConfigError(
                    f"--lora-init-from needs --lora-rank > 0 (got {self.lora_rank}); give the adapter's rank, "
                    f"e.g. --lora-rank 16"
                )
            return
        unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if unknown or not self.lora_targets:
            raise ConfigError(
                f"--lora-targets: unknown target(s) {' '.join(unknown) or '(none given)'}; choose from "
                f"{' '.join(LORA_TARGETS)}"
            )
        column = [t for t in self.lora_targets if t in LORA_COLUMN_TARGETS]
        if column and self.lora_rank % parallel.tp:
            raise ConfigError(
                f"--lora-rank {self.lora_rank} is not divisible by --tp {parallel.tp}: the adapters of "
                f"{' '.join(column)} shard their rank over TP; use a rank that is a multiple of {parallel.tp}"
            )
        if parallel.pipeline_schedule == "zb-h1":
            raise ConfigError(
                "--pipeline-schedule zb-h1 with --lora-rank: the frozen base has no weight gradient to defer; "
                "use --pipeline-schedule 1f1b"
            )
        if parallel.cp > 1:
            raise ConfigError("--lora-rank with --context-parallel-size > 1 is not supported in this build; use cp 1")
        if self.lora_dropout > 0 and (train.activation_checkpointing or train.recompute_granularity):
            raise ConfigError(
                "--lora-dropout > 0 with recompute: the recomputed forward would draw other dropout masks; use "
                "--lora-dropout 0 or no recompute"
            )


# The sections a command line sets (the model comes from --model), in `threed train --help` order.
SECTIONS: dict[str, type] = {
    "parallel": ParallelConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "checkpoint": CheckpointConfig,
    "control": RunControlConfig,
    "metrics": MetricsConfig,
    "lora": LoraConfig,
}
# Fields that moved section: where configs written before (threed_run.json, manifests) had them.
_MOVED = {
    "checkpoint": ("control", [f.name for f in dataclasses.fields(RunControlConfig)]),
    "train": ("parallel", ["partition_method"]),
}


def check_ranges(section: str, obj: Any) -> None:
    """Raise a ConfigError naming the first numeric field of `obj` outside its range (its metadata)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_ranges(section, value)  # e.g. the model's rope_scaling
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        m = field_meta(f)
        name = f"model field {f.name}" if section == "model" else flag_name(f)
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        if m.above is not None and value <= m.above:
            raise ConfigError(f"{name} must be > {m.above:g}, got {value}")
        if value < m.at_least:
            raise ConfigError(f"{name} must be >= {m.at_least:g}, got {value}")
        if m.below is not None and value >= m.below:
            raise ConfigError(f"{name} must be in [{m.at_least:g}, {m.below:g}), got {value}")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    control: RunControlConfig = field(default_factory=RunControlConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        """`--num-layers-per-virtual-pipeline-stage N` becomes the vpp it means, so that every reader of the config
        finds the chunks in `parallel.vpp`; ConfigError (one line) when N does not fit or contradicts --vpp."""
        p, n = self.parallel, self.parallel.num_layers_per_virtual_pipeline_stage
        if n is None:
            return
        blocks = self.model.num_layers
        if n < 1 or p.pp < 1 or blocks % (p.pp * n):
            fits = [str(k) for k in range(1, blocks + 1) if p.pp >= 1 and blocks % (p.pp * k) == 0]
            fix = f"use N = {' or '.join(fits)}" if fits else f"pp {p.pp} does not divide them: change pp"
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {n}: pp x N = {p.pp} x {n} must divide the {blocks} "
                f"blocks; {fix}"
            )
        vpp = blocks // (p.pp * n)
        if p.vpp not in (1, vpp):
            raise ConfigError(
                f"--num-layers-per-virtual-pipeline-stage {n} means --vpp {vpp} at pp {p.pp} ({blocks} blocks), "
                f"not --vpp {p.vpp}; give one of them"
            )
        object.__setattr__(self, "parallel", dataclasses.replace(p, vpp=vpp))

    def validate(self, world_size: int) -> None:
        """Every field's range, then the arithmetic: what training, the dry run and `threed check-config` check
        before anything is built."""
        for f in dataclasses.fields(self):
            check_ranges(f.name, getattr(self, f.name))
        t = self.train
        if t.min_lr > t.lr:
            raise ConfigError(
                f"--min-lr {t.min_lr} is above --lr {t.lr}: the schedule decays from lr to min_lr; "
                f"use --min-lr <= {t.lr}"
            )
        self.model.validate()
        self.parallel.validate(self.model, world_size)
        self.train.validate(self.model)
        self.lora.validate(self.parallel, self.train)
        cp = self.parallel.cp
        if cp > 1 and self.train.seq_length % (2 * cp * (self.parallel.tp if self.parallel.sequence_parallel else 1)):
            chunks = 2 * cp * (self.parallel.tp if self.parallel.sequence_parallel else 1)
            raise ConfigError(
                f"--context-parallel-size {cp} cuts each sequence into 2 x cp chunks"
                f"{' of whole SP slices (x tp)' if self.parallel.sequence_parallel else ''}: seq_length "
                f"{self.train.seq_length} is not a multiple of {chunks}; use a multiple of {chunks}"
            )
        if self.parallel.sequence_parallel and self.train.seq_length % self.parallel.tp:
            raise ConfigError(
                f"--sequence-parallel splits each sequence over tp={self.parallel.tp} ranks: "
                f"seq_length {self.train.seq_length} is not a multiple of {self.parallel.tp}; use a "
                f"multiple of {self.parallel.tp}"
            )
        p = self.parallel
        check_lm_head_chunks(
            self.train.lm_head_chunks, self.train.seq_length, p.tp, p.cp, p.sequence_parallel, p.pipeline_schedule
        )
        check_torch_compile(self.train.torch_compile, p.pipeline_schedule)
        _, gas, _ = self.train.resolve_batch(self.parallel.dp(world_size))
        check_virtual_stages(p.pp, p.vpp, self.model.num_layers, p.pipeline_schedule, gas)
        if self.checkpoint.load and self.checkpoint.init_from:
            raise ConfigError("give either load (full resume) or init_from (weights only), not both")
        if self.checkpoint.async_save and not self.checkpoint.save:
            raise ConfigError(
                "--async-save without --save: no checkpoint would be written; give --save DIR (launcher: SAVE=) or "
                "drop --async-save (ASYNC_SAVE=)"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "RunConfig":
        """The inverse of `to_dict`; also reads configs written before a field moved section (see `_MOVED`)."""
        m = dict(d["model"])
        if m.get("rope_scaling"):
            m["rope_scaling"] = RopeScaling(**m["rope_scaling"])
        sections = {name: dict(d.get(name) or {}) for name in SECTIONS}
        for old, (new, names) in _MOVED.items():
            for name in names:
                if name in sections[old]:
                    sections[new].setdefault(name, sections[old].pop(name))
        return RunConfig(model=ModelConfig(**m), **{name: cls(**sections[name]) for name, cls in SECTIONS.items()})
