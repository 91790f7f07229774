"""Protocol versions (fs3/rpc/versions.py): the compatibility rule, and each place it is applied —
the framed HELLO, gRPC metadata, mgmtd's registration — refusing a peer it cannot talk to with a
message naming both versions, while a protocol-1 peer (an older release) is still served."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
from pathlib import Path
from typing import Any

import grpc
import pytest

from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.cli.main import main as cli_main
from fs3.cli.main import node_entries
from fs3.client.admin import AdminClient
from fs3.common.errors import FS3Error, InvalidArgument, ProtocolError, StatusCode
from fs3.common.ids import chunk_id
from fs3.kv.store import MemKVStore
from fs3.meta.server import MetaConfig, heartbeat_loop
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer, check_node_protocol
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.framed import FramedChannel, FramedServer
from fs3.rpc.framing import HEADER, MAGIC, FrameKind, pack_header, unpack_header
from fs3.rpc.grpc_transport import GrpcChannel, GrpcServer
from fs3.rpc.methods import service_spec
from fs3.rpc.versions import (
    PROTOCOL_VERSION,
    PROTOCOL_VERSION_MAX_ENV,
    PROTOCOL_VERSION_MIN,
    RELEASE,
    VersionRange,
    accept_choice,
    advertised_range,
    apply_config_pin,
    negotiate,
    range_from_wire,
    stamp_heartbeat,
)
from tests.conftest import make_client, wait_until
from tests.harness import ProcessCluster
from tests.test_rpc import TOKEN, serving

MGMTD = service_spec("Mgmtd")


# -- the rule ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("local", "peer", "spoken"), [
    ((1, 2), (1, 1), 1),   # a new node and an old one: the old protocol
    ((1, 2), (1, 2), 2),
    ((1, 2), (1, 3), 2),   # a newer peer that still speaks ours
    ((2, 3), (1, 2), 2),
    ((1, 1), (1, 2), 1),   # pinned to 1 during an upgrade
])
def test_two_overlapping_ranges_speak_the_highest_version_both_know(local: tuple[int, int],
                                                                   peer: tuple[int, int], spoken: int) -> None:
    assert negotiate(VersionRange(*local), VersionRange(*peer), "peer p") == spoken


def test_a_peer_too_old_is_refused_naming_both_versions_and_whom_to_upgrade() -> None:
    with pytest.raises(ProtocolError) as refused:
        negotiate(VersionRange(2, 3), VersionRange(1, 1), "storage node 7", release="0.0.9")
    text = refused.value.message
    assert "storage node 7 speaks protocol 1 (release 0.0.9)" in text and "speaks 2..3" in text
    assert "storage node 7 is too old" in text and "upgrade it" in text


def test_a_peer_too_new_is_refused_telling_this_side_to_upgrade() -> None:
    with pytest.raises(ProtocolError) as refused:
        negotiate(VersionRange(1, 2), VersionRange(3, 4), "the server h:1", local_name="this client")
    text = refused.value.message
    assert "speaks protocol 3..4" in text and "this client speaks 1..2" in text
    assert "this client is too old for it; upgrade this client" in text and RELEASE in text
    assert not refused.value.retryable  # no retry can cure it


def test_absent_fields_read_as_protocol_1_and_a_nonsense_range_is_refused() -> None:
    assert range_from_wire(0) == VersionRange(1, 1)
    assert range_from_wire(3, 0) == VersionRange(1, 3)
    with pytest.raises(ProtocolError, match="lowest is above its highest"):
        range_from_wire(2, 5)
    with pytest.raises(ValueError, match="need 1 <= low <= high"):
        VersionRange(0, 1)


def test_the_operator_pin_lowers_the_top_and_a_bad_pin_is_refused() -> None:
    assert advertised_range({}) == VersionRange(PROTOCOL_VERSION_MIN, PROTOCOL_VERSION)
    assert advertised_range({PROTOCOL_VERSION_MAX_ENV: "1"}) == VersionRange(1, 1)
    # "²" passes str.isdigit() but not int(): it too must be the pin's own error, not a bare ValueError.
    for bad in ("0", str(PROTOCOL_VERSION + 1), "two", "\u00b2", "-1", "1.5"):
        with pytest.raises(InvalidArgument, match=PROTOCOL_VERSION_MAX_ENV):
            advertised_range({PROTOCOL_VERSION_MAX_ENV: bad})


def test_a_bad_pin_stops_any_command_at_once_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(PROTOCOL_VERSION_MAX_ENV, "two")
    # No mgmtd listens there: the pin is refused before any connection is tried.
    assert cli_main(["admin", "--mgmtd", "127.0.0.1:1", "nodes"]) == 1
    err = capsys.readouterr().err
    assert "FS3_PROTOCOL_VERSION_MAX='two'" in err and "Traceback" not in err


def test_the_pin_can_live_in_a_service_config() -> None:
    environ: dict[str, str] = {}
    apply_config_pin(0, environ)
    assert environ == {}  # 0: no pin
    apply_config_pin(1, environ)
    assert advertised_range(environ) == VersionRange(1, 1)
    apply_config_pin(1, environ)  # the same in both places is fine
    with pytest.raises(InvalidArgument, match="protocol_version_max = 2 in the config, but"):
        apply_config_pin(2, environ)
    with pytest.raises(InvalidArgument, match=r"protocol_version_max = 9: this release speaks protocol 1\.\.2"):
        apply_config_pin(9, {})


@pytest.mark.parametrize("service", ["mgmtd", "storage", "meta"])
def test_every_service_reads_the_pin_from_its_toml(service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before anything starts when the config's pin and the environment's disagree: the
    config's key reached the pin."""
    config = tmp_path / f"{service}.toml"
    extra = f'node_id = 1\n[[targets]]\ntarget_id = 101\npath = "{tmp_path / "t"}"\n' if service == "storage" else ""
    config.write_text(f"protocol_version_max = 1\n{extra}")
    config.chmod(0o600)
    monkeypatch.setenv(PROTOCOL_VERSION_MAX_ENV, "2")
    assert cli_main([service, "--config", str(config)]) == 1
    assert "protocol_version_max = 1 in the config, but FS3_PROTOCOL_VERSION_MAX='2'" in capsys.readouterr().err


