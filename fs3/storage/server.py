"""The storage process: ``fs3 storage --config storage.toml``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from fs3.common.errors import InvalidArgument
from fs3.common.logging import setup_logging
from fs3.common.metrics import ServiceMetrics
from fs3.common.secret_files import TokenSource, make_private_dir
from fs3.kv.store import RocksKVStore, open_kv
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.methods import service_spec
from fs3.rpc.server import ServiceRuntime, TokenReloader, install_uvloop
from fs3.rpc.tls import Tls, TlsConfig
from fs3.storage.blobs import FileBlobStore
from fs3.storage.chunk_engine import ChunkEngine
from fs3.storage.node import StorageNode, StorageNodeConfig
from fs3.storage.replica import ReplicaConfig
from fs3.storage.scrub import ScrubConfig
from fs3.storage.service import StorageServicer

__all__ = ["StorageConfig", "TargetConfig", "run_storage"]

log = logging.getLogger(__name__)


@dataclass
class TargetConfig:
    target_id: int
    path: str


@dataclass
class StorageConfig:
    """Settings of one storage process (TOML keys; env ``FS3_STORAGE_<KEY>``); every target's
    replica's in the ``[replica]`` table (env ``FS3_STORAGE_REPLICA_<KEY>``)."""

    # Keys that were top-level before the replica's settings became a table: still read, with a warning.
    MOVED_KEYS: ClassVar[Mapping[str, str]] = {
        key: "replica" for key in ("forward_timeout_ms", "forward_retry_total_ms", "dirty_read_policy",
                                   "channel_record_ttl_ms", "updates_inflight_max", "updates_inflight_bytes_max")}

    node_id: int = 1
    mgmtd_address: str = "127.0.0.1:9000"  # several mgmtd: comma-separated (the node follows the primary)
    listen_host: str = "127.0.0.1"
    advertise_host: str = ""
    framed_port: int = 0
    grpc_port: int = 0
    metrics_port: int = -1
    # The cluster token inline (never printed: not in the repr), or a token file (one token a
    # line, the first presented, all accepted; read again on SIGHUP, so tokens rotate live).
    token: str = field(default="", repr=False)
    token_file: str = ""
    # Trusted-client tokens (mount daemons acting for their callers), one a line; reloaded on SIGHUP.
    trusted_token_file: str = ""
    transport: str = "framed"
    targets: list[TargetConfig] = field(default_factory=list)
    heartbeat_interval_ms: int = 1_000
    rpc_timeout_ms: int = 5_000
    replica: ReplicaConfig = field(default_factory=ReplicaConfig)
    fsync: bool = True
    # Free space new chunk data never takes (writes get NO_SPACE); with RocksDB at least its
    # headroom plus COMMIT_SLACK_BYTES whatever this says (see open_engines).
    reserve_bytes: int = 0
    # Chunk versions up to this size live in the target's RocksDB instead of files (0: never).
    inline_max_bytes: int = 128 * 1024
    kv_engine: str = "rocksdb"
    io_threads: int = 4
    # Mutual TLS on both transports, incoming and outgoing (the [tls] table; off when empty).
    tls: TlsConfig = field(default_factory=TlsConfig)
    # How far past its expiry a client's data-path capability is still accepted (clock skew with meta).
    capability_skew_ms: int = 30_000
    # The background scrubber (the [scrub] table; off unless a rate is set).
    scrub: ScrubConfig = field(default_factory=ScrubConfig)
    # Speak at most this protocol (fs3/rpc/versions.py; 0: this release's newest), as
    # $FS3_PROTOCOL_VERSION_MAX: the pin of a rolling upgrade (docs/operations.md "Rolling upgrade").
    protocol_version_max: int = 0
    log_level: str = "INFO"
    # A target of an older format is migrated when the node starts; off: it is refused, and
    # `fs3 admin upgrade --config` migrates it with the node stopped (docs/operations.md "Upgrading").
    upgrade_on_start: bool = True

    def validate(self) -> None:
        if self.node_id <= 0:
            raise InvalidArgument("node_id must be positive")
        if not self.targets:
            raise InvalidArgument("a storage node needs at least one [[targets]] entry")
        if self.token and self.token_file:
            raise InvalidArgument("set token or token_file, not both")
        ids = [t.target_id for t in self.targets]
        if len(set(ids)) != len(ids) or any(t <= 0 for t in ids):
            raise InvalidArgument("target ids must be positive and unique")
        if self.transport not in ("framed", "grpc"):
            raise InvalidArgument(f"transport {self.transport!r}: expected framed or grpc")
        if not 0 <= self.io_threads <= 64:
            raise InvalidArgument("io_threads must be within [0, 64]")
        if not 0 <= self.inline_max_bytes <= 1 << 20:
            raise InvalidArgument("inline_max_bytes must be within [0, 1 MiB]")
        if self.heartbeat_interval_ms < 10:
            raise InvalidArgument("heartbeat_interval_ms must be at least 10")
        if not 0 <= self.capability_skew_ms <= 600_000:
            raise InvalidArgument("capability_skew_ms must be within [0, 600000]")
        self.replica.validate()
        self.scrub.validate()


