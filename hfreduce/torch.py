"""HFReduce inside torch: a DDP communication hook and a ``torch.distributed`` backend named "hfreduce".

Importing this module registers the backend (once, however often it is imported)::

    import hfreduce.torch                       # registers backend="hfreduce"
    torch.distributed.init_process_group(backend="hfreduce")
    model = torch.nn.parallel.DistributedDataParallel(model)   # gradients averaged by HFReduce

or keeps torch's own process group (gloo) for everything but the gradients::

    comm = hfreduce.init(master_port=int(os.environ["MASTER_PORT"]) + 1)   # its own rendezvous port
    model.register_comm_hook(comm, hfreduce.torch.ddp_comm_hook)             # None: hfreduce.init()'s

How it maps to torch's APIs:

- :func:`ddp_comm_hook` is a ``DistributedDataParallel.register_comm_hook`` hook: it averages the
  bucket's flat gradient buffer in place (``allreduce`` AVG, asynchronous) and returns a
  ``torch.futures.Future`` that the HFReduce work completes from its done callback — with the bucket
  when it succeeded, with the error (``set_exception``) when it failed.
- The backend is a Python ``torch.distributed.ProcessGroup`` (:class:`ProcessGroupHFReduce`),
  registered with ``Backend.register_backend("hfreduce", ..., extended_api=True, devices=["cpu"])``:
  torch calls the creator once per group (``init_process_group`` and every ``new_group`` this rank
  belongs to) with the group's store, group rank, size, timeout and name; the creator starts a
  :class:`~hfreduce.Communicator` whose rendezvous runs over that store (``TorchStore``, keys under
  ``hfreduce/<group name>``, so groups never share keys) with the group's own ranks ``0..k-1``.
  The timeout of ``init_process_group`` / ``new_group`` is the communicator's fault timeout: a peer
  that dies or hangs fails the pending operations within it.
  Node leaders listen on the interface that routes to the host of torch's TCPStore (where rank 0 is).
- ``all_reduce`` (SUM, AVG, MAX, MIN; others are refused with :class:`~hfreduce.InvalidArgument`),
  ``broadcast``, ``all_gather``, ``all_gather_into_tensor``/``all_gather_single``, ``reduce_scatter``,
  ``reduce_scatter_tensor``/``reduce_scatter_single`` and ``barrier`` run on HFReduce; what torch's
  DDP needs of a process group (broadcast of the module state, the all-gather that checks parameter
  shapes, the gradient allreduce) is among them. Point-to-point, gather, scatter, reduce, all-to-all and the coalesced
  variants are not implemented: they raise at once, naming the operation (keep a gloo group for them).
- Every call returns a ``torch.distributed.Work`` whose ``wait(timeout)`` blocks until the HFReduce
  work ends (raising its error), and whose ``get_future()`` is completed by the same callback.
- Tensors must be CPU tensors, contiguous, float32/float64/float16/bfloat16/int32/int64: anything
  else is an ``InvalidArgument`` raised by the call itself, before any rank starts the collective.

A Python process group stands for the whole group in torch (``init_process_group`` uses it in place
of its per-device dispatch), so a mixed backend string such as ``"cpu:hfreduce,cuda:nccl"`` is not
supported: use ``backend="hfreduce"`` alone, or the hook.

Options: ``init_process_group(backend="hfreduce", pg_options=HFReduceOptions(chunk_size_bytes=...))``
(``new_group(..., pg_options=...)`` likewise) sets the communicator's chunk size and slots.
"""

# No ``from __future__ import annotations`` here: DistributedDataParallel.register_comm_hook compares the
# hook's annotations with dist.GradBucket and Future[Tensor] objects, and would refuse strings.

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    GradBucket,
    ReduceScatterOptions,
    TCPStore,
)
from torch._C._distributed_c10d import ReduceOp as TorchReduceOp
from torch._C._distributed_c10d import Work as TorchWork

import hfreduce
from hfreduce.comm import DEFAULT_CHUNK_SIZE_BYTES, DEFAULT_SLOTS, Communicator
from hfreduce.engine import Work
from hfreduce.errors import HFReduceError, HFReduceTimeout, InvalidArgument
from hfreduce.kernels import ReduceOp
from hfreduce.store import TorchStore

__all__ = ["BACKEND_NAME", "HFReduceOptions", "ProcessGroupHFReduce", "communicator_of", "ddp_comm_hook", "reduce_op"]

BACKEND_NAME = "hfreduce"

