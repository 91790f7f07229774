"""Data parallelism on HFReduce: every rank holds the whole model, and backward averages the gradients.

    import haiscale
    from haiscale.ddp import DistributedDataParallel

    ctx = haiscale.init()
    model = DistributedDataParallel(model)            # parameters and buffers: dp rank 0's, bit for bit
    optimizer = torch.optim.AdamW(model.parameters())
    for inputs, targets in my_share_of_the_batches:
        loss = loss_fn(model(inputs), targets)
        loss.backward()                               # returns with every gradient averaged over the group
        optimizer.step()
        optimizer.zero_grad()

This is the paper's HaiScale DDP (Fire-Flyer AI-HPC §V-A): gradients are reduced by HFReduce on the
CPU, asynchronously to the backward pass that is still computing the earlier layers' gradients.

How a backward pass goes:

* At construction the parameters that require a gradient are cut into **buckets** in reverse
  registration order — the order in which backward produces their gradients — each at most
  ``bucket_cap_mb`` (the first, like torch's DDP, at most 1 MiB, so that communication starts as early
  as possible; a parameter larger than the cap gets a bucket of its own). The buckets of one dtype
  are consecutive slices of one buffer from ``comm.shared_tensor``: registered host memory that the
  node's other ranks map too, so HFReduce reduces it in place with no copy in or out.
* With ``gradient_as_bucket_view`` (the default) every parameter's ``.grad`` *is* its slice of the
  bucket, so backward accumulates straight into registered memory. A gradient that is not the view
  — the first backward, or after ``optimizer.zero_grad(set_to_none=True)`` freed it — is copied into
  the view once, and ``.grad`` re-pointed at it (what torch's DDP does too); with
  ``zero_grad(set_to_none=False)`` the views simply stay.
* A hook after each parameter's gradient accumulation marks it ready; as soon as a bucket's
  parameters are all ready its ``allreduce(AVG, async_op=True)`` starts, while backward goes on.
  Buckets start strictly in bucket order on every rank (HFReduce requires the same collectives in the
  same order everywhere), so a bucket that is ready early waits for the ones before it.
* At the end of backward (a callback queued on torch's autograd engine, as torch's DDP does) every
  bucket not yet started is started and every bucket is waited for: when ``backward()`` returns,
  each ``.grad`` holds the group's average. A failed reduction — a dead peer, a timeout, ranks that
  disagree — is raised from ``backward()`` itself (HFReduce fails every rank's pending and later
  operations, so the next step raises too); nothing waits without a bound.

Parameters that get no gradient in a backward pass (unused in this forward, on this rank) are not
searched for (there is no ``find_unused_parameters``): their bucket starts at the end of backward,
and each such parameter contributes its current ``.grad`` — zero if it has none. Every parameter
therefore ends the synchronized backward with the group's average as its ``.grad``, the same on every
rank, even one that no rank used (then zero, where torch's DDP would leave ``None``: an optimizer with
weight decay still moves such a parameter, identically on every rank).

``no_sync()`` skips all communication: gradients accumulate locally (in the views), and the next
synchronized backward reduces the accumulated sums.

``state_dict()`` and ``load_state_dict()`` use the wrapped module's keys (no ``module.`` prefix), so
a checkpoint of the wrapper loads into the bare model and the other way round.

Limits: CPU parameters only; one synchronized backward per iteration; parameters that require a
gradient must not change after construction (the buckets are fixed then). The hooks stay on the
parameters, so a wrapped module keeps reducing its gradients even when called without the wrapper;
wrap a copy for anything else. Registered buffers live until the communicator shuts down, so
wrapping a model again allocates new ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import hfreduce
from haiscale.dist import get_context

__all__ = ["DEFAULT_BUCKET_CAP_MB", "FIRST_BUCKET_CAP_BYTES", "DistributedDataParallel"]

DEFAULT_BUCKET_CAP_MB = 25.0
FIRST_BUCKET_CAP_BYTES = 1 << 20
"""The first bucket (the last layers' gradients, produced first) is kept small so that the first
allreduce starts early — torch's DDP does the same."""

_REDUCIBLE = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_BROADCAST_ALIGN_BYTES = 8


@dataclass(eq=False)
class _Slot:
    """One parameter's place: its bucket, and its gradient's view in the bucket's registered memory."""

    name: str
    param: nn.Parameter
    bucket: int
    view: torch.Tensor
    ready: bool = False


@dataclass(eq=False)
class _Bucket:
    index: int
    flat: torch.Tensor
    slots: list[_Slot] = field(default_factory=list)
    pending: int = 0
    work: hfreduce.Work | None = None


class DistributedDataParallel(nn.Module):
    """``module`` replicated over a data-parallel group, gradients averaged by HFReduce (module doc).

    ``comm``: the group's communicator (default: ``haiscale.get_context().dp_comm``). Construction is
    collective: every rank of the group must wrap a module with the same parameters and buffers.
    """

    def __init__(self, module: nn.Module, *, comm: hfreduce.Communicator | None = None,
                 bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, broadcast_buffers: bool = True,
                 gradient_as_bucket_view: bool = True) -> None:
        super().__init__()
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, not {bucket_cap_mb}")
        if comm is None:
            comm = get_context().dp_comm
        self.module = module
        self.comm = comm
        self.broadcast_buffers = broadcast_buffers
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.bucket_cap_bytes = int(bucket_cap_mb * (1 << 20))
        self._require_sync = True
        self._in_backward = False
        self._next_bucket = 0

        named = list(module.named_parameters())
        buffers = [buffer for _, buffer in module.named_buffers()]
        # Every rank must hold the same parameters before anything is broadcast into them: checked
        # first, with a collective of fixed size that cannot itself disagree.
        _check_same_everywhere(comm, named, list(module.named_buffers()))
        for name, param in named:
            if param.device.type != "cpu":
                raise ValueError(f"parameter {name} is on {param.device}: haiscale's DDP takes CPU parameters")
            if param.requires_grad and param.dtype not in _REDUCIBLE:
                raise ValueError(f"parameter {name} is {param.dtype}: HFReduce reduces float32, float64, float16 "
                                 f"and bfloat16 gradients")
        _broadcast_bitwise(comm, [param for _, param in named] + buffers)
        self._slots, self._buckets = self._make_buckets([(n, p) for n, p in named if p.requires_grad])
        self._hooks = [slot.param.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            self._make_hook(slot)) for slot in self._slots]
        self.register_state_dict_post_hook(_strip_module_prefix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_module_prefix)  # type: ignore[no-untyped-call]

    # -- construction -----------------------------------------------------------------------------

    def _make_buckets(self, named: list[tuple[str, nn.Parameter]]) -> tuple[list[_Slot], list[_Bucket]]:
        """Buckets in reverse registration order, one dtype each, each a slice of a registered buffer."""
        plan: list[tuple[torch.dtype, list[tuple[str, nn.Parameter]]]] = []
        open_bucket: dict[torch.dtype, int] = {}
        open_bytes: dict[torch.dtype, int] = {}
        for name, param in reversed(named):
            nbytes = param.numel() * param.element_size()
            # Bucket 0 holds the first gradients produced: kept small so communication starts early.
            cap = min(FIRST_BUCKET_CAP_BYTES, self.bucket_cap_bytes) if open_bucket.get(param.dtype) == 0 \
                else self.bucket_cap_bytes
            index = open_bucket.get(param.dtype)
            if index is None or (open_bytes[param.dtype] > 0 and open_bytes[param.dtype] + nbytes > cap):
                index = len(plan)
                plan.append((param.dtype, []))
                open_bucket[param.dtype], open_bytes[param.dtype] = index, 0
            plan[index][1].append((name, param))
            open_bytes[param.dtype] += nbytes
        # One registered buffer per dtype (every rank allocates them in the same order: a collective).
        totals: dict[torch.dtype, int] = {}
        for dtype, members in plan:
            totals[dtype] = totals.get(dtype, 0) + sum(p.numel() for _, p in members)
        regions = {dtype: self.comm.shared_tensor((total,), dtype) for dtype, total in totals.items()}
        offsets = dict.fromkeys(totals, 0)
        slots: list[_Slot] = []
        buckets: list[_Bucket] = []
        for index, (dtype, members) in enumerate(plan):
            start = offsets[dtype]
            size = sum(p.numel() for _, p in members)
            bucket = _Bucket(index, regions[dtype][start:start + size])
            position = 0
            for name, param in members:
                view = bucket.flat[position:position + param.numel()].view(param.shape)
                position += param.numel()
                slot = _Slot(name, param, index, view)
                bucket.slots.append(slot)
                slots.append(slot)
                if self.gradient_as_bucket_view:
                    with torch.no_grad():
                        if param.grad is not None:
                            view.copy_(param.grad)
                        else:
                            view.zero_()
                    param.grad = view if param.grad is not None else None
            bucket.pending = len(bucket.slots)
            offsets[dtype] = start + size
            buckets.append(bucket)
        return slots, buckets

    def bucket_names(self) -> list[list[str]]:
        """The parameters of each bucket, in the order the buckets are reduced (introspection)."""
        return [[slot.name for slot in bucket.slots] for bucket in self._buckets]

    # -- forward ----------------------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._in_backward:
            raise RuntimeError("the previous backward pass did not finish (it raised before its end): the ranks' "
                               "gradient reductions no longer line up; rebuild the job")
        if self.broadcast_buffers and self._require_sync and torch.is_grad_enabled():
            # Buffers (running statistics) follow dp rank 0, as torch's DDP does before each training
            # forward; not under no_grad (evaluation may run a different number of times per rank).
            buffers = list(self.module.buffers())
            if buffers:
                _broadcast_bitwise(self.comm, buffers)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next one outside reduces the sums."""
        previous, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = previous

    # -- backward ---------------------------------------------------------------------------------

    def _make_hook(self, slot: _Slot) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._grad_ready(slot)
        return hook

    def _grad_ready(self, slot: _Slot) -> None:
        """Runs on the autograd thread right after ``slot``'s gradient was accumulated into ``.grad``."""
        if not self._require_sync:
            return
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if slot.ready:
            raise RuntimeError(f"parameter {slot.name} received its gradient twice in one synchronized backward "
                               f"pass (reentrant backward is not supported)")
        self._take_grad(slot)
        slot.ready = True
        bucket = self._buckets[slot.bucket]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._start_ready_buckets()

    def _take_grad(self, slot: _Slot) -> None:
        """Put the parameter's gradient (zero if it has none) into its bucket view."""
        grad = slot.param.grad
        with torch.no_grad():
            if grad is None:
                slot.view.zero_()
            elif grad.data_ptr() != slot.view.data_ptr():
                slot.view.copy_(grad)
            else:
                return
        if self.gradient_as_bucket_view:
            slot.param.grad = slot.view

    def _start_ready_buckets(self) -> None:
        while self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0:
            bucket = self._buckets[self._next_bucket]
            bucket.work = self.comm.allreduce(bucket.flat, op=hfreduce.ReduceOp.AVG, async_op=True)
            self._next_bucket += 1

    def _finish_backward(self) -> None:
        """End of backward: start what is left (unused parameters count as their current grad), wait."""
        try:
            for bucket in self._buckets[self._next_bucket:]:
                for slot in bucket.slots:
                    if not slot.ready:
                        self._take_grad(slot)
                        slot.ready = True
                bucket.pending = 0
            self._start_ready_buckets()
            for bucket in self._buckets:
                assert bucket.work is not None
                bucket.work.wait()
            for slot in self._slots:
                if not self.gradient_as_bucket_view:
                    grad = slot.param.grad
                    if grad is None:
                        slot.param.grad = slot.view.clone()
                    else:
                        with torch.no_grad():
                            grad.copy_(slot.view)
                elif slot.param.grad is None or slot.param.grad.data_ptr() != slot.view.data_ptr():
                    slot.param.grad = slot.view
        finally:
            self._in_backward = False
            self._next_bucket = 0
            for bucket in self._buckets:
                bucket.work = None
                bucket.pending = len(bucket.slots)
                for slot in bucket.slots:
                    slot.ready = False


