"""Each service of a cluster, wired from what the caller injects.

What differs between a simulated cluster, an in-process one and a process's own ``main`` — the
channel factory (simulated network or real sockets), the stores (in memory, on disk, crashable),
the clocks, the random choices, the I/O pool, the token and metrics — comes in as arguments; what
does not — which servicer serves which service spec, how meta reaches mgmtd and storage — is
written here once. Binding the dispatcher (a simulated address, a listening socket) and running
the service's tasks are the caller's, because that is where the ways differ most (a simulated
process owns its tasks so that killing it cancels them).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.common.clock import Clock
from fs3.common.metrics import ServiceMetrics
from fs3.kv.api import TxnEngine
from fs3.kv.store import KVStore
from fs3.meta.identity import MetaGate
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.rpc.auth import Authenticator
from fs3.rpc.channel import ChannelFactory
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.methods import service_spec
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.node import IoSubmitter, StorageNode, StorageNodeConfig
from fs3.storage.service import StorageServicer

__all__ = ["MetaParts", "MgmtdParts", "StorageParts", "build_meta", "build_mgmtd", "build_storage_node"]


@dataclass
class MgmtdParts:
    servicer: MgmtdServicer
    dispatcher: Dispatcher


@dataclass
class StorageParts:
    node: StorageNode
    dispatcher: Dispatcher


@dataclass
class MetaParts:
    """Meta and the clients it uses: ``routing`` must learn the chain tables before a create can
    place a file, ``storage`` asks lengths and removes chunks."""

    service: MetaService
    routing: RoutingCache
    storage: StorageClient
    dispatcher: Dispatcher




def build_mgmtd(kv: KVStore, config: MgmtdConfig, *, token: str | None = None,
                metrics: ServiceMetrics | None = None) -> MgmtdParts:
    """mgmtd on ``kv``; ``metrics`` counts its requests (None: none are kept, as in the simulator)."""
    servicer = MgmtdServicer(kv, config, metrics=metrics)
    dispatcher = Dispatcher(token=token, metrics=metrics)
    dispatcher.add_service(service_spec("Mgmtd"), servicer)
    return MgmtdParts(servicer, dispatcher)


def build_storage_node(config: StorageNodeConfig, engines: dict[int, ChunkEngine], channels: ChannelFactory, *,
                       io_submitter: IoSubmitter | None = None, token: str | None = None,
                       metrics: ServiceMetrics | None = None) -> StorageParts:
    """A storage node serving ``engines`` (target id -> engine), talking to its peers and mgmtd over
    ``channels``; ``io_submitter`` replaces its I/O pool (the simulator's model of one)."""
    node = StorageNode(config, engines, channels, io_submitter=io_submitter, metrics=metrics)
    dispatcher = Dispatcher(token=token, metrics=metrics)
    dispatcher.add_service(service_spec("Storage"), StorageServicer(node, dispatcher.auth))
    return StorageParts(node, dispatcher)


def build_meta(engine: TxnEngine, channels: ChannelFactory, mgmtd_address: str, client_id: bytes,
               config: MetaServiceConfig, storage_config: StorageClientConfig, *, routing_timeout_ms: int = 5_000,
               wall_ns: Callable[[], int] | None = None, clock: Clock | None = None,
               pick: Callable[[int], int] | None = None, token: str | None = None,
               metrics: ServiceMetrics | None = None, server_id: bytes | None = None) -> MetaParts:
    """Meta on ``engine``, finding the chains through mgmtd at ``mgmtd_address`` and reaching storage
    as client ``client_id``; ``wall_ns`` stamps inode times and ``clock`` times leases (None: the
    real ones), ``pick`` chooses among a chain's replicas (None: at random); ``server_id`` names
    this meta server in the claims it records in the store (None: a random id)."""
    routing = RoutingCache([mgmtd_address], channels, rpc_timeout_ms=routing_timeout_ms)
    storage = StorageClient(routing, channels, client_id, storage_config, pick=pick)
    auth = Authenticator([token] if token else [])
    service = MetaService(engine, routing, storage, config, wall_ns=wall_ns or time.time_ns, clock=clock, auth=auth,
                          metrics=metrics, server_id=server_id)
    dispatcher = Dispatcher(metrics=metrics, auth=auth)
    dispatcher.add_service(service_spec("Meta"), MetaGate(service))
    return MetaParts(service, routing, storage, dispatcher)
