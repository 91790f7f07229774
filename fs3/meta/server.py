"""The meta process: ``fs3 meta --config meta.toml``.

Wires :class:`~fs3.meta.service.MetaService` to its transaction engine (embedded RocksDB by
default; ``kv_engine = "postgres"`` with ``pg_url``: :mod:`fs3.kv.postgres`, a database several
meta servers can share), to mgmtd (heartbeats as a ``NODE_META`` node, so clients find it in the routing
information; routing for the chain tables) and to storage (length queries, chunk removal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mgpb
from fs3.client.mgmtd import MgmtdCaller
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.common.errors import AlreadyExists, FS3Error, InvalidArgument, ProtocolError
from fs3.common.ids import validate_chunk_size
from fs3.common.logging import setup_logging
from fs3.common.metrics import ServiceMetrics
from fs3.common.secret_files import TokenSource, make_private_dir
from fs3.kv.api import TxnEngine
from fs3.kv.store import open_kv
from fs3.kv.txn import OptimisticTxnEngine
from fs3.meta.identity import MetaGate
from fs3.meta.service import MetaService, MetaServiceConfig
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.methods import service_spec
from fs3.rpc.server import ServiceRuntime, TokenReloader, install_uvloop
from fs3.rpc.tls import Tls, TlsConfig
from fs3.rpc.versions import stamp_heartbeat

if TYPE_CHECKING:
    from fs3.kv.postgres import PostgresConfig

__all__ = ["KV_ENGINES", "MetaConfig", "export_engine_metrics", "heartbeat_loop", "meta_store_name", "open_engine",
           "run_meta"]

log = logging.getLogger(__name__)

KV_ENGINES = ("rocksdb", "mem", "postgres")


def _service_defaults() -> MetaServiceConfig:
    # -1: the uid (gid) running meta owns / when it is first created.
    return MetaServiceConfig(root_uid=-1, root_gid=-1)


@dataclass
class MetaConfig:
    """Settings of one meta process (TOML keys; env ``FS3_META_<KEY>``); the metadata service's own
    in the ``[service]`` table (env ``FS3_META_SERVICE_<KEY>``)."""

    # Keys that were top-level before the service's settings became a table: still read, with a warning.
    MOVED_KEYS: ClassVar[Mapping[str, str]] = {
        key: "service" for key in ("chain_table_id", "chunk_size_bytes", "stripe_default", "root_uid", "root_gid",
                                   "root_mode", "client_lease_ms", "expired_client_ttl_ms", "prune_interval_ms",
                                   "gc_interval_ms")}

    node_id: int = 1001
    mgmtd_address: str = "127.0.0.1:9000"
    listen_host: str = "127.0.0.1"
    advertise_host: str = ""
    framed_port: int = 9010
    grpc_port: int = 9011
    metrics_port: int = 9012
    # The cluster token inline (never printed: not in the repr), or a token file (one token a
    # line, the first presented, all accepted; read again on SIGHUP, so tokens rotate live).
    token: str = field(default="", repr=False)
    token_file: str = ""
    # Trusted-client tokens (mount daemons acting for their callers), one a line; reloaded on SIGHUP.
    trusted_token_file: str = ""
    transport: str = "framed"
    data_dir: str = ".fs3/meta"
    # rocksdb (embedded, one meta server), mem (tests), or postgres: the namespace in a PostgreSQL
    # database at pg_url (libpq URL; it holds the password, so it is never printed), shared by
    # every meta server of the cluster whose cluster_id the database was created with.
    kv_engine: str = "rocksdb"
    sync_commits: bool = True
    pg_url: str = field(default="", repr=False)
    cluster_id: str = "fs3"
    pg_pool_size_max: int = 16
    pg_statement_timeout_ms: int = 5_000
    heartbeat_interval_ms: int = 1_000
    rpc_timeout_ms: int = 5_000
    service: MetaServiceConfig = field(default_factory=_service_defaults)
    # Mutual TLS on both transports, incoming and outgoing (the [tls] table; off when empty).
    tls: TlsConfig = field(default_factory=TlsConfig)
    # Speak at most this protocol (fs3/rpc/versions.py; 0: this release's newest), as
    # $FS3_PROTOCOL_VERSION_MAX: the pin of a rolling upgrade (docs/operations.md "Rolling upgrade").
    protocol_version_max: int = 0
    log_level: str = "INFO"

    def validate(self) -> None:
        if self.node_id <= 0:
            raise InvalidArgument("node_id must be positive")
        if self.token and self.token_file:
            raise InvalidArgument("set token or token_file, not both")
        if self.transport not in ("framed", "grpc"):
            raise InvalidArgument(f"transport {self.transport!r}: expected framed or grpc")
        if self.kv_engine not in KV_ENGINES:
            raise InvalidArgument(f"kv_engine {self.kv_engine!r}: expected one of {', '.join(KV_ENGINES)}")
        if self.kv_engine == "postgres":
            if not self.pg_url:
                raise InvalidArgument("kv_engine postgres needs pg_url (postgresql://user:password@host:port/db)")
            self.postgres_config().validate()
        elif self.pg_url:
            raise InvalidArgument(f"pg_url is set but kv_engine is {self.kv_engine!r}: set kv_engine = \"postgres\"")
        service = self.service
        validate_chunk_size(service.chunk_size_bytes)
        if not 1 <= service.stripe_default <= 256:
            raise InvalidArgument("service.stripe_default must be within [1, 256]")
        if service.client_lease_ms < 1_000:
            raise InvalidArgument("service.client_lease_ms must be at least 1000")
        if service.expired_client_ttl_ms < 2 * service.client_lease_ms:
            raise InvalidArgument("service.expired_client_ttl_ms must be at least twice client_lease_ms "
                                  "(clients retry a request for up to half of it)")
        if not 0 <= service.root_mode <= 0o7777:
            raise InvalidArgument("service.root_mode must be a permission mode (0..0o7777)")
        service.validate()

    def postgres_config(self) -> PostgresConfig:
        from fs3.kv.postgres import PostgresConfig  # the driver loads only for meta on PostgreSQL

        return PostgresConfig(self.pg_url, cluster_id=self.cluster_id, sync=self.sync_commits,
                              pool_size_max=self.pg_pool_size_max, statement_timeout_ms=self.pg_statement_timeout_ms,
                              acquire_timeout_ms=self.rpc_timeout_ms)

    def service_config(self) -> MetaServiceConfig:
        """The service's settings with the process's defaults resolved (root owned by the user running meta)."""
        return replace(self.service, root_uid=os.getuid() if self.service.root_uid < 0 else self.service.root_uid,
                       root_gid=os.getgid() if self.service.root_gid < 0 else self.service.root_gid)


async def heartbeat_loop(config: MetaConfig, channels: RealChannelFactory, addresses: tuple[str, str, str]) -> None:
    """Registers this meta server with mgmtd and keeps it registered, forever (cancel to stop).

    Public because a meta service run inside another process (an in-process test cluster) registers
    the same way ``serve_meta`` does.
    """
    mgmtd = MgmtdCaller(config.mgmtd_address, channels, config.rpc_timeout_ms)  # follows the primary
    req = stamp_heartbeat(mgpb.HeartbeatReq(
        node_id=config.node_id, node_type=cpb.NODE_META, framed_address=addresses[0], grpc_address=addresses[1],
        metrics_address=addresses[2], hostname=socket.gethostname(), pid=os.getpid()))
    refused = False  # the refusal is logged at error once per run of them: it will not heal by itself
    while True:
        try:
            await mgmtd.call("Heartbeat", req)
            refused = False
        except ProtocolError as exc:
            log.log(logging.DEBUG if refused else logging.ERROR, "mgmtd refuses this meta server: %s", exc.message)
            refused = True
        except FS3Error as exc:
            log.debug("meta heartbeat failed: %s", exc)
        await asyncio.sleep(config.heartbeat_interval_ms / 1000)


async def open_engine(config: MetaConfig) -> tuple[TxnEngine, Callable[[], Awaitable[None]]]:
    """The transaction engine ``config`` names, and how to close it. PostgreSQL: connects and
    checks the schema first (an unreachable server, a wrong password, a database of another
    cluster or schema version stop the start here, with nothing written)."""
    if config.kv_engine == "postgres":
        from fs3.kv.postgres import PostgresTxnEngine

        pg = await PostgresTxnEngine.open(config.postgres_config())
        return pg, pg.close
    if config.kv_engine == "rocksdb":
        make_private_dir(config.data_dir)
    kv = open_kv(config.kv_engine, Path(config.data_dir) / "kv" if config.kv_engine == "rocksdb" else None)

    async def close() -> None:
        kv.close()

    return OptimisticTxnEngine(kv, sync=config.sync_commits), close


def meta_store_name(config: MetaConfig) -> str:
    """How refusals and logs name meta's store (never with the database URL: it holds a password)."""
    if config.kv_engine == "postgres":
        return f"meta store (PostgreSQL, cluster {config.cluster_id})"
    return f"meta store {Path(config.data_dir) / 'kv'}"


