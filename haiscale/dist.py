"""Joining a HaiScale job: torch's default group (gloo) for control and pipeline sends, and one
HFReduce group per data-parallel group for gradients and parameter shards.

    import haiscale
    ctx = haiscale.init(pipeline_size=2, placement="staggered")   # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    ctx.stage, ctx.dp_rank, ctx.dp_comm                          # this rank's place; its HFReduce communicator
    ...
    haiscale.destroy()

Every rank creates every data-parallel group, in stage order (``torch.distributed.new_group`` is
collective over the whole job); a rank keeps the groups it belongs to.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

import hfreduce
import hfreduce.torch as hfreduce_torch
from haiscale.topology import ParallelLayout, Placement

__all__ = ["ParallelContext", "destroy", "get_context", "init"]

DEFAULT_TIMEOUT_S = 60.0


@dataclass
class ParallelContext:
    """This rank's place in the job and the groups it talks through."""

    rank: int
    world_size: int
    layout: ParallelLayout
    stage: int
    dp_rank: int
    dp_comm: hfreduce.Communicator
    """The HFReduce communicator of this rank's data-parallel group (its ranks numbered by ``dp_rank``)."""
    dp_group: Any
    """The same group as a ``torch.distributed`` process group (backend ``hfreduce``)."""
    dp_gloo_group: Any
    """The same ranks over gloo: objects and the odd small collective HFReduce does not offer."""
    timeout_s: float

    @property
    def data_size(self) -> int:
        return self.layout.data_size

    @property
    def pipeline_size(self) -> int:
        return self.layout.pipeline_size

    @property
    def previous_rank(self) -> int | None:
        return self.layout.previous_rank(self.rank)

    @property
    def next_rank(self) -> int | None:
        return self.layout.next_rank(self.rank)


_context: ParallelContext | None = None
_owns_default_group = False
_groups: list[Any] = []
"""The groups :func:`init` made (this rank's and, as ``new_group`` requires, everyone else's): destroyed
by :func:`destroy` even when the default group is the caller's and stays."""


def init(pipeline_size: int = 1, placement: Placement = "contiguous", timeout_s: float = DEFAULT_TIMEOUT_S,
         chunk_size_bytes: int = hfreduce.DEFAULT_CHUNK_SIZE_BYTES) -> ParallelContext:
    """Join the job described by torch's launcher variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); ``timeout_s`` bounds how long a rank waits for a dead or stuck peer."""
    global _context, _owns_default_group
    if _context is not None:
        raise RuntimeError("haiscale.init() was already called in this process: call haiscale.destroy() first")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, not {timeout_s}")
    timeout = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise RuntimeError(f"{name} is not set: start the job with torchrun or set torch's launcher variables")
        dist.init_process_group("gloo", timeout=timeout)
        _owns_default_group = True
    rank, world_size = dist.get_rank(), dist.get_world_size()
    layout = ParallelLayout(world_size, pipeline_size, placement)
    stage, dp_rank = layout.coordinates(rank)
    options = hfreduce_torch.HFReduceOptions(chunk_size_bytes=chunk_size_bytes)
    mine: dict[str, Any] = {}
    try:
        for group_stage, ranks in enumerate(layout.dp_groups()):
            hf_group = dist.new_group(ranks, timeout=timeout, backend=hfreduce_torch.BACKEND_NAME, pg_options=options)
            _groups.append(hf_group)
            gloo_group = dist.new_group(ranks, timeout=timeout, backend="gloo")
            _groups.append(gloo_group)
            if group_stage == stage:
                mine = {"hf": hf_group, "gloo": gloo_group}
        _context = ParallelContext(rank=rank, world_size=world_size, layout=layout, stage=stage, dp_rank=dp_rank,
                                   dp_comm=hfreduce_torch.communicator_of(mine["hf"]), dp_group=mine["hf"],
                                   dp_gloo_group=mine["gloo"], timeout_s=timeout_s)
    except BaseException:
        _destroy_default()
        raise
    return _context


def get_context() -> ParallelContext:
    if _context is None:
        raise RuntimeError("call haiscale.init() first")
    return _context


def destroy() -> None:
    """Leave the job: the HFReduce communicators close, and the default group if :func:`init` made it."""
    global _context
    _context = None
    _destroy_default()


def _destroy_default() -> None:
    """Destroy what :func:`init` made. With a default group of the caller's, that group stays, but the
    data-parallel groups go: each HFReduce communicator holds a worker thread, sockets and registered
    memory, and would otherwise live (and keep answering collectives) until the process ends."""
    global _owns_default_group
    groups = [group for group in _groups if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER]
    _groups.clear()
    if _owns_default_group and dist.is_initialized():
        dist.destroy_process_group()  # every group with it
    else:
        for group in groups:
            if isinstance(group, hfreduce_torch.ProcessGroupHFReduce):
                # torch's destroy_process_group(group) cannot unregister this backend's groups (they
                # carry no c10d group name); shutting the communicator down is what frees its resources.
                hfreduce_torch.communicator_of(group).shutdown()
            elif dist.is_initialized():
                dist.destroy_process_group(group)
    _owns_default_group = False
