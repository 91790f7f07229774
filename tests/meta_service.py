"""A metadata service on the in-memory engine, called as the RPC layer calls it (trash and quota tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fs3 import common_pb2 as cpb
from fs3 import meta_pb2 as mpb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient
from fs3.kv.store import MemKVStore
from fs3.kv.txn import OptimisticTxnEngine, TxnFaults
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.channel import RealChannelFactory

__all__ = ["InMemoryMeta"]

_EMPTY = memoryview(b"")


class InMemoryMeta:
    """One meta service over a :class:`MemKVStore` with a trash of ``trash_days`` (0: off); requests
    carry ``client_id`` and a fresh request id each; ``wall_ns`` is meta's clock when a test sets it."""

    def __init__(self, client_id: bytes, trash_days: float = 0.0, faults: TxnFaults | None = None,
                 wall_ns: Callable[[], int] | None = None) -> None:
        channels = RealChannelFactory()
        routing = RoutingCache(["127.0.0.1:1"], channels)
        routing._install(cpb.RoutingInfo(chain_tables=[cpb.ChainTable(table_id=1, chain_ids=[11, 12, 13])]))
        self.client_id = client_id
        self.engine = OptimisticTxnEngine(MemKVStore(), faults=faults)
        config = MetaServiceConfig(root_mode=0o777, trash_days=trash_days)
        storage = StorageClient(routing, channels, client_id)
        self.service = (MetaService(self.engine, routing, storage, config) if wall_ns is None
                        else MetaService(self.engine, routing, storage, config, wall_ns=wall_ns))
        self.request_id = 0

    def ctx(self, uid: int = 0) -> mpb.ReqCtx:
        self.request_id += 1
        return mpb.ReqCtx(user=mpb.User(uid=uid, gid=uid), client_id=self.client_id, request_id=self.request_id)

    async def call(self, name: str, req: Any) -> Any:
        rsp, _ = await getattr(self.service, name)(req, _EMPTY)
        return rsp
