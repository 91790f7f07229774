"""Pipeline parallelism: a model cut into stages, one stage per rank, micro-batches flowing through
them under the 1F1B or the GPipe schedule, each stage's gradients averaged over its data-parallel group
with HFReduce (the Fire-Flyer paper's HaiScale pipeline parallelism, §VII-A).

    ctx = haiscale.init(pipeline_size=2, placement="staggered")
    stage = ByteGPT(config, seed=0).stages(ctx.pipeline_size)[ctx.stage]
    pipe = PipelineParallel(stage, loss_fn=lm_loss, micro_batches=8)        # schedule="1f1b" (or "gpipe")
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.1)
    loss = pipe.train_step(inputs, targets)     # the first stage reads inputs, the last reads targets
    optimizer.step(); optimizer.zero_grad()     # loss: the batch's mean loss on the last stage, else None

The module has two halves. The **schedule** (:func:`make_schedule`, :func:`check_schedules`) is pure:
it says, for one stage, in which order to run forwards, backwards and transfers, and the checker runs
every stage's list against the others under blocking (rendezvous) send/receive semantics to prove the
lists finish and every send meets the receive meant for it. :class:`PipelineParallel` executes such a
list literally: activations and their gradients travel between neighbouring ranks with
``torch.distributed`` ``isend``/``irecv`` on the default (gloo) group, whose timeout (``haiscale.init``'s
``timeout_s``) bounds every wait, so a dead neighbour fails the step with a :class:`PipelineError`
instead of a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

import hfreduce
from haiscale.dist import ParallelContext, get_context

__all__ = ["SCHEDULES", "Compute", "Exchange", "PipelineError", "PipelineParallel", "Schedule", "ScheduleError",
           "Transfer", "check_schedules", "describe", "make_schedule", "peak_stored_activations"]

Schedule = Literal["1f1b", "gpipe"]
SCHEDULES: tuple[Schedule, ...] = ("1f1b", "gpipe")

TransferKind = Literal["recv_activation", "send_activation", "recv_grad", "send_grad"]

DEFAULT_BUCKET_SIZE_BYTES = 4 << 20


# -- the schedule: pure --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Compute:
    """Run one micro-batch through the stage (``forward``) or back through it (``backward``)."""

    kind: Literal["forward", "backward"]
    micro_batch: int


@dataclass(frozen=True)
class Transfer:
    """One message to or from a neighbour: an activation goes to the next stage, its gradient comes back."""

    kind: TransferKind
    micro_batch: int


@dataclass(frozen=True)
class Exchange:
    """Transfers posted together and all waited for before the next action. Pairing a send with a
    receive in one exchange is what keeps 1F1B's steady state from deadlocking under blocking sends:
    neighbours that each send before receiving would wait on each other forever."""

    transfers: tuple[Transfer, ...]


Action = Compute | Exchange


class ScheduleError(ValueError):
    """A schedule that is malformed, deadlocks, or pairs a send with the wrong receive."""


def make_schedule(schedule: Schedule, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """Stage ``stage``'s actions for one training step of ``micro_batches`` micro-batches.

    ``"gpipe"``: every forward, then every backward (in micro-batch order). ``"1f1b"`` (PipeDream-flush,
    Megatron's non-interleaved order): ``stages - stage - 1`` warm-up forwards, then one forward and one
    backward in turn, then the cool-down backwards — so a stage holds at most ``stages - stage``
    micro-batches' activations instead of all of them. Both run the backwards in micro-batch order, so
    gradients accumulate in the same order and the two schedules give bit-identical results.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {schedule!r}")
    if stages < 1:
        raise ValueError(f"stages must be at least 1, not {stages}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside 0..{stages - 1}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be at least 1, not {micro_batches}")
    first, last = stage == 0, stage == stages - 1
    actions: list[Action] = []

    def exchange(*transfers: tuple[TransferKind, int, bool]) -> None:
        chosen = tuple(Transfer(kind, micro_batch) for kind, micro_batch, applies in transfers if applies)
        if chosen:
            actions.append(Exchange(chosen))

    def recv_act(i: int) -> tuple[TransferKind, int, bool]:
        return ("recv_activation", i, not first)

    def send_act(i: int) -> tuple[TransferKind, int, bool]:
        return ("send_activation", i, not last)

    def recv_grad(i: int) -> tuple[TransferKind, int, bool]:
        return ("recv_grad", i, not last)

    def send_grad(i: int) -> tuple[TransferKind, int, bool]:
        return ("send_grad", i, not first)

    if schedule == "gpipe":
        for i in range(micro_batches):
            exchange(recv_act(i))
            actions.append(Compute("forward", i))
            exchange(send_act(i))
        for i in range(micro_batches):
            exchange(recv_grad(i))
            actions.append(Compute("backward", i))
            exchange(send_grad(i))
        return actions

    warmup = min(stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    for i in range(warmup):
        exchange(recv_act(i))
        actions.append(Compute("forward", i))
        exchange(send_act(i))
    if steady:
        exchange(recv_act(warmup))
    for j in range(steady):
        forward = warmup + j
        actions.append(Compute("forward", forward))
        exchange(send_act(forward), recv_grad(j))
        actions.append(Compute("backward", j))
        if j == steady - 1:
            exchange(send_grad(j))
        else:
            exchange(send_grad(j), recv_act(forward + 1))
    for j in range(steady, micro_batches):
        exchange(recv_grad(j))
        actions.append(Compute("backward", j))
        exchange(send_grad(j))
    return actions


_SHORT = {"forward": "F", "backward": "B", "recv_activation": "ra", "send_activation": "sa",
          "recv_grad": "rg", "send_grad": "sg"}


def describe(actions: Sequence[Action]) -> list[str]:
    """A compact spelling for tables and messages: ``F0``/``B0`` compute, ``ra0 sa0 rg0 sg0`` transfers
    (receive/send activation/gradient of micro-batch 0), ``sa1+rg0`` one exchange of two transfers."""
    out = []
    for action in actions:
        if isinstance(action, Compute):
            out.append(f"{_SHORT[action.kind]}{action.micro_batch}")
        else:
            out.append("+".join(f"{_SHORT[t.kind]}{t.micro_batch}" for t in action.transfers))
    return out


def peak_stored_activations(actions: Sequence[Action]) -> int:
    """The most micro-batches whose forward has run and backward has not, at any point of ``actions``:
    what the stage keeps in memory (inputs, outputs and autograd graphs)."""
    live = peak = 0
    for action in actions:
        if isinstance(action, Compute):
            live += 1 if action.kind == "forward" else -1
            peak = max(peak, live)
    return peak


def _check_stage(stage: int, stages: int, micro_batches: int, actions: Sequence[Action]) -> None:
    """Every micro-batch forwarded and backwarded once, each transfer once, each in a sensible order:
    an activation is received before its forward and sent after it, a gradient received before its
    backward and sent after it; the first stage receives no activations, the last sends none."""
    first, last = stage == 0, stage == stages - 1
    seen: dict[tuple[str, int], int] = {}
    for index, action in enumerate(actions):
        items: Sequence[Compute | Transfer] = (action,) if isinstance(action, Compute) else action.transfers
        if isinstance(action, Exchange) and not action.transfers:
            raise ScheduleError(f"stage {stage}: action {index} is an empty exchange")
        for item in items:
            key = (item.kind, item.micro_batch)
            if not 0 <= item.micro_batch < micro_batches:
                raise ScheduleError(f"stage {stage}: {describe([action])[0]} names micro-batch {item.micro_batch}, "
                                    f"outside 0..{micro_batches - 1}")
            if key in seen:
                raise ScheduleError(f"stage {stage}: {item.kind} of micro-batch {item.micro_batch} appears twice")
            if item.kind in ("recv_activation", "send_grad") and first:
                raise ScheduleError(f"stage {stage}: the first stage has no previous stage to {item.kind}")
            if item.kind in ("send_activation", "recv_grad") and last:
                raise ScheduleError(f"stage {stage}: the last stage has no next stage to {item.kind}")
            seen[key] = index
    required = [("forward", True), ("backward", True), ("recv_activation", not first), ("send_activation", not last),
                ("recv_grad", not last), ("send_grad", not first)]
    for kind, needed in required:
        for i in range(micro_batches):
            if needed and (kind, i) not in seen:
                raise ScheduleError(f"stage {stage}: no {kind} of micro-batch {i}")
    # (earlier, later): the first must come in a strictly earlier action than the second.
    # A gradient is received into a buffer shaped like the forward's output, so the forward comes first.
    order = [("recv_activation", "forward"), ("forward", "send_activation"), ("forward", "backward"),
             ("forward", "recv_grad"), ("recv_grad", "backward"), ("backward", "send_grad")]
    for before, after in order:
        for i in range(micro_batches):
            if (before, i) in seen and (after, i) in seen and seen[(before, i)] >= seen[(after, i)]:
                raise ScheduleError(f"stage {stage}: {after} of micro-batch {i} does not come after its {before}")


def check_schedules(schedules: Sequence[Sequence[Action]], micro_batches: int) -> None:
    """Prove that the stages' action lists (``schedules[s]`` is stage ``s``'s) finish together.

    Each list is checked on its own (:func:`_check_stage`), then all are run against each other with
    **blocking** semantics: a send completes only when the neighbour has posted the matching receive in
    its current exchange (a rendezvous; gloo and NCCL may buffer small messages, and a schedule that
    finishes without buffering finishes with it), an exchange ends when all its transfers have, and a
    compute action always proceeds. Messages on one link are matched in order (as gloo matches them per
    tag), so the k-th send must carry the micro-batch the k-th receive expects. Raises
    :class:`ScheduleError` naming where each stage is stuck if no stage can move before all are done.
    """
    stages = len(schedules)
    if stages < 1:
        raise ScheduleError("no stages")
    for stage, actions in enumerate(schedules):
        _check_stage(stage, stages, micro_batches, actions)
    # Each transfer's place on its link: (link, sequence number). A link is (sender, receiver, what).
    Link = tuple[int, int, str]
    place: list[dict[Transfer, tuple[Link, int]]] = []
    for stage, actions in enumerate(schedules):
        counts: dict[Link, int] = {}
        mine: dict[Transfer, tuple[Link, int]] = {}
        for action in actions:
            if isinstance(action, Exchange):
                for t in action.transfers:
                    if t.kind == "send_activation":
                        link: Link = (stage, stage + 1, "activation")
                    elif t.kind == "recv_activation":
                        link = (stage - 1, stage, "activation")
                    elif t.kind == "recv_grad":
                        link = (stage + 1, stage, "grad")
                    else:
                        link = (stage, stage - 1, "grad")
                    mine[t] = (link, counts.get(link, 0))
                    counts[link] = counts.get(link, 0) + 1
        place.append(mine)
    pcs = [0] * stages
    done: list[set[Transfer]] = [set() for _ in range(stages)]

    def current(stage: int) -> Exchange | None:
        if pcs[stage] < len(schedules[stage]):
            action = schedules[stage][pcs[stage]]
            if isinstance(action, Exchange):
                return action
        return None

    while True:
        moved = False
        for stage in range(stages):
            while pcs[stage] < len(schedules[stage]):
                action = schedules[stage][pcs[stage]]
                if isinstance(action, Exchange) and not all(t in done[stage] for t in action.transfers):
                    break
                pcs[stage] += 1
                done[stage] = set()
                moved = True
        for stage in range(stages):
            exchange = current(stage)
            if exchange is None:
                continue
            for send in exchange.transfers:
                if not send.kind.startswith("send") or send in done[stage]:
                    continue
                link, number = place[stage][send]
                peer = link[1]
                if not 0 <= peer < stages:
                    continue
                theirs = current(peer)
                if theirs is None:
                    continue
                for recv in theirs.transfers:
                    if recv.kind.startswith("recv") and recv not in done[peer] and place[peer][recv] == (link, number):
                        if recv.micro_batch != send.micro_batch:
                            raise ScheduleError(f"stage {stage} sends the {link[2]} of micro-batch {send.micro_batch} "
                                                f"where stage {peer} receives micro-batch {recv.micro_batch}")
                        done[stage].add(send)
                        done[peer].add(recv)
                        moved = True
        if not moved:
            break
    if any(pcs[stage] < len(schedules[stage]) for stage in range(stages)):
        stuck = [f"stage {stage} at action {pcs[stage]} ({describe([schedules[stage][pcs[stage]]])[0]})"
                 for stage in range(stages) if pcs[stage] < len(schedules[stage])]
        raise ScheduleError("deadlock: " + "; ".join(stuck))


# -- the executor -----------------------------------------------------------------------------------------------


class PipelineError(RuntimeError):
    """A pipeline step failed: a neighbour died, timed out or sent something this stage cannot use."""


# Activation headers: the dtype's index here, the number of dimensions, then the dimensions.
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAX_DIMS = 8
_HEADER_LEN = 2 + _MAX_DIMS
# One tag per kind of message: gloo matches messages from one peer in order per tag.
_TAG_HEADER, _TAG_ACTIVATION, _TAG_GRAD = 1, 2, 3


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _DTYPES:
        raise PipelineError(f"a stage's output must be a floating-point tensor ({', '.join(map(str, _DTYPES))}) "
                            f"so that its gradient can come back, not {tensor.dtype}")
    if tensor.dim() > _MAX_DIMS:
        raise PipelineError(f"a stage's output has {tensor.dim()} dimensions; at most {_MAX_DIMS} travel")
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[0] = _DTYPES.index(tensor.dtype)
    header[1] = tensor.dim()
    header[2:2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def _from_header(header: torch.Tensor, peer: int) -> torch.Tensor:
    code, ndim = int(header[0]), int(header[1])
    shape = [int(d) for d in header[2:2 + ndim]] if 0 <= ndim <= _MAX_DIMS else []
    if not 0 <= code < len(_DTYPES) or not 0 <= ndim <= _MAX_DIMS or any(d < 0 for d in shape):
        raise PipelineError(f"rank {peer} sent an activation header this stage cannot read: {header.tolist()}")
    return torch.empty(shape, dtype=_DTYPES[code])


class _GradientAverager:
    """Averages a stage's gradients over its data-parallel group with HFReduce while the step's last
    backward is still running.

    Parameters are put in buckets in reverse registration order (roughly the order backward finishes
    them), at most ``bucket_size_bytes`` each and of one dtype, each with a flat registered buffer
    (``comm.shared_tensor``: node-mates reduce it in place). During the last micro-batch's backward a
    hook counts the gradients that are final; a bucket whose gradients are all final is copied in and
    its asynchronous allreduce starts at once — in bucket order only, so every replica issues the same
    collectives in the same order even if hooks fire in a different order. :meth:`finish` starts what is
    left, waits, and copies the averages out. A parameter that gets no gradient (a layer the forward
    skips) contributes zeros, and holds its bucket and every later one back until the backward ends.
    """

    def __init__(self, params: Sequence[nn.Parameter], comm: hfreduce.Communicator, bucket_size_bytes: int,
                 where: str) -> None:
        self.comm = comm
        self.where = where
        """Who is averaging, for errors: HFReduce names the group's ranks by their place in the group."""
        self.buckets: list[list[nn.Parameter]] = []
        size = 0
        for param in reversed(params):
            nbytes = param.numel() * param.element_size()
            bucket = self.buckets[-1] if self.buckets else None
            if bucket is None or bucket[0].dtype != param.dtype or size + nbytes > bucket_size_bytes:
                self.buckets.append([param])
                size = nbytes
            else:
                bucket.append(param)
                size += nbytes
        self.buffers = [comm.shared_tensor((sum(p.numel() for p in bucket),), bucket[0].dtype)
                        for bucket in self.buckets]
        self.bucket_of = {id(p): index for index, bucket in enumerate(self.buckets) for p in bucket}
        self.armed = False
        self.ready = [0] * len(self.buckets)
        self.works: list[hfreduce.Work] = []
        self.overlapped = 0
        """How many buckets of the last step started reducing while the backward was still running."""
        # torch leaves this method unannotated.
        self.handles = [p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                        for p in params]

    def arm(self) -> None:
        """The next backward is the step's last: start reducing buckets as their gradients become final."""
        self.armed = True
        self.ready = [0] * len(self.buckets)
        self.works = []
        self.overlapped = 0

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.armed:
            return
        self.ready[self.bucket_of[id(param)]] += 1
        while len(self.works) < len(self.buckets) and self.ready[len(self.works)] == len(self.buckets[len(self.works)]):
            self._start(len(self.works))
            self.overlapped += 1

    def _start(self, index: int) -> None:
        buffer, offset = self.buffers[index], 0
        for param in self.buckets[index]:
            piece = buffer[offset:offset + param.numel()]
            if param.grad is None:
                piece.zero_()
            else:
                piece.copy_(param.grad.detach().reshape(-1))
            offset += param.numel()
        self.works.append(self.comm.allreduce(buffer, op=hfreduce.ReduceOp.AVG, async_op=True))

    def finish(self) -> None:
        self.armed = False
        while len(self.works) < len(self.buckets):
            self._start(len(self.works))
        for index, work in enumerate(self.works):
            try:
                work.wait()
            except hfreduce.HFReduceError as exc:
                raise PipelineError(f"{self.where}: averaging the stage's gradients over its data-parallel group "
                                    f"failed: {exc}") from exc
            buffer, offset = self.buffers[index], 0
            with torch.no_grad():
                for param in self.buckets[index]:
                    average = buffer[offset:offset + param.numel()].view_as(param)
                    if param.grad is None:
                        param.grad = average.clone()
                    else:
                        param.grad.copy_(average)
                    offset += param.numel()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


@dataclass
class _StepState:
    inputs: list[torch.Tensor]
    """The first stage's micro-batches of inputs."""
    received: dict[int, torch.Tensor]
    """Activations received from the previous stage, until their micro-batch's backward."""
    outputs: dict[int, torch.Tensor]
    """Forwarded, not yet backwarded: the stage's output (or the weighted loss on the last stage)."""
    grads_in: dict[int, torch.Tensor]
    grads_out: dict[int, torch.Tensor]
    targets: list[torch.Tensor]
    weights: list[float]
    loss: torch.Tensor | None = None


class PipelineParallel:
    """Trains one pipeline stage: ``train_step`` runs the schedule over the micro-batches of one batch
    and leaves the batch's gradients (averaged over the data-parallel group) in the stage's ``.grad``.

    Creating it is collective over the stage's data-parallel group when ``ctx.data_size > 1`` (it
    registers the gradient buffers with HFReduce); ``train_step`` is collective over the whole job.

    ``loss_fn(output, targets)`` must average over the samples of its micro-batch (as ``lm_loss`` and
    torch's default reductions do): each micro-batch's loss is weighted by its share of the batch, so the
    gradients equal one pass over the whole batch even when the batch does not divide evenly (micro-batches
    are ``torch.tensor_split``'s: sizes differ by at most one). The value returned on the last stage is
    that weighted sum — the batch's mean loss, detached; other stages return ``None`` (the loss is not
    broadcast: that would cost every step a message for a number only logging wants). With data
    parallelism it is this replica's loss.
    """

    def __init__(self, stage_module: nn.Module, *, ctx: ParallelContext | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], micro_batches: int,
                 schedule: Schedule = "1f1b", bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES) -> None:
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"micro_batches must be a positive integer, not {micro_batches!r}")
        if bucket_size_bytes < 1:
            raise ValueError(f"bucket_size_bytes must be positive, not {bucket_size_bytes}")
        self.ctx = ctx if ctx is not None else get_context()
        self.module = stage_module
        self.loss_fn = loss_fn
        self.micro_batches = micro_batches
        self.schedule: Schedule = schedule
        self.stage, self.stages = self.ctx.stage, self.ctx.pipeline_size
        self.actions = make_schedule(schedule, self.stage, self.stages, micro_batches)
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        self.timeout = timedelta(seconds=self.ctx.timeout_s)
        self.peak_stored = 0
        """The most micro-batches whose activations this stage held at once in the last step."""
        params = [p for p in stage_module.parameters() if p.requires_grad]
        group = self.ctx.layout.dp_group(self.stage)
        where = (f"pipeline stage {self.stage} (rank {self.ctx.rank}; its data-parallel group's ranks "
                 f"0..{len(group) - 1} are global ranks {', '.join(map(str, group))})")
        self._averager = (_GradientAverager(params, self.ctx.dp_comm, bucket_size_bytes, where)
                          if self.ctx.data_size > 1 and params else None)

    @property
    def gradient_buckets(self) -> tuple[int, int]:
        """``(overlapped, total)``: of the stage's gradient buckets, how many started their allreduce during
        the last step's final backward (the rest started after it); ``(0, 0)`` without data parallelism."""
        if self._averager is None:
            return 0, 0
        return self._averager.overlapped, len(self._averager.buckets)

    def train_step(self, inputs: torch.Tensor | None = None,
                   targets: torch.Tensor | None = None) -> torch.Tensor | None:
        """One batch forward and backward through the pipeline. The first stage must pass ``inputs``
        and the last ``targets`` (dimension 0 is the batch, at least ``micro_batches`` long); other stages
        may pass them too (handy when every rank loads the whole batch) and they are not read."""
        state = _StepState(inputs=[], received={}, outputs={}, grads_in={}, grads_out={}, targets=[], weights=[])
        if self.first:
            state.inputs = self._split(inputs, "inputs")
        if self.last:
            state.targets = self._split(targets, "targets")
            total = sum(t.shape[0] for t in state.targets)
            state.weights = [t.shape[0] / total for t in state.targets]
        self.peak_stored = 0
        if self._averager is not None:
            self._averager.armed = False  # a step that failed in its last backward left it armed
        for action in self.actions:
            if isinstance(action, Exchange):
                self._exchange(action, state)
            elif action.kind == "forward":
                self._forward(action.micro_batch, state)
            else:
                if self._averager is not None and action.micro_batch == self.micro_batches - 1:
                    self._averager.arm()
                self._backward(action.micro_batch, state)
        if self._averager is not None:
            self._averager.finish()
        return state.loss

    def _split(self, batch: torch.Tensor | None, what: str) -> list[torch.Tensor]:
        if batch is None:
            raise ValueError(f"stage {self.stage} of {self.stages} needs the batch's {what}")
        if not isinstance(batch, torch.Tensor) or batch.dim() < 1:
            raise ValueError(f"{what} must be a tensor whose dimension 0 is the batch, not {type(batch).__name__}")
        if batch.shape[0] < self.micro_batches:
            raise ValueError(f"a batch of {batch.shape[0]} samples cannot make {self.micro_batches} micro-batches")
        return list(torch.tensor_split(batch, self.micro_batches))

    def _forward(self, i: int, state: _StepState) -> None:
        x = state.inputs[i] if self.first else state.received[i]
        out = self.module(x)
        if not isinstance(out, torch.Tensor):
            raise PipelineError(f"stage {self.stage} returned {type(out).__name__}: a stage must return one tensor")
        if self.last:
            target = state.targets[i]
            if out.shape[0] != target.shape[0]:
                raise PipelineError(f"micro-batch {i} reached the last stage with {out.shape[0]} samples but its "
                                    f"targets have {target.shape[0]}: inputs and targets must have the same batch size")
            out = self.loss_fn(out, target) * state.weights[i]
            weighted = out.detach()
            state.loss = weighted if state.loss is None else state.loss + weighted
        state.outputs[i] = out
        self.peak_stored = max(self.peak_stored, len(state.outputs))

    def _backward(self, i: int, state: _StepState) -> None:
        out = state.outputs.pop(i)
        if self.last:
            torch.autograd.backward(out)
        else:
            torch.autograd.backward(out, grad_tensors=state.grads_in.pop(i))
        if not self.first:
            x = state.received.pop(i)
            state.grads_out[i] = x.grad if x.grad is not None else torch.zeros_like(x)

    def _exchange(self, exchange: Exchange, state: _StepState) -> None:
        """Post every transfer of the exchange, then wait for all of them (a receive's payload is posted
        when its header has arrived); each wait is bounded by the default group's timeout."""
        pending: list[tuple[Any, str]] = []
        headers: list[tuple[int, torch.Tensor, Any]] = []
        keep: list[torch.Tensor] = []  # what an isend reads must outlive the wait
        previous, following = self.ctx.previous_rank, self.ctx.next_rank
        for t in exchange.transfers:
            if t.kind == "send_activation":
                assert following is not None
                out = state.outputs[t.micro_batch].detach().contiguous()
                header = _header(out)
                keep += [out, header]
                what = f"sending the activation of micro-batch {t.micro_batch} to rank {following}"
                pending.append((self._post(dist.isend, header, following, _TAG_HEADER, what), what))
                pending.append((self._post(dist.isend, out, following, _TAG_ACTIVATION, what), what))
            elif t.kind == "send_grad":
                assert previous is not None
                grad = state.grads_out.pop(t.micro_batch).contiguous()
                keep.append(grad)
                what = f"sending the gradient of micro-batch {t.micro_batch} to rank {previous}"
                pending.append((self._post(dist.isend, grad, previous, _TAG_GRAD, what), what))
            elif t.kind == "recv_grad":
                assert following is not None
                grad = torch.empty_like(state.outputs[t.micro_batch])
                state.grads_in[t.micro_batch] = grad
                what = f"receiving the gradient of micro-batch {t.micro_batch} from rank {following}"
                pending.append((self._post(dist.irecv, grad, following, _TAG_GRAD, what), what))
            else:
                assert previous is not None
                header = torch.empty(_HEADER_LEN, dtype=torch.int64)
                what = f"receiving the activation of micro-batch {t.micro_batch} from rank {previous}"
                headers.append((t.micro_batch, header, self._post(dist.irecv, header, previous, _TAG_HEADER, what)))
        for micro_batch, header, work in headers:
            what = f"receiving the activation of micro-batch {micro_batch} from rank {previous}"
            self._wait(work, what)
            assert previous is not None
            activation = _from_header(header, previous)
            pending.append((self._post(dist.irecv, activation, previous, _TAG_ACTIVATION, what), what))
            state.received[micro_batch] = activation
        for work, what in pending:
            self._wait(work, what)
        for micro_batch in [h[0] for h in headers]:
            state.received[micro_batch].requires_grad_(True)

    def _post(self, op: Callable[..., Any], tensor: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        try:
            return op(tensor, peer, tag=tag)
        except RuntimeError as exc:
            raise self._error(what, exc) from exc

    def _wait(self, work: Any, what: str) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> PipelineError:
        return PipelineError(f"pipeline stage {self.stage} (rank {self.ctx.rank}): {what} failed: {exc}")

    def close(self) -> None:
        """Remove the gradient hooks (the stage module can then be trained another way)."""
        if self._averager is not None:
            self._averager.close()
