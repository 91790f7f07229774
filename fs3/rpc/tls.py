"""Mutual TLS for both transports: the ``[tls]`` table, and the contexts and credentials built from it.

With TLS on, every connection is encrypted and both ends prove who they are with a certificate the
cluster's CA signed: a server refuses a peer without one (or with one from another CA) before a
single frame is read, and a client refuses a server whose certificate does not name the host it
dialled. The token checks of :mod:`fs3.rpc.auth` still run on top: a certificate says "this peer
belongs to the cluster's PKI", the token says which role it has.

The files are read once, when a process starts (:meth:`Tls.load`), so that a missing or unreadable
file, a key that does not match its certificate or a key file others can read stops the process
with a clear error instead of failing every connection later. Only TLS 1.2 and newer are
accepted; OpenSSL negotiates 1.3 whenever both ends have it.
"""

from __future__ import annotations

import os
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fs3.common.errors import FS3Error, InvalidArgument, Unauthenticated, Unavailable

__all__ = ["Tls", "TlsConfig", "tls_error"]


@dataclass
class TlsConfig:
    """The ``[tls]`` table of a service's config, or a client's (env ``<PREFIX>_TLS_<KEY>``).

    ``ca_file`` turns TLS on: peers are verified against it. A service also needs its own
    ``cert_file`` and ``key_file``; so does a client, since servers refuse one without a
    certificate. ``server_name``: the name every server's certificate must carry, instead of the
    host part of the address dialled (for certificates issued to one shared name).
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""

    @property
    def enabled(self) -> bool:
        return bool(self.ca_file)

    def validate(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidArgument("tls: cert_file and key_file must be given together")
        if (self.cert_file or self.server_name) and not self.ca_file:
            raise InvalidArgument("tls: ca_file is required once any other tls setting is given")


def _read(what: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"tls: cannot read {what} {path}: {exc.strerror or exc}") from None


def _check_key_private(path: str) -> None:
    """Refuse a private key that other users may read (as ssh does): whoever reads it can pose
    as this node."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise InvalidArgument(f"tls: cannot read key_file {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise InvalidArgument(f"tls: key_file {path} is accessible by other users (mode {stat.S_IMODE(mode):04o});"
                              f" chmod 600 it")


class Tls:
    """A process's TLS material, loaded and checked once; hands out the server and client sides of
    both transports. Holds the private key's bytes (gRPC wants them in memory): never printed."""

    def __init__(self, config: TlsConfig) -> None:
        config.validate()
        if not config.enabled:
            raise InvalidArgument("tls: no ca_file given")
        self.config = config
        self.ca_pem = _read("ca_file", config.ca_file)
        self.cert_pem = _read("cert_file", config.cert_file) if config.cert_file else None
        if config.key_file:
            _check_key_private(config.key_file)
        self._key_pem = _read("key_file", config.key_file) if config.key_file else None
        # Building the client context checks that the CA parses and the key matches the certificate.
        self.client_context = self._client_context()
        self._server_context: ssl.SSLContext | None = None

    def __repr__(self) -> str:
        return f"Tls(ca_file={self.config.ca_file!r}, cert_file={self.config.cert_file!r})"

    @classmethod
    def load(cls, config: TlsConfig | None, *, server: bool = False) -> Tls | None:
        """The material ``config`` names, or None when TLS is off; ``server``: a service, which
        must have a certificate of its own."""
        if config is None or not config.enabled:
            return None
        if server and not config.cert_file:
            raise InvalidArgument("tls: a service needs cert_file and key_file besides ca_file")
        return cls(config)

    @property
    def server_name(self) -> str:
        return self.config.server_name

    def _base_context(self, purpose: int) -> ssl.SSLContext:
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_verify_locations(cadata=self.ca_pem.decode("ascii", "replace"))
            if self.config.cert_file:
                context.load_cert_chain(self.config.cert_file, self.config.key_file)
        except (ssl.SSLError, ValueError) as exc:
            raise InvalidArgument(f"tls: bad certificate material ({self.config.ca_file}, {self.config.cert_file}): "
                                  f"{exc}") from None
        return context

    def _client_context(self) -> ssl.SSLContext:
        # PROTOCOL_TLS_CLIENT verifies the server's chain and host name by default.
        return self._base_context(ssl.PROTOCOL_TLS_CLIENT)

    def server_context(self) -> ssl.SSLContext:
        """The framed server's context: a client certificate signed by the CA is required."""
        if self._server_context is None:
            if not self.config.cert_file:
                raise InvalidArgument("tls: a server needs cert_file and key_file")
            context = self._base_context(ssl.PROTOCOL_TLS_SERVER)
            context.verify_mode = ssl.CERT_REQUIRED
            self._server_context = context
        return self._server_context

    def grpc_server_credentials(self) -> Any:
        import grpc

        if self.cert_pem is None or self._key_pem is None:
            raise InvalidArgument("tls: a server needs cert_file and key_file")
        return grpc.ssl_server_credentials([(self._key_pem, self.cert_pem)], root_certificates=self.ca_pem,
                                           require_client_auth=True)

    def grpc_channel_credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca_pem, private_key=self._key_pem,
                                            certificate_chain=self.cert_pem)


# OpenSSL's reasons for an alert the server sent about our certificate: it will not change on a retry.
_REFUSED_CERT_REASONS = ("CERTIFICATE_REQUIRED", "BAD_CERTIFICATE", "UNKNOWN_CA", "CERTIFICATE_UNKNOWN",
                         "CERTIFICATE_EXPIRED", "CERTIFICATE_REVOKED", "UNSUPPORTED_CERTIFICATE", "ACCESS_DENIED",
                         "DECRYPT_ERROR", "HANDSHAKE_FAILURE")


def tls_error(exc: ssl.SSLError, address: str) -> FS3Error:
    """What a failed TLS exchange with ``address`` means to the caller.

    A certificate either side refused is :class:`Unauthenticated` (no retry can fix it, so a
    client fails at once with the reason instead of retrying for a minute); anything else (a
    connection cut mid-handshake, a server that speaks no TLS) is :class:`Unavailable`.
    """
    if isinstance(exc, ssl.SSLCertVerificationError):
        return Unauthenticated(f"TLS: the certificate of {address} is not trusted: {exc.verify_message}")
    reason = exc.reason or ""
    if any(r in reason for r in _REFUSED_CERT_REASONS):
        return Unauthenticated(f"TLS: {address} refused this peer's certificate ({reason})")
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
        return Unavailable(f"TLS handshake with {address} failed ({reason}): does it serve TLS?")
    return Unavailable(f"TLS handshake with {address} failed: {reason or exc}")