def _describe(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    return "\n".join(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad}" for name, t in tensors).encode()


def _check_same_everywhere(comm: hfreduce.Communicator, params: list[tuple[str, nn.Parameter]],
                           buffers: list[tuple[str, torch.Tensor]]) -> None:
    """Every rank of the group holds the same parameters and buffers (names, shapes, dtypes), or every
    rank raises the same clear error — before any broadcast could copy rank 0's bytes into a tensor
    of another shape."""
    digest = int.from_bytes(hashlib.blake2b(_describe(list(params)) + b"\0" + _describe(buffers),
                                            digest_size=7).digest(), "big")
    numel = sum(p.numel() for _, p in params)
    mine = [len(params), numel, len(buffers), digest]
    both = torch.tensor(mine + [-value for value in mine], dtype=torch.int64)
    comm.allreduce(both, op=hfreduce.ReduceOp.MAX)
    highest, lowest = both[:4].tolist(), [-value for value in both[4:].tolist()]
    if highest != mine or lowest != mine:
        what = ("parameters", "parameter elements", "buffers")
        spread = "; ".join(f"{label}: {low} to {high}" for label, low, high in zip(what, lowest, highest, strict=False)
                           if low != high)
        raise ValueError(f"the ranks of the data-parallel group wrap different models: this rank (rank "
                         f"{comm.rank} of {comm.world_size}) has {len(params)} parameters of {numel} elements and "
                         f"{len(buffers)} buffers; over the group "
                         f"{spread or 'the same counts, but other parameter names, shapes or dtypes'}")


def _broadcast_bitwise(comm: hfreduce.Communicator, tensors: list[torch.Tensor]) -> None:
    """Rank 0's bytes of every tensor into every rank's, in one broadcast (any dtype: bool masks too)."""
    if not tensors:
        return
    spans: list[tuple[int, int]] = []
    total = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        spans.append((total, nbytes))
        total += -(-nbytes // _BROADCAST_ALIGN_BYTES) * _BROADCAST_ALIGN_BYTES
    packed = torch.zeros(max(total, _BROADCAST_ALIGN_BYTES), dtype=torch.uint8)
    with torch.no_grad():
        for tensor, (start, nbytes) in zip(tensors, spans, strict=True):
            packed[start:start + nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        comm.broadcast(packed.view(torch.int32), src=0)
        for tensor, (start, nbytes) in zip(tensors, spans, strict=True):
            tensor.copy_(packed[start:start + nbytes].view(tensor.dtype).view(tensor.shape))


def _strip_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict()`` gives the wrapped module's keys: ``x``, not ``module.x``."""
    inner = prefix + "module."
    for key in [key for key in state_dict if key.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_module_prefix(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
                       strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                       error_msgs: list[str]) -> None:
    """``load_state_dict()`` takes the wrapped module's keys (a bare model's checkpoint)."""
    inner = prefix + "module."
    for key in [key for key in state_dict if key.startswith(prefix) and not key.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)
