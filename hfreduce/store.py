"""A small key/value store for the rendezvous: rank 0 serves it, every rank sets and waits on keys.

torch's ``TCPStore`` plays this role for ``torch.distributed``; HFReduce has its own so that it runs
without torch (numpy arrays only), and takes torch's store instead when torch creates the process
group (:class:`TorchStore`). Three operations, the ones the rendezvous needs: ``set``, ``get`` (waits
until the key exists, up to a timeout) and ``add`` (an atomic counter, for barriers).

Like torch's store it trusts the network it listens on: run jobs on a private network (the rendezvous
only exchanges addresses, never data). Keys and values are bounded, and so are connections.

Wire format, both ways: ``u8 op | u32 key length | key | u32 value length | value`` (replies reuse it
with the op byte as a status).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any, Protocol

from hfreduce.errors import HFReduceError, HFReduceTimeout

__all__ = ["KeyValueStore", "StoreClient", "StoreServer", "TorchStore"]

_SET, _GET, _ADD = 1, 2, 3
_OK, _MISSING, _BAD = 0, 1, 2
_HEAD = struct.Struct("!BI")
_LENGTH = struct.Struct("!I")
_GET_WAIT = struct.Struct("!I")
_COUNTER = struct.Struct("!q")
MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 20
MAX_CONNECTIONS = 8192


class KeyValueStore(Protocol):
    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout_s: float) -> bytes: ...

    def add(self, key: str, delta: int) -> int: ...


def _read_exact(sock: socket.socket, count: int) -> bytes:
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the rendezvous peer closed the connection")
        got += n
    return bytes(buffer)


def _send_message(sock: socket.socket, op: int, key: bytes, value: bytes) -> None:
    sock.sendall(_HEAD.pack(op, len(key)) + key + _LENGTH.pack(len(value)) + value)


def _read_message(sock: socket.socket) -> tuple[int, bytes, bytes]:
    op, key_length = _HEAD.unpack(_read_exact(sock, _HEAD.size))
    if key_length > MAX_KEY_BYTES:
        raise ConnectionError(f"rendezvous key of {key_length} bytes (at most {MAX_KEY_BYTES})")
    key = _read_exact(sock, key_length)
    (value_length,) = _LENGTH.unpack(_read_exact(sock, _LENGTH.size))
    if value_length > MAX_VALUE_BYTES:
        raise ConnectionError(f"rendezvous value of {value_length} bytes (at most {MAX_VALUE_BYTES})")
    return op, key, _read_exact(sock, value_length)


class StoreServer:
    """Rank 0's store: a listening socket and one thread per connected rank."""

    def __init__(self, host: str, port: int) -> None:
        self._values: dict[bytes, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._connections: set[socket.socket] = set()
        try:
            self._listener = socket.create_server((host, port), reuse_port=False, backlog=1024)
        except OSError as exc:
            raise HFReduceError(f"cannot listen for the rendezvous on {host}:{port}: {exc.strerror}") from exc
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="hfreduce-store", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with self._changed:
                if self._closed or len(self._connections) >= MAX_CONNECTIONS:
                    connection.close()
                    continue
                self._connections.add(connection)
            threading.Thread(target=self._serve, args=(connection,), name="hfreduce-store-conn", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                op, key, value = _read_message(connection)
                status, reply = self._handle(op, key, value)
                _send_message(connection, status, b"", reply)
        except (OSError, ConnectionError, struct.error):
            pass
        finally:
            with self._changed:
                self._connections.discard(connection)
            connection.close()

    def _handle(self, op: int, key: bytes, value: bytes) -> tuple[int, bytes]:
        with self._changed:
            if op == _SET:
                self._values[key] = value
                self._changed.notify_all()
                return _OK, b""
            if op == _ADD:
                if len(value) != _COUNTER.size:
                    return _BAD, b"add needs an 8-byte delta"
                current = _COUNTER.unpack(self._values.get(key, _COUNTER.pack(0)))[0]
                current += _COUNTER.unpack(value)[0]
                self._values[key] = _COUNTER.pack(current)
                self._changed.notify_all()
                return _OK, self._values[key]
            if op == _GET:
                if len(value) != _GET_WAIT.size:
                    return _BAD, b"get needs a 4-byte wait"
                deadline = time.monotonic() + _GET_WAIT.unpack(value)[0] / 1000
                while key not in self._values and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return _MISSING, b""
                    self._changed.wait(remaining)
                return (_OK, self._values[key]) if key in self._values else (_MISSING, b"")
            return _BAD, b"unknown operation"

    def close(self) -> None:
        with self._changed:
            self._closed = True
            connections = list(self._connections)
            self._changed.notify_all()
        # Closing a socket does not wake a thread blocked in accept(), which keeps it listening (the
        # port stays taken, and a later start on it is answered by this closed store); a shutdown does.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._listener.close()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class StoreClient:
    """One rank's connection to the store; reconnects only at start (the store lives through init)."""

    def __init__(self, host: str, port: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last_error: OSError | None = None
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=min(5.0, timeout_s))
                break
            except OSError as exc:  # rank 0 may not listen yet
                last_error = exc
                if time.monotonic() >= deadline:
                    raise HFReduceTimeout(f"no rendezvous at {host}:{port} within {timeout_s:g} s "
                                          f"({last_error.strerror or last_error})") from exc
                time.sleep(0.05)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        self.address = (host, port)
        # How long a reply may take beyond a get's own wait: a peer on MASTER_PORT that never answers
        # (another service, a stopped rank 0) is an error, not a rank blocked for ever.
        self._reply_timeout_s = timeout_s

    def local_address(self) -> str:
        """This host's address on the interface that reaches rank 0 (what peers will dial)."""
        return str(self._sock.getsockname()[0])

    def _call(self, op: int, key: str, value: bytes, wait_s: float = 0.0) -> tuple[int, bytes]:
        encoded = key.encode()
        if len(encoded) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise HFReduceError(f"rendezvous key or value too large ({len(encoded)}, {len(value)} bytes)")
        limit_s = wait_s + self._reply_timeout_s
        with self._lock:
            try:
                self._sock.settimeout(limit_s)
                _send_message(self._sock, op, encoded, value)
                status, _, reply = _read_message(self._sock)
            except TimeoutError as exc:
                # The stream is out of step now (a late reply would answer the next request): done.
                self.close()
                raise HFReduceTimeout(f"the rendezvous store at {self.address[0]}:{self.address[1]} did not "
                                      f"answer within {limit_s:g} s (rank 0 stopped, or another service "
                                      f"listens on MASTER_PORT)") from exc
            except (OSError, ConnectionError) as exc:
                raise HFReduceError(f"lost the rendezvous store at {self.address[0]}:{self.address[1]}: "
                                    f"{exc}") from exc
        if status == _BAD:
            raise HFReduceError(f"the rendezvous store refused the request: {reply.decode(errors='replace')}")
        return status, reply

    def set(self, key: str, value: bytes) -> None:
        self._call(_SET, key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        wait_ms = max(0, min(int(timeout_s * 1000), 0xFFFFFFFF))
        status, reply = self._call(_GET, key, _GET_WAIT.pack(wait_ms), wait_ms / 1000)
        if status == _MISSING:
            raise HFReduceTimeout(f"rendezvous: {key!r} did not appear within {timeout_s:g} s "
                                  f"(a rank did not start, or started with other arguments)")
        return reply

    def add(self, key: str, delta: int) -> int:
        return int(_COUNTER.unpack(self._call(_ADD, key, _COUNTER.pack(delta))[1])[0])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()


class TorchStore:
    """torch's ``c10d.Store`` (what ``init_process_group`` hands a backend) as a :class:`KeyValueStore`."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            self._store.wait([key], timedelta(seconds=timeout_s))
        except RuntimeError as exc:  # torch raises DistStoreError (a RuntimeError) on a timeout
            raise HFReduceTimeout(f"rendezvous: {key!r} did not appear within {timeout_s:g} s") from exc
        return bytes(self._store.get(key))

    def add(self, key: str, delta: int) -> int:
        return int(self._store.add(key, delta))
