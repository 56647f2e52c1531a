"""A checkpoint's weights read straight into this rank's stage at any tp / pp: what `threed reshard` would write
for this rank, put into its modules instead of into files. `threed train --init-from`, `threed generate` and
`threed eval-harness` use it when the checkpoint was written at another layout (engine/build.py; same layout:
DeepSpeed's own `load_checkpoint(load_module_only=True)`).

    load_into_stage(open_checkpoint(ckpt, tag=tag), local_modules(module, model), tp, tp_rank)

Why not DeepSpeed's loader: at another tp it merges and splits layer files by GPT-2 Megatron name rules (wrong for
our fused QKV and SwiGLU, and failing on tensor sizes); at another pp it wants one mp_rank file per stage. Why not
reshard to disk first: a 70B checkpoint is 140 GB written and read again, on a file system the user may not own.
Here each rank reads only the slices of the old TP files that make its new shards (threed.convert.slices, the
converter's streaming form, equal bit for bit to `threed reshard`'s files: tests/ranks/test_init_any_layout.py
checks the weights and the training that follows equal a native load of the resharded copy), one layer at a time.
"""

from __future__ import annotations

from typing import Sequence

import torch

from threed.checkpoint.format import Checkpoint
from threed.convert.ds_checkpoint import shard_reader
from threed.convert.from_hf import convert_rank
from threed.convert.slices import BufferPool
from threed.model.spec import PipelineLayer


def load_into_stage(
    ck: Checkpoint, modules: Sequence[tuple[PipelineLayer, torch.nn.Module]], tp: int, tp_rank: int
) -> int:
    """Load each (spec layer, module) of this rank's stage from `ck`, sliced for TP rank `tp_rank` of `tp`; the
    bytes of the shards loaded. A tied head's module is the embedding's (threed.parallel.pipeline.local_modules):
    it gets the embedding's weights, as DeepSpeed's broadcast to the last stage would give it. Values keep the
    checkpoint's dtype until `load_state_dict` copies them into the parameters (DeepSpeed's own load does the same).
    """
    pool = BufferPool()  # each state dict is copied into the module before the next is made
    loaded = 0
    for layer, module in modules:
        sd = convert_rank(ck.model, layer, shard_reader(ck, layer), tp, tp_rank, pool=pool)
        module.load_state_dict(sd, strict=True)
        loaded += sum(t.numel() * t.element_size() for t in sd.values() if isinstance(t, torch.Tensor))
    return loaded