_REDUCE_OPS = {TorchReduceOp.SUM: ReduceOp.SUM, TorchReduceOp.AVG: ReduceOp.AVG, TorchReduceOp.MAX: ReduceOp.MAX,
               TorchReduceOp.MIN: ReduceOp.MIN}


def reduce_op(op: Any) -> ReduceOp:
    """torch's ``ReduceOp`` (or its ``RedOpType``) as HFReduce's; PRODUCT, bitwise and PREMUL_SUM are refused."""
    kind = getattr(op, "op", op)  # a ReduceOp object carries its RedOpType in .op
    for torch_op, ours in _REDUCE_OPS.items():
        if kind == torch_op:
            return ours
    name = getattr(kind, "name", repr(kind))
    raise InvalidArgument(f"hfreduce reduces with SUM, AVG, MAX or MIN, not ReduceOp.{name}")


# -- completion: HFReduce Work -> torch Future / Work -----------------------------------------------------


def _complete(work: Work, future: torch.futures.Future[Any], result: Callable[[], Any]) -> None:
    """Complete ``future`` from ``work``'s done callback: with ``result()`` (it may copy out), or the error."""

    def done(finished: Work) -> None:
        error = finished.exception()
        if error is None:
            try:
                value = result()
            except Exception as exc:  # a failed copy-out is the operation's failure, not the pipeline's
                future.set_exception(exc)
                return
            future.set_result(value)
        else:
            future.set_exception(error)

    work.add_done_callback(done)


