"""Transports: the same calls over framed and gRPC, auth, and malformed input on the wire."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.common.errors import (
    FrameTooLarge,
    InvalidArgument,
    PermissionDenied,
    StatusCode,
    Unauthenticated,
    UnknownMethod,
)
from fs3.kv.store import MemKVStore
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.rpc.auth import SERVICE, TRUSTED, Authenticator, Role
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.framed import FramedChannel, FramedLimits, FramedServer
from fs3.rpc.framing import HEADER, MAGIC, FrameKind, pack_header, unpack_header
from fs3.rpc.grpc_transport import GrpcChannel, GrpcServer
from fs3.rpc.methods import MethodSpec, method_by_id, service_spec
from fs3.rpc.versions import VersionRange

MGMTD = service_spec("Mgmtd")
TOKEN = "s3cret"


@asynccontextmanager
async def serving(token: str | None = TOKEN, limits: FramedLimits | None = None,
                  protocols: VersionRange | None = None) -> AsyncIterator[tuple[str, str, MgmtdServicer]]:
    """An mgmtd servicer on both transports (``protocols``: the versions the servers speak)."""
    servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
    servicer.start()
    dispatcher = Dispatcher(token=token)
    dispatcher.add_service(MGMTD, servicer)
    framed = FramedServer(dispatcher, limits, protocols=protocols)
    grpc_server = GrpcServer(dispatcher, protocols=protocols)
    framed_port = await framed.start("127.0.0.1", 0)
    grpc_port = await grpc_server.start("127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{framed_port}", f"127.0.0.1:{grpc_port}", servicer
    finally:
        await framed.stop()
        await grpc_server.stop()
        await servicer.stop()


def _heartbeat(node_id: int = 1) -> mpb.HeartbeatReq:
    req = mpb.HeartbeatReq(node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address="h:1")
    req.targets.add(target_id=node_id * 100 + 1, local_state=cpb.UP_TO_DATE)
    return req


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_same_calls_on_both_transports(transport: str) -> None:
    async def body() -> None:
        async with serving() as (framed_addr, grpc_addr, servicer):
            channel = FramedChannel(framed_addr, TOKEN) if transport == "framed" else GrpcChannel(grpc_addr, TOKEN)
            rsp, _ = await channel.call(MGMTD.method("Heartbeat"), _heartbeat())
            assert isinstance(rsp, mpb.HeartbeatRsp) and rsp.routing_version > 0
            listing, _ = await channel.call(MGMTD.method("ListTargets"), cpb.Empty())
            assert [t.target_id for t in listing.targets] == [101]  # type: ignore[attr-defined]
            with pytest.raises(InvalidArgument):
                await channel.call(MGMTD.method("CreateChainTable"), mpb.CreateChainTableReq(replicas=3))
            # Many calls in flight on one connection.
            results = await asyncio.gather(*(channel.call(MGMTD.method("Heartbeat"), _heartbeat(i))
                                             for i in range(2, 60)))
            assert len(results) == 58 and len(servicer.state.nodes) == 59
            await channel.close()
    asyncio.run(body())


def test_a_framed_channel_reaches_an_ipv6_address_in_brackets() -> None:
    """``[::1]:PORT``, as URLs and the CLI write an IPv6 address, connects (the brackets are the
    address's notation, not part of the host)."""
    async def body() -> None:
        servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
        servicer.start()
        dispatcher = Dispatcher(token=TOKEN)
        dispatcher.add_service(MGMTD, servicer)
        framed = FramedServer(dispatcher)
        port = await framed.start("::1", 0)
        channel = FramedChannel(f"[::1]:{port}", TOKEN)
        try:
            rsp, _ = await channel.call(MGMTD.method("Heartbeat"), _heartbeat())
            assert isinstance(rsp, mpb.HeartbeatRsp) and rsp.routing_version > 0
        finally:
            await channel.close()
            await framed.stop()
            await servicer.stop()
    asyncio.run(body())


USER_TOKEN = "fs3u.0123456789abcdef." + "x" * 43


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_a_client_that_is_not_a_service_reaches_client_methods_only(transport: str) -> None:
    """A user token opens a connection, but chain and node administration need a cluster token
    (the refusal is PERMISSION_DENIED and changes nothing)."""
    async def body() -> None:
        async with serving() as (framed_addr, grpc_addr, servicer):
            channel = (FramedChannel(framed_addr, USER_TOKEN) if transport == "framed"
                       else GrpcChannel(grpc_addr, USER_TOKEN))
            rsp, _ = await channel.call(MGMTD.method("GetRoutingInfo"), mpb.GetRoutingInfoReq())
            assert isinstance(rsp, mpb.GetRoutingInfoRsp)
            with pytest.raises(PermissionDenied):
                await channel.call(MGMTD.method("Heartbeat"), _heartbeat())
            assert not servicer.state.nodes
            await channel.close()
    asyncio.run(body())


def test_the_authenticator_maps_each_credential_to_its_role() -> None:
    auth = Authenticator(["new-token", "old-token"], ["mount-token"])
    assert auth.authenticate("new-token") == SERVICE and auth.authenticate(b"old-token") == SERVICE
    assert auth.authenticate("mount-token") == TRUSTED
    user = auth.authenticate(USER_TOKEN)
    assert user is not None and user.role == Role.USER and user.token_id == "0123456789abcdef"
    assert USER_TOKEN not in repr(user)
    for bad in (None, "", "wrong", b"\xff\xfe", "fs3u.nothex.secret", USER_TOKEN + "!"):
        assert auth.authenticate(bad) is None, bad
    auth.set_tokens(["new-token"])
    assert auth.authenticate("old-token") is None and auth.authenticate("mount-token") is None
    assert Authenticator().authenticate(None) == SERVICE  # no token configured: an open cluster


@pytest.mark.parametrize("transport", ["framed", "grpc"])
@pytest.mark.parametrize("token", [None, "wrong"])
def test_calls_without_the_token_are_refused(transport: str, token: str | None) -> None:
    async def body() -> None:
        async with serving() as (framed_addr, grpc_addr, servicer):
            channel = FramedChannel(framed_addr, token) if transport == "framed" else GrpcChannel(grpc_addr, token)
            with pytest.raises(Unauthenticated):
                await channel.call(MGMTD.method("Heartbeat"), _heartbeat())
            assert not servicer.state.nodes
            await channel.close()
    asyncio.run(body())


async def _raw_exchange(address: str, data: bytes, hello: bool = True) -> list[tuple[int, int, bytes]]:
    """Send raw bytes; return the (kind, status, message) frames received until the server hangs up."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    if hello:
        writer.write(pack_header(FrameKind.HELLO, 0, 0, 0, len(TOKEN), 0) + TOKEN.encode())
    writer.write(data)
    await writer.drain()
    writer.write_eof()  # a client that sent a partial frame and went away
    frames = []
    try:
        while True:
            raw = await asyncio.wait_for(reader.readexactly(HEADER.size), 5)
            header = unpack_header(raw, 1 << 30, 1 << 30)
            body = await reader.readexactly(header.msg_len + header.payload_len)
            frames.append((int(header.kind), header.status, body[: header.msg_len]))
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()
    return frames


async def _still_serving(framed_addr: str) -> None:
    channel = FramedChannel(framed_addr, TOKEN)
    rsp, _ = await channel.call(MGMTD.method("ListNodes"), cpb.Empty())
    assert isinstance(rsp, mpb.ListNodesRsp)
    await channel.close()


def test_malformed_frames_get_typed_errors_and_the_server_survives() -> None:
    async def body() -> None:
        limits = FramedLimits(msg_max_bytes=1024, payload_max_bytes=4096)
        async with serving(limits=limits) as (framed_addr, _, servicer):
            garbage = await _raw_exchange(framed_addr, b"\x00garbage bytes that are not a frame" * 3)
            assert garbage[-1][1] == StatusCode.PROTOCOL_ERROR
            oversize = await _raw_exchange(framed_addr, pack_header(FrameKind.REQUEST, 0x100, 0, 1, 10**6, 0))
            assert oversize[-1][1] == StatusCode.FRAME_TOO_LARGE
            big_payload = await _raw_exchange(framed_addr, pack_header(FrameKind.REQUEST, 0x100, 0, 1, 0, 10**6))
            assert big_payload[-1][1] == StatusCode.FRAME_TOO_LARGE
            truncated = pack_header(FrameKind.REQUEST, 0x100, 0, 1, 100, 0) + b"only a little"
            assert await _raw_exchange(framed_addr, truncated) == [(FrameKind.HELLO_ACK, 0, b"")]
            unknown = await _raw_exchange(framed_addr, pack_header(FrameKind.REQUEST, 0x7777, 0, 5, 0, 0))
            assert (unknown[-1][0], unknown[-1][1]) == (FrameKind.RESPONSE, StatusCode.UNKNOWN_METHOD)
            bad_msg = b"\xff\xff\xff\xff"
            undecodable = await _raw_exchange(
                framed_addr, pack_header(FrameKind.REQUEST, MGMTD.method("Heartbeat").method_id, 0, 6,
                                         len(bad_msg), 0) + bad_msg)
            assert undecodable[-1][1] == StatusCode.INVALID_ARGUMENT
            no_hello = await _raw_exchange(framed_addr, pack_header(FrameKind.REQUEST, 0x100, 0, 7, 0, 0),
                                           hello=False)
            assert no_hello[-1][1] == StatusCode.UNAUTHENTICATED
            bad_version = struct.pack("<HBBHHQII", MAGIC, 9, 1, 0, 0, 0, 0, 0)
            assert (await _raw_exchange(framed_addr, bad_version))[-1][1] == StatusCode.PROTOCOL_ERROR
            assert not servicer.state.nodes
            await _still_serving(framed_addr)
    asyncio.run(body())


def test_before_its_hello_a_connection_may_send_only_a_small_frame_and_only_briefly() -> None:
    """Until a connection has authenticated, whoever opens it is nobody: its first frame may hold a
    token and no more, and must arrive whole within the hello timeout. Otherwise anyone who can
    reach the port makes the server buffer a full-size frame (88 MiB) per connection, or holds
    connections open for ever by sending a header and then nothing."""
    async def body() -> None:
        limits = FramedLimits(hello_timeout_ms=300)
        async with serving(limits=limits) as (framed_addr, _, servicer):
            for kind in (FrameKind.HELLO, FrameKind.REQUEST):
                big = await _raw_exchange(framed_addr, pack_header(kind, 0x100, 0, 1, 1 << 20, 0), hello=False)
                assert big and big[-1][1] == StatusCode.FRAME_TOO_LARGE, kind
                bulk = await _raw_exchange(framed_addr, pack_header(kind, 0x100, 0, 1, 10, 1 << 20), hello=False)
                assert bulk and bulk[-1][1] == StatusCode.FRAME_TOO_LARGE, kind
            # A header promising a token that never comes: the server hangs up after the timeout.
            host, port = framed_addr.rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(pack_header(FrameKind.HELLO, 0, 0, 0, 100, 0) + b"fs3u.")
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 3) == b""  # closed, unanswered
            writer.close()
            # A real token still fits, and so does a large frame once authenticated.
            await _still_serving(framed_addr)
            assert not servicer.state.nodes
    asyncio.run(body())


def test_oversize_and_unknown_on_the_client_side() -> None:
    async def body() -> None:
        async with serving() as (framed_addr, grpc_addr, _):
            bogus = MethodSpec("Mgmtd", "Nope", 0x1FF, cpb.Empty, cpb.Empty)
            channel = FramedChannel(framed_addr, TOKEN)
            with pytest.raises(UnknownMethod):
                await channel.call(bogus, cpb.Empty())
            await channel.close()
            grpc_channel = grpc.aio.insecure_channel(grpc_addr)
            call = grpc_channel.unary_unary("/fs3.Mgmtd/Heartbeat")
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call(b"\xff\xff\xff", metadata=(("x-fs3-token", TOKEN),))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            await grpc_channel.close()
            with pytest.raises(FrameTooLarge):
                unpack_header(pack_header(FrameKind.REQUEST, 1, 0, 1, 10, 0), 5, 5)
    asyncio.run(body())


def test_method_ids_are_stable_and_unique() -> None:
    ids = [m.method_id for name in ("Mgmtd", "Storage") for m in service_spec(name).methods]
    assert len(ids) == len(set(ids))
    assert service_spec("Mgmtd").method("Heartbeat").method_id == 0x100
    assert service_spec("Storage").method("Update").method_id == 0x200
    assert method_by_id(0x200) is service_spec("Storage").method("Update")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method_index=st.integers(0, 6), message=st.binary(max_size=200), payload=st.binary(max_size=64))
def test_fuzzed_requests_never_crash_the_dispatcher(method_index: int, message: bytes, payload: bytes) -> None:
    """Random bytes as any Mgmtd request: a typed status every time, never an exception."""

    async def body() -> None:
        servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
        servicer.state.load(0)
        dispatcher = Dispatcher()
        dispatcher.add_service(MGMTD, servicer)
        method = MGMTD.methods[method_index]
        reply = await dispatcher.dispatch(method.method_id, message, payload, SERVICE)
        assert reply.status in {c.value for c in StatusCode}
    asyncio.run(body())