# Free space beyond RocksDB's headroom for the commits of writes admitted just before the disk
# filled: a commit may still write (an inline chunk patched at commit is stored anew), and it must
# not fail once the successors have committed.
COMMIT_SLACK_BYTES = 4 << 20


def open_engines(config: StorageConfig) -> dict[int, ChunkEngine]:
    """Each target's chunk engine on its own KV store and blob store.

    With RocksDB the target keeps free space in two tiers: new chunk data is refused (NO_SPACE)
    below ``reserve_bytes`` — at least RocksDB's headroom plus :data:`COMMIT_SLACK_BYTES` —, and
    the KV store refuses its own writes only below the headroom, which is what lets commits of
    admitted writes and the deletes that free space through on a full target.
    """
    engines = {}
    for target in config.targets:
        root = Path(target.path)
        make_private_dir(root)  # 0700: its chunk files are for this service only
        headroom = RocksKVStore.default_headroom(root) if config.kv_engine == "rocksdb" else 0
        kv = open_kv(config.kv_engine, root / "meta" if config.kv_engine == "rocksdb" else None, headroom)
        files = FileBlobStore(root / "chunks", fsync=config.fsync)
        reserve = max(config.reserve_bytes, headroom + COMMIT_SLACK_BYTES) if headroom else config.reserve_bytes
        engines[target.target_id] = ChunkEngine(kv, files, inline_max_bytes=config.inline_max_bytes,
                                                reserve_bytes=reserve, sync_commits=config.fsync,
                                                upgrade=config.upgrade_on_start, where=f"storage target {root}")
    return engines


async def serve_storage(config: StorageConfig, ready_file: str | None = None) -> None:
    tls = Tls.load(config.tls, server=True)  # before anything opens: bad TLS material stops the start
    tokens = TokenReloader(TokenSource(config.token, config.token_file, config.trusted_token_file))
    channels = tokens.channel_factory(config.transport, tls)  # type: ignore[arg-type]
    engines = open_engines(config)
    metrics = ServiceMetrics("storage")
    dispatcher = Dispatcher(metrics=metrics, auth=tokens.auth)
    runtime = ServiceRuntime(f"storage-{config.node_id}", dispatcher, metrics, tokens=tokens, tls=tls)
    node_config = StorageNodeConfig(
        node_id=config.node_id, mgmtd_address=config.mgmtd_address,
        heartbeat_interval_ms=config.heartbeat_interval_ms, rpc_timeout_ms=config.rpc_timeout_ms,
        io_threads=config.io_threads, replica=config.replica, capability_skew_ms=config.capability_skew_ms,
        scrub=config.scrub,
    )
    node = StorageNode(node_config, engines, channels, metrics=metrics)
    dispatcher.add_service(service_spec("Storage"), StorageServicer(node, dispatcher.auth))
    bound = await runtime.start(config.listen_host, config.framed_port, config.grpc_port, config.metrics_port,
                                config.advertise_host)
    node_config.framed_address, node_config.grpc_address = bound.framed, bound.grpc
    node_config.metrics_address = bound.metrics
    await node.start()
    runtime.write_ready_file(ready_file)

    async def shutdown() -> None:
        await node.stop()
        await channels.close()
        for engine in engines.values():
            engine.close()

    await runtime.run_until_stopped(shutdown)


def run_storage(config: StorageConfig, ready_file: str | None = None) -> None:
    setup_logging(f"storage-{config.node_id}", config.log_level)
    install_uvloop()
    asyncio.run(serve_storage(config, ready_file))