def ddp_comm_hook(state: Communicator | None, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``DistributedDataParallel.register_comm_hook(state, ddp_comm_hook)``: average the bucket with HFReduce.

    ``state`` is the :class:`~hfreduce.Communicator` to use, or None for ``hfreduce.init()``'s. The
    allreduce runs asynchronously (DDP keeps computing gradients for the next buckets); its done
    callback completes the returned Future with the averaged bucket, or with the error. Callbacks
    chained on that Future (``then``) run in HFReduce's completion thread: keep them short, and never
    wait there for another HFReduce collective.
    """
    communicator = state if state is not None else hfreduce.get_communicator()
    buffer = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    work = communicator.allreduce(buffer, ReduceOp.AVG, async_op=True)
    _complete(work, future, lambda: buffer)
    return future


class _TorchWork(TorchWork):
    """A ``torch.distributed.Work`` over an HFReduce :class:`~hfreduce.Work` (what every backend call returns)."""

    def __init__(self, work: Work, result: Callable[[], Any]) -> None:
        """``result()`` is what the future holds: the list of output tensors (a list of lists for ``allgather``)."""
        super().__init__()
        self._work = work
        self._future: torch.futures.Future[Any] = torch.futures.Future()
        _complete(work, self._future, result)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        """Block until done (raising its error); a positive ``timeout`` bounds the wait (torch's 0 = none).

        Without a timeout the wait still ends: the communicator fails a collective whose peers stop
        making progress within its own timeout.
        """
        seconds = timeout.total_seconds() if timeout else 0.0
        if not self._work.wait(seconds if seconds > 0 else None):
            raise HFReduceTimeout(f"hfreduce: {self._work.description} did not finish within {seconds:g} s")
        self._future.wait()  # the done callback (which completes the future) may still be running
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._work.is_completed() and self._work.exception() is None

    def exception(self) -> BaseException | None:
        return self._work.exception()

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return list(self._future.value())

    def synchronize(self) -> None:
        self.wait()


# -- the process group ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HFReduceOptions:
    """``pg_options`` for ``init_process_group``/``new_group`` with ``backend="hfreduce"``."""

    chunk_size_bytes: int = DEFAULT_CHUNK_SIZE_BYTES
    slots: int = DEFAULT_SLOTS


def _one(tensors: Sequence[Any], what: str) -> Any:
    if len(tensors) != 1:
        raise InvalidArgument(f"hfreduce {what}: takes one tensor per process, not {len(tensors)}")
    return tensors[0]


def _cpu(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """The backend is registered for CPU: a CUDA tensor on it is a mistake torch's dispatch would have caught."""
    if tensor.device.type != "cpu":
        raise InvalidArgument(f"hfreduce {what}: the backend takes CPU tensors, not {tensor.device.type} "
                              f"(use ddp_comm_hook or the hfreduce API for others)")
    return tensor


class ProcessGroupHFReduce(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose collectives run on one HFReduce :class:`Communicator`."""

    def __init__(self, communicator: Communicator, group_name: str) -> None:
        # torch's stub lists only the (store, rank, size) form; a Python subclass must use (rank, size).
        super().__init__(communicator.rank, communicator.world_size)  # type: ignore[call-arg]
        self.communicator = communicator
        self._group_name = group_name

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return (f"ProcessGroupHFReduce(group={self._group_name!r}, rank={self.communicator.rank}, "
                f"size={self.communicator.world_size})")

    def allreduce(self, tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: AllreduceOptions | None = None) -> TorchWork:
        tensor = _cpu(_one(tensors, "all_reduce"), "all_reduce")
        op = reduce_op(opts.reduceOp if opts is not None else TorchReduceOp.SUM)
        return _TorchWork(self.communicator.allreduce(tensor, op, async_op=True), lambda: tensors)

    def broadcast(self, tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: BroadcastOptions | None = None) -> TorchWork:
        tensor = _cpu(_one(tensors, "broadcast"), "broadcast")
        root = opts.rootRank if opts is not None else 0
        return _TorchWork(self.communicator.broadcast(tensor, root, async_op=True), lambda: tensors)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: AllgatherOptions | None = None) -> TorchWork:
        self._check_dtypes(output, input, "all_gather_into_tensor")
        work = self.communicator.all_gather(_cpu(output, "all_gather_into_tensor"),
                                            _cpu(input, "all_gather_into_tensor"), async_op=True)
        return _TorchWork(work, lambda: [output])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: AllgatherOptions | None = None) -> TorchWork:
        return self.all_gather_single(output, input, opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: AllgatherOptions | None = None) -> TorchWork:
        """The list form (``all_gather``, and DDP's check of parameter shapes): gathered flat, copied out."""
        targets = _one(outputs, "all_gather")
        source = _cpu(_one(inputs, "all_gather"), "all_gather")
        self._check_list(targets, source, "all_gather")
        flat = torch.empty((self.communicator.world_size, source.numel()), dtype=source.dtype)
        work = self.communicator.all_gather(flat.view(-1), source.contiguous(), async_op=True)

        def copy_out() -> list[list[torch.Tensor]]:
            for target, row in zip(targets, flat, strict=True):
                target.copy_(row.view(target.shape))
            return outputs

        return _TorchWork(work, copy_out)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: ReduceScatterOptions | None = None) -> TorchWork:
        self._check_dtypes(output, input, "reduce_scatter_tensor")
        op = reduce_op(opts.reduceOp if opts is not None else TorchReduceOp.SUM)
        work = self.communicator.reduce_scatter(_cpu(output, "reduce_scatter_tensor"),
                                                _cpu(input, "reduce_scatter_tensor"), op, async_op=True)
        return _TorchWork(work, lambda: [output])

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: ReduceScatterOptions | None = None) -> TorchWork:
        return self.reduce_scatter_single(output, input, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor],  # type: ignore[override]
                       inputs: list[list[torch.Tensor]], opts: ReduceScatterOptions | None = None) -> TorchWork:
        """The list form: the inputs concatenated in rank order, reduced, block r to rank r."""
        target = _cpu(_one(outputs, "reduce_scatter"), "reduce_scatter")
        sources = _one(inputs, "reduce_scatter")
        self._check_list(sources, target, "reduce_scatter")
        op = reduce_op(opts.reduceOp if opts is not None else TorchReduceOp.SUM)
        flat = torch.cat([_cpu(source, "reduce_scatter").reshape(-1) for source in sources])
        return _TorchWork(self.communicator.reduce_scatter(target, flat, op, async_op=True), lambda: outputs)

    def barrier(self, opts: BarrierOptions | None = None) -> TorchWork:  # type: ignore[override]
        token = torch.zeros(1, dtype=torch.int32)
        return _TorchWork(self.communicator.allreduce(token, ReduceOp.SUM, async_op=True), lambda: [token])

    def shutdown(self) -> None:
        """``destroy_process_group``: stop the communicator (its peers see this rank leave)."""
        self.communicator.shutdown()

    def abort(self) -> None:
        self.communicator.shutdown()

    def _check_list(self, tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        if len(tensors) != self.communicator.world_size:
            raise InvalidArgument(f"hfreduce {what}: {len(tensors)} tensors in the list, expected one per rank "
                                  f"({self.communicator.world_size})")
        for tensor in tensors:
            if tensor.dtype != like.dtype or tensor.numel() != like.numel():
                raise InvalidArgument(f"hfreduce {what}: every tensor in the list must be {like.dtype} with "
                                      f"{like.numel()} elements, not {tensor.dtype} with {tensor.numel()}")

    @staticmethod
    def _check_dtypes(output: torch.Tensor, input: torch.Tensor, what: str) -> None:
        if output.dtype != input.dtype:
            raise InvalidArgument(f"hfreduce {what}: output is {output.dtype}, input {input.dtype}")


def _unsupported(name: str, torch_name: str) -> Callable[..., TorchWork]:
    def refuse(self: ProcessGroupHFReduce, *args: object, **kwargs: object) -> TorchWork:
        raise HFReduceError(f"the hfreduce backend does not implement {torch_name} (it runs all_reduce, "
                            f"broadcast, all_gather, reduce_scatter and barrier); use a gloo group for it")

    refuse.__name__ = name
    refuse.__doc__ = f"Not implemented: ``{torch_name}`` raises at once rather than falling through to torch."
    return refuse


# What torch.distributed's functions call on a process group that HFReduce does not do: without these
# overrides torch would fall back to looking for a C++ backend and fail with an obscure message.
for _name, _torch_name in (("send", "send"), ("recv", "recv"), ("recv_anysource", "recv"),
                           ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"),
                           ("alltoall", "all_to_all"), ("alltoall_base", "all_to_all_single"),
                           ("allreduce_coalesced", "all_reduce_coalesced"),
                           ("allgather_coalesced", "all_gather_coalesced"),
                           ("all_gather_single_coalesced", "coalesced all_gather_into_tensor"),
                           ("reduce_scatter_single_coalesced", "coalesced reduce_scatter_tensor"),
                           ("allgather_into_tensor_coalesced", "coalesced all_gather_into_tensor"),
                           ("reduce_scatter_tensor_coalesced", "coalesced reduce_scatter_tensor")):
    setattr(ProcessGroupHFReduce, _name, _unsupported(_name, _torch_name))


# -- registration ----------------------------------------------------------------------------------------------


def _store_host(store: Any) -> str | None:
    """The host of the TCPStore under torch's PrefixStores: where rank 0 is, so the route peers will use."""
    for _ in range(16):  # PrefixStores nest a few levels deep at most
        if isinstance(store, TCPStore):
            return str(store.host)
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            return None
        store = inner
    return None


def _is_whole_world(global_ranks: Sequence[int]) -> bool:
    """Whether a group spans the launched job in rank order (so the launcher's LOCAL_* variables describe it)."""
    if not global_ranks:
        return True  # init_process_group's own group
    return list(global_ranks) == list(range(dist.get_world_size()))


def _create_process_group(options: Any, pg_options: HFReduceOptions | None) -> ProcessGroupHFReduce:
    """``Backend.register_backend``'s creator (extended API): one communicator per torch group."""
    if pg_options is None:
        pg_options = HFReduceOptions()
    elif not isinstance(pg_options, HFReduceOptions):
        raise InvalidArgument(f"pg_options for the hfreduce backend must be hfreduce.torch.HFReduceOptions, "
                              f"not {type(pg_options).__name__}")
    timeout = options.timeout
    timeout_s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    group_name = str(options.group_id)
    communicator = Communicator(store=TorchStore(options.store), rank=int(options.group_rank),
                                world_size=int(options.group_size), timeout_s=timeout_s,
                                master_addr=_store_host(options.store), chunk_size_bytes=pg_options.chunk_size_bytes,
                                slots=pg_options.slots, prefix=f"hfreduce/{group_name}",
                                launcher_env=_is_whole_world(options.global_ranks_in_group))
    try:
        return ProcessGroupHFReduce(communicator, group_name)
    except BaseException:
        communicator.shutdown()
        raise


def communicator_of(group: Any) -> Communicator:
    """The HFReduce :class:`Communicator` under a group made with ``backend="hfreduce"`` (``new_group`` or
    ``init_process_group``), for what only the communicator offers: registered buffers
    (``shared_tensor``) and ``Work`` objects with callbacks. ``InvalidArgument`` for any other group."""
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        raise InvalidArgument("this rank is not a member of that group")
    if not isinstance(group, ProcessGroupHFReduce):  # the extended API hands torch the group itself
        raise InvalidArgument(f"the group is a {type(group).__name__}, not an hfreduce group")
    return group.communicator


_register_lock = threading.Lock()


def _register() -> None:
    """Make ``backend="hfreduce"`` known to torch (once; importing this module again does nothing)."""
    with _register_lock:
        if BACKEND_NAME in dist.Backend.backend_list:
            return
        dist.Backend.register_backend(BACKEND_NAME, _create_process_group, extended_api=True, devices=["cpu"])


_register()
