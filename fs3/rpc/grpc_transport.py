"""The gRPC transport: every service's public, language-neutral API.

Requests are the plain protobuf messages of ``proto/fs3``; bulk data rides in their
``payload`` field. The cluster token travels as the ``x-fs3-token`` metadata entry. Errors are
gRPC statuses whose trailing metadata ``x-fs3-code`` carries the fs3 status code.

Every server also answers the two standard services that tools in any language expect of a
gRPC API (docs/grpc.md): server reflection (``grpcurl list``, ``describe``), for callers the
port admits (the token rules of its own methods), and health checking
(``grpc.health.v1.Health``), without a token — probes rarely carry secrets, and the answer is
only whether each ``fs3.*`` service (and the server, under ``""``) is ``SERVING``; it turns
``NOT_SERVING`` once the process starts to stop. With mutual TLS both stay behind the
certificate check that guards the whole port.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from fs3.common.errors import FS3Error, ProtocolError, StatusCode, Timeout, Unauthenticated, Unavailable, error_for
from fs3.rpc.auth import Authenticator
from fs3.rpc.dispatch import Buffer, Dispatcher
from fs3.rpc.limits import GRPC_MESSAGE_MAX_BYTES
from fs3.rpc.methods import PAYLOAD_FIELD, MethodSpec
from fs3.rpc.versions import VersionRange, accept_choice, advertised_range, negotiate, protocol_number, range_from_wire

__all__ = ["CODE_METADATA_KEY", "HEALTH_SERVICE", "PROTOCOL_METADATA_KEY", "PROTOCOL_MIN_METADATA_KEY",
           "REFLECTION_SERVICE", "TOKEN_METADATA_KEY", "GrpcChannel",
           "GrpcServer"]

TOKEN_METADATA_KEY = "x-fs3-token"
CODE_METADATA_KEY = "x-fs3-code"
# The caller's protocol range (fs3/rpc/versions.py); absent: a protocol-1 caller.
PROTOCOL_METADATA_KEY = "x-fs3-protocol"
PROTOCOL_MIN_METADATA_KEY = "x-fs3-protocol-min"
HEALTH_SERVICE: str = health.SERVICE_NAME
REFLECTION_SERVICE: str = reflection.SERVICE_NAME
# The health service's name for the server as a whole.
_OVERALL = health.OVERALL_HEALTH
_OPTIONS = [
    ("grpc.max_send_message_length", GRPC_MESSAGE_MAX_BYTES),
    ("grpc.max_receive_message_length", GRPC_MESSAGE_MAX_BYTES),
]

_TO_GRPC: dict[StatusCode, grpc.StatusCode] = {
    StatusCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    StatusCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    StatusCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    StatusCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    StatusCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    StatusCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StatusCode.NO_SPACE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StatusCode.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    StatusCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    StatusCode.UNKNOWN_METHOD: grpc.StatusCode.UNIMPLEMENTED,
}


def _grpc_code(code: int) -> grpc.StatusCode:
    try:
        return _TO_GRPC.get(StatusCode(code), grpc.StatusCode.FAILED_PRECONDITION)
    except ValueError:
        return grpc.StatusCode.INTERNAL


def _caller_range(metadata: Any) -> VersionRange:
    """The protocol range a call's metadata advertises (none: protocol 1)."""
    high = low = 0
    for key, value in metadata or ():
        if key in (PROTOCOL_METADATA_KEY, PROTOCOL_MIN_METADATA_KEY):
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
            number = protocol_number(text)
            if number is None:
                raise ProtocolError(f"bad {key} metadata {text[:20]!r}: expected a protocol number")
            if key == PROTOCOL_METADATA_KEY:
                high = number
            else:
                low = number
    return range_from_wire(high, low)


def _presented_token(metadata: Any) -> str | bytes | None:
    """The ``x-fs3-token`` a call carries (None: none; the last one if it carries several)."""
    presented = None
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY:
            presented = value
    return presented


async def _refuse_unauthenticated(request_iterator: Any, context: Any) -> None:
    # Take the caller's first message before refusing: a refusal racing a client that is still
    # sending it reaches that client as an INTERNAL failure of its send, not as UNAUTHENTICATED.
    async for _ in request_iterator:
        break
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token",
                        trailing_metadata=((CODE_METADATA_KEY, str(int(StatusCode.UNAUTHENTICATED))),))


