"""HFReduce: the Fire-Flyer paper's CPU-side asynchronous allreduce (§IV, Algorithms 1 and 2).

Each node's ranks deposit their buffers chunk by chunk in shared memory, the node's leader reduces
every chunk on the CPU as soon as all local ranks have deposited it, the node leaders allreduce the
partial sums over a double binary tree of TCP links, and every rank copies the result out — all
pipelined per chunk and asynchronous to the caller::

    import hfreduce
    comm = hfreduce.init()                      # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    work = comm.allreduce(grads, op=hfreduce.ReduceOp.AVG, async_op=True)
    ...                                         # compute while it runs
    work.wait()

Module-level functions act on the communicator made by :func:`init`. See ``hfreduce/README.md``.
"""

from __future__ import annotations

from typing import Any

from hfreduce.comm import DEFAULT_CHUNK_SIZE_BYTES, DEFAULT_SLOTS, DEFAULT_TIMEOUT_S, Communicator
from hfreduce.engine import Work
from hfreduce.errors import HFReduceError, HFReduceTimeout, InvalidArgument
from hfreduce.kernels import ReduceOp

__all__ = ["DEFAULT_CHUNK_SIZE_BYTES", "DEFAULT_SLOTS", "DEFAULT_TIMEOUT_S", "Communicator", "HFReduceError",
           "HFReduceTimeout", "InvalidArgument", "ReduceOp", "Work", "all_gather", "allreduce", "barrier",
           "broadcast", "destroy", "get_communicator", "init", "reduce_scatter"]

_default: Communicator | None = None


def init(**kwargs: Any) -> Communicator:
    """Join the job (arguments as :class:`Communicator`; the rest from torch's environment variables)."""
    global _default
    if _default is not None:
        raise HFReduceError("hfreduce.init() was already called in this process: call destroy() first")
    _default = Communicator(**kwargs)
    return _default


def get_communicator() -> Communicator:
    if _default is None:
        raise HFReduceError("call hfreduce.init() first")
    return _default


def destroy() -> None:
    global _default
    if _default is not None:
        _default.shutdown()
        _default = None


def allreduce(tensor: Any, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work:
    return get_communicator().allreduce(tensor, op, async_op)


def reduce_scatter(output: Any, input: Any, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Work:
    return get_communicator().reduce_scatter(output, input, op, async_op)


def all_gather(output: Any, input: Any, async_op: bool = False) -> Work:
    return get_communicator().all_gather(output, input, async_op)


def broadcast(tensor: Any, src: int = 0, async_op: bool = False) -> Work:
    return get_communicator().broadcast(tensor, src, async_op)


def barrier(timeout_s: float | None = None) -> None:
    get_communicator().barrier(timeout_s)
