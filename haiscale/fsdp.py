"""Fully sharded data parallel (ZeRO-3) on HFReduce: each rank keeps only its slice of every parameter,
gradient and optimizer state, and gathers a unit's parameters just for the time that unit computes.

    import haiscale
    from haiscale.fsdp import FullyShardedDataParallel
    from haiscale.models import Block, ByteGPT, Embedding, Head

    ctx = haiscale.init()
    model = FullyShardedDataParallel(ByteGPT(config), wrap=(Embedding, Block, Head))
    optimizer = torch.optim.Adam(model.parameters())       # sees only this rank's shards
    loss = lm_loss(model(x), y); loss.backward(); optimizer.step()

How it works (HaiScale's FSDP, the Fire-Flyer paper's §VII-A, on HFReduce's all-gather and
reduce-scatter; the design of torch's FSDP with flat parameters):

* **Units.** Every submodule the ``wrap`` policy selects is a unit, and the root is one for whatever
  parameters are left. A unit's parameters are flattened into one flat tensor, padded to a multiple of
  the data-parallel world size and cut with :func:`haiscale.sharding.shard_range`; a rank keeps its
  slice as the ``nn.Parameter`` the optimizer sees, so the optimizer's state is sharded too.
* **Forward.** Before a unit runs, its flat parameter is all-gathered (rank order) into a full buffer,
  and the original parameters become views of that buffer; after the unit's forward the buffer's
  storage is freed (resized to zero) — the views stay in the autograd graph, pointing at nothing.
* **Backward.** A hook on the unit's outputs gathers the parameters again (into the same storage, so
  the views the graph saved see them) before the unit's backward; once autograd has accumulated the
  unit's whole gradient into the full buffer, it is reduce-scattered (average) into the shard's
  ``.grad`` and the full buffer is freed again.
* **Prefetch.** While unit k computes, the all-gather of the unit that runs next (k+1 in forward,
  k-1 in backward, from the order the last forward took) is already in flight on HFReduce's worker.

Every rank must run the same units in the same order (collectives are matched by order); a rank that
diverges, dies or stalls fails every rank with HFReduce's error, which FSDP re-raises naming the unit.

What follows from flat units: a unit whose forward did not run, or whose output did not reach the
loss, gets no gradient (``None``, skipped by the optimizer, as in one process); a parameter unused
inside a unit that did get a gradient gets zeros (torch's flat-parameter FSDP does the same). A
parameter shared by two units is refused (share it within one unit). Between uses, the module's
original parameter attributes are empty tensors. Parameters are CPU tensors (HFReduce's buffers).
"""

from __future__ import annotations

import ctypes
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

import hfreduce
from haiscale.dist import get_context
from haiscale.models import Block
from haiscale.sharding import Shard, shard_range

__all__ = ["FSDPEvent", "FullyShardedDataParallel", "ShardedOptimizer", "WrapPolicy"]

WrapPolicy = tuple[type[nn.Module], ...] | Callable[[nn.Module], bool]
"""Which submodules become units: a tuple of module types, or a predicate on the module."""

EventKind = Literal["gather", "gathered", "forward", "forward_done", "backward", "reduce_scatter", "free"]

# Reduce-scatters in flight before backward waits for the oldest: each one holds a full gradient, so
# this bounds backward's memory while still overlapping the reduction with the next unit's backward.
MAX_PENDING_REDUCE_SCATTERS = 2

# dtypes HFReduce moves; buffers of other dtypes (bool masks, uint8 tables) travel as int32.
_BITS_AS: dict[int, np.dtype[Any]] = {2: np.dtype(np.float16), 4: np.dtype(np.float32), 8: np.dtype(np.float64)}
_COLLECTIVE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64)


@dataclass(frozen=True)
class FSDPEvent:
    """One step of a unit's life, reported to ``trace``: what happened, to which unit, and how many
    bytes of full (gathered) parameter buffers this rank held right after it."""

    kind: EventKind
    unit: str
    gathered_bytes: int


@dataclass
class _Param:
    """One original parameter inside its unit's flat parameter."""

    names: list[str]
    """Its fully qualified names in the wrapped module (more than one when it is shared)."""
    owners: list[tuple[nn.Module, str]]
    shape: torch.Size
    offset: int
    numel: int


