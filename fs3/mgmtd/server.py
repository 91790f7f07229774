"""The mgmtd process: ``fs3 mgmtd --config mgmtd.toml``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from fs3.common.errors import InvalidArgument
from fs3.common.logging import setup_logging
from fs3.common.metrics import ServiceMetrics
from fs3.common.secret_files import TokenSource, make_private_dir
from fs3.kv.api import TxnEngine
from fs3.kv.store import open_kv
from fs3.mgmtd.formats import open_mgmtd_format, open_shared_mgmtd_format
from fs3.mgmtd.ha import SharedEngine
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.methods import service_spec
from fs3.rpc.server import ServiceRuntime, TokenReloader, install_uvloop
from fs3.rpc.tls import Tls

__all__ = ["open_shared_engine", "run_mgmtd", "shared_setup"]

log = logging.getLogger(__name__)


async def open_shared_engine(config: MgmtdConfig) -> tuple[TxnEngine, Callable[[], Awaitable[None]]]:
    """The shared database several mgmtd instances run on (``kv_engine = "postgres"``), and how to
    close it: connects and checks the schema first (an unreachable server, a wrong password, a
    database of another cluster or schema version stop the start here, with nothing written).

    Everything above it (the lease, the fenced state writes, standbys) speaks only
    :class:`~fs3.kv.api.TxnEngine`. mgmtd's keys live under ``mgmtd/``, so it may share the
    database of the cluster's meta servers (one cluster id for both).
    """
    from fs3.kv.postgres import PostgresConfig, PostgresTxnEngine  # the driver loads only for PostgreSQL

    engine = await PostgresTxnEngine.open(PostgresConfig(config.pg_url, cluster_id=config.cluster_id, sync=True))
    return engine, engine.close


def shared_setup(config: MgmtdConfig, engine: TxnEngine) -> SharedEngine:
    """This instance's part in the lease: its name and the address standbys send clients to."""
    address = config.advertise_address or f"{config.listen_host}:{config.framed_port}"
    if not config.advertise_address and config.framed_port == 0:
        raise InvalidArgument("several mgmtd on a shared engine: set framed_port or advertise_address, so that "
                              "standbys can name this instance")
    return SharedEngine(engine, config.instance_name or address, address, config.lease_config())


async def serve_mgmtd(config: MgmtdConfig, ready_file: str | None = None) -> None:
    tls = Tls.load(config.tls, server=True)  # before anything opens: bad TLS material stops the start
    tokens = TokenReloader(TokenSource(config.token, config.token_file, config.trusted_token_file))
    metrics = ServiceMetrics("mgmtd")
    close_engine: Callable[[], Awaitable[None]] | None = None
    if config.kv_engine == "postgres":
        engine, close_engine = await open_shared_engine(config)
        try:
            await open_shared_mgmtd_format(engine, f"mgmtd store (PostgreSQL, cluster {config.cluster_id})",
                                           upgrade=config.upgrade_on_start, cluster_id=config.cluster_id)
        except BaseException:
            await close_engine()
            raise
        servicer = MgmtdServicer(None, config, metrics=metrics, shared=shared_setup(config, engine))
    else:
        if config.kv_engine == "rocksdb":
            make_private_dir(config.data_dir)
        kv = open_kv(config.kv_engine, Path(config.data_dir) / "kv" if config.kv_engine == "rocksdb" else None)
        try:
            open_mgmtd_format(kv, f"mgmtd store {Path(config.data_dir) / 'kv'}", upgrade=config.upgrade_on_start,
                              cluster_id=config.cluster_id)
        except BaseException:
            kv.close()
            raise
        servicer = MgmtdServicer(kv, config, metrics=metrics)
    dispatcher = Dispatcher(metrics=metrics, auth=tokens.auth)
    dispatcher.add_service(service_spec("Mgmtd"), servicer)
    runtime = ServiceRuntime("mgmtd", dispatcher, metrics, tokens=tokens, tls=tls)
    servicer.start()
    bound = await runtime.start(config.listen_host, config.framed_port, config.grpc_port, config.metrics_port)
    servicer.metrics_address = bound.metrics
    servicer.framed_address = bound.framed
    runtime.write_ready_file(ready_file)

    async def shutdown() -> None:
        await servicer.stop()
        if close_engine is not None:
            await close_engine()

    await runtime.run_until_stopped(shutdown)


def run_mgmtd(config: MgmtdConfig, ready_file: str | None = None) -> None:
    setup_logging("mgmtd", config.log_level)
    install_uvloop()
    asyncio.run(serve_mgmtd(config, ready_file))