# -- the transports ------------------------------------------------------------------------------

async def _frames_after(address: str, data: bytes) -> list[tuple[int, int, int, bytes]]:
    """Send raw bytes; the (kind, method_id, status, message) frames received until the server hangs up."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    frames = []
    try:
        while True:
            raw = await asyncio.wait_for(reader.readexactly(HEADER.size), 5)
            header = unpack_header(raw, 1 << 20, 1 << 20)
            body = await reader.readexactly(header.msg_len + header.payload_len)
            frames.append((int(header.kind), header.method_id, header.status, body[: header.msg_len]))
            if header.kind == FrameKind.HELLO_ACK and header.status == StatusCode.OK:
                break
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    writer.close()
    return frames


def test_a_frame_of_a_newer_layout_gets_an_error_frame_the_old_layout_reads() -> None:
    async def body() -> None:
        async with serving() as (framed_addr, _, _servicer):
            newer = struct.pack("<HBBHHQII", MAGIC, 2, FrameKind.HELLO, 0, 0, 0, len(TOKEN), 0) + TOKEN.encode()
            frames = await _frames_after(framed_addr, newer)
            # unpack_header above accepted it: the answer is a layout-1 frame.
            assert [(kind, status) for kind, _, status, _ in frames] == [(FrameKind.RESPONSE,
                                                                          StatusCode.PROTOCOL_ERROR)]
            assert b"unsupported frame version 2" in frames[0][3] and b"frame version 1 only" in frames[0][3]
    asyncio.run(body())


def test_a_protocol_1_hello_gets_protocol_1_bytes_and_a_newer_client_its_version() -> None:
    async def body() -> None:
        async with serving() as (framed_addr, _, _servicer):
            hello = TOKEN.encode()
            old = await _frames_after(framed_addr, pack_header(FrameKind.HELLO, 0, 0, 0, len(hello), 0) + hello)
            assert old == [(FrameKind.HELLO_ACK, 0, StatusCode.OK, b"")]
            new = await _frames_after(framed_addr, pack_header(FrameKind.HELLO, 2, 1, 0, len(hello), 0) + hello)
            assert new == [(FrameKind.HELLO_ACK, 2, StatusCode.OK, b"")]
            for pinned, spoken in ((VersionRange(1, 1), 1), (None, PROTOCOL_VERSION)):
                channel = FramedChannel(framed_addr, TOKEN, protocols=pinned)
                await channel.call(MGMTD.method("ListNodes"), cpb.Empty())
                assert channel.protocol == spoken
                await channel.close()
    asyncio.run(body())


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_a_server_refuses_a_client_it_cannot_talk_to_and_says_why(transport: str) -> None:
    async def body() -> None:
        async with serving(protocols=VersionRange(2, 2)) as (framed_addr, grpc_addr, servicer):
            def channel(protocols: VersionRange) -> FramedChannel | GrpcChannel:
                if transport == "framed":
                    return FramedChannel(framed_addr, TOKEN, protocols=protocols)
                return GrpcChannel(grpc_addr, TOKEN, protocols=protocols)

            for protocols, expected in ((VersionRange(1, 1), "the client at .* speaks protocol 1, this server "
                                                             "speaks 2 .* is too old; upgrade it"),
                                        (VersionRange(3, 3), "speaks protocol 3, this server speaks 2 .* this "
                                                             "server is too old for it")):
                client = channel(protocols)
                with pytest.raises(ProtocolError, match=expected.replace("the client", "the (client|caller)")):
                    await client.call(MGMTD.method("Heartbeat"), _heartbeat(1))
                await client.close()
            assert not servicer.state.nodes
            good = channel(VersionRange(1, 2))
            await good.call(MGMTD.method("Heartbeat"), _heartbeat(1))
            await good.close()
            assert list(servicer.state.nodes) == [1]
    asyncio.run(body())


def test_a_client_refuses_a_server_too_old_for_it() -> None:
    async def body() -> None:
        async with serving(protocols=VersionRange(1, 1)) as (framed_addr, _, _servicer):
            client = FramedChannel(framed_addr, TOKEN, protocols=VersionRange(2, 2))
            with pytest.raises(ProtocolError, match=r"server .* too old"):
                await client.call(MGMTD.method("ListNodes"), cpb.Empty())
            await client.close()
    asyncio.run(body())


def test_a_client_refuses_a_server_that_chose_a_protocol_it_never_offered() -> None:
    """A HELLO_ACK naming a version above the client's range is a broken or lying server: refused,
    not read as the client's own highest."""
    async def lying_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw = await reader.readexactly(HEADER.size)
        hello = unpack_header(raw, 1 << 20, 0)
        await reader.readexactly(hello.msg_len)
        writer.write(pack_header(FrameKind.HELLO_ACK, 7, 0, hello.request_id, 0, 0))
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    async def body() -> None:
        server = await asyncio.start_server(lying_server, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = FramedChannel(f"127.0.0.1:{port}", TOKEN, protocols=VersionRange(1, 2))
        try:
            with pytest.raises(ProtocolError, match=r"chose protocol 7, which this client never offered"):
                await client.call(MGMTD.method("ListNodes"), cpb.Empty())
        finally:
            await client.close()
            server.close()
            await server.wait_closed()
    asyncio.run(body())
    assert accept_choice(VersionRange(1, 2), 0, "s") == 1  # a protocol-1 server says nothing
    assert accept_choice(VersionRange(1, 2), 2, "s") == 2


def test_a_meta_server_refused_by_mgmtd_says_so_once_not_every_heartbeat(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with serving(protocols=VersionRange(3, 3)) as (framed_addr, _, _servicer):
            config = MetaConfig(mgmtd_address=framed_addr, heartbeat_interval_ms=10, token=TOKEN)
            channels = RealChannelFactory(TOKEN, "framed")
            beating = asyncio.create_task(heartbeat_loop(config, channels, ("h:1", "h:2", "")))
            async def refused_five_times() -> bool:
                return sum("mgmtd refuses this meta server" in r.message for r in caplog.records) >= 5
            await wait_until(refused_five_times, timeout_s=10, what="five refused heartbeats")
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating
            await channels.close()
    with caplog.at_level(logging.DEBUG, logger="fs3.meta.server"):
        asyncio.run(body())
    refusals = [r for r in caplog.records if "mgmtd refuses this meta server" in r.message]
    assert [r.levelno for r in refusals[:2]] == [logging.ERROR, logging.DEBUG]
    assert "speaks protocol 1..2, this server speaks 3" in refusals[0].message


# -- mgmtd's registration ------------------------------------------------------------------------

def _heartbeat(node_id: int, protocol: int = 0, protocol_min: int = 0, release: str = "") -> mpb.HeartbeatReq:
    req = mpb.HeartbeatReq(node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address=f"h{node_id}:1",
                           protocol_version=protocol, protocol_version_min=protocol_min, release=release)
    req.targets.add(target_id=node_id * 100 + 1, local_state=cpb.UP_TO_DATE)
    return req


def test_mgmtd_refuses_to_register_a_node_of_a_protocol_it_does_not_speak() -> None:
    async def body() -> None:
        servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
        servicer.start()
        try:
            servicer.protocols = VersionRange(2, 3)
            with pytest.raises(ProtocolError) as refused:
                await servicer.heartbeat(_heartbeat(4), memoryview(b""))
            assert "storage node 4 (h4:1) speaks protocol 1, mgmtd speaks 2..3" in refused.value.message
            with pytest.raises(ProtocolError, match=r"protocol 4\.\.5 .* mgmtd is too old for it"):
                await servicer.heartbeat(_heartbeat(5, 5, 4, "9.0"), memoryview(b""))
            assert not servicer.state.nodes and not servicer.state.targets
            await servicer.heartbeat(_heartbeat(6, 3, 1, "0.2.0"), memoryview(b""))
            listing, _ = await servicer.list_nodes(cpb.Empty(), memoryview(b""))
            entries = {e["node_id"]: e for e in node_entries(listing)}
            assert (entries[6]["release"], entries[6]["protocol_version"]) == ("0.2.0", 3)
            assert (entries[0]["release"], entries[0]["protocol_version"]) == (RELEASE, 3)  # the range set above
        finally:
            await servicer.stop()
    asyncio.run(body())


def test_a_node_of_an_older_release_is_registered_as_protocol_1() -> None:
    assert check_node_protocol(VersionRange(1, 2), _heartbeat(1)) == 1
    listing = mpb.ListNodesRsp(nodes=[cpb.NodeInfo(node_id=1, node_type=cpb.NODE_STORAGE)])
    (entry,) = node_entries(listing)
    assert (entry["protocol_version"], entry["release"]) == (1, "")


# -- a mixed cluster -----------------------------------------------------------------------------

@pytest.mark.slow
def test_a_cluster_with_one_node_pinned_to_protocol_1_still_serves(process_cluster: ProcessCluster) -> None:
    """Mid-upgrade: one storage node speaks protocol 1 only (pinned, as an older release speaks);
    the others talk to it in protocol 1 (forwarding along its chains, heartbeats), everyone else
    in protocol 2, and mgmtd's node listing shows which node speaks what."""
    asyncio.run(_mixed(process_cluster))


async def _mixed(cluster: ProcessCluster) -> None:
    pinned = "storage-2"
    cluster.kill(pinned)
    saved = cluster.env
    cluster.env = {**saved, PROTOCOL_VERSION_MAX_ENV: "1"}
    try:
        cluster.start(pinned)
    finally:
        cluster.env = saved
    client, channels = make_client(cluster)
    admin = AdminClient(cluster.mgmtd_address, channels)

    async def protocols() -> dict[int, int]:
        return {e["node_id"]: e["protocol_version"] for e in node_entries(await admin.node_listing())
                if e["node_type"] == "storage" and e["alive"]}

    async def registered() -> bool:
        # Until the restarted node's first heartbeat, mgmtd still lists its previous run.
        return await protocols() == {1: PROTOCOL_VERSION, 2: 1, 3: PROTOCOL_VERSION} and \
            len(await admin.targets()) == 6

    await wait_until(registered, what="3 storage nodes registered, node 2 on protocol 1")
    table = await admin.create_chain_table(1, replicas=3)

    async def serving() -> bool:
        return all(t.public_state == cpb.SERVING for t in await admin.targets() if t.chain_id)

    await wait_until(serving, what="every chain serving")
    for index, chain in enumerate(c.chain_id for c in table.chains):
        await client.write(chain, chunk_id(24, index), 0, b"mixed %d" % index, 1 << 20)
        data, _ = await client.read(chain, chunk_id(24, index), 0, 7)
        assert data == (b"mixed %d" % index)[:7]
    report = await admin.verify()
    assert report.ok and report.chunks_checked == len(table.chains), report.as_dict()
    await channels.close()


def test_the_pin_reaches_every_channel_and_server_a_process_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROTOCOL_VERSION_MAX_ENV, "1")
    dispatcher = Dispatcher(token=TOKEN)
    for endpoint in (FramedChannel("h:1"), GrpcChannel("h:1"), FramedServer(dispatcher), GrpcServer(dispatcher)):
        assert endpoint.protocols == VersionRange(1, 1), type(endpoint).__name__
    req = stamp_heartbeat(mpb.HeartbeatReq(node_id=1))
    assert (req.protocol_version, req.protocol_version_min, req.release) == (1, 1, RELEASE)


def test_grpc_metadata_that_is_not_a_version_is_refused() -> None:
    async def body() -> None:
        async with serving() as (_, grpc_addr, _servicer):
            channel = grpc.aio.insecure_channel(grpc_addr)
            call = channel.unary_unary(MGMTD.method("ListNodes").grpc_path)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(b"", metadata=(("x-fs3-token", TOKEN), ("x-fs3-protocol", "two")), timeout=5)
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "bad x-fs3-protocol metadata 'two'" in (refused.value.details() or "")
            # Numbers no protocol field holds: the same clear refusal.
            for bad in ("99999", "1" * 40):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(b"", metadata=(("x-fs3-token", TOKEN), ("x-fs3-protocol-min", bad)), timeout=5)
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, bad
                assert "bad x-fs3-protocol-min metadata" in (refused.value.details() or ""), bad
            # A third-party caller with the token only (no fs3 version metadata) is a protocol-1
            # caller, served, and gets no version back.
            plain = channel.unary_unary(MGMTD.method("ListNodes").grpc_path)
            answered = plain(b"", metadata=(("x-fs3-token", TOKEN),), timeout=5)
            assert mpb.ListNodesRsp.FromString(await answered).protocol_version == PROTOCOL_VERSION
            assert "x-fs3-protocol" not in dict(await answered.trailing_metadata() or ())
            await channel.close()
    asyncio.run(body())


def test_a_grpc_client_learns_the_servers_protocol_and_refuses_one_too_old() -> None:
    async def body() -> None:
        async with serving() as (_, grpc_addr, _servicer):
            current = GrpcChannel(grpc_addr, TOKEN)
            await current.call(MGMTD.method("ListNodes"), cpb.Empty())
            assert current.protocol == PROTOCOL_VERSION
            await current.close()
        # A server of protocol 1 (an older release) ignores the caller's version and answers
        # without one: the first call runs there, and its answer shows the server is too old.
        answered: list[bytes] = []

        async def list_nodes(raw: bytes, context: Any) -> bytes:
            answered.append(raw)
            return b""

        old = grpc.aio.server()
        old.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
            "fs3.Mgmtd", {"ListNodes": grpc.unary_unary_rpc_method_handler(list_nodes)}),))
        port = old.add_insecure_port("127.0.0.1:0")
        await old.start()
        try:
            newer = GrpcChannel(f"127.0.0.1:{port}", TOKEN, protocols=VersionRange(2, 3))
            with pytest.raises(ProtocolError, match=r"the server .* speaks protocol 1, this client speaks 2\.\.3"):
                await newer.call(MGMTD.method("ListNodes"), cpb.Empty())
            with pytest.raises(ProtocolError, match="too old"):
                await newer.call(MGMTD.method("ListNodes"), cpb.Empty())
            assert len(answered) == 1  # the second call was never sent
            await newer.close()
        finally:
            await old.stop(None)
    asyncio.run(body())


