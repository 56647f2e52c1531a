"""Full-vocabulary logits from a pipeline engine, for parity checks (`threed verify`, tests)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def pipeline_logits(engine, inputs, vocab_size: int) -> Optional[torch.Tensor]:
    """Run `inputs` (tokens `[b, s]`, or packed rows `(tokens, doc_ids)`) through the pipeline as one micro-batch;
    returns fp32 logits `[b, s, vocab]` on the last stage (every TP rank of it, on CPU whatever the device), None on
    other stages. Every rank of the model must call this."""
    tokens = inputs[0] if isinstance(inputs, (tuple, list)) else inputs
    batch = (inputs, torch.zeros_like(tokens))  # labels are loaded by the last stage but unused here
    _, logits = engine.eval_batch(
        iter([batch]), return_logits=True, compute_loss=False, reduce_output=None, bcast_loss=False, num_micro_batches=1
    )
    if not engine.is_last_stage():
        return None
    tp_group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    full = torch.cat(parts, dim=-1)[..., :vocab_size]  # drop vocab padding
    return full.transpose(0, 1).float().cpu()  # [s, b, v] -> [b, s, v], on CPU for comparing and saving
