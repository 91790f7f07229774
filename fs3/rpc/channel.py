"""Client-side channel abstraction: one interface over framed, gRPC and simulated transports."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Protocol

from google.protobuf.message import Message

from fs3.rpc.dispatch import Buffer
from fs3.rpc.methods import MethodSpec

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
    """Channels over real sockets, one cached per address."""

    def __init__(self, token: str | None = None, transport: Transport = "framed") -> None:
        self.token = token
        self.transport: Transport = transport
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
            if self.transport == "grpc":
                from fs3.rpc.grpc_transport import GrpcChannel

                channel = GrpcChannel(address, self.token)
            else:
                from fs3.rpc.framed import FramedChannel

                channel = FramedChannel(address, self.token)
            self._channels[address] = channel
        return channel

    def node_address(self, framed_address: str, grpc_address: str) -> str:
        return grpc_address if self.transport == "grpc" else framed_address

    async def close(self) -> None:
        channels, self._channels = self._channels, {}
        for channel in channels.values():
            await channel.close()
