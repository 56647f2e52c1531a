"""DeepSpeed's config for a run: the one writer of DeepSpeed's JSON (engine policy: batch, ZeRO-1, bf16 with fp32
gradient accumulation and fp32 reduction, the pipeline's activation hand-off).

    deepspeed_config(dims, cfg.train, cfg.parallel, cfg.data.pack)   the training config, once per start
                                                                    (threed.engine.resolved holds it)
    engine_config(base, load_universal=..., train=...)              what the engine is built with: a universal
                                                                    resume's load flag, ZeRO off for scoring

Pure (no torch): `threed check-config` and the launcher's dry run print the same dict the engine gets.
The optimizer and LR schedule are client objects (threed.engine.optimizer), so they are not in here.
"""

from __future__ import annotations

import copy
from typing import Any

from threed.config import ParallelConfig, TrainConfig
from threed.parallel.dims import RunDims


def deepspeed_config(dims: RunDims, train: TrainConfig, parallel: ParallelConfig, packed: bool) -> dict[str, Any]:
    """The training run's DeepSpeed config (`packed`: --pack, rows of several documents)."""
    ds: dict[str, Any] = {
        # DeepSpeed's data axis holds dp x cp ranks (threed.parallel.pipeline.make_topology) and it checks
        # train_batch_size = micro x gas x its data size; the CP ranks of a data-parallel rank read the same rows,
        # so the rows per step stay micro x gas x dp (`global_batch`).
        "train_batch_size": dims.global_batch * dims.cp,
        "train_micro_batch_size_per_gpu": dims.micro,
        "gradient_accumulation_steps": dims.gas,
        "gradient_clipping": train.grad_clip,
        "zero_optimization": {"stage": train.zero_stage},
        # A torch AdamW under ZeRO-1 is exact (elementwise on flat partitions) and matches a plain torch run.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # we log ourselves, with tokens/s and MFU
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer, started in every micro-batch's forward pass, synchronizes the device there
        # once its step count reaches 2 (`synchronized`, on by default): a host wait per micro-batch. The pipeline
        # engine never advances that count (only DeepSpeedEngine.step does), and threed times steps itself
        # (threed.metrics.stages), so it is off rather than left to that detail.
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
    }
    if train.dtype == "bf16":
        ds["bf16"] = {
            "enabled": True,
            # Each micro-batch's bf16 gradient is added into the fp32 accumulator by a hook as soon as it is
            # produced and the bf16 .grad is freed (DeepSpeed 0.19's default, stated so it cannot change under
            # us): 2 B/param less at the peak, and the same sums in the same order as the deferred copy.
            "immediate_grad_update": True,
        }
        # fp32 gradient accumulation selects DeepSpeed's BF16_Optimizer (fp32 master weights and grads).
        ds["data_types"] = {"grad_accum_dtype": train.grad_accum_dtype}
    # The data-parallel all-reduce runs on the fp32 accumulated gradients. DeepSpeed's default is the compute
    # dtype (bf16 when bf16 is on), which rounds the fp32 sums to bf16 before reducing and allocates a 2 B/param
    # temporary every step; fp32 keeps dp2 x gas1 equal to dp1 x gas2 (tests/ranks/test_training.py).
    ds["communication_data_type"] = "fp32"
    if packed:
        # Packed rows send (hidden, doc_ids) between stages: DeepSpeed's reentrant activation checkpointing needs
        # every input of a checkpointed block to require grad, which the integer ids cannot (the first stage fails
        # with "element 0 of tensors does not require grad"); the non-reentrant variant takes them as they are.
        ds["pipeline"] = {"use_reentrant": False}
    if parallel.sequence_parallel or dims.vpp > 1:
        # DeepSpeed's pipe_partitioned / grad_partitioned (on by default under TP) assume every TP rank holds the
        # same activation, send 1/tp of it and all-gather it over TP after the receive. Under sequence parallelism
        # each rank's [s/tp, b, h] is already its own part: it goes as it is, with no gather (1/tp per rank still).
        # Interleaved stages (threed.parallel.interleaved) send their activations whole, as DeepSpeed's DualPipeV
        # does: without SP each TP rank sends the full [s, b, h] (tp x the bytes of the partitioned hand-off).
        ds.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
    return ds


def engine_config(base: dict[str, Any], load_universal: bool = False, train: bool = True) -> dict[str, Any]:
    """The config the engine is built with, from the run's `base` (a copy: the run's value stays as resolved).
    `train=False`: an engine that only runs its stages (threed generate / eval-harness), ZeRO off.
    `load_universal`: resuming at another layout (threed.checkpoint.universal)."""
    ds = copy.deepcopy(dict(base))
    if not train:
        ds["zero_optimization"] = {"stage": 0}
    if load_universal:
        ds["checkpoint"] = {"load_universal": True}
    return ds