def test_a_grpc_client_follows_the_server_behind_its_address_across_a_restart() -> None:
    """gRPC reconnects a channel by itself: after the server behind the address restarts on another
    release, the channel's protocol is the new server's, not the one it learned first."""
    async def body() -> None:
        servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
        servicer.start()
        dispatcher = Dispatcher(token=TOKEN)
        dispatcher.add_service(MGMTD, servicer)
        pinned = GrpcServer(dispatcher, protocols=VersionRange(1, 1))
        port = await pinned.start("127.0.0.1", 0)
        channel = GrpcChannel(f"127.0.0.1:{port}", TOKEN)
        try:
            await channel.call(MGMTD.method("ListNodes"), cpb.Empty())
            assert channel.protocol == 1
            await pinned.stop()
            upgraded = GrpcServer(dispatcher)
            await upgraded.start("127.0.0.1", port)
            try:
                async def answered_on_new() -> bool:
                    try:
                        await channel.call(MGMTD.method("ListNodes"), cpb.Empty(), timeout_ms=1_000)
                    except FS3Error:
                        return False  # still reconnecting
                    return channel.protocol == PROTOCOL_VERSION
                for _ in range(50):
                    if await answered_on_new():
                        break
                    await asyncio.sleep(0.1)
                assert channel.protocol == PROTOCOL_VERSION
            finally:
                await upgraded.stop()
        finally:
            await channel.close()
            await servicer.stop()
    asyncio.run(body())
