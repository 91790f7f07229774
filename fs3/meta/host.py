"""What the parts of the metadata service take from one another.

:class:`~fs3.meta.service.MetaService` is one object made of three parts, each in its own module:
the request handlers (``service.py``), the file-length logic (``lengths.py``: probing storage for a
file's end, applying a writer's length) and the background jobs (``jobs.py``: truncate jobs, GC,
client expiry, fsck's chunk listing). They share one inode lock (per process, and a claim in the
store across meta servers), one transaction engine and one storage client, and call across: a length
probe first finishes the inode's truncate job, the expiry of a client closes its sessions with their
lengths probed, and a handler runs truncate jobs before it answers. This class names what each part
relies on from the others, so each module type-checks on its own and a reader sees the seams.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from google.protobuf.message import Message

from fs3 import meta_pb2 as mpb
from fs3 import storage_pb2 as spb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient
from fs3.common.clock import Clock
from fs3.common.metrics import ServiceMetrics
from fs3.kv.api import TxnEngine
from fs3.meta.claims import ClaimTable
from fs3.meta.ops import Ancestry, Namespace, OpEnv

if TYPE_CHECKING:
    from fs3.meta.service import MetaServiceConfig

__all__ = ["MetaHost"]

M = TypeVar("M", bound=Message)


class MetaHost(abc.ABC):
    """The state and the operations the service's parts share (see the module's docstring)."""

    engine: TxnEngine
    routing: RoutingCache
    storage: StorageClient
    config: MetaServiceConfig
    clock: Clock
    # client id -> (renewal count, when this server first saw it); expired id -> when seen cleaned.
    _leases_seen: dict[bytes, tuple[int, int]]
    _expired_seen: dict[bytes, int]
    _gc_wakeup: asyncio.Event
    # What this server holds of the work several meta servers share (fs3.meta.claims).
    claims: ClaimTable
    gc_removed_chunks: int
    # Where the job queues' gauges go (None: not exported, as in the simulator).
    metrics: ServiceMetrics | None

    # -- from the service: the request plumbing ---------------------------------------------------

    @abc.abstractmethod
    def _now_ms(self) -> int:
        """Wall time in milliseconds (stamps, never durations)."""

    @abc.abstractmethod
    def _env(self, user: mpb.User) -> OpEnv:
        """The inputs of one operation, fixed before its transaction runs."""

    @abc.abstractmethod
    async def _mutate(self, ctx: mpb.ReqCtx, rsp_type: type[M], fn: Callable[[Namespace], Awaitable[M]],
                      ancestry: Ancestry | None = None, refs: Sequence[mpb.PathRef] = (),
                      keys: Sequence[bytes] = (), target_keys: bool = False, removing: bool = False) -> M:
        """Run ``fn`` as the request's one idempotent transaction (``refs``, ``keys``: what it
        will read, fetched with its first read on a networked engine)."""

    @abc.abstractmethod
    def _inode_lock(self, inode_id: int) -> contextlib.AbstractAsyncContextManager[None]:
        """Serializes an inode's truncates, their jobs, GC and its length probes, within this
        process and across the meta servers sharing the store (waiting for another's claim)."""

    @abc.abstractmethod
    def _try_inode_lock(self, inode_id: int) -> contextlib.AbstractAsyncContextManager[bool]:
        """:meth:`_inode_lock` that yields False at once when another meta server holds the inode."""

    @abc.abstractmethod
    def _check_inode_claim(self, inode_id: int) -> None:
        """Raise ``Unavailable`` when this server can no longer be sure it holds the inode's claim."""

    # -- from the lengths: storage's view of a file ---------------------------------------------

    @abc.abstractmethod
    async def _list_inode_chunks(self, chain_id: int, inode_id: int, index: int,
                                 head_first: bool) -> tuple[list[spb.ChunkMeta], bool]:
        """One page of the inode's chunks on a chain from chunk ``index`` on, and whether more follow."""

    @abc.abstractmethod
    async def _exact_length(self, inode_id: int, hint: int, wrote: bool,
                            within_size_is_exact: bool = False) -> tuple[int | None, int | None]:
        """The file's end on storage and the size generation probed under, after any truncate job."""

    # -- from the jobs: truncation's storage side -----------------------------------------------

    @abc.abstractmethod
    async def _run_truncate_locked(self, inode_id: int) -> None:
        """Carry out the inode's truncate job, if it has one (the caller holds the inode's lock)."""

    @abc.abstractmethod
    async def _finish_truncate(self, inode_id: int) -> None:
        """Carry out the inode's truncate job, if it has one, taking the inode's lock."""
