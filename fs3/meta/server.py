"""The meta process: ``fs3 meta --config meta.toml``.

Wires :class:`~fs3.meta.service.MetaService` to its transaction engine (embedded RocksDB by
default), to mgmtd (heartbeats as a ``NODE_META`` node, so clients find it in the routing
information; routing for the chain tables) and to storage (length queries, chunk removal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mgpb
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.common.errors import FS3Error, InvalidArgument
from fs3.common.ids import validate_chunk_size
from fs3.common.logging import setup_logging
from fs3.common.metrics import ServiceMetrics
from fs3.kv.store import open_kv
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.methods import service_spec
from fs3.rpc.server import ServiceRuntime, install_uvloop

__all__ = ["MetaConfig", "run_meta"]

log = logging.getLogger(__name__)


@dataclass
class MetaConfig:
    """Settings of one meta process (TOML keys; env ``FS3_META_<KEY>``)."""

    node_id: int = 1001
    mgmtd_address: str = "127.0.0.1:9000"
    listen_host: str = "127.0.0.1"
    advertise_host: str = ""
    framed_port: int = 9010
    grpc_port: int = 9011
    metrics_port: int = 9012
    token: str = ""
    transport: str = "framed"
    data_dir: str = ".fs3/meta"
    kv_engine: str = "rocksdb"
    sync_commits: bool = True
    heartbeat_interval_ms: int = 1_000
    rpc_timeout_ms: int = 5_000
    chain_table_id: int = 1
    chunk_size_bytes: int = 4 * 1024 * 1024
    stripe_default: int = 16
    root_uid: int = -1           # -1: the uid running meta
    root_gid: int = -1
    root_mode: int = 0o755
    client_lease_ms: int = 30_000
    expired_client_ttl_ms: int = 600_000   # a lapsed client's id stays refused; clients retry for half of it
    prune_interval_ms: int = 5_000
    gc_interval_ms: int = 2_000
    log_level: str = "INFO"

    def validate(self) -> None:
        if self.node_id <= 0:
            raise InvalidArgument("node_id must be positive")
        if self.transport not in ("framed", "grpc"):
            raise InvalidArgument(f"transport {self.transport!r}: expected framed or grpc")
        validate_chunk_size(self.chunk_size_bytes)
        if not 1 <= self.stripe_default <= 256:
            raise InvalidArgument("stripe_default must be within [1, 256]")
        if self.client_lease_ms < 1_000:
            raise InvalidArgument("client_lease_ms must be at least 1000")
        if self.expired_client_ttl_ms < 2 * self.client_lease_ms:
            raise InvalidArgument("expired_client_ttl_ms must be at least twice client_lease_ms "
                                  "(clients retry a request for up to half of it)")
        if not 0 <= self.root_mode <= 0o7777:
            raise InvalidArgument("root_mode must be a permission mode (0..0o7777)")


async def _heartbeat_loop(config: MetaConfig, channels: RealChannelFactory, addresses: tuple[str, str, str]) -> None:
    method = service_spec("Mgmtd").method("Heartbeat")
    req = mgpb.HeartbeatReq(node_id=config.node_id, node_type=cpb.NODE_META, framed_address=addresses[0],
                            grpc_address=addresses[1], metrics_address=addresses[2], hostname=socket.gethostname(),
                            pid=os.getpid())
    while True:
        try:
            await channels.get(config.mgmtd_address).call(method, req, timeout_ms=config.rpc_timeout_ms)
        except FS3Error as exc:
            log.debug("meta heartbeat failed: %s", exc)
        await asyncio.sleep(config.heartbeat_interval_ms / 1000)


async def serve_meta(config: MetaConfig, ready_file: str | None = None) -> None:
    kv = open_kv(config.kv_engine, Path(config.data_dir) / "kv" if config.kv_engine == "rocksdb" else None)
    engine = OptimisticTxnEngine(kv, sync=config.sync_commits)
    metrics = ServiceMetrics("meta")
    channels = RealChannelFactory(config.token or None, config.transport)  # type: ignore[arg-type]
    routing = RoutingCache([config.mgmtd_address], channels, config.rpc_timeout_ms)
    storage = StorageClient(routing, channels, os.urandom(16),
                            StorageClientConfig(rpc_timeout_ms=config.rpc_timeout_ms))
    service = MetaService(engine, routing, storage, MetaServiceConfig(
        chain_table_id=config.chain_table_id, chunk_size_bytes=config.chunk_size_bytes,
        stripe_default=config.stripe_default,
        root_uid=os.getuid() if config.root_uid < 0 else config.root_uid,
        root_gid=os.getgid() if config.root_gid < 0 else config.root_gid,
        root_mode=config.root_mode, client_lease_ms=config.client_lease_ms,
        expired_client_ttl_ms=config.expired_client_ttl_ms,
        prune_interval_ms=config.prune_interval_ms, gc_interval_ms=config.gc_interval_ms))
    dispatcher = Dispatcher(token=config.token or None, metrics=metrics)
    dispatcher.add_service(service_spec("Meta"), service)
    runtime = ServiceRuntime(f"meta-{config.node_id}", dispatcher, metrics)
    with contextlib.suppress(FS3Error):
        await routing.refresh()
    await service.start()
    bound = await runtime.start(config.listen_host, config.framed_port, config.grpc_port, config.metrics_port,
                                config.advertise_host)
    heartbeat = asyncio.create_task(_heartbeat_loop(config, channels, (bound.framed, bound.grpc, bound.metrics)))
    runtime.write_ready_file(ready_file)

    async def shutdown() -> None:
        heartbeat.cancel()
        with contextlib.suppress(BaseException):
            await heartbeat
        await service.stop()
        await channels.close()
        kv.close()

    await runtime.run_until_stopped(shutdown)


def run_meta(config: MetaConfig, ready_file: str | None = None) -> None:
    setup_logging(f"meta-{config.node_id}", config.log_level)
    install_uvloop()
    asyncio.run(serve_meta(config, ready_file))
