"""The pipeline schedule, `--pipeline-schedule 1f1b | zb-h1`: in which order each stage runs its forward (F),
input-gradient (B) and weight-gradient (W) passes, and what that order costs in time and held activations.

    1f1b   DeepSpeed's TrainSchedule: p - 1 - s warm-up forwards on stage s, then one forward, one backward; the
           backward computes both gradients. Every stage idles (p - 1) / (gas + p - 1) of the step.
    zb-h1  Zero Bubble's ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): the same F and B
           order and the same messages, but B computes only the input gradient (what the stage before waits for)
           and stage s defers its weight gradients by s micro-batches, W(j) running after B(j + s). The deferred
           W fill the cool-down, where 1F1B stages wait for gradients; the bubble falls from (p-1)(F+B+W) to about
           (p-1)(F+B-W). Stage s holds at most p micro-batches (p - s in flight plus s awaiting W): no stage
           holds more than 1F1B's first stage.

Why ZB-H1 and not DeepSpeed's DualPipeV: see README ("Pipeline schedules"). Why on DeepSpeed's engine: the F/B
order and every send and receive are DeepSpeed's own TrainSchedule, so ZB-H1 cannot deadlock where 1F1B does not;
the W passes are local and slot in between, and its sends do not wait for the receiver, so that a stage runs its W
instead (`zero_bubble_engine`). The weight-gradient split is `threed.model.wgrad`, on megatron-core's
Column/RowParallelLinear.

The pure part (orders, `held`, `simulate`) needs no torch: the memory model, the step-time model and the planner
use it. The DeepSpeed part is built lazily, where an engine is built.
"""
from __future__ import annotations

import functools
import typing
from contextlib import contextmanager
from typing import Any

from threed.config import ParallelConfig

# The names are the flag's choices (ParallelConfig.pipeline_schedule), listed once there.
SCHEDULES: tuple[str, ...] = typing.get_args(typing.get_type_hints(ParallelConfig)["pipeline_schedule"])


def weight_delay(schedule: str, pp: int, stage: int) -> int:
    """By how many micro-batches stage `stage` defers its weight gradients (0: W runs right after its B)."""
    return stage if schedule == "zb-h1" else 0


def stage_order(schedule: str, pp: int, gas: int, stage: int) -> list[tuple[str, int]]:
    """The passes of one stage in the order it runs them: ("F", j), ("B", j), ("W", j) for micro-batch j. Under
    1f1b "B" is the whole backward (no "W" entries). The F/B order is 1F1B's under every schedule."""
    warmup = min(pp - 1 - stage, gas)
    fb: list[tuple[str, int]] = [("F", j) for j in range(warmup)]
    for k in range(gas - warmup):
        fb += [("F", warmup + k), ("B", k)]
    fb += [("B", k) for k in range(gas - warmup, gas)]
    if schedule == "1f1b":
        return fb
    delay = weight_delay(schedule, pp, stage)
    order: list[tuple[str, int]] = []
    next_w = 0
    for kind, j in fb:
        order.append((kind, j))
        if kind == "B":
            # W(i) is due once B(i + delay) has run; the last B releases every W still pending.
            last = j if j == gas - 1 else j - delay
            order += [("W", i) for i in range(next_w, last + 1)]
            next_w = max(next_w, last + 1)
    return order


def held(schedule: str, pp: int, gas: int, stage: int) -> list[tuple[int, int]]:
    """(micro-batches forwarded and not yet through B, micro-batches through B awaiting W) after each pass of the
    stage: the first holds a micro-batch's whole activations, the second only what its W needs (the linears'
    inputs and output gradients; threed.memory)."""
    live = waiting = 0
    out = []
    for kind, _ in stage_order(schedule, pp, gas, stage):
        if kind == "F":
            live += 1
        elif kind == "B":
            live -= 1
            waiting += schedule != "1f1b"
        else:
            waiting -= 1
        out.append((live, waiting))
    return out


def held_before_backward(schedule: str, pp: int, gas: int, stage: int) -> list[tuple[int, int]]:
    """`held` just before each B of the stage (the micro-batch about to go through B among those in flight): what
    the backward's transients come on top of."""
    before = [(0, 0), *held(schedule, pp, gas, stage)]
    return [state for (kind, _), state in zip(stage_order(schedule, pp, gas, stage), before) if kind == "B"]


