"""Transport-independent request dispatch: auth, decode, call the servicer, encode, metrics.

Both transports (and the simulator's network) call :meth:`Dispatcher.dispatch`; it never
raises. Any failure becomes a ``(status, message)`` pair, so one malformed request can never
take a service down.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message

from fs3.common.buffers import Buffer
from fs3.common.errors import (
    FS3Error,
    InvalidArgument,
    InvariantViolation,
    PermissionDenied,
    StatusCode,
    Unauthenticated,
    UnknownMethod,
)
from fs3.common.metrics import ServiceMetrics
from fs3.rpc.auth import Authenticator, Principal, principal_scope
from fs3.rpc.methods import PAYLOAD_FIELD, MethodSpec, ServiceSpec, method_by_id

__all__ = ["Buffer", "Dispatcher", "Handler", "Reply"]

log = logging.getLogger(__name__)

Handler = Callable[[Any, memoryview], Awaitable[tuple[Message, Buffer]]]
EMPTY = memoryview(b"")


@dataclass(slots=True)
class Reply:
    """The outcome of one dispatched call: either ``status == OK`` with a message, or an error."""

    status: int
    message: bytes  # serialized response, or UTF-8 error text
    payload: Buffer


class Dispatcher:
    """Routes method ids to servicer coroutines."""

    def __init__(self, token: str | None = None, metrics: ServiceMetrics | None = None,
                 auth: Authenticator | None = None) -> None:
        self.auth = auth if auth is not None else Authenticator([token] if token else [])
        self.metrics = metrics
        self._handlers: dict[int, tuple[MethodSpec, Handler]] = {}
        self._on_fatal: Callable[[BaseException], None] | None = None
        self._metric_children: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def add_service(self, spec: ServiceSpec, servicer: object) -> None:
        for method in spec.methods:
            handler = getattr(servicer, method.handler_name, None)
            if handler is None:
                raise TypeError(f"{type(servicer).__name__} lacks {method.handler_name} for {method.grpc_path}")
            self._handlers[method.method_id] = (method, handler)

    def on_fatal(self, callback: Callable[[BaseException], None]) -> None:
        """Called when a handler breaks an invariant: the service must stop, not keep serving."""
        self._on_fatal = callback

    def methods(self) -> list[MethodSpec]:
        return [spec for spec, _ in self._handlers.values()]

    async def dispatch(self, method_id: int, message: Buffer, payload: Buffer, principal: Principal | None) -> Reply:
        """Serve one call from ``principal`` (None: the connection did not authenticate)."""
        entry = self._handlers.get(method_id)
        method = method_by_id(method_id)
        # Unknown ids share one label value: anyone may send any of 65536 ids (an unauthenticated
        # connection gets one request answered), and a series per id would grow /metrics, and this
        # process's memory, without bound.
        name = method.name if method else "unknown"
        service = method.service if method else "unknown"
        start = time.perf_counter()
        code = StatusCode.OK
        try:
            if principal is None:
                raise Unauthenticated("missing or wrong token")
            if entry is None:
                raise UnknownMethod(f"no method with id {method_id}")
            spec, handler = entry
            if not principal.may_call(spec.service, spec.name):
                log.warning("refused %s.%s to %r: a service method", spec.service, spec.name, principal)
                raise PermissionDenied(f"{spec.service}.{spec.name} needs a cluster token")
            try:
                request = spec.request_type.FromString(bytes(message))
            except (DecodeError, RuntimeError, ValueError) as exc:
                raise InvalidArgument(f"undecodable {spec.request_type.__name__}: {exc}") from None
            if spec.request_has_payload and getattr(request, PAYLOAD_FIELD):
                # gRPC clients put bulk data in the payload field; handlers see it as the payload.
                if len(payload):
                    raise InvalidArgument("payload sent both in the message and after the frame")
                payload = memoryview(getattr(request, PAYLOAD_FIELD))
                request.ClearField(PAYLOAD_FIELD)
            view = payload if isinstance(payload, memoryview) else memoryview(payload)
            if self.metrics is not None and len(view):
                self.metrics.rpc_bytes_in.labels(service).inc(len(view))
            with principal_scope(principal):
                response, out_payload = await handler(request, view)
            if self.metrics is not None and len(out_payload):
                self.metrics.rpc_bytes_out.labels(service).inc(len(out_payload))
            return Reply(StatusCode.OK, response.SerializeToString(), out_payload)
        except InvariantViolation as exc:
            code = exc.code
            log.critical("invariant violated in %s: %s", name, exc)
            if self._on_fatal is not None:
                self._on_fatal(exc)
            return Reply(code, str(exc.message).encode(), EMPTY)
        except FS3Error as exc:
            code = exc.code
            return Reply(code, exc.message.encode("utf-8", "replace"), EMPTY)
        except Exception as exc:
            code = StatusCode.INTERNAL
            log.exception("unexpected error in %s", name)
            return Reply(code, f"internal error: {type(exc).__name__}: {exc}".encode("utf-8", "replace"), EMPTY)
        finally:
            if self.metrics is not None:
                counter, histogram = self._metric(service, name, code)
                counter.inc()
                histogram.observe(time.perf_counter() - start)

    def _metric(self, service: str, name: str, code: StatusCode) -> tuple[Any, Any]:
        key = (service, name, int(code))
        children = self._metric_children.get(key)
        if children is None:
            assert self.metrics is not None
            children = (self.metrics.rpc_requests.labels(service, name, code.name),
                        self.metrics.rpc_latency_seconds.labels(service, name))
            self._metric_children[key] = children
        return children
