"""A simulated network between simulated processes.

Each call is serialized to bytes (so the protobuf contracts are exercised), delayed by a
seeded random latency, possibly dropped, and delivered to the destination's dispatcher as a
task of the destination process, so a crash there cancels it mid-way. Messages on one
directed link are delivered in order, like TCP; messages on different links reorder freely.
A dropped message or a dead destination looks to the caller like a real one: a timeout (the
request may or may not have run) or a refused connection.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field

from google.protobuf.message import Message

from fs3.common.errors import StatusCode, Timeout, Unavailable, error_for
from fs3.rpc.auth import SERVICE
from fs3.rpc.dispatch import Buffer, Dispatcher
from fs3.sim.loop import SimProcess

__all__ = ["NetworkFaults", "SimChannel", "SimChannelFactory", "SimNetwork"]


@dataclass
class NetworkFaults:
    latency_min_ms: float = 0.05
    latency_max_ms: float = 2.0
    drop_probability: float = 0.0
    partitioned: set[frozenset[str]] = field(default_factory=set)
    cancel_probability: float = 0.0  # a call that times out cancels its handler on the server


@dataclass
class _Host:
    name: str
    process: SimProcess
    dispatcher: Dispatcher


class SimNetwork:
    def __init__(self, rng: random.Random, faults: NetworkFaults | None = None) -> None:
        self.rng = rng
        self.faults = faults or NetworkFaults()
        self._hosts: dict[str, _Host] = {}
        self._link_clock: dict[tuple[str, str], float] = {}
        self.messages = 0
        self.dropped = 0

    def bind(self, address: str, process: SimProcess, dispatcher: Dispatcher) -> None:
        self._hosts[address] = _Host(address, process, dispatcher)

    def unbind(self, address: str) -> None:
        self._hosts.pop(address, None)

    def partition(self, a: str, b: str) -> None:
        self.faults.partitioned.add(frozenset((a, b)))

    def heal(self) -> None:
        self.faults.partitioned.clear()

    def _cut(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self.faults.partitioned

    async def _transit(self, src: str, dst: str) -> bool:
        """Wait out the latency of one message; False when it is lost."""
        self.messages += 1
        loop = asyncio.get_running_loop()
        delay = self.rng.uniform(self.faults.latency_min_ms, self.faults.latency_max_ms) / 1000
        key = (src, dst)
        arrive = max(loop.time() + delay, self._link_clock.get(key, 0.0))
        self._link_clock[key] = arrive
        dropped = self.rng.random() < self.faults.drop_probability or self._cut(src, dst)
        await asyncio.sleep(arrive - loop.time())
        if dropped:
            self.dropped += 1
        return not dropped

    async def call(self, src: str, dst: str, method_id: int, message: bytes, payload: Buffer,
                   timeout_ms: int) -> tuple[int, bytes, bytes]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        host = self._hosts.get(dst)
        if host is None or not host.process.alive:
            await asyncio.sleep(self.rng.uniform(0.1, 1.0) / 1000)
            raise Unavailable(f"connection to {dst} refused")
        if not await self._transit(src, dst):
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            raise Timeout(f"call to {dst} timed out (message lost)")
        if not host.process.alive or self._hosts.get(dst) is not host:
            raise Unavailable(f"connection to {dst} reset")
        payload_copy = bytes(payload)
        task = host.process.run(host.dispatcher.dispatch(method_id, message, payload_copy, SERVICE))
        try:
            reply = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - loop.time()))
        except TimeoutError:
            if self.faults.cancel_probability and self.rng.random() < self.faults.cancel_probability:
                task.cancel()  # the deadline reaches the server, or the client closed the connection
            raise Timeout(f"call to {dst} timed out") from None
        except asyncio.CancelledError:
            if task.cancelled() and not _self_cancelled():
                raise Unavailable(f"connection to {dst} reset (process died)") from None
            raise
        if not await self._transit(dst, src):
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            raise Timeout(f"call to {dst} timed out (reply lost)")
        return reply.status, bytes(reply.message), bytes(reply.payload)


def _self_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class SimChannel:
    def __init__(self, network: SimNetwork, src: str, dst: str) -> None:
        self.network = network
        self.src = src
        self.address = dst

    async def call(self, method, request: Message, payload: Buffer = b"",  # type: ignore[no-untyped-def]
                   timeout_ms: int = 10_000) -> tuple[Message, bytes]:
        status, body, out = await self.network.call(self.src, self.address, method.method_id,
                                                    request.SerializeToString(), payload, timeout_ms)
        if status != StatusCode.OK:
            raise error_for(status, body.decode("utf-8", "replace"))
        return method.response_type.FromString(body), out

    async def close(self) -> None:
        pass


class SimChannelFactory:
    def __init__(self, network: SimNetwork, src: str) -> None:
        self.network = network
        self.src = src
        self._channels: dict[str, SimChannel] = {}

    def get(self, address: str) -> SimChannel:
        channel = self._channels.get(address)
        if channel is None:
            channel = SimChannel(self.network, self.src, address)
            self._channels[address] = channel
        return channel

    def node_address(self, framed_address: str, grpc_address: str) -> str:
        return framed_address

    async def close(self) -> None:
        self._channels.clear()

