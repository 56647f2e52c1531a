"""Interleaved 1F1B on DeepSpeed's PipelineEngine (`--vpp V > 1`): each rank runs its V chunks of layers
(`threed.parallel.staged.StagedPipelineModule.activate_chunk`) in megatron-core's order
(`threed.parallel.schedule.interleaved_order`).

DeepSpeed 0.19.8's PipelineEngine knows one chunk per rank: its TrainSchedule, its two buffer slots and its blocking
sends (`p2p.send` waits for the receive, under gloo and NCCL alike) serve a stage that talks to the stages either
side. Here a rank's chunks talk to the ranks either side too, but rank pp - 1's chunk c feeds rank 0's chunk c + 1,
and at pp 2 the two ranks exchange activations and gradients both ways: blocking sends in megatron's order would
deadlock. So `InterleavedEngine` (a change of class, as `threed.parallel.zero_bubble`'s) keeps DeepSpeed's forward,
backward, loss, data loading and gradient reductions, and replaces the instruction stream and the messages:

- `ticks` puts every rank's passes on one clock (a pass runs one tick after what it needs, as `simulate` does with
  unit costs). The messages of a tick (a forward's output to the next virtual stage, a backward's input gradient
  to the one before) form one batch on each side (torch's batch_isend_irecv: one NCCL group; separate isend /
  irecv under gloo), posted at that tick by sender and receiver alike: every channel carries its messages in the
  same order at both ends, and nothing waits for a send. A pass waits only for the batch that brought its input,
  posted in an earlier tick; so no rank can wait on one that waits on it. A sent tensor is let go once a later
  batch from its receiver has come in (`_let_go_of_sends`): the receiver has posted its receive by then.
- Buffers are per (micro-batch, chunk) slot, gas x V of them, each freed when its pass is done; the last virtual
  stage keeps each micro-batch's loss until its backward (its F and B need not be adjacent).
- The batches go over the rank's pipeline group (DeepSpeed's `grid.get_pipe_parallel_group()`: the ranks of one
  pipeline, in stage order), as megatron-core's p2p goes over its pp group. A batch involves a rank and its
  neighbours, never the whole group, and under NCCL torch leaves a batch_isend_irecv undefined when it is the first
  collective on its group and not every rank of the group takes part (that first call makes the group's
  communicator). So the first schedule an engine runs opens the group with an all-reduce of all its ranks
  (`_open_pipe_group`).
- The tensor meta (shapes, dtypes) of the activations into each chunk comes once, in the first message's tick
  (DeepSpeed's own `_send_tensor_meta` / `_recv_tensor_meta` are blocking and fill one shared buffer, which the
  many receives in flight here cannot share); gradients take their outputs' shapes.
- The data is read on the first virtual stage (rank 0, chunk 0) and the last (rank pp - 1, chunk V - 1), in
  micro-batch order, as DeepSpeed's first and last stages read it; the tied, data-parallel and ZeRO-1 reductions
  run once per step after every chunk's backward, DeepSpeed's instructions as under 1F1B.

Every micro-batch crosses the same layers in the same order as under 1F1B, and each weight's gradient sums the
micro-batches in the same order, so fp32 runs agree with 1F1B's to rounding in the gradient norm's sum
(tests/ranks/test_interleaved.py).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule

from threed.parallel.lean_engine import LeanPipelineEngine
from threed.parallel.schedule import interleaved_order

Pass = tuple[str, int, int]  # ("F" | "B", micro-batch, chunk)
# ("act" | "grad", micro-batch, this rank's chunk, the other end's pipeline rank): a send or a receive of one tick
Message = tuple[str, int, int, int]
META_SIZE = 32  # int64 words of one activation meta message: (is tensor, count, then dtype, ndim, *shape each)


@dataclass(frozen=True)
class Tick:
    time: int  # on the common clock
    run: Optional[Pass]  # the pass this rank runs at the tick, if any
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


def ticks(orders: list[list[Pass]], vpp: int) -> list[list[Tick]]:
    """Each rank's passes (`orders[rank]`, in its order) on one clock of unit ticks, with the messages each tick
    sends and receives; ticks where a rank does nothing are left out of its list. Virtual stage k = c x pp + r."""
    pp, last = len(orders), len(orders) * vpp - 1
    done: dict[tuple[str, int, int], int] = {}  # (kind, micro-batch, virtual stage) -> its tick
    placed: list[list[tuple[int, Pass]]] = [[] for _ in range(pp)]
    at, tick = [0] * pp, 0
    while any(at[r] < len(orders[r]) for r in range(pp)):
        ran = False
        for r in range(pp):
            if at[r] == len(orders[r]):
                continue
            kind, j, c = orders[r][at[r]]
            k = c * pp + r
            need = ("F", j, k - 1) if kind == "F" else ("B", j, k + 1) if k < last else ("F", j, k)
            if (kind == "B" or k > 0) and done.get(need, tick) >= tick:
                continue
            done[(kind, j, k)] = tick
            placed[r].append((tick, (kind, j, c)))
            at[r] += 1
            ran = True
        assert ran, f"the pass orders deadlock at tick {tick}"
        tick += 1
    sends: dict[tuple[int, int], list[Message]] = {}
    recvs: dict[tuple[int, int], list[Message]] = {}
    for r in range(pp):
        for t, (kind, j, c) in placed[r]:
            k = c * pp + r
            to = k + 1 if kind == "F" else k - 1
            if 0 <= to <= last and (kind == "B" or k < last):
                what = "act" if kind == "F" else "grad"
                sends.setdefault((r, t), []).append((what, j, c, to % pp))
                recvs.setdefault((to % pp, t), []).append((what, j, to // pp, r))
    out: list[list[Tick]] = []
    for r in range(pp):
        runs = dict(placed[r])
        times = sorted(set(runs) | {t for rank, t in sends if rank == r} | {t for rank, t in recvs if rank == r})
        out.append([Tick(t, runs.get(t), tuple(sends.get((r, t), ())), tuple(recvs.get((r, t), ()))) for t in times])
    return out


@functools.lru_cache(maxsize=64)
def rank_ticks(pp: int, vpp: int, gas: int, stage: int, train: bool = True) -> tuple[Tick, ...]:
    """`ticks` of interleaved_order for one rank (every step asks again: computed once per layout). Without
    `train` (evaluation) the forwards alone, in the same order."""
    orders = [interleaved_order(pp, vpp, gas, s) for s in range(pp)]
    if not train:
        orders = [[p for p in order if p[0] == "F"] for order in orders]
    return tuple(ticks(orders, vpp)[stage])


class Exchange(ds_schedule.PipeInstruction):
    """Post one tick's sends and receives as one batch (`sends`, `recvs`: `Message`s); nothing waits here but the
    first step's meta messages. RecvActivation / RecvGrad wait for the batch that brings their input."""


