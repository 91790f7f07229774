"""The framed transport: asyncio TCP (uvloop in services), many requests in flight per connection."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import ssl

from google.protobuf.message import Message

from fs3.common.errors import (
    FrameTooLarge,
    FS3Error,
    InvalidArgument,
    ProtocolError,
    StatusCode,
    Timeout,
    Unauthenticated,
    Unavailable,
    error_for,
)
from fs3.rpc.auth import Principal
from fs3.rpc.dispatch import Buffer, Dispatcher
from fs3.rpc.framing import HEADER, MAGIC, FrameHeader, FrameKind, pack_header, unpack_header
from fs3.rpc.limits import HELLO_MSG_MAX_BYTES, FramedLimits
from fs3.rpc.methods import MethodSpec
from fs3.rpc.tls import tls_error
from fs3.rpc.versions import VersionRange, accept_choice, advertised_range, negotiate, range_from_wire

__all__ = ["FramedChannel", "FramedLimits", "FramedServer"]

log = logging.getLogger(__name__)


_COALESCE_MAX_BYTES = 64 * 1024
#: One connection's calls in flight: request id -> the future of its (status, message, payload).
_Pending = dict[int, "asyncio.Future[tuple[int, bytes, bytes]]"]


def _tls_eof(exc: ssl.SSLError) -> bool:
    """Whether OpenSSL reports the peer closing the connection without a TLS alert or close_notify."""
    return isinstance(exc, ssl.SSLEOFError) or exc.reason == "UNEXPECTED_EOF_WHILE_READING"


def _send_frame(writer: asyncio.StreamWriter, header: bytes, message: bytes, payload: Buffer) -> None:
    """Queue one frame; small frames go out as one buffer (one send), large payloads are not copied."""
    if len(payload) <= _COALESCE_MAX_BYTES:
        writer.write(b"".join((header, message, payload)))
    else:
        writer.write(header + message)
        writer.write(payload)


def _tune(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class FramedServer:
    """Serves a :class:`Dispatcher` over the framed protocol.

    With ``ssl_context`` (a server context that requires a client certificate) every connection
    first completes a TLS handshake; a peer that fails it is dropped before any frame is read.
    """

    def __init__(self, dispatcher: Dispatcher, limits: FramedLimits | None = None,
                 ssl_context: ssl.SSLContext | None = None, protocols: VersionRange | None = None) -> None:
        """``protocols``: the protocol versions this server speaks (default: this release's, as pinned
        by ``$FS3_PROTOCOL_VERSION_MAX``); a client outside them is refused at its HELLO."""
        self.dispatcher = dispatcher
        self.protocols = protocols or advertised_range()
        self.limits = limits or FramedLimits()
        self._ssl = ssl_context
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(
            self._on_connection, host, port, limit=1 << 20, ssl=self._ssl,
            ssl_handshake_timeout=self.limits.hello_timeout_ms / 1000 if self._ssl is not None else None)
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        _tune(writer)
        try:
            await self._serve(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # TimeoutError: no token within the hello timeout
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        limits = self.limits
        auth = self.dispatcher.auth
        principal: Principal | None = auth.authenticate(None) if auth.open else None
        authenticated = principal is not None
        presented: bytes | None = None  # the credential of the HELLO, checked again after a token change
        generation = auth.generation
        inflight = asyncio.Semaphore(limits.inflight_requests_max)
        tasks: set[asyncio.Task[None]] = set()
        first = True
        try:
            while True:
                # Before it authenticated, a connection is nobody's: its first frame may hold a token
                # and no more, and must arrive whole within the hello timeout (else anyone who can
                # reach the port makes the server buffer a full-size frame per connection, or keeps
                # connections open for ever with a header and nothing after it).
                anonymous = first and not authenticated
                async with asyncio.timeout(limits.hello_timeout_ms / 1000 if anonymous else None):
                    raw = await reader.readexactly(HEADER.size)
                    try:
                        header = unpack_header(raw, HELLO_MSG_MAX_BYTES if anonymous else limits.msg_max_bytes,
                                               0 if anonymous else limits.payload_max_bytes)
                    except (ProtocolError, FrameTooLarge) as exc:
                        # The stream cannot be re-synchronised after a bad header: answer, then hang up.
                        log.warning("refused a frame from %s: %s", _peer(writer), exc.message)
                        writer.write(pack_header(FrameKind.RESPONSE, 0, exc.code, 0, len(exc.message), 0))
                        writer.write(exc.message.encode())
                        await writer.drain()
                        return
                    message = await reader.readexactly(header.msg_len) if header.msg_len else b""
                    payload = await reader.readexactly(header.payload_len) if header.payload_len else b""
                if header.kind == FrameKind.HELLO:
                    presented, generation = message, auth.generation
                    principal = auth.authenticate(message)
                    ok = principal is not None
                    status = StatusCode.OK if ok else StatusCode.UNAUTHENTICATED
                    chosen, refusal = self._negotiate(header, writer) if ok else (0, b"")
                    if refusal:
                        status, ok = StatusCode.PROTOCOL_ERROR, False
                    # A protocol-1 client (it sent no range) gets the very bytes protocol 1 answers.
                    writer.write(pack_header(FrameKind.HELLO_ACK, chosen if header.method_id else 0, status,
                                             header.request_id, len(refusal), 0) + refusal)
                    await writer.drain()
                    if not ok:
                        return
                    authenticated = True
                    first = False
                    continue
                first = False
                if header.kind != FrameKind.REQUEST:
                    raise ProtocolError(f"unexpected frame kind {header.kind.name} from a client")
                if authenticated and auth.generation != generation:
                    # The valid tokens changed (a rotation finished): a connection opened with a
                    # token that is no longer valid is refused from its next request on.
                    generation = auth.generation
                    principal = auth.authenticate(presented)
                    authenticated = principal is not None
                await inflight.acquire()
                task = asyncio.create_task(
                    self._handle(writer, header.method_id, header.request_id, message, payload, principal,
                                 inflight)
                )
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                if not authenticated:
                    # The refusal is on its way; an unauthenticated connection gets nothing more.
                    await task
                    return
        except asyncio.IncompleteReadError as exc:
            if exc.partial or not tasks:
                raise
            # The client closed its side after its last request: answer what it already sent.
            await asyncio.wait(set(tasks), timeout=30)
        finally:
            for task in tasks:
                task.cancel()

    def _negotiate(self, hello: FrameHeader, writer: asyncio.StreamWriter) -> tuple[int, bytes]:
        """The protocol to speak with the client of ``hello``, or (0, why not) to refuse it."""
        try:
            return negotiate(self.protocols, range_from_wire(hello.method_id, hello.status),
                             f"the client at {_peer(writer)}", local_name="this server"), b""
        except ProtocolError as exc:
            log.warning("refused a client: %s", exc.message)
            return 0, exc.message.encode("utf-8", "replace")

    async def _handle(self, writer: asyncio.StreamWriter, method_id: int, request_id: int, message: bytes,
                      payload: bytes, principal: Principal | None, inflight: asyncio.Semaphore) -> None:
        try:
            reply = await self.dispatcher.dispatch(method_id, message, payload, principal)
            if writer.is_closing():
                return
            header = pack_header(FrameKind.RESPONSE, method_id, reply.status, request_id, len(reply.message),
                                 len(reply.payload))
            _send_frame(writer, header, reply.message, reply.payload)
            await writer.drain()
        except (ConnectionError, RuntimeError):
            pass
        finally:
            inflight.release()



def _peer(writer: asyncio.StreamWriter) -> str:
    """The remote end of a connection as ``host:port`` (for log lines and refusals)."""
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer or "unknown")


def _http2_settings(raw: bytes) -> bool:
    """Whether the first bytes a server sent are an HTTP/2 SETTINGS frame: the server preface of
    a gRPC port (a length that is a multiple of 6, type 4, stream 0), never a framed HELLO_ACK,
    which starts with the framed magic. Said plainly, it spares a user the "bad frame magic"
    puzzle of a port mixed up with its neighbour."""
    return (len(raw) >= 9 and int.from_bytes(raw[:2], "little") != MAGIC and raw[3] == 0x04 and raw[4] in (0, 1)
            and raw[5:9] == b"\0\0\0\0" and int.from_bytes(raw[:3], "big") % 6 == 0)


class FramedChannel:
    """A client connection to one framed server, multiplexing concurrent calls.

    Connects lazily, authenticates with the cluster token, and reconnects on the next call
    after a failure. A call that cannot be delivered raises :class:`Unavailable`; one that
    gets no answer in time raises :class:`Timeout` (the request may still have executed).
    """

    def __init__(self, address: str, token: str | None = None, connect_timeout_ms: int = 3_000,
                 limits: FramedLimits | None = None, ssl_context: ssl.SSLContext | None = None,
                 server_name: str = "", protocols: VersionRange | None = None) -> None:
        """``ssl_context``: speak TLS, verifying the server's certificate names ``server_name``
        (default: the host part of ``address``). ``protocols``: the protocol versions this client
        speaks (default: this release's, as pinned by ``$FS3_PROTOCOL_VERSION_MAX``)."""
        self.protocols = protocols or advertised_range()
        #: The protocol the current connection speaks (0: not connected yet); features of a newer
        #: protocol are used only when this says the server speaks it.
        self.protocol = 0
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad address {address!r}, expected host:port")
        self.address = address
        # An IPv6 address is written ``[v6]:port``; the socket layer wants it without brackets.
        self._host, self._port = host.removeprefix("[").removesuffix("]"), int(port)
        self._token = token
        self._ssl = ssl_context
        self._server_name = server_name or host.strip("[]")
        self._tls_refusals = 0  # connections in a row the server closed right after the TLS handshake
        self._connect_timeout_ms = connect_timeout_ms
        self._limits = limits or FramedLimits()
        self._writer: asyncio.StreamWriter | None = None
        # Every connection's reader: the current one's, and those of connections retired by a
        # token change that still answer the calls sent on them.
        self._readers: set[asyncio.Task[None]] = set()
        # The calls in flight on the current connection (each connection has its own).
        self._pending: _Pending = {}
        # A bound on requests in flight on this connection: callers beyond it wait their turn.
        self._slots = asyncio.Semaphore(self._limits.inflight_requests_max)
        self._ids = itertools.count(1)
        self._connect_lock = asyncio.Lock()
        self._closed = False

    def set_token(self, token: str | None) -> None:
        """Present ``token`` from now on (a token rotation). The current connection, which
        authenticated with the old token, takes no new calls: the next call opens a connection
        with the new token, and the old one closes once the calls sent on it have their answers,
        so a rotation fails no call in flight."""
        if token == self._token:
            return
        self._token = token
        writer, pending = self._writer, self._pending
        self._writer, self._pending = None, {}
        if writer is not None and not pending:
            writer.close()  # its reader sees the end of the stream and stops

    async def _ensure_connected(self) -> tuple[asyncio.StreamWriter, _Pending]:
        if self._writer is not None and not self._writer.is_closing():
            return self._writer, self._pending
        async with self._connect_lock:
            if self._writer is not None and not self._writer.is_closing():
                return self._writer, self._pending
            if self._closed:
                raise Unavailable(f"channel to {self.address} is closed")
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self._host, self._port, limit=1 << 20, ssl=self._ssl,
                                            server_hostname=self._server_name if self._ssl else None),
                    self._connect_timeout_ms / 1000,
                )
            except ssl.SSLError as exc:
                if _tls_eof(exc):
                    raise self._closed_after_tls() from None
                raise tls_error(exc, self.address) from None
            except (OSError, TimeoutError) as exc:
                raise Unavailable(f"cannot connect to {self.address}: {exc}") from None
            _tune(writer)
            try:
                token = (self._token or "").encode()
                # Pinned to protocol 1, the HELLO is protocol 1's, byte for byte.
                high, low = (self.protocols.high, self.protocols.low) if self.protocols.high >= 2 else (0, 0)
                writer.write(pack_header(FrameKind.HELLO, high, low, 0, len(token), 0) + token)
                await writer.drain()
                raw = await asyncio.wait_for(reader.readexactly(HEADER.size), self._connect_timeout_ms / 1000)
                if _http2_settings(raw):
                    writer.close()
                    raise InvalidArgument(f"{self.address} is a gRPC port (it answers in HTTP/2): use "
                                          f"--transport grpc, or the service's framed port")
                header = unpack_header(raw, self._limits.msg_max_bytes, self._limits.payload_max_bytes)
                said = (await reader.readexactly(header.msg_len)).decode("utf-8", "replace") if header.msg_len else ""
            except ssl.SSLError as exc:
                writer.close()
                if _tls_eof(exc):
                    raise self._closed_after_tls() from None
                raise tls_error(exc, self.address) from None
            except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
                writer.close()
                if self._ssl is not None and isinstance(exc, asyncio.IncompleteReadError | ConnectionResetError):
                    raise self._closed_after_tls() from None
                hint = "" if self._ssl or not isinstance(exc, asyncio.IncompleteReadError) else \
                    " (closed unanswered: does the server require TLS?)"
                raise Unavailable(f"handshake with {self.address} failed: {exc!r}{hint}") from None
            self._tls_refusals = 0
            if header.kind != FrameKind.HELLO_ACK or header.status != StatusCode.OK:
                writer.close()
                if header.status == StatusCode.UNAUTHENTICATED:
                    raise Unauthenticated(f"{self.address} refused the cluster token")
                raise error_for(header.status, f"handshake with {self.address} refused" + (f": {said}" if said else ""))
            try:
                # A HELLO_ACK without a version (method_id 0) comes from a protocol-1 server.
                self.protocol = accept_choice(self.protocols, header.method_id, f"the server {self.address}")
            except ProtocolError:
                writer.close()
                raise
            self._writer, self._pending = writer, {}
            reader_task = asyncio.create_task(self._read_loop(reader, writer, self._pending))
            self._readers.add(reader_task)
            reader_task.add_done_callback(self._readers.discard)
            return writer, self._pending

    def _closed_after_tls(self) -> FS3Error:
        """The server hung up between the TLS handshake and its answer to our HELLO.

        With TLS 1.3 a server judges the client's certificate after the client's side of the
        handshake is done, and asyncio servers close without sending the alert: this is how a
        refused certificate looks from here. A server stopping at that very moment looks the same
        once, but not twice in a row (a stopped server refuses the next connection outright), so
        the first time is retryable and the second is the refusal it almost surely is.
        """
        self._tls_refusals += 1
        if self._tls_refusals >= 2:
            return Unauthenticated(f"TLS: {self.address} closes every connection right after the handshake: it "
                                   f"refuses this client's certificate (none, expired, or not signed by the "
                                   f"cluster's CA)")
        return Unavailable(f"TLS: {self.address} closed the connection right after the handshake (stopping, or "
                           f"refusing this client's certificate)")

    async def _read_loop(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pending: _Pending) -> None:
        error: FS3Error = Unavailable(f"connection to {self.address} lost")
        try:
            while True:
                raw = await reader.readexactly(HEADER.size)
                header = unpack_header(raw, self._limits.msg_max_bytes, self._limits.payload_max_bytes)
                message = await reader.readexactly(header.msg_len) if header.msg_len else b""
                payload = await reader.readexactly(header.payload_len) if header.payload_len else b""
                if header.request_id == 0 and header.status != StatusCode.OK:
                    error = error_for(header.status, message.decode("utf-8", "replace"))
                    break
                future = pending.pop(header.request_id, None)
                if future is not None and not future.done():
                    future.set_result((header.status, message, payload))
                if self._writer is not writer and not pending:
                    break  # retired by a token change, and its last call is answered
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except FS3Error as exc:
            error = Unavailable(f"bad frame from {self.address}: {exc}")
        except asyncio.CancelledError:
            pass
        finally:
            if self._writer is writer:
                self._writer, self._pending = None, {}
            writer.close()
            for future in list(pending.values()):
                if not future.done():
                    future.set_exception(type(error)(error.message))

    async def call(self, method: MethodSpec, request: Message, payload: Buffer = b"",
                   timeout_ms: int = 10_000) -> tuple[Message, bytes]:
        async with self._slots:
            status, body, out_payload = await self._exchange(method, request, payload, timeout_ms)
        if status != StatusCode.OK:
            raise error_for(status, body.decode("utf-8", "replace"))
        return method.response_type.FromString(body), out_payload

    async def _exchange(self, method: MethodSpec, request: Message, payload: Buffer,
                        timeout_ms: int) -> tuple[int, bytes, bytes]:
        writer, pending = await self._ensure_connected()
        request_id = next(self._ids)
        message = request.SerializeToString()
        future: asyncio.Future[tuple[int, bytes, bytes]] = asyncio.get_running_loop().create_future()
        pending[request_id] = future
        timer = asyncio.get_running_loop().call_later(timeout_ms / 1000, _expire, future)
        try:
            header = pack_header(FrameKind.REQUEST, method.method_id, 0, request_id, len(message), len(payload))
            _send_frame(writer, header, message, payload)
            await writer.drain()
            return await future
        except (ConnectionError, RuntimeError) as exc:
            raise Unavailable(f"send to {self.address} failed: {exc}") from None
        except TimeoutError:
            raise Timeout(f"{method.name} to {self.address} timed out after {timeout_ms} ms") from None
        finally:
            timer.cancel()
            pending.pop(request_id, None)
            if not pending and pending is not self._pending:
                writer.close()  # a retired connection's last call is over (answered or timed out)

    async def close(self) -> None:
        self._closed = True
        for reader_task in list(self._readers):
            reader_task.cancel()
            with contextlib.suppress(BaseException):
                await reader_task
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _expire(future: asyncio.Future[tuple[int, bytes, bytes]]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())