def export_engine_metrics(engine: TxnEngine, metrics: ServiceMetrics) -> None:
    """The engine's counters as gauges read at scrape time (``fs3_meta_kv_round_trips`` and so on:
    database round trips, commits, conflicts, ambiguous commits), for the engines that keep them."""
    for name, doc in (("round_trips", "Round trips to the database (each flush that waited for the server)"),
                      ("commits", "Transactions committed"),
                      ("conflicts", "Transactions that conflicted (to be run again)"),
                      ("maybe_committed", "Commits whose outcome was unknown (connection lost)")):
        if hasattr(engine, name):
            gauge = metrics.gauge(f"fs3_meta_kv_{name}", doc)
            gauge.set_function(lambda name=name: float(getattr(engine, name)))  # type: ignore[misc]


async def serve_meta(config: MetaConfig, ready_file: str | None = None) -> None:
    tls = Tls.load(config.tls, server=True)  # before anything opens: bad TLS material stops the start
    tokens = TokenReloader(TokenSource(config.token, config.token_file, config.trusted_token_file))
    channels = tokens.channel_factory(config.transport, tls)  # type: ignore[arg-type]
    engine, close_engine = await open_engine(config)
    metrics = ServiceMetrics("meta")
    export_engine_metrics(engine, metrics)
    routing = RoutingCache([config.mgmtd_address], channels, config.rpc_timeout_ms)
    storage = StorageClient(routing, channels, os.urandom(16),
                            StorageClientConfig(rpc_timeout_ms=config.rpc_timeout_ms))
    service = MetaService(engine, routing, storage, config.service_config(), auth=tokens.auth, metrics=metrics,
                          server_id=f"meta-node-{config.node_id}".encode(),
                          exclusive_store=config.kv_engine in ("rocksdb", "mem"),  # opened by this process alone
                          node_id=config.node_id,  # on a shared database: one live server per node id
                          store_name=meta_store_name(config), cluster_id=config.cluster_id)
    dispatcher = Dispatcher(metrics=metrics, auth=tokens.auth)
    dispatcher.add_service(service_spec("Meta"), MetaGate(service))
    runtime = ServiceRuntime(f"meta-{config.node_id}", dispatcher, metrics, tokens=tokens, tls=tls)
    with contextlib.suppress(FS3Error):
        await routing.refresh()
    try:
        await service.start()  # a node id another live server holds stops the start here, nothing written
    except BaseException:
        await channels.close()
        await close_engine()
        raise
    bound = await runtime.start(config.listen_host, config.framed_port, config.grpc_port, config.metrics_port,
                                config.advertise_host)
    heartbeat = asyncio.create_task(heartbeat_loop(config, channels, (bound.framed, bound.grpc, bound.metrics)))
    runtime.write_ready_file(ready_file)

    async def stop_when_id_lost() -> None:
        await service.registration_lost.wait()
        log.error("meta node id %d is held by another meta server now: stopping", config.node_id)
        runtime.stopping.set()

    id_watch = asyncio.create_task(stop_when_id_lost())

    async def shutdown() -> None:
        for task in (heartbeat, id_watch):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await service.stop()
        await channels.close()
        await close_engine()

    await runtime.run_until_stopped(shutdown)
    if service.registration_lost.is_set():
        raise AlreadyExists(f"meta node id {config.node_id} was taken over by another meta server")


def run_meta(config: MetaConfig, ready_file: str | None = None) -> None:
    setup_logging(f"meta-{config.node_id}", config.log_level)
    install_uvloop()
    asyncio.run(serve_meta(config, ready_file))
