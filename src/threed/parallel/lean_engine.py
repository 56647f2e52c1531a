"""DeepSpeed's PipelineEngine whose last stage lets go of its logits once the loss is computed (`LeanPipelineEngine`).

DeepSpeed 0.19.8's `_exec_forward_pass` keeps every micro-batch's output in `pipe_buffers['outputs']` and the last
stage's loss in `engine.loss`. A middle stage needs its output in backward and clears it there; the last stage's
`_exec_backward_pass` runs `backward(engine.loss)` and returns before that clearing. So each of its two buffer slots
kept a micro-batch's logits `[s, b, V/tp]` (and, through their autograd graph, the received input and its
gradient) until the slot was reused, between steps too: 2-4 GiB of the last stage's peak at the 1B shape.

After `destroy()` they kept the whole engine: `DeepSpeedEngine.forward` registers a backward hook on the logits
(`register_output_backward_hooks`) whose closure holds the engine, and torch keeps tensor hooks on the grad_fn, a C++
object the garbage collector cannot see through. The engine -> buffers -> logits -> grad_fn -> hook -> engine cycle is
never collected: its parameters, gradients and optimizer state stayed allocated (22.7 GiB on one H200 at the 1B
shape).

Here the last stage drops its output as soon as the loss is computed: nothing in backward reads the logits tensor (the
LM head's matmul keeps its input, the cross-entropy its own fp32 softmax), and the hooks stay on the grad_fn, which the
loss's graph keeps until backward has run them. After backward the loss is kept detached (its value, not its graph).
`destroy()` empties every pipeline buffer as well. A change of class only (as `threed.parallel.zero_bubble`'s engine,
which builds on this one): DeepSpeed's schedule, sends and numbers are untouched (tests/ranks/test_bytes.py: the same
losses and gradient norms bit for bit, and the engine freed after `destroy()`).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine


class LeanPipelineEngine(PipelineEngine):
    """PipelineEngine whose last stage keeps no logits after the loss and no loss graph after backward."""

    def _exec_forward_pass(self, buffer_id):
        super()._exec_forward_pass(buffer_id)
        if self.is_last_stage():
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_backward_pass(self, buffer_id):
        super()._exec_backward_pass(buffer_id)
        if self.is_last_stage() and torch.is_tensor(self.loss):
            self.loss = self.loss.detach()

    def destroy(self):
        super().destroy()
        for key, slots in self.pipe_buffers.items():
            self.pipe_buffers[key] = [None] * len(slots)
        self.loss = self.outputs = self.total_loss = None

    # DeepSpeed dispatches through this map of functions, not through methods: the overrides go in it too.
    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
    }
