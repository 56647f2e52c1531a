"""ZB-H1 on DeepSpeed's PipelineEngine (`--pipeline-schedule zb-h1`; the schedule itself, which stage runs which pass
when, is the pure `threed.parallel.schedule`).

DeepSpeed 0.19.8's `deepspeed.initialize` picks the engine class from the module's type alone (PipelineEngine, or
DualPipeVEngine for a DualPipeVModule), so `use_schedule` re-classes the engine it returns: `ZeroBubbleEngine` adds
methods, and no state of its own beyond the deferral queue and its sends in flight. Both schedules' engines build on
`threed.parallel.lean_engine` (the last stage's logits let go after the loss). The F/B order and every send
and receive are DeepSpeed's own TrainSchedule, so ZB-H1 cannot deadlock where 1F1B does not; the W passes are
local and slot in between. The weight-gradient split is `threed.model.wgrad`, on megatron-core's
Column/RowParallelLinear.

A module of its own, apart from schedule.py, so that the schedule's pure part imports no DeepSpeed: the memory
model, the step-time model and the planner use it without torch.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import p2p
from deepspeed.runtime.pipe import schedule as ds_schedule

from threed.model.wgrad import DEFERRED
from threed.parallel.interleaved import InterleavedEngine
from threed.parallel.lean_engine import LeanPipelineEngine
from threed.parallel.schedule import stage_order


class WeightPass(ds_schedule.PipeInstruction):
    """Run the oldest deferred weight gradients (those of `micro_batch`, first in, first out)."""


class ZeroBubbleSchedule(ds_schedule.TrainSchedule):
    """DeepSpeed's 1F1B TrainSchedule, every command kept in place, with a WeightPass for micro-batch i placed
    after B(i + delay) (threed.parallel.schedule.stage_order). A W goes at the start of the step after its B, behind
    that step's SendGrad (the stage before waits for that gradient, not for our W) and before its receive
    (which may wait: the W fills that wait); W passes still pending at the end run before the gradient
    reductions."""

    def steps(self):
        # Which W passes follow each B: read off stage_order, the one place that says where they go.
        after: dict[int, list[int]] = {}
        for kind, j in stage_order("zb-h1", self.stages, self.micro_batches, self.stage_id):
            if kind == "B":
                after[j] = backward = []
            elif kind == "W":
                backward.append(j)
        due: list[int] = []  # W passes to issue at the start of the next step
        for step_id, cmds in enumerate(super().steps()):
            cmds = list(cmds)
            at = 1 if cmds and isinstance(cmds[0], ds_schedule.SendGrad) else 0
            cmds[at:at] = [WeightPass(micro_batch=i) for i in due]
            due = []
            for k, cmd in enumerate(cmds):
                if isinstance(cmd, ds_schedule.BackwardPass):
                    due = after.pop(self._step_to_micro_batch(step_id)[0])
                if isinstance(cmd, ds_schedule.ReduceTiedGrads):
                    # The end of the batch: every W before the reductions (the last B may be in this step).
                    cmds[k:k] = [WeightPass(micro_batch=i) for i in due]
                    due = []
                    break
            yield cmds
        assert not after and not due, (after, due)


class ZeroBubbleEngine(LeanPipelineEngine):
    """B computes input gradients only (`threed.model.wgrad`); WeightPass runs the deferred weight gradients."""

    def train_batch(self, *args, **kwargs):
        DEFERRED.clear()  # nothing left over from a batch that raised
        self._wait_for_sends()
        return super().train_batch(*args, **kwargs)

    def _train_schedule(self):
        return ZeroBubbleSchedule(micro_batches=self.micro_batches, stages=self.num_stages, stage_id=self.stage_id)

    def _exec_backward_pass(self, buffer_id):
        # DeepSpeed receives every output gradient into one reused buffer (`grad_layer`), and the residual
        # stream hands that very tensor to the block's last linear as its output gradient, which a deferred W
        # keeps: the next RecvGrad would overwrite it before W runs (found at tp1 pp4). Backward gets its own
        # copy; the buffer stays DeepSpeed's.
        self._let_go_of_received_sends()
        received = self.grad_layer
        if received is not None and not self.is_last_stage():
            self.grad_layer = received.clone() if torch.is_tensor(received) else [t.clone() for t in received]
        try:
            with DEFERRED.deferring():
                super()._exec_backward_pass(buffer_id)
        finally:
            self.grad_layer = received

    def _exec_weight_pass(self, micro_batch):
        # Grads reach the weights through autograd (AccumulateGrad), so DeepSpeed's gradient hooks run as in
        # backward (BF16_Optimizer's fp32 accumulation needs its immediate_grad_update: threed.engine.build sets it).
        assert not self.using_bf16_optimizer or self._config.bfloat16_config.immediate_grad_update
        self._running_engine_backward = True  # what DeepSpeed's own backward sets around gradient hooks
        try:
            DEFERRED.run_oldest()
        finally:
            self._running_engine_backward = False

    # Sends that do not wait for the receiver. DeepSpeed's p2p.send is blocking (torch's send: gloo and NCCL
    # both wait for the matching receive), so a stage that has sent a gradient would sit in the send until the
    # stage before reaches its receive, instead of running the W that the schedule put there (measured at pp2
    # gas4: 16 ms of a 13 ms backward, every micro-batch). The sent tensors (a micro-batch's output, or its
    # input's gradient) are not written again; they are kept alive here until received (checked at every send
    # and backward: a micro-batch or two), and every send is waited for before the gradient reductions.
    # The receives stay DeepSpeed's: a stage needs what it receives.
    def _exec_send_activations(self, buffer_id):
        with self._sends_in_flight():
            super()._exec_send_activations(buffer_id)

    def _exec_send_grads(self, buffer_id):
        with self._sends_in_flight():
            super()._exec_send_grads(buffer_id)

    @contextmanager
    def _sends_in_flight(self):
        if not torch.is_grad_enabled():  # evaluation (InferenceSchedule): no W to run meanwhile; DeepSpeed's
            yield
            return
        pending = self._let_go_of_received_sends()

        def isend(tensor, dest_stage, async_op=False):
            pending.append((dist.isend(tensor, self.grid.stage_to_global(dest_stage)), tensor))

        blocking, p2p.send = p2p.send, isend
        try:
            yield
        finally:
            p2p.send = blocking

    def _let_go_of_received_sends(self) -> list:
        pending = self.__dict__.setdefault("_threed_sends", [])
        pending[:] = [(work, t) for work, t in pending if not work.is_completed()]
        return pending

    def _wait_for_sends(self):
        for work, _ in self.__dict__.pop("_threed_sends", []):
            work.wait()

    def _exec_reduce_tied_grads(self):
        assert DEFERRED.pending() == 0, f"{DEFERRED.pending()} weight-gradient passes never ran"
        self._wait_for_sends()
        super()._exec_reduce_tied_grads()

    # DeepSpeed dispatches through this map of functions, not through methods: the overrides go in it too.
    _INSTRUCTION_MAP = {
        **LeanPipelineEngine._INSTRUCTION_MAP,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.SendActivation: _exec_send_activations,
        ds_schedule.SendGrad: _exec_send_grads,
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        WeightPass: _exec_weight_pass,
    }


def use_schedule(engine: Any, schedule: str, vpp: int = 1) -> Any:
    """Make a DeepSpeed PipelineEngine run `schedule` (1f1b: DeepSpeed's own, in `LeanPipelineEngine`; with vpp > 1
    interleaved, `threed.parallel.interleaved`)."""
    if vpp > 1:
        assert schedule == "1f1b", schedule  # refused by the config (threed.config.check_virtual_stages)
        engine.__class__ = InterleavedEngine
    else:
        engine.__class__ = ZeroBubbleEngine if schedule == "zb-h1" else LeanPipelineEngine
    return engine