@functools.lru_cache(maxsize=4096)
def simulate(schedule: str, pp: int, gas: int, f: float = 1.0, b: float = 1.0, w: float = 1.0,
             ) -> tuple[float, tuple[float, ...]]:
    """(step time, each stage's idle fraction) of one step when every stage takes f, b and w per micro-batch for
    its F, B and W passes and messages are free. Under 1f1b a backward costs b + w."""
    orders = [stage_order(schedule, pp, gas, s) for s in range(pp)]
    cost = {"F": f, "B": b + w if schedule == "1f1b" else b, "W": w}
    finish: dict[tuple[str, int, int], float] = {}
    clock, at = [0.0] * pp, [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(pp):
            while at[s] < len(orders[s]):
                kind, j = orders[s][at[s]]
                if kind == "F":
                    dep = ("F", s - 1, j) if s > 0 else None
                elif kind == "B":
                    dep = ("B", s + 1, j) if s < pp - 1 else ("F", s, j)
                else:
                    dep = None
                if dep is not None and dep not in finish:
                    break
                start = max(clock[s], finish[dep] if dep is not None else 0.0)
                clock[s] = start + cost[kind]
                finish[(kind, s, j)] = clock[s]
                at[s] += 1
                remaining -= 1
                progressed = True
        assert progressed, "schedule deadlocks"
    step = max(clock)
    busy = [sum(cost[k] for k, _ in o) for o in orders]
    return step, tuple(1 - x / step for x in busy)


@functools.cache
def zero_bubble_engine() -> type:
    """DeepSpeed's PipelineEngine running ZB-H1 (created lazily: deepspeed and torch are imported only where an
    engine is built). DeepSpeed 0.19.8's `deepspeed.initialize` picks the engine class from the module's type
    alone (PipelineEngine, or DualPipeVEngine for a DualPipeVModule), so threed.engine re-classes the engine it
    returns: this subclass adds methods, and no state of its own beyond the deferral queue and its sends in
    flight."""
    # deepspeed, torch, megatron: heavy; the planner and the memory model use the pure part above without them
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.pipe import p2p
    from deepspeed.runtime.pipe import schedule as ds_schedule
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from threed.model.wgrad import DEFERRED

    class WeightPass(ds_schedule.PipeInstruction):
        """Run the oldest deferred weight gradients (those of `micro_batch`, first in, first out)."""

    class ZeroBubbleSchedule(ds_schedule.TrainSchedule):
        """DeepSpeed's 1F1B TrainSchedule, every command kept in place, with a WeightPass for micro-batch i placed
        after B(i + delay) (threed.schedule.stage_order). A W goes at the start of the step after its B, behind
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

    class ZeroBubbleEngine(PipelineEngine):
        """B computes input gradients only (`threed.model.wgrad`); WeightPass runs the deferred weight gradients."""

        def train_batch(self, *args, **kwargs):
            DEFERRED.clear()  # nothing left over from a batch that raised
            self._wait_for_sends()
            return super().train_batch(*args, **kwargs)

        def _train_schedule(self):
            return ZeroBubbleSchedule(micro_batches=self.micro_batches, stages=self.num_stages,
                                      stage_id=self.stage_id)

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
            # backward (BF16_Optimizer's fp32 accumulation needs its immediate_grad_update: threed.engine sets it).
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
        _INSTRUCTION_MAP = {**PipelineEngine._INSTRUCTION_MAP, ds_schedule.BackwardPass: _exec_backward_pass,
                            ds_schedule.SendActivation: _exec_send_activations, ds_schedule.SendGrad: _exec_send_grads,
                            ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads, WeightPass: _exec_weight_pass}

    ZeroBubbleEngine.WeightPass = WeightPass
    return ZeroBubbleEngine


def use_schedule(engine: Any, schedule: str) -> Any:
    """Make a DeepSpeed PipelineEngine run `schedule` (1f1b: DeepSpeed's own, unchanged)."""
    if schedule == "zb-h1":
        engine.__class__ = zero_bubble_engine()
    return engine