@dataclass(repr=False)
class _Unit:
    name: str
    module: nn.Module
    params: list[_Param]
    numel: int
    padded_numel: int
    shard_start: int
    shard_end: int
    shard: nn.Parameter
    full: torch.Tensor
    """The full flat parameter (a leaf): storage allocated only while gathered."""
    gather_work: hfreduce.Work | None = None
    gathered: bool = False
    gathered_version: int = -1
    """The shard's version counter when the gather that filled ``full`` was issued: a shard changed in
    place since (an optimizer step, a loaded state dict) makes the gathered values stale."""
    forward_ran: bool = False
    backward_done: bool = False

    @property
    def full_bytes(self) -> int:
        return self.padded_numel * self.full.element_size()

    def __repr__(self) -> str:  # never the tensors: the full one's storage is usually freed
        return f"<FSDP unit {_unit_label(self.name)}: {self.numel} parameters, gathered={self.gathered}>"

    def allocated(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0


@dataclass
class _PendingReduceScatter:
    unit: _Unit
    output: torch.Tensor
    input: torch.Tensor
    """The full gradient, kept until the reduce-scatter has read it."""
    work: hfreduce.Work


class FullyShardedDataParallel(nn.Module):
    """``module`` trained fully sharded over ``comm`` (default: this rank's data-parallel group from
    :func:`haiscale.init`).

    ``wrap`` selects the units (module types or a predicate; the root is always one). ``prefetch``
    overlaps the next unit's all-gather with the current unit's compute. ``reshard_after_forward=False``
    keeps every unit gathered from its forward to its backward (no second gather, more memory; a
    ``no_grad`` forward, which has no backward, frees them all the same, and a unit whose shard changed
    since its gather — an optimizer step, a loaded state — is gathered again before it computes).
    ``trace`` receives an :class:`FSDPEvent` for every gather, forward, backward, reduce-scatter and
    free — for tests and profiling.

    The module's parameters are replaced: ``parameters()`` yields one flat shard per unit (hand them to
    an ordinary optimizer); use :meth:`sharded_state_dict`, :meth:`full_state_dict` and the optimizer
    methods for their values. Buffers stay replicated (broadcast from rank 0 here).
    """

    def __init__(self, module: nn.Module, *, comm: hfreduce.Communicator | None = None,
                 wrap: WrapPolicy = (Block,), prefetch: bool = True, reshard_after_forward: bool = True,
                 trace: Callable[[FSDPEvent], None] | None = None) -> None:
        super().__init__()
        if comm is None:
            comm = get_context().dp_comm
        self.module = module
        self.comm = comm
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self._trace = trace
        self._units = self._make_units(module, _policy(wrap))
        self.flat_shards = nn.ParameterList([unit.shard for unit in self._units])
        self._order: list[_Unit] = list(self._units)
        self._current_order: list[_Unit] = []
        self._finish_order: list[_Unit] = []
        self._backward_order: list[_Unit] = []
        self._backward_started = False
        self._pending: deque[_PendingReduceScatter] = deque()
        self._broadcast_buffers()
        for unit in self._units:
            unit.module.register_forward_pre_hook(self._make_pre_forward(unit))
            unit.module.register_forward_hook(self._make_post_forward(unit))
            if unit.full.requires_grad:
                hook = self._make_post_backward(unit)
                unit.full.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]

    # -- construction -------------------------------------------------------------------------------

    def _make_units(self, root: nn.Module, policy: Callable[[nn.Module], bool]) -> list[_Unit]:
        """Assign every parameter to the innermost selected module above it, then flatten and shard
        each unit's parameters (rank 0's values, broadcast, so every rank starts the same)."""
        members: dict[int, list[tuple[str, nn.Module, str, nn.Parameter]]] = {}
        unit_modules: dict[int, tuple[str, nn.Module]] = {}

        def walk(module: nn.Module, prefix: str, unit_key: int) -> None:
            if prefix and policy(module):
                unit_key = id(module)
                unit_modules.setdefault(unit_key, (prefix, module))
            for attr, param in module._parameters.items():
                if param is not None:
                    members.setdefault(unit_key, []).append((f"{prefix}{attr}", module, attr, param))
            for child_name, child in module._modules.items():
                if child is not None:
                    walk(child, f"{prefix}{child_name}.", unit_key)

        unit_modules[id(root)] = ("", root)
        walk(root, "", id(root))
        owner_unit: dict[int, tuple[int, str]] = {}
        for key, entries in members.items():
            for name, _module, _attr, param in entries:
                seen = owner_unit.setdefault(id(param), (key, name))
                if seen[0] != key:
                    raise ValueError(f"parameter {name!r} is the same tensor as {seen[1]!r}, in another FSDP unit "
                                     f"({_unit_label(unit_modules[seen[0]][0])} and "
                                     f"{_unit_label(unit_modules[key][0])}): tied parameters must live in one "
                                     f"unit — wrap a module that contains both users, or untie them")
        # Every unit is checked before any is built, so a refused model is left as it was. Units come
        # in the order their modules appear (root first): the first forward's prefetch order.
        plans = [(prefix.rstrip("."), module, self._plan_unit(prefix.rstrip("."), members[key]))
                 for key, (prefix, module) in unit_modules.items() if members.get(key)]
        return [self._build_unit(name, module, plan) for name, module, plan in plans]

    def _plan_unit(self, name: str, entries: list[tuple[str, nn.Module, str, nn.Parameter]]
                   ) -> list[tuple[_Param, nn.Parameter]]:
        """The unit's distinct parameters with their places in the flat parameter, checked."""
        params: list[_Param] = []
        tensors: dict[int, tuple[_Param, nn.Parameter]] = {}
        offset = 0
        for full_name, owner, attr, param in entries:
            known = tensors.get(id(param))
            if known is not None:  # the same tensor under another name: one place in the flat parameter
                known[0].names.append(full_name)
                if (owner, attr) not in known[0].owners:
                    known[0].owners.append((owner, attr))
                continue
            info = _Param([full_name], [(owner, attr)], param.shape, offset, param.numel())
            tensors[id(param)] = (info, param)
            params.append(info)
            offset += param.numel()
        first, sample = next(iter(tensors.values()))
        for info, param in tensors.values():
            if param.dtype != sample.dtype or param.device != sample.device:
                raise ValueError(f"FSDP unit {_unit_label(name)} mixes {sample.dtype} on {sample.device} "
                                 f"({first.names[0]}) with {param.dtype} on {param.device} ({info.names[0]}): "
                                 f"a unit's parameters share one flat buffer")
            if param.device.type != "cpu" or param.element_size() not in _BITS_AS:
                raise ValueError(f"FSDP shards CPU parameters of 2-, 4- or 8-byte dtypes; {info.names[0]} is "
                                 f"{param.dtype} on {param.device}")
            if param.requires_grad != sample.requires_grad:
                raise ValueError(f"FSDP unit {_unit_label(name)} mixes trainable and frozen parameters "
                                 f"({first.names[0]}, {info.names[0]}): freeze whole units")
        return list(tensors.values())

    def _build_unit(self, name: str, module: nn.Module, plan: list[tuple[_Param, nn.Parameter]]) -> _Unit:
        params = [info for info, _param in plan]
        sample = plan[0][1]
        numel = sum(info.numel for info in params)
        world, rank = self.comm.world_size, self.comm.rank
        padded = -(-numel // world) * world
        flat = torch.zeros(padded, dtype=sample.dtype, device=sample.device)
        with torch.no_grad():
            for info, param in plan:
                flat[info.offset:info.offset + info.numel].copy_(param.reshape(-1))
        self._wait(self.comm.broadcast(flat, src=0, async_op=True), "broadcast", name)
        start, end = shard_range(padded, rank, world)
        shard = nn.Parameter(flat[start:end].clone(), requires_grad=sample.requires_grad)
        full = torch.empty(padded, dtype=sample.dtype, device=sample.device, requires_grad=sample.requires_grad)
        for info in params:
            for owner, attr in info.owners:
                del owner._parameters[attr]
        unit = _Unit(name=name, module=module, params=params, numel=numel, padded_numel=padded,
                     shard_start=start, shard_end=end, shard=shard, full=full)
        self._use_views(unit)  # attributes exist from the start (views need the storage, freed right after)
        full.untyped_storage().resize_(0)
        return unit

    def _broadcast_buffers(self) -> None:
        """Buffers are replicated: every rank takes rank 0's (as DDP does at start)."""
        for name, buffer in self.module.named_buffers():
            moved = buffer.detach() if buffer.dtype in _COLLECTIVE_DTYPES else buffer.detach().to(torch.int32)
            moved = moved.contiguous().clone()
            self._wait(self.comm.broadcast(moved, src=0, async_op=True), "broadcast", name)
            with torch.no_grad():
                buffer.copy_(moved.to(buffer.dtype))

    # -- the unit's life ----------------------------------------------------------------------------

    def _event(self, kind: EventKind, unit: _Unit) -> None:
        if self._trace is not None:
            self._trace(FSDPEvent(kind, _unit_label(unit.name), self.gathered_bytes()))

    def gathered_bytes(self) -> int:
        """Bytes of full parameter buffers this rank holds now (gathered or being gathered)."""
        return sum(unit.full.untyped_storage().nbytes() for unit in self._units)

    def _issue_gather(self, unit: _Unit) -> None:
        if unit.gathered and unit.gathered_version != unit.shard._version:
            # Kept gathered (``reshard_after_forward=False``, or an evaluation forward) while the shard
            # changed: the full buffer holds the old values. Gather again rather than compute with them.
            unit.gathered = False
        if unit.gathered or unit.gather_work is not None:
            return
        storage = unit.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(unit.full_bytes)
        unit.gathered_version = unit.shard._version
        unit.gather_work = self.comm.all_gather(_raw_view(unit.full), _raw_view(unit.shard), async_op=True)
        self._event("gather", unit)

    def _ensure_gathered(self, unit: _Unit) -> None:
        self._issue_gather(unit)
        if unit.gather_work is not None:
            work, unit.gather_work = unit.gather_work, None
            self._wait(work, "all-gather", unit.name)
            unit.gathered = True
            self._event("gathered", unit)

    def _free(self, unit: _Unit) -> None:
        if unit.gather_work is not None:  # never free memory HFReduce is still writing
            work, unit.gather_work = unit.gather_work, None
            self._wait(work, "all-gather", unit.name)
        if unit.allocated():
            unit.full.untyped_storage().resize_(0)
            # The module's attributes stop pointing into the freed storage (reading a view of it would
            # read freed memory); the autograd graph keeps its own views for the next gather.
            empty = unit.full.new_empty(0).detach()
            for info in unit.params:
                for owner, attr in info.owners:
                    setattr(owner, attr, empty)
            self._event("free", unit)
        unit.gathered = False

    def _use_views(self, unit: _Unit) -> None:
        """Point the original parameters at views of the full buffer (new views each forward, so the
        autograd graph of this forward reaches the full buffer)."""
        for info in unit.params:
            view = unit.full[info.offset:info.offset + info.numel].view(info.shape)
            for owner, attr in info.owners:
                setattr(owner, attr, view)

    def _next_to_prefetch(self, order: list[_Unit], unit: _Unit) -> _Unit | None:
        try:
            index = order.index(unit)
        except ValueError:
            return None
        for candidate in order[index + 1:]:
            if not candidate.gathered and candidate.gather_work is None and not candidate.backward_done:
                return candidate
            if candidate.gathered or candidate.gather_work is not None:
                return None  # already on its way
        return None

    def _make_pre_forward(self, unit: _Unit) -> Callable[..., None]:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if unit not in self._current_order:
                self._current_order.append(unit)
            self._ensure_gathered(unit)
            self._use_views(unit)
            unit.forward_ran = True
            if self.prefetch:
                following = self._next_to_prefetch(self._order, unit)
                if following is not None:
                    self._issue_gather(following)
            self._event("forward", unit)
        return pre_forward

    def _make_post_forward(self, unit: _Unit) -> Callable[..., None]:
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if unit not in self._finish_order:
                self._finish_order.append(unit)
            self._event("forward_done", unit)
            if self.reshard_after_forward:
                self._free(unit)
            if torch.is_grad_enabled() and unit.full.requires_grad:
                tensors = [t for t in _tensors(output) if t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(tensors, self._make_pre_backward(unit), mode="any")
        return post_forward

    def _make_pre_backward(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def pre_backward(grad: torch.Tensor) -> None:
            if not self._backward_started:
                self._backward_started = True
                # Backward visits units in the reverse of the order their forwards *finished* (an
                # enclosing unit, such as the root, finishes last and is needed first).
                self._backward_order = list(reversed(self._finish_order))
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            if unit.backward_done:
                return
            self._ensure_gathered(unit)
            if self.prefetch:
                following = self._next_to_prefetch(self._backward_order, unit)
                if following is not None:
                    self._issue_gather(following)
            self._event("backward", unit)
        return pre_backward

    def _make_post_backward(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def post_backward(full: torch.Tensor) -> None:
            grad = full.grad
            full.grad = None
            if grad is None:
                return
            self._reduce_scatter(unit, grad.contiguous())
            unit.backward_done = True
            self._free(unit)
        return post_backward

    def _reduce_scatter(self, unit: _Unit, grad: torch.Tensor) -> None:
        while len(self._pending) >= MAX_PENDING_REDUCE_SCATTERS:
            self._complete(self._pending.popleft())
        output = torch.empty_like(unit.shard, requires_grad=False)
        work = self.comm.reduce_scatter(output, grad, op=hfreduce.ReduceOp.AVG, async_op=True)
        self._pending.append(_PendingReduceScatter(unit, output, grad, work))
        self._event("reduce_scatter", unit)

    def _complete(self, pending: _PendingReduceScatter) -> None:
        self._wait(pending.work, "reduce-scatter", pending.unit.name)
        shard = pending.unit.shard
        if shard.grad is None:
            shard.grad = pending.output
        else:
            shard.grad += pending.output

    def _finish_backward(self) -> None:
        """End of backward (autograd's final callback): finish the reductions, free what is left.

        A unit that ran forward but got no gradient (its output did not reach the loss) keeps no
        gradient, as its parameters would in a single process; every rank sees the same, so no rank
        waits for a reduce-scatter the others never start."""
        try:
            while self._pending:
                self._complete(self._pending.popleft())
        finally:
            for unit in self._units:
                self._free(unit)
                unit.forward_ran = unit.backward_done = False
            self._backward_started = False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._pending or self._backward_started:
            # The last backward stopped early (an exception in the loss or a hook): finish its
            # reductions — the other ranks issued them too — and start clean.
            self._finish_backward()
        self._current_order = []
        self._finish_order = []
        for unit in self._units:
            unit.forward_ran = unit.backward_done = False
        try:
            return self.module(*args, **kwargs)
        finally:
            if self._current_order:
                self._order = list(self._current_order)
            keep = not self.reshard_after_forward and torch.is_grad_enabled()
            for unit in self._units:
                # A prefetch for a unit this forward did not run; with resharding, anything left over;
                # under no_grad everything (no backward will use it: kept, it would only hold memory).
                if not keep or not unit.forward_ran:
                    self._free(unit)

    def _wait(self, work: hfreduce.Work, what: str, unit: str) -> None:
        try:
            work.wait()
        except hfreduce.HFReduceError as exc:
            raise type(exc)(f"FSDP {what} of {_unit_label(unit)} failed: {exc}") from exc

    # -- state ------------------------------------------------------------------------------------------

    def _named_params(self) -> Iterator[tuple[str, _Unit, _Param]]:
        for unit in self._units:
            for info in unit.params:
                for name in info.names:
                    yield name, unit, info

    def _local_range(self, unit: _Unit, info: _Param) -> tuple[int, int]:
        """This rank's elements of ``info`` as ``[start, end)`` of the flattened parameter."""
        start = min(max(unit.shard_start - info.offset, 0), info.numel)
        end = max(min(unit.shard_end - info.offset, info.numel), start)
        return start, end

    def _shard_piece(self, unit: _Unit, info: _Param, values: torch.Tensor) -> Shard:
        start, end = self._local_range(unit, info)
        base = info.offset + start - unit.shard_start
        return Shard(values[base:base + end - start].detach().clone(), tuple(info.shape), start)

    def sharded_state_dict(self) -> dict[str, Shard]:
        """``{parameter name: Shard}``: this rank's piece of every original parameter (padding left out;
        a parameter this rank holds nothing of is listed with an empty piece)."""
        return {name: self._shard_piece(unit, info, unit.shard) for name, unit, info in self._named_params()}

    def shard_ranges(self) -> dict[str, tuple[int, int]]:
        """``{parameter name: (start, end)}``: the flat element range of each parameter this rank holds —
        what :meth:`load_sharded_state_dict` needs covered."""
        return {name: self._local_range(unit, info) for name, unit, info in self._named_params()}

    def load_sharded_state_dict(self, state: Mapping[str, Shard]) -> None:
        """Load parameters from ``{name: Shard}``, each Shard covering (at least) this rank's range of
        that parameter. Everything is checked before anything is written: bad input changes nothing."""
        writes: list[tuple[_Unit, _Param, torch.Tensor]] = []
        expected = {name: (unit, info) for name, unit, info in self._named_params()}
        _check_names(state.keys(), expected.keys(), "state dict")
        for name, value in state.items():
            unit, info = expected[name]
            writes.append((unit, info, self._needed(name, unit, info, value, unit.shard.dtype)))
        with torch.no_grad():
            for unit, info, piece in writes:
                start, end = self._local_range(unit, info)
                base = info.offset + start - unit.shard_start
                unit.shard[base:base + end - start].copy_(piece)

    def _needed(self, name: str, unit: _Unit, info: _Param, value: Any, dtype: torch.dtype) -> torch.Tensor:
        """The part of ``value`` (a Shard) this rank needs for ``info``, after checking it fits."""
        if not isinstance(value, Shard):
            raise ValueError(f"{name}: expected a haiscale.sharding.Shard, not {type(value).__name__}")
        if tuple(value.global_shape) != tuple(info.shape):
            raise ValueError(f"{name}: the shard is of a tensor of shape {tuple(value.global_shape)}, the "
                             f"parameter's is {tuple(info.shape)}")
        if value.local.dtype != dtype:
            raise ValueError(f"{name}: the shard holds {value.local.dtype}, the parameter is {dtype}")
        start, end = self._local_range(unit, info)
        if start < end and not (value.flat_offset <= start and value.flat_end >= end):
            raise ValueError(f"{name}: the shard holds elements [{value.flat_offset}, {value.flat_end}), this "
                             f"rank needs [{start}, {end})")
        return value.local[start - value.flat_offset:end - value.flat_offset] if start < end else value.local[:0]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole, on every rank (collective: call it on every rank)."""
        out: dict[str, torch.Tensor] = {}
        for unit in self._units:
            full = torch.empty(unit.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)
            self._wait(self.comm.all_gather(full, unit.shard.detach(), async_op=True), "all-gather", unit.name)
            for info in unit.params:
                value = full[info.offset:info.offset + info.numel].view(info.shape).clone()
                for name in info.names:
                    out[name] = value
        return out

    # -- optimizer state ------------------------------------------------------------------------------

    def sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        """``{parameter name: {state key: Shard or value}}`` for parameters the optimizer has state for.

        State shaped like the flat shard (Adam's ``exp_avg``, ``exp_avg_sq``) becomes a Shard of each
        original parameter, as :meth:`sharded_state_dict`; per-tensor state (``step``) is repeated for
        each parameter. Hyperparameters stay in ``optimizer.state_dict()["param_groups"]``.
        """
        self._check_optimizer(optimizer)
        out: dict[str, dict[str, Any]] = {}
        for name, unit, info in self._named_params():
            state = optimizer.state.get(unit.shard)
            if not state:
                continue
            entry: dict[str, Any] = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.shape == unit.shard.shape:
                    entry[key] = self._shard_piece(unit, info, value)
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    entry[key] = value.detach().clone()
                elif value is None or isinstance(value, (int, float, bool)):
                    entry[key] = value
                else:
                    raise ValueError(f"optimizer state {key!r} of {name} is neither per-element nor a scalar: "
                                     f"it cannot be resharded")
            out[name] = entry
        return out

    def load_sharded_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                          state: Mapping[str, Mapping[str, Any]]) -> None:
        """Load what :meth:`sharded_optimizer_state_dict` gave (on any number of ranks: each Shard must
        cover this rank's range). Checked whole before anything changes."""
        self._check_optimizer(optimizer)
        expected = {name: (unit, info) for name, unit, info in self._named_params()}
        unknown = sorted(set(state) - set(expected))
        if unknown:
            raise ValueError(f"optimizer state for parameters this model does not have: {_few(unknown)}")
        new_states: list[tuple[_Unit, dict[str, Any]]] = []
        for unit in self._units:
            names = [name for info in unit.params for name in info.names]
            present = [name for name in names if name in state]
            if not present:
                continue
            if len(present) != len(names):
                missing = sorted(set(names) - set(present))
                raise ValueError(f"optimizer state of {_unit_label(unit.name)} covers some of its parameters but "
                                 f"not {_few(missing)}: a unit's state loads whole")
            keys = set(state[present[0]])
            new: dict[str, Any] = {}
            for info in unit.params:
                for name in info.names:
                    entry = state[name]
                    if set(entry) != keys:
                        raise ValueError(f"optimizer state of {name} has keys {sorted(entry)}, of {present[0]} "
                                         f"{sorted(keys)}")
                    for key, value in entry.items():
                        if isinstance(value, Shard):
                            target = new.setdefault(key, torch.zeros_like(unit.shard.detach()))
                            if not isinstance(target, torch.Tensor) or target.shape != unit.shard.shape:
                                raise ValueError(f"optimizer state {key!r} of {name} is a Shard, of another "
                                                 f"parameter of the unit a scalar")
                            piece = self._needed(f"{name} ({key})", unit, info, value, value.local.dtype)
                            if target.dtype != piece.dtype:
                                target = new[key] = target.to(piece.dtype)
                            start, end = self._local_range(unit, info)
                            base = info.offset + start - unit.shard_start
                            target[base:base + end - start] = piece
                        else:
                            known = new.setdefault(key, value)
                            if not _same_scalar(known, value):
                                raise ValueError(f"optimizer state {key!r} differs between parameters of "
                                                 f"{_unit_label(unit.name)} ({present[0]}, {name}): one unit "
                                                 f"has one value")
                            if isinstance(value, torch.Tensor):
                                new[key] = value.detach().clone()
            new_states.append((unit, new))
        for unit, new in new_states:
            optimizer.state[unit.shard] = new

    def sharded_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """``optimizer``'s state as sharded state for a checkpoint: ``ckpt.save(step, fsdp,
        fsdp.sharded_optimizer(optimizer))`` saves on N ranks what loads on M."""
        return ShardedOptimizer(self, optimizer)

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        mine = {id(unit.shard) for unit in self._units}
        theirs = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not theirs <= mine:
            raise ValueError("the optimizer holds parameters that are not this FSDP model's shards "
                             "(build it from FullyShardedDataParallel.parameters())")

    def unit_names(self) -> list[str]:
        """The units, in construction order (``"<root>"`` for the root's own parameters)."""
        return [_unit_label(unit.name) for unit in self._units]


# What an optimizer keeps per element of a parameter once it has stepped: what a fresh one (no state
# yet) will load from a checkpoint, so that it can say which ranges it wants before its first step.
_PER_ELEMENT_STATE: dict[type[torch.optim.Optimizer], Callable[[dict[str, Any]], tuple[str, ...]]] = {
    torch.optim.Adam: lambda group: ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()),
    torch.optim.AdamW: lambda group: ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()),
    torch.optim.SGD: lambda group: ("momentum_buffer",) if group["momentum"] else (),
}
_STEP_STATE = (torch.optim.Adam, torch.optim.AdamW)
_JSON_SCALARS = (bool, int, float, str, type(None))


class ShardedOptimizer:
    """An FSDP model's optimizer as sharded state (``sharded_state_dict`` / ``load_sharded_state_dict``,
    what :class:`haiscale.checkpoint.CheckpointManager` saves and reshards): ``"{parameter}/{key}"`` →
    a Shard of each original parameter (or the per-tensor value, Adam's ``step``), and
    ``"param_groups"`` → the hyperparameters of each group.

    A fresh optimizer (no step taken) states what it will hold — for Adam, AdamW and SGD — so a
    checkpoint loads into it; other optimizers load once they have stepped.
    """

    def __init__(self, model: FullyShardedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        model._check_optimizer(optimizer)
        self.model = model
        self.optimizer = optimizer

    def sharded_state_dict(self) -> dict[str, Any]:
        state = self.model.sharded_optimizer_state_dict(self.optimizer) or self._fresh_state()
        out: dict[str, Any] = {f"{name}/{key}": value for name, entry in state.items() for key, value in entry.items()}
        out["param_groups"] = [{key: list(value) if isinstance(value, tuple) else value
                                for key, value in group.items()
                                if key != "params" and isinstance(value, (*_JSON_SCALARS, tuple, list))}
                               for group in self.optimizer.param_groups]
        return out

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        groups = state.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the optimizer has {len(self.optimizer.param_groups)} parameter groups, the state "
                             f"{len(groups) if isinstance(groups, list) else 'no list of them'}")
        nested: dict[str, dict[str, Any]] = {}
        for full, value in state.items():
            if full != "param_groups":
                name, _, key = full.rpartition("/")
                if not name:
                    raise ValueError(f"optimizer state entry {full!r} is not PARAMETER/KEY")
                nested.setdefault(name, {})[key] = value
        self.model.load_sharded_optimizer_state_dict(self.optimizer, nested)
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            for key, value in saved.items():
                if key in group and key != "params":
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value

    def _fresh_state(self) -> dict[str, dict[str, Any]]:
        """Zeros of the per-element state (and a zero ``step``) for every parameter, as the optimizer
        would hold them after its first step."""
        kind = type(self.optimizer)
        if kind not in _PER_ELEMENT_STATE:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for name, unit, info in self.model._named_params():
            group = next(g for g in self.optimizer.param_groups if any(p is unit.shard for p in g["params"]))
            entry: dict[str, Any] = {key: self.model._shard_piece(unit, info, torch.zeros_like(unit.shard.detach()))
                                     for key in _PER_ELEMENT_STATE[kind](group)}
            if kind in _STEP_STATE:
                entry["step"] = torch.tensor(0.0)
            if entry:
                out[name] = entry
        return out


def _policy(wrap: WrapPolicy) -> Callable[[nn.Module], bool]:
    if isinstance(wrap, tuple):
        types = wrap
        for kind in types:
            if not (isinstance(kind, type) and issubclass(kind, nn.Module)):
                raise TypeError(f"wrap= takes module types or a predicate; {kind!r} is neither")
        return lambda module: isinstance(module, types)
    if callable(wrap):
        return wrap
    raise TypeError(f"wrap= takes a tuple of module types or a predicate, not {type(wrap).__name__}")


def _raw_view(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over a CPU tensor's memory that leaves the tensor's storage resizable.

    ``Tensor.numpy()`` marks the storage non-resizable for good, and FSDP frees a unit's full buffer by
    resizing its storage to zero (the autograd graph keeps views of that storage and sees the next
    gather's values in it). Safe because a buffer is never freed while a collective uses it
    (:meth:`FullyShardedDataParallel._free` waits first). All-gather moves bits, so any dtype travels as
    the float of its width."""
    nbytes = tensor.numel() * tensor.element_size()
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    array: np.ndarray = np.frombuffer(memoryview(raw), dtype=_BITS_AS[tensor.element_size()])
    return array


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _unit_label(name: str) -> str:
    return name or "<root>"


def _few(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_names(given: Any, expected: Any, what: str) -> None:
    given_set, expected_set = set(given), set(expected)
    missing, unexpected = sorted(expected_set - given_set), sorted(given_set - expected_set)
    if missing or unexpected:
        parts = ([f"missing {_few(missing)}"] if missing else []) + ([f"unexpected {_few(unexpected)}"]
                                                                     if unexpected else [])
        raise ValueError(f"{what} does not match the model: {'; '.join(parts)}")


def _same_scalar(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    return bool(a == b)