class InterleavedSchedule(ds_schedule.PipeSchedule):
    """The commands of one rank, tick by tick (`ticks`): receive (wait), load, forward or backward of a
    (micro-batch, chunk) slot, then the tick's Exchange; the gradient reductions and the step at the end.
    `train=False` (eval_batch): the forwards alone, in the same order."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int, vpp: int, train: bool = True):
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.vpp, self.train = vpp, train

    def num_pipe_buffers(self) -> int:
        return self.micro_batches * self.vpp  # one slot per (micro-batch, chunk): slot j x vpp + c

    def steps(self):
        pp, vpp = self.stages, self.vpp
        last = pp * vpp - 1
        for tick in rank_ticks(pp, vpp, self.micro_batches, self.stage_id, self.train):
            cmds: list[ds_schedule.PipeInstruction] = []
            if tick.run is not None:
                kind, j, c = tick.run
                k, slot = c * pp + self.stage_id, j * vpp + c
                if kind == "F":
                    if k in (0, last):  # tokens on the first virtual stage, labels on the last
                        cmds.append(ds_schedule.LoadMicroBatch(slot, chunk=c))
                    if k > 0:
                        cmds.append(ds_schedule.RecvActivation(slot, chunk=c))
                    cmds.append(ds_schedule.ForwardPass(slot, chunk=c))
                else:
                    if k < last:
                        cmds.append(ds_schedule.RecvGrad(slot, chunk=c))
                    cmds.append(ds_schedule.BackwardPass(slot, chunk=c))
            if tick.sends or tick.recvs:
                cmds.append(Exchange(tick=tick.time, sends=tick.sends, recvs=tick.recvs))
            yield cmds
        if self.train:
            yield [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]


class Batch:
    """One tick's posted sends and receives, waited for once: a gloo work waited for a second time waits for a
    second message (torch 2.13's gloo receive times out there). `peers`: the global ranks it sends to."""

    def __init__(self, ops: list, tick: int = -1):
        self.works = dist.batch_isend_irecv(ops)
        self.tick = tick
        self.peers = {op.peer for op in ops if op.op is dist.isend}
        self.sources = {op.peer for op in ops if op.op is dist.irecv}
        self.done = False

    def wait(self) -> None:
        if not self.done:
            for work in self.works:
                work.wait()
            self.done = True


@dataclass
class InFlight:
    """What an interleaved step holds between its commands (`InterleavedEngine`)."""

    recvd: dict[tuple[str, int], tuple[Batch, list[torch.Tensor], bool]] = field(default_factory=dict)
    grads: dict[int, Any] = field(default_factory=dict)  # slot -> received output gradient, until its backward
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # slot -> loss, until its backward
    sends: list[tuple[Batch, list[torch.Tensor]]] = field(default_factory=list)  # kept alive until sent
    heard: dict[int, int] = field(default_factory=dict)  # global rank -> latest tick of a batch received from it
    specs: dict[int, tuple[bool, list]] = field(default_factory=dict)  # chunk -> its activations' meta
    meta_sent: set[int] = field(default_factory=set)  # chunks whose outputs' meta went out

    def clear_step(self) -> None:
        self.recvd.clear()
        self.grads.clear()
        self.losses.clear()
        self.sends.clear()
        self.heard.clear()


def _as_list(x: Any) -> list[torch.Tensor]:
    return [x] if torch.is_tensor(x) else list(x)


class InterleavedEngine(LeanPipelineEngine):
    """DeepSpeed's PipelineEngine running a chunked StagedPipelineModule (vpp > 1) in interleaved 1F1B order.
    Inside a pass `is_first_stage` / `is_last_stage` speak of the virtual stage (DeepSpeed's forward, backward and
    loading ask them); outside, of the rank (data iterators, the loss broadcast)."""

    def is_first_stage(self) -> bool:
        chunk = self.__dict__.get("_chunk")
        return self.stage_id == 0 and chunk in (None, 0)

    def is_last_stage(self) -> bool:
        chunk = self.__dict__.get("_chunk")
        return self.stage_id == self.num_stages - 1 and chunk in (None, self.module.vpp - 1)

    @contextmanager
    def _in_chunk(self, chunk: int):
        self._chunk = chunk
        self.module.activate_chunk(chunk)
        try:
            yield
        finally:
            self._chunk = None
            self.module.activate_chunk(0)

    def _flight(self) -> InFlight:
        return self.__dict__.setdefault("_threed_flight", InFlight())

    def _train_schedule(self):
        return InterleavedSchedule(self.micro_batches, self.num_stages, self.stage_id, self.module.vpp)

    def _inference_schedule(self, micro_batches):
        return InterleavedSchedule(micro_batches, self.num_stages, self.stage_id, self.module.vpp, train=False)

    def reset_activation_shape(self):
        super().reset_activation_shape()
        self._flight().specs.clear()
        self._flight().meta_sent.clear()

    def _exec_schedule(self, pipe_schedule):
        assert not self.dynamic_shape and not self.is_pipe_partitioned, "interleaving sends whole, fixed shapes"
        self._open_pipe_group()
        flight = self._flight()
        flight.clear_step()  # nothing left over from a step that raised
        super()._exec_schedule(pipe_schedule)
        self._wait_for_sends()
        assert not (flight.recvd or flight.grads or flight.losses), "a message or a loss was never used"

    def _p2p(self, op, tensor: torch.Tensor, stage: int) -> dist.P2POp:
        """A send or receive (`op`) of `tensor` with pipeline stage `stage` of this rank's pipeline, on its pipeline
        group: torch takes the peer's global rank and finds its rank in the group (as megatron-core passes it)."""
        return dist.P2POp(op, tensor, self.grid.stage_to_global(stage), group=self.grid.get_pipe_parallel_group())

    def _open_pipe_group(self) -> None:
        """Once per engine, before its first batch of sends and receives: an all-reduce over the whole pipeline group,
        so that the group's first collective has every rank of it (NCCL makes the group's communicator there; a
        batch_isend_irecv of some of its ranks first is undefined behaviour in torch). Every rank of the pipeline
        runs each train_batch / eval_batch, so each reaches this call. The value is unused: no number changes."""
        if self.__dict__.get("_threed_pipe_open"):
            return
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.grid.get_pipe_parallel_group())
        self._threed_pipe_open = True

    def _wait_for_sends(self) -> None:
        flight = self._flight()
        for batch, _ in flight.sends:
            batch.wait()
        flight.sends.clear()

    def _exec_load_micro_batch(self, buffer_id, chunk):
        with self._in_chunk(chunk):
            super()._exec_load_micro_batch(buffer_id)

    def _exec_forward_pass(self, buffer_id, chunk):
        with self._in_chunk(chunk):
            super()._exec_forward_pass(buffer_id)
            if self.is_last_stage() and torch.is_grad_enabled():
                self._flight().losses[buffer_id] = self.loss
        if not torch.is_grad_enabled():  # evaluation: no backward will free them
            self.pipe_buffers["inputs"][buffer_id] = self.pipe_buffers["labels"][buffer_id] = None

    def _exec_backward_pass(self, buffer_id, chunk):
        flight = self._flight()
        with self._in_chunk(chunk):
            first, last = self.is_first_stage(), self.is_last_stage()
            if last:
                self.loss = flight.losses.pop(buffer_id)
            else:
                self.grad_layer = flight.grads.pop(buffer_id)
            super()._exec_backward_pass(buffer_id)
        self.grad_layer = None
        # DeepSpeed's cyclic slots drop the tokens and labels when reused; these slots are one per micro-batch
        # and chunk, so they are dropped here (a middle chunk's input goes with its gradient's send).
        if first:
            self.pipe_buffers["inputs"][buffer_id] = None
        if last:
            self.pipe_buffers["labels"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id, chunk):
        tensors, is_tensor = self._received("act", buffer_id)
        for t in tensors:
            t.requires_grad_(t.is_floating_point())  # DeepSpeed's received activations, as its recv sets them
        self.pipe_buffers["inputs"][buffer_id] = tensors[0] if is_tensor else tuple(tensors)

    def _exec_recv_grads(self, buffer_id, chunk):
        tensors, is_tensor = self._received("grad", buffer_id)
        self._flight().grads[buffer_id] = tensors[0] if is_tensor else tensors

    def _received(self, kind: str, slot: int) -> tuple[list[torch.Tensor], bool]:
        flight = self._flight()
        batch, tensors, is_tensor = flight.recvd.pop((kind, slot))
        batch.wait()
        for peer in batch.sources:
            flight.heard[peer] = max(flight.heard.get(peer, -1), batch.tick)
        self._let_go_of_sends()
        return tensors, is_tensor

    def _let_go_of_sends(self) -> None:
        """Sent tensors (a gradient is referenced by nothing else) are kept until their batch is done. A peer whose
        tick-t batch reached us has posted every receive of its ticks up to t, ours among them: our sends to it up
        to tick t finish without waiting on the peer (gloo's `is_completed` stays False until waited for), so they
        are waited for and let go here, not only at the step's end (gas x vpp gradients held otherwise)."""
        flight = self._flight()
        kept = []
        for batch, tensors in flight.sends:
            # (its receives too: from each source a later batch has come, so this one's is in)
            if all(flight.heard.get(peer, -1) >= batch.tick for peer in batch.peers | batch.sources):
                batch.wait()
            else:
                kept.append((batch, tensors))
        flight.sends[:] = kept

    def _exec_exchange(self, tick, sends, recvs):
        flight, vpp = self._flight(), self.module.vpp
        self._exchange_meta(sends, recvs)
        ops, sent, posted = [], [], []
        for kind, j, chunk, peer in sends:
            tensors = self._outgoing(kind, j * vpp + chunk)
            sent += tensors
            ops += [self._p2p(dist.isend, t, peer) for t in tensors]
        for kind, j, chunk, peer in recvs:
            tensors, is_tensor = self._incoming(kind, j * vpp + chunk, chunk)
            posted.append(((kind, j * vpp + chunk), tensors, is_tensor))
            ops += [self._p2p(dist.irecv, t, peer) for t in tensors]
        batch = Batch(ops, tick)
        for key, tensors, is_tensor in posted:
            flight.recvd[key] = (batch, tensors, is_tensor)
        if sent:
            flight.sends.append((batch, sent))

    def _outgoing(self, kind: str, slot: int) -> list[torch.Tensor]:
        """What a send of slot `slot` carries: the forward's output, or the input's gradient (every floating input)."""
        if kind == "act":
            outputs = self.pipe_buffers["outputs"][slot]
            if not torch.is_grad_enabled():  # evaluation: sent is done with (backward frees it in training)
                self.pipe_buffers["outputs"][slot] = None
            return _as_list(outputs)
        inputs = self.pipe_buffers["inputs"][slot]
        self.pipe_buffers["inputs"][slot] = None  # the input is done with once its gradient is out
        grads = [t.grad for t in _as_list(inputs) if t.is_floating_point()]
        assert all(g is not None for g in grads), "an input of the chunk got no gradient"
        return grads

    def _incoming(self, kind: str, slot: int, chunk: int) -> tuple[list[torch.Tensor], bool]:
        if kind == "act":
            is_tensor, specs = self._flight().specs[chunk]
            return [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs], is_tensor
        outputs = self.pipe_buffers["outputs"][slot]  # the gradient of what this slot's forward sent
        return [torch.empty_like(t) for t in _as_list(outputs) if t.is_floating_point()], torch.is_tensor(outputs)

    def _exchange_meta(self, sends, recvs):
        """The first activation out of a chunk is preceded by its meta, in the same tick at both ends."""
        flight, ops, incoming = self._flight(), [], []
        for kind, j, chunk, peer in sends:
            if kind == "act" and chunk not in flight.meta_sent:
                flight.meta_sent.add(chunk)
                meta = self._meta(self.pipe_buffers["outputs"][j * self.module.vpp + chunk])
                ops.append(self._p2p(dist.isend, meta, peer))
        for kind, j, chunk, peer in recvs:
            if kind == "act" and chunk not in flight.specs:
                buf = torch.zeros(META_SIZE, dtype=torch.int64, device=self.device)
                incoming.append((chunk, buf))
                ops.append(self._p2p(dist.irecv, buf, peer))
        if ops:
            Batch(ops).wait()
        for chunk, buf in incoming:
            flight.specs[chunk] = self._parse_meta(buf.tolist())

    def _meta(self, outputs: Any) -> torch.Tensor:
        words = [int(torch.is_tensor(outputs)), len(_as_list(outputs))]
        for t in _as_list(outputs):
            words += [self.DTYPE_TO_ID[t.dtype], t.dim(), *t.shape]
        assert len(words) <= META_SIZE, words
        return torch.tensor(words + [0] * (META_SIZE - len(words)), dtype=torch.int64, device=self.device)

    def _parse_meta(self, words: list[int]) -> tuple[bool, list[tuple[list[int], torch.dtype]]]:
        specs, at = [], 2
        for _ in range(words[1]):
            ndim = words[at + 1]
            specs.append((words[at + 2 : at + 2 + ndim], self.ID_TO_DTYPE[words[at]]))
            at += 2 + ndim
        return bool(words[0]), specs

    def _exec_reduce_tied_grads(self):
        self._wait_for_sends()
        super()._exec_reduce_tied_grads()

    # DeepSpeed dispatches through this map of functions, not through methods: the overrides go in it too.
    _INSTRUCTION_MAP = {
        **LeanPipelineEngine._INSTRUCTION_MAP,
        ds_schedule.LoadMicroBatch: _exec_load_micro_batch,
        ds_schedule.ForwardPass: _exec_forward_pass,
        ds_schedule.BackwardPass: _exec_backward_pass,
        ds_schedule.RecvActivation: _exec_recv_activations,
        ds_schedule.RecvGrad: _exec_recv_grads,
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        Exchange: _exec_exchange,
    }