class _ReflectionGate(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Server reflection answers whoever the port's own methods admit (``Authenticator``): a
    missing or wrong token gets ``UNAUTHENTICATED`` there as on any ``fs3.*`` method. Health
    checks and the fs3 methods pass through (the latter check their token in the dispatcher)."""

    _PREFIX = f"/{REFLECTION_SERVICE}/"

    def __init__(self, auth: Authenticator) -> None:
        self._auth = auth
        self._refusal = grpc.stream_stream_rpc_method_handler(_refuse_unauthenticated)

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        if not handler_call_details.method.startswith(self._PREFIX):
            return await continuation(handler_call_details)
        if self._auth.authenticate(_presented_token(handler_call_details.invocation_metadata)) is None:
            return self._refusal
        return await continuation(handler_call_details)


class GrpcServer:
    """Serves a :class:`Dispatcher` over gRPC (grpc.aio), with server reflection and the health
    service (see the module doc); with ``credentials`` (server credentials that require a client
    certificate) over TLS only."""

    def __init__(self, dispatcher: Dispatcher, credentials: Any = None, protocols: VersionRange | None = None) -> None:
        """``protocols``: the protocol versions served (default: this release's, as pinned by
        ``$FS3_PROTOCOL_VERSION_MAX``); a call advertising none of them is refused."""
        self.dispatcher = dispatcher
        self.protocols = protocols or advertised_range()
        self._credentials = credentials
        self._server: Any = None
        self._health: Any = None
        self.service_names: list[str] = []

    def _make_handler(self, method: MethodSpec) -> Any:
        dispatcher = self.dispatcher

        async def handle(raw: bytes, context: Any) -> bytes:
            metadata = context.invocation_metadata()
            try:
                caller = _caller_range(metadata)
                chosen = negotiate(self.protocols, caller, f"the caller at {context.peer()}",
                                   local_name="this server")
            except ProtocolError as exc:
                context.set_trailing_metadata(((CODE_METADATA_KEY, str(int(exc.code))),))
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.message)
            # The protocol chosen goes back in the trailing metadata, except to a protocol-1 caller
            # (it sent no version): it gets exactly what protocol 1 sends.
            spoken: tuple[tuple[str, str], ...] = ((PROTOCOL_METADATA_KEY, str(chosen)),) if caller.high >= 2 else ()
            presented = _presented_token(metadata)
            reply = await dispatcher.dispatch(method.method_id, raw, b"", dispatcher.auth.authenticate(presented))
            if reply.status != StatusCode.OK:
                context.set_trailing_metadata(((CODE_METADATA_KEY, str(int(reply.status))), *spoken))
                await context.abort(_grpc_code(reply.status), reply.message.decode("utf-8", "replace"))
            if spoken:
                context.set_trailing_metadata(spoken)
            if len(reply.payload) and method.response_has_payload:
                response = method.response_type.FromString(reply.message)
                setattr(response, PAYLOAD_FIELD, bytes(reply.payload))
                return bytes(response.SerializeToString())
            return reply.message

        return grpc.unary_unary_rpc_method_handler(handle)

    async def start(self, host: str, port: int) -> int:
        self._server = grpc.aio.server(options=_OPTIONS, interceptors=(_ReflectionGate(self.dispatcher.auth),))
        by_service: dict[str, dict[str, Any]] = {}
        for method in self.dispatcher.methods():
            by_service.setdefault(method.service, {})[method.name] = self._make_handler(method)
        for service, handlers in by_service.items():
            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(f"fs3.{service}", handlers),))
        self.service_names = [f"fs3.{service}" for service in by_service]
        self._health = health.aio.HealthServicer()
        for name in (_OVERALL, *self.service_names):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        # The fs3 messages are in the default descriptor pool (fs3.rpc.methods imports every module).
        reflection.enable_server_reflection((*self.service_names, HEALTH_SERVICE, REFLECTION_SERVICE),
                                            self._server)
        if self._credentials is not None:
            bound = self._server.add_secure_port(f"{host}:{port}", self._credentials)
        else:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot bind gRPC to {host}:{port}")
        await self._server.start()
        return int(bound)

    async def stop_serving(self) -> None:
        """Report every service ``NOT_SERVING`` from now on (the process is stopping: load
        balancers and probes move away while the calls in flight finish)."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()

    async def stop(self) -> None:
        if self._server is not None:
            await self.stop_serving()
            await self._server.stop(grace=0.5)
            self._server = None


class GrpcChannel:
    """A client for one gRPC server, with the same ``call`` signature as the framed channel.

    ``credentials``: channel credentials (TLS, with this client's certificate); the server's
    certificate must name ``server_name`` (default: the host part of the address).
    """

    def __init__(self, address: str, token: str | None = None, credentials: Any = None,
                 server_name: str = "", protocols: VersionRange | None = None) -> None:
        self.address = address
        self.protocols = protocols or advertised_range()
        #: The protocol the server chose in its latest answer (0: no call answered yet); newer
        #: features wait for it.
        self.protocol = 0
        self._refusal: str | None = None  # why the server is refused (then no call is sent)
        # Pinned to protocol 1, a call carries protocol 1's metadata: the token only.
        self._version_metadata: tuple[tuple[str, str], ...] = (
            ((PROTOCOL_METADATA_KEY, str(self.protocols.high)), (PROTOCOL_MIN_METADATA_KEY, str(self.protocols.low)))
            if self.protocols.high >= 2 else ())
        self._token = token
        self._credentials = credentials
        self._server_name = server_name
        self._channel: Any = None
        self._stubs: dict[str, Any] = {}

    def set_token(self, token: str | None) -> None:
        """Present ``token`` from the next call on (gRPC sends it with every call)."""
        self._token = token

    def _server_protocol(self, trailing: Any) -> int:
        """The protocol the server chose, from the trailing metadata of an answer (none: a
        protocol-1 server). A server too old for this client is refused: the call that
        found out already ran there (gRPC has no handshake to refuse it before), later ones are
        not sent (a new channel asks again)."""
        chosen = 0
        for key, value in trailing or ():
            if key == PROTOCOL_METADATA_KEY:
                chosen = protocol_number(str(value)) or 0
        try:
            return accept_choice(self.protocols, chosen, f"the server {self.address}")
        except ProtocolError as exc:
            self._refusal = exc.message
            raise

    def _stub(self, method: MethodSpec) -> Any:
        if self._channel is None:
            if self._credentials is not None:
                options = [*_OPTIONS, *([("grpc.ssl_target_name_override", self._server_name)]
                                        if self._server_name else [])]
                self._channel = grpc.aio.secure_channel(self.address, self._credentials, options=options)
            else:
                self._channel = grpc.aio.insecure_channel(self.address, options=_OPTIONS)
        stub = self._stubs.get(method.grpc_path)
        if stub is None:
            stub = self._channel.unary_unary(method.grpc_path)
            self._stubs[method.grpc_path] = stub
        return stub

    async def call(self, method: MethodSpec, request: Message, payload: Buffer = b"",
                   timeout_ms: int = 10_000) -> tuple[Message, bytes]:
        if len(payload):
            if not method.request_has_payload:
                raise ValueError(f"{method.name} carries no payload")
            request = type(request).FromString(request.SerializeToString())
            setattr(request, PAYLOAD_FIELD, bytes(payload))
        if self._refusal is not None:
            raise ProtocolError(self._refusal)
        metadata = (((TOKEN_METADATA_KEY, self._token),) if self._token else ()) + self._version_metadata
        try:
            call = self._stub(method)(request.SerializeToString(), timeout=timeout_ms / 1000,
                                      metadata=metadata or None)
            raw = await call
            # Every answer, not only the first: the channel reconnects under us to whatever release
            # now serves the address (a server upgraded, or rolled back), and the protocol is that one's.
            self.protocol = self._server_protocol(await call.trailing_metadata())
        except grpc.aio.AioRpcError as exc:
            raise _to_fs3_error(exc, self.address, method, self._credentials is not None) from None
        except asyncio.CancelledError:
            raise
        response = method.response_type.FromString(raw)
        out = b""
        if method.response_has_payload:
            out = getattr(response, PAYLOAD_FIELD)
            response.ClearField(PAYLOAD_FIELD)
        return response, out

    async def close(self) -> None:
        if self._channel is not None:
            with contextlib.suppress(Exception):
                await self._channel.close()
            self._channel = None


# What gRPC reports when this side refused the server's certificate: no retry can change that.
_TLS_REFUSED_BY_US = ("Tls handshake failed", "CERTIFICATE_VERIFY_FAILED", "Verification Check failed")


def _to_fs3_error(exc: Any, address: str, method: MethodSpec, tls: bool = False) -> FS3Error:
    """The one place gRPC failures become fs3 errors."""
    for key, value in exc.trailing_metadata() or ():
        if key == CODE_METADATA_KEY:
            return error_for(int(value), exc.details() or "")
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Timeout(f"{method.name} to {address} timed out")
    if code == grpc.StatusCode.UNAVAILABLE:
        details = exc.details() or ""
        if tls and any(marker in details for marker in _TLS_REFUSED_BY_US):
            return Unauthenticated(f"TLS: the certificate of {address} is not trusted: {details}")
        if tls and "Socket closed" in details:
            # A server that refuses our certificate just closes the connection (TLS 1.3); so does
            # one that is stopping, hence still retryable.
            return Unavailable(f"{address} unavailable: {details} (stopping, or refusing this client's "
                               f"certificate)")
        if "Socket closed" in details:
            return Unavailable(f"{address} unavailable: {details} (stopping, or serving TLS only)")
        return Unavailable(f"{address} unavailable: {details}")
    return error_for(StatusCode.INTERNAL, f"{method.name} to {address}: {code.name}: {exc.details()}")
