"""`StagedPipelineModule`: DeepSpeed's PipelineModule with three things it lacks, for `threed.parallel.pipeline`.

- Explicit stage boundaries: DeepSpeed's PipelineModule knows only its own partition methods, so threed's
  (`--partition-method`, resolved by the pure `threed.parallel.partition`) arrive as `partition_method="parts:0,6,11"`
  (layer indices where each stage starts, then the end).
- Megatron's full recompute (`--recompute-granularity full --recompute-method uniform|block --recompute-num-layers
  N`): the chunks are `threed.parallel.partition.recompute_chunks`, counted over blocks as Megatron counts them.
- Sequence parallelism's norm-gradient sum over the TP group, which megatron's finalize_model_grads does and
  DeepSpeed's pipeline engine does not.
- Interleaved stages (`--vpp V`): a rank builds V chunks of layers, round-robin as Megatron assigns them (virtual
  stage k = chunk c x pp + rank r; the boundaries arrive as pp x V + 1 `parts`). Each layer keeps its global index
  (module name, layer file `layer_NN`), so a checkpoint is the same whatever the layout; `activate_chunk` exposes
  one chunk as the module's forward, bounds and recompute runs, as DeepSpeed's DualPipeVModule does its phases.

A module of its own, apart from partition.py, so that the pure partitioner imports no DeepSpeed: the planner, the
memory model and check-config resolve stages in a second, without torch.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from deepspeed.pipe import PipelineModule

from threed.parallel.partition import PARTS_PREFIX, describe, recompute_chunks


class StagedPipelineModule(PipelineModule):
    """`recompute`: (method, N) of full recompute (`full_recompute`), or None. The module is then built with
    activation_checkpoint_interval 1, which only keeps DeepSpeed's engine treating it as checkpointed (the
    reentrant variant's first-stage inputs); `forward` runs `recompute_runs` instead of DeepSpeed's chunks."""

    def __init__(self, *args: Any, recompute: Optional[tuple[str, int]] = None, vpp: int = 1, **kwargs: Any):
        # Read by _partition_layers and _build, which DeepSpeed's __init__ calls (a plain int: nn.Module allows it
        # before its own __init__).
        self.vpp = vpp
        super().__init__(*args, **kwargs)
        # DeepSpeed cuts a stage's layers into chunks of `activation_checkpoint_interval` counted from its first
        # layer (on stage 0 the embedding: a chunk of N would mix it with N-1 blocks and not be checkpointed at
        # all) and checkpoints every chunk of blocks alike. Megatron's methods count blocks (uniform: chunks
        # from the first block; block: only the first N), so the runs are Megatron's, over the layers that
        # DeepSpeed's `_is_checkpointable` accepts (`checkpointable_layers`: the blocks).
        self.recompute = recompute
        # Megatron's full recompute counts the blocks of each model chunk (each is a TransformerBlock of its own).
        self.chunk_runs = [
            [] if recompute is None else recompute_chunks([self._is_checkpointable([f]) for f in funcs], *recompute)
            for funcs in self.chunk_funcs
        ]
        self.activate_chunk(0)

    def _build(self) -> None:
        # Each chunk through DeepSpeed's own _build over its bounds: modules registered under their global layer
        # index, a tied module built once (where its first chunk is) and shared by a later chunk holding it.
        self.chunk_funcs: list[list] = []
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            self.forward_funcs = []
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)

    def activate_chunk(self, chunk: int) -> None:
        """Expose chunk `chunk` (of this rank's `vpp`) as the module's layers: forward, bounds, recompute runs."""
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self._local_start, self._local_stop = self.chunk_bounds[chunk]
        self.recompute_runs: list[tuple[int, int, bool]] = self.chunk_runs[chunk]

    def indexed_layers(self) -> list[tuple[int, Any]]:
        """(global pipeline-layer index, layer) of every layer this rank holds, chunk by chunk."""
        return [
            (index, fn)
            for (start, stop), funcs in zip(self.chunk_bounds, self.chunk_funcs)
            for index, fn in zip(range(start, stop), funcs)
        ]

    def stage_owner(self, layer_idx: int) -> int:
        # The pipeline rank holding the layer (DeepSpeed asks it for the tied groups): virtual stage k lies on rank
        # k mod pp.
        for k in range(len(self.parts) - 1):
            if self.parts[k] <= layer_idx < self.parts[k + 1]:
                return k % self.num_stages
        raise RuntimeError(f"layer {layer_idx} outside {self.parts}")

    def save_state_dict(self, *args: Any, **kwargs: Any) -> None:
        for chunk in range(self.vpp):  # layer files by global index: the same files at any vpp
            self.activate_chunk(chunk)
            super().save_state_dict(*args, **kwargs)
        self.activate_chunk(0)

    def load_state_dir(self, *args: Any, **kwargs: Any) -> None:
        for chunk in range(self.vpp):
            self.activate_chunk(chunk)
            super().load_state_dir(*args, **kwargs)
        self.activate_chunk(0)

    def forward(self, forward_input: Any) -> Any:
        if self.recompute is None:
            return super().forward(forward_input)
        # DeepSpeed's forward with its chunks replaced by the runs; the checkpoint function is the one its
        # engine set (reentrant, or non-reentrant for packed rows: threed.engine.build). Its per-layer reseeding
        # (seed_layers) is off in threed's pipeline and not repeated here.
        assert not self.seed_layers, "threed's pipeline builds no per-layer seeds"
        self.micro_offset += 1
        x = forward_input
        for start, stop, recomputed in self.recompute_runs:
            x = x if isinstance(x, tuple) else (x,)  # DeepSpeed's convention: layers get one tensor or a tuple
            run = functools.partial(self._run_layers, start, stop)
            x = self.activation_checkpoint_func(run, *x) if recomputed else run(*x)
        return x

    def _run_layers(self, start: int, stop: int, *inputs: Any) -> Any:
        x = inputs[0] if len(inputs) == 1 else inputs
        for layer in self.forward_funcs[start:stop]:
            x = layer(x)
        return x

    def get_tied_weights_and_groups(self) -> list:
        # Sequence parallelism: each TP rank's norm weights (tagged `sequence_parallel`, threed.model.layers)
        # saw its own part of the sequence, so their gradients must be summed over the TP group, as megatron's
        # finalize_model_grads does; DeepSpeed's pipeline engine does not. Its tied-weight step
        # (ReduceTiedGrads: after the last backward, before the DP reduction and the gradient norm; the fp32
        # `_hp_grad` under bf16) all-reduces each (weight, group) of this list: they join it with the TP group.
        # A frozen weight (LoRA's base) has no gradient to sum: under bf16 it has no fp32 `_hp_grad` at all.
        pairs = [(w, g) for w, g in super().get_tied_weights_and_groups() if w.requires_grad]
        partial = [p for p in self.parameters() if getattr(p, "sequence_parallel", False) and p.requires_grad]
        if partial:
            from megatron.core import parallel_state  # heavy: as deepspeed above

            group = parallel_state.get_tensor_model_parallel_group()
            pairs += [(p, group) for p in partial]
        return pairs

    def _synchronize_tied_weights(self) -> None:
        # DeepSpeed broadcasts the tied weight (Llama 3.2's embedding) in place with autograd on, so torch
        # warns at every backward that c10d::broadcast_ has no autograd kernel (the gradients are right).
        # Copying weights is not part of the graph: no_grad.
        with torch.no_grad():
            super()._synchronize_tied_weights()

    def _partition_layers(self, method: str = "uniform") -> None:
        if not method.startswith(PARTS_PREFIX):
            assert self.vpp == 1, "interleaved stages take explicit boundaries"
            super()._partition_layers(method)
            self.chunk_bounds = [(self._local_start, self._local_stop)]
            return
        self.parts = [int(b) for b in method[len(PARTS_PREFIX) :].split(",")]
        pp = self.num_stages
        assert len(self.parts) == pp * self.vpp + 1 and self.parts[-1] == len(self._layer_specs), self.parts
        if dist.get_rank() == 0:
            model = self._layer_specs[0].module_args[0]
            what = "pipeline stages" if self.vpp == 1 else f"virtual pipeline stages (on rank k mod {pp})"
            print(f"{what}: {describe(self.parts, model)}", flush=True)
        stage = self._topo.get_coord(self.global_rank).pipe
        # Megatron's round-robin: chunk c of rank r is virtual stage c x pp + r.
        self.chunk_bounds = [(self.parts[c * pp + stage], self.parts[c * pp + stage + 1]) for c in range(self.vpp)]
        self._set_bounds(*self.chunk_bounds[0])
