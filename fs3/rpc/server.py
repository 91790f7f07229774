"""Running one service process: both transports, /metrics, signals, its tokens, and a readiness file."""

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

from fs3.common.errors import FS3Error
from fs3.common.metrics import ServiceMetrics, serve_metrics
from fs3.common.secret_files import TokenSource
from fs3.rpc.auth import Authenticator
from fs3.rpc.channel import RealChannelFactory, Transport
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.framed import FramedServer
from fs3.rpc.grpc_transport import GrpcServer
from fs3.rpc.tls import Tls

__all__ = ["BoundAddresses", "ServiceRuntime", "TokenReloader", "install_uvloop"]

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


class TokenReloader:
    """A service's cluster tokens, read again from their token file on SIGHUP: the dispatcher
    accepts every token of the file on incoming calls, and the service's channels present the
    first on outgoing ones (new connections at once; open ones once their calls are answered).

    A file that cannot be read or is not private leaves the tokens as they were (an error is
    logged, naming the file, never a token): a typo in a rotation loses nothing."""

    def __init__(self, source: TokenSource) -> None:
        """Reads the tokens once: a token file that cannot be used stops the start, with its error."""
        self.source = source
        self._tokens = source.load()
        self.auth = Authenticator(self._tokens, source.load_trusted())
        self.channels: RealChannelFactory | None = None

    def channel_factory(self, transport: Transport, tls: Tls | None = None) -> RealChannelFactory:
        """The service's outgoing channels, presenting the first token (and the new one after a reload)."""
        self.channels = RealChannelFactory(self._tokens[0] if self._tokens else None, transport, tls)
        return self.channels

    def reload(self) -> bool:
        """Read the token file again and switch to its tokens; False (and the old tokens kept) if it
        cannot be used."""
        if not self.source.reloadable:
            log.warning("SIGHUP: no token_file is configured, nothing to reload")
            return False
        try:
            tokens = self.source.load()
            trusted = self.source.load_trusted()
        except FS3Error as exc:
            log.error("SIGHUP: keeping the current tokens: %s", exc)
            return False
        self._tokens = tokens
        self.auth.set_tokens(tokens, trusted)
        if self.channels is not None and tokens:
            self.channels.set_token(tokens[0])
        log.info("SIGHUP: %d cluster token(s) loaded from %s; %d trusted-client token(s)", len(tokens),
                 self.source.token_file, len(trusted))
        return True


class ServiceRuntime:
    """Serves a dispatcher on the framed and gRPC transports until told to stop.

    With ``tls`` both transports accept only mutual-TLS connections from peers whose certificate
    the cluster's CA signed (the /metrics endpoint stays plain HTTP: it carries no secrets).
    """

    def __init__(self, name: str, dispatcher: Dispatcher, metrics: ServiceMetrics,
                 *, tokens: TokenReloader | None = None, tls: Tls | None = None) -> None:
        """``tokens``: reloaded on SIGHUP (without, SIGHUP is logged and ignored: it never stops
        a service)."""
        self.name = name
        self.tokens = tokens
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
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        log.info("%s serving (%s): framed %s, grpc %s, metrics %s", self.name,
                 "mutual TLS" if self.tls is not None else "clear", self.bound.framed, self.bound.grpc,
                 self.bound.metrics or "off")
        return self.bound

    def _on_sighup(self) -> None:
        if self.tokens is None:
            log.warning("%s: SIGHUP ignored (no token file)", self.name)
            return
        self.tokens.reload()

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
        # Health checks answer NOT_SERVING for the whole shutdown, before anything is torn down.
        await self.grpc.stop_serving()
        if on_stop is not None:
            await on_stop()
        await self.framed.stop()
        await self.grpc.stop()
