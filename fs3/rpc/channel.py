"""Client-side channel abstraction: one interface over framed, gRPC and simulated transports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from google.protobuf.message import Message

from fs3.rpc.dispatch import Buffer
from fs3.rpc.methods import MethodSpec
from fs3.rpc.tls import Tls, TlsConfig

if TYPE_CHECKING:
    from fs3.rpc.framed import FramedChannel
    from fs3.rpc.grpc_transport import GrpcChannel

__all__ = ["Channel", "ChannelFactory", "RealChannelFactory", "Transport"]

Transport = Literal["framed", "grpc"]


class Channel(Protocol):
    address: str

    async def call(self, method: MethodSpec, request: Message, payload: Buffer = b"",
                   timeout_ms: int = 10_000) -> tuple[Message, bytes]: ...

    async def close(self) -> None: ...


class ChannelFactory(Protocol):
    """Hands out (cached) channels by address; services and clients get one injected."""

    def get(self, address: str) -> Channel: ...

    def node_address(self, framed_address: str, grpc_address: str) -> str:
        """Which of a node's two addresses this factory's channels speak to."""
        ...

    async def close(self) -> None: ...


class RealChannelFactory:
    """Channels over real sockets, one cached per address.

    ``tls`` (loaded material, or a ``[tls]`` table to load): every channel speaks mutual TLS,
    presenting this process's certificate; a service passes the same material its servers use, so
    its outgoing calls (forwarding, heartbeats, meta to storage) are as protected as its incoming.
    """

    def __init__(self, token: str | None = None, transport: Transport = "framed",
                 tls: Tls | TlsConfig | None = None) -> None:
        self.token = token
        self.transport: Transport = transport
        self.tls = tls if isinstance(tls, Tls) or tls is None else Tls.load(tls)
        self._grpc_credentials: object = None
        self._channels: dict[str, FramedChannel | GrpcChannel] = {}

    def __repr__(self) -> str:  # never print a secret
        return f"RealChannelFactory({self.transport}, {len(self._channels)} channels)"

    def set_token(self, token: str | None) -> None:
        """Present ``token`` on every call from now on (a token rotation): new connections use it,
        and each open connection is replaced once the calls in flight on it are answered."""
        self.token = token
        for channel in self._channels.values():
            channel.set_token(token)

    def get(self, address: str) -> Channel:
        channel = self._channels.get(address)
        if channel is None:
            tls = self.tls
            if self.transport == "grpc":
                from fs3.rpc.grpc_transport import GrpcChannel

                if tls is not None and self._grpc_credentials is None:
                    self._grpc_credentials = tls.grpc_channel_credentials()
                channel = GrpcChannel(address, self.token, self._grpc_credentials,
                                      tls.server_name if tls is not None else "")
            else:
                from fs3.rpc.framed import FramedChannel

                channel = FramedChannel(address, self.token, ssl_context=tls.client_context if tls else None,
                                        server_name=tls.server_name if tls is not None else "")
            self._channels[address] = channel
        return channel

    def node_address(self, framed_address: str, grpc_address: str) -> str:
        return grpc_address if self.transport == "grpc" else framed_address

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
