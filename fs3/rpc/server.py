"""Running one service process: both transports, /metrics, signals, and a readiness file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from fs3.common.metrics import ServiceMetrics, serve_metrics
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.framed import FramedServer
from fs3.rpc.grpc_transport import GrpcServer
from fs3.rpc.tls import Tls

__all__ = ["BoundAddresses", "ServiceRuntime", "install_uvloop"]

log = logging.getLogger(__name__)


def install_uvloop() -> None:
    """Use uvloop for service processes when it is installed (it is a hard dependency)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a declared dependency
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


@dataclass
class BoundAddresses:
    framed: str = ""
    grpc: str = ""
    metrics: str = ""
    extra: dict[str, object] = field(default_factory=dict)


class ServiceRuntime:
    """Serves a dispatcher on the framed and gRPC transports until told to stop.

    With ``tls`` both transports accept only mutual-TLS connections from peers whose certificate
    the cluster's CA signed (the /metrics endpoint stays plain HTTP: it carries no secrets).
    """

    def __init__(self, name: str, dispatcher: Dispatcher, metrics: ServiceMetrics, tls: Tls | None = None) -> None:
        self.name = name
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.tls = tls
        self.framed = FramedServer(dispatcher, ssl_context=tls.server_context() if tls is not None else None)
        self.grpc = GrpcServer(dispatcher, tls.grpc_server_credentials() if tls is not None else None)
        self.stopping = asyncio.Event()
        self.bound = BoundAddresses()
        dispatcher.on_fatal(self._fatal)

    def _fatal(self, exc: BaseException) -> None:
        log.critical("%s: stopping after a broken invariant: %s", self.name, exc)
        self.stopping.set()

    async def start(self, host: str, framed_port: int, grpc_port: int, metrics_port: int,
                    advertise_host: str = "") -> BoundAddresses:
        public = advertise_host or host
        port = await self.framed.start(host, framed_port)
        self.bound.framed = f"{public}:{port}"
        port = await self.grpc.start(host, grpc_port)
        self.bound.grpc = f"{public}:{port}"
        if metrics_port >= 0:
            port = serve_metrics(self.metrics, host, metrics_port)
            self.bound.metrics = f"{public}:{port}"
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stopping.set)
        log.info("%s serving (%s): framed %s, grpc %s, metrics %s", self.name,
                 "mutual TLS" if self.tls is not None else "clear", self.bound.framed, self.bound.grpc,
                 self.bound.metrics or "off")
        return self.bound

    def write_ready_file(self, path: str | None) -> None:
        """Tell a supervisor (fs3 local, tests) where this process listens, atomically."""
        if not path:
            return
        data = {"name": self.name, "pid": os.getpid(), "framed": self.bound.framed, "grpc": self.bound.grpc,
                "metrics": self.bound.metrics, **self.bound.extra}
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)

    async def run_until_stopped(self, on_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        await self.stopping.wait()
        log.info("%s stopping", self.name)
        if on_stop is not None:
            await on_stop()
        await self.framed.stop()
        await self.grpc.stop()
