"""Mutual TLS: certificates from ``fs3 admin certs init``, who is refused on each transport, a node
from another CA that cannot join, and a TLS cluster serving reads and writes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

import fs3.aio
from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mpb
from fs3.cli.main import main as fs3_main
from fs3.cluster.certs import CLIENT, init_certs, parse_node_specs, tls_config
from fs3.cluster.processes import config_toml
from fs3.cluster.services import build_storage_node
from fs3.cluster.topology import META, MGMTD
from fs3.common.config import load_config
from fs3.common.errors import FS3Error, InvalidArgument, Unauthenticated
from fs3.common.metrics import ServiceMetrics
from fs3.kv.store import MemKVStore
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.rpc.channel import Channel, RealChannelFactory
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.methods import service_spec
from fs3.rpc.server import ServiceRuntime
from fs3.rpc.tls import Tls, TlsConfig
from fs3.storage.node import StorageNodeConfig
from fs3.storage.server import StorageConfig, TargetConfig, open_engines
from tests.inproc import InProcessCluster

MGMTD_SPEC = service_spec("Mgmtd")
TOKEN = "tls-test-token"
NODES = [MGMTD, META, "storage-1", "storage-2", "storage-3"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cluster's CA, a certificate per service and one for clients."""
    directory = tmp_path_factory.mktemp("pki")
    init_certs(directory, {name: ["127.0.0.1", "localhost"] for name in NODES})
    return directory


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another CA, with certificates of the same names: what an outsider can make for itself."""
    directory = tmp_path_factory.mktemp("other-pki")
    init_certs(directory, {name: ["127.0.0.1", "localhost"] for name in [*NODES, "storage-9"]})
    return directory


def _heartbeat(node_id: int) -> mpb.HeartbeatReq:
    req = mpb.HeartbeatReq(node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address="127.0.0.1:1")
    req.targets.add(target_id=node_id * 100 + 1, local_state=cpb.UP_TO_DATE)
    return req


@asynccontextmanager
async def tls_mgmtd(pki: Path) -> AsyncIterator[tuple[ServiceRuntime, MgmtdServicer]]:
    """mgmtd with mutual TLS on both transports, in this event loop."""
    servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
    servicer.start()
    dispatcher = Dispatcher(token=TOKEN)
    dispatcher.add_service(MGMTD_SPEC, servicer)
    runtime = ServiceRuntime(MGMTD, dispatcher, ServiceMetrics("mgmtd"),
                             tls=Tls.load(tls_config(pki, MGMTD), server=True))
    await runtime.start("127.0.0.1", 0, 0, -1)
    try:
        yield runtime, servicer
    finally:
        runtime.stopping.set()
        await runtime.run_until_stopped()
        await servicer.stop()


def _channel(runtime: ServiceRuntime, transport: str, tls: TlsConfig | None) -> tuple[Channel, RealChannelFactory]:
    channels = RealChannelFactory(TOKEN, transport, tls)  # type: ignore[arg-type]
    address = runtime.bound.grpc if transport == "grpc" else runtime.bound.framed
    return channels.get(address), channels


# -- who is refused --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_a_client_without_a_valid_certificate_is_refused_and_gets_nothing(transport: str, pki: Path,
                                                                         other_pki: Path) -> None:
    """With the right token, but: no TLS at all; TLS without a certificate; a certificate another CA
    signed (trusting the cluster's CA); everything from another CA. Heartbeat is the probe: served,
    it would register a node."""
    foreign_cert = TlsConfig(ca_file=str(pki / "ca.pem"), cert_file=str(other_pki / "client.pem"),
                             key_file=str(other_pki / "client.key"))
    cases: dict[str, TlsConfig | None] = {
        "clear": None,
        "no certificate": TlsConfig(ca_file=str(pki / "ca.pem")),
        "certificate of another CA": foreign_cert,
        "all of another CA": tls_config(other_pki, CLIENT),
    }

    async def body() -> None:
        async with tls_mgmtd(pki) as (runtime, servicer):
            for name, tls in cases.items():
                channel, channels = _channel(runtime, transport, tls)
                errors = []
                for _ in range(2):
                    with pytest.raises(FS3Error) as caught:
                        await channel.call(MGMTD_SPEC.method("Heartbeat"), _heartbeat(1), timeout_ms=3_000)
                    errors.append(caught.value)
                await channels.close()
                assert not servicer.state.nodes, f"{name}: served"
                message = str(errors[-1])
                if name == "all of another CA":  # this client refuses the server, at once
                    assert all(isinstance(e, Unauthenticated) for e in errors), errors
                    assert "not trusted" in message
                elif name != "clear":
                    assert "certificate" in message, message
                    if transport == "framed":  # a refusal that repeats is not retried any longer
                        assert isinstance(errors[-1], Unauthenticated), errors
            # The same call with the cluster's client certificate is served.
            channel, channels = _channel(runtime, transport, tls_config(pki, CLIENT))
            await channel.call(MGMTD_SPEC.method("Heartbeat"), _heartbeat(1), timeout_ms=3_000)
            await channels.close()
            assert 1 in servicer.state.nodes

    asyncio.run(body())


def test_a_client_refuses_a_server_whose_certificate_names_another_host(pki: Path) -> None:
    async def body() -> None:
        async with tls_mgmtd(pki) as (runtime, _):
            for transport in ("framed", "grpc"):
                tls = tls_config(pki, CLIENT, server_name="mgmtd.elsewhere")
                channel, channels = _channel(runtime, transport, tls)
                with pytest.raises(Unauthenticated, match="not trusted"):
                    await channel.call(MGMTD_SPEC.method("ListNodes"), cpb.Empty(), timeout_ms=3_000)
                await channels.close()

    asyncio.run(body())


def test_a_storage_node_with_a_certificate_of_another_ca_cannot_join(tmp_path: Path, pki: Path, other_pki: Path,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="fs3.storage.node")

    async def body() -> None:
        async with InProcessCluster(tmp_path, storage_nodes=1, replicas=1, token=TOKEN, tls_dir=pki) as cluster:
            assert cluster.mgmtd is not None and 1 in cluster.mgmtd.state.nodes  # a node of this CA joined
            foreign = Tls.load(tls_config(other_pki, "storage-9"), server=True)
            channels = RealChannelFactory(TOKEN, "framed", foreign)
            engines = open_engines(StorageConfig(node_id=9, fsync=False,
                                                 targets=[TargetConfig(901, str(tmp_path / "n9"))]))
            parts = build_storage_node(StorageNodeConfig(node_id=9, mgmtd_address=cluster.mgmtd_address,
                                                         heartbeat_interval_ms=50, rpc_timeout_ms=1_000),
                                       engines, channels, token=TOKEN)
            runtime = ServiceRuntime("storage-9", parts.dispatcher, ServiceMetrics("storage"), tls=foreign)
            bound = await runtime.start("127.0.0.1", 0, 0, -1)
            parts.node.config.framed_address, parts.node.config.grpc_address = bound.framed, bound.grpc
            await parts.node.start()
            try:
                await asyncio.sleep(0.6)  # a dozen heartbeats
                assert 9 not in cluster.mgmtd.state.nodes
                assert 901 not in cluster.mgmtd.state.targets
                # The node says why in its log, once: it will not heal by itself.
                refusals = [r for r in caplog.records if r.getMessage().startswith("node 9: routing refresh failed")]
                assert [r.levelname for r in refusals][:1] == ["WARNING"] and len(refusals) > 3
                assert "not trusted" in refusals[0].getMessage()
                assert sum(r.levelname == "WARNING" for r in refusals) == 1
                with pytest.raises(Unauthenticated, match="not trusted"):
                    await parts.node.heartbeat_once()
            finally:
                await parts.node.stop()
                await channels.close()
                runtime.stopping.set()
                await runtime.run_until_stopped()
                for engine in engines.values():
                    engine.close()

    asyncio.run(body())


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_a_tls_cluster_serves_reads_and_writes(tmp_path: Path, transport: str, pki: Path) -> None:
    """Client to meta and storage, meta to storage, storage forwarding along 3-replica chains, every
    node's heartbeats: all over mutual TLS."""
    async def body() -> None:
        async with InProcessCluster(tmp_path, token=TOKEN, transport=transport, with_meta=True,
                                    tls_dir=pki) as cluster:
            assert all(node.channels.tls is not None for node in cluster.nodes.values())  # type: ignore[attr-defined]
            data = os.urandom(3 * 1024 * 1024 + 17)
            fs = await fs3.aio.connect(cluster.mgmtd_address, TOKEN, transport=transport,
                                       tls=tls_config(pki, CLIENT), rpc_timeout_ms=5_000)
            try:
                async with await fs.open("/tls.bin", "wb") as f:
                    await f.write(data)
                async with await fs.open("/tls.bin", "rb") as f:
                    assert await f.read() == data
            finally:
                await fs.close()
            # One chain of three replicas: each got every chunk, forwarded along the chain over TLS.
            replicas = [sorted(engine.all_chunk_ids()) for node in cluster.nodes.values()
                        for engine in node.engines.values()]
            assert len(replicas) == 3 and replicas[0] and all(r == replicas[0] for r in replicas)

    asyncio.run(body())


# -- settings and material -------------------------------------------------------------------


def test_tls_settings_are_checked(tmp_path: Path, pki: Path, other_pki: Path) -> None:
    for bad in (TlsConfig(ca_file="ca.pem", cert_file="n.pem"), TlsConfig(ca_file="ca.pem", key_file="n.key"),
                TlsConfig(cert_file="n.pem", key_file="n.key"), TlsConfig(server_name="mgmtd")):
        with pytest.raises(InvalidArgument):
            bad.validate()
    assert Tls.load(TlsConfig()) is None and Tls.load(None) is None
    with pytest.raises(InvalidArgument, match="cannot read ca_file"):
        Tls.load(TlsConfig(ca_file=str(tmp_path / "missing.pem")))
    with pytest.raises(InvalidArgument, match="a service needs cert_file"):
        Tls.load(TlsConfig(ca_file=str(pki / "ca.pem")), server=True)
    # A key that does not belong to the certificate.
    mismatched = TlsConfig(ca_file=str(pki / "ca.pem"), cert_file=str(pki / "mgmtd.pem"),
                           key_file=str(other_pki / "mgmtd.key"))
    with pytest.raises(InvalidArgument, match="bad certificate material"):
        Tls.load(mismatched, server=True)
    # A key file other users can read is refused, as ssh refuses one.
    loose = tmp_path / "loose.key"
    loose.write_bytes((pki / "client.key").read_bytes())
    loose.chmod(0o644)
    with pytest.raises(InvalidArgument, match="accessible by other users"):
        Tls.load(TlsConfig(ca_file=str(pki / "ca.pem"), cert_file=str(pki / "client.pem"), key_file=str(loose)))
    tls = Tls.load(tls_config(pki, MGMTD), server=True)
    assert tls is not None and "PRIVATE" not in repr(tls)
    assert tls.server_context().verify_mode == ssl.CERT_REQUIRED
    assert tls.server_context().minimum_version == ssl.TLSVersion.TLSv1_2
    assert tls.client_context.check_hostname and tls.client_context.minimum_version == ssl.TLSVersion.TLSv1_2


def test_the_tls_table_is_read_from_files_and_the_environment(tmp_path: Path, pki: Path) -> None:
    config = StorageConfig(node_id=2, targets=[TargetConfig(201, "/d")], tls=tls_config(pki, "storage-2"))
    path = tmp_path / "storage.toml"
    path.write_text(config_toml(config))
    assert "[tls]" in path.read_text()
    assert load_config(StorageConfig, path, environ={}).tls == config.tls
    env = {"FS3_STORAGE_TLS_SERVER_NAME": "fs3-nodes"}
    assert load_config(StorageConfig, path, env_prefix="FS3_STORAGE", environ=env).tls.server_name == "fs3-nodes"
    assert load_config(MgmtdConfig, None, env_prefix="FS3_MGMTD", environ={}).tls == TlsConfig()
    path.write_text('node_id = 2\n[[targets]]\ntarget_id = 201\npath = "/d"\n[tls]\ncert_file = "n.pem"\n')
    with pytest.raises(InvalidArgument, match="tls"):
        load_config(StorageConfig, path, environ={})


# -- fs3 admin certs init --------------------------------------------------------------------


def test_certs_init_makes_a_ca_and_certificates_with_the_hosts_and_keeps_them(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    made = init_certs(directory, parse_node_specs("mgmtd,10.0.0.7", ["storage-1=storage1,10.0.0.11"]))
    assert [c.name for c in made] == ["ca", "mgmtd", "10.0.0.7", "storage-1", CLIENT]
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for c in made:
        assert stat.S_IMODE(c.key.stat().st_mode) == 0o600, c.key
    ca = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
    ca_key = ca.public_key()
    assert isinstance(ca_key, ec.EllipticCurvePublicKey)

    def cert(name: str) -> x509.Certificate:
        loaded = x509.load_pem_x509_certificate((directory / f"{name}.pem").read_bytes())
        loaded.verify_directly_issued_by(ca)
        return loaded

    sans = cert("storage-1").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["storage1"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.11"]
    usage = cert(CLIENT).extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]  # a client's key cannot serve
    node_usage = cert("mgmtd").extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in list(node_usage)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    again = init_certs(directory, {"mgmtd": ["mgmtd"], "storage-4": ["storage4"]})
    assert {c.name: c.created for c in again} == {"ca": False, "mgmtd": False, "storage-4": True, CLIENT: False}
    assert all((directory / name).read_bytes() == data for name, data in before.items())
    cert("storage-4")  # signed by the same CA


def test_certs_init_refuses_bad_names_and_hosts(tmp_path: Path) -> None:
    for hosts, nodes in (("", []), ("ok", ["storage-1"]), ("ok", ["=h"]), ("bad host!", []),
                         ("ca", []), ("../x", []), (None, ["client=h"])):
        with pytest.raises(InvalidArgument):
            parse_node_specs(hosts, nodes)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "ca.pem").write_text("only the certificate")
    with pytest.raises(InvalidArgument, match="only one of"):
        init_certs(tmp_path / "half", {"n": ["n"]})


def test_certs_init_names_shared_hosts_on_every_node_and_reissues_a_certificate_lacking_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--san``: one public host every node is reached by (docker-compose's FS3_PUBLIC_HOST). Asked
    for after the first run, it re-issues the nodes' certificates for their same keys."""
    directory = tmp_path / "certs"

    def sans(name: str) -> list[str]:
        cert = x509.load_pem_x509_certificate((directory / f"{name}.pem").read_bytes())
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes()))
        value = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        return [*value.get_values_for_type(x509.DNSName), *map(str, value.get_values_for_type(x509.IPAddress))]

    assert parse_node_specs("a,b", [], [""]) == {"a": ["a"], "b": ["b"]}  # an unset variable: nothing added
    init_certs(directory, parse_node_specs("a,b", ["c=c,10.0.0.3"], [""]))
    keys = {name: (directory / f"{name}.key").read_bytes() for name in ("a", "b", "c", CLIENT)}
    client_cert = (directory / f"{CLIENT}.pem").read_bytes()
    made = init_certs(directory, parse_node_specs("a,b", ["c=c,10.0.0.3"], ["fs3.example.net,192.0.2.10", "a"]))
    assert {c.name: (c.created, c.reissued) for c in made} == {
        "ca": (False, False), "a": (False, True), "b": (False, True), "c": (False, True), CLIENT: (False, False)}
    assert sans("a") == ["a", "fs3.example.net", "192.0.2.10"]
    assert sans("b") == ["b", "fs3.example.net", "a", "192.0.2.10"]
    assert sans("c") == ["c", "fs3.example.net", "a", "10.0.0.3", "192.0.2.10"]
    assert {name: (directory / f"{name}.key").read_bytes() for name in keys} == keys
    assert (directory / f"{CLIENT}.pem").read_bytes() == client_cert  # a client is never dialled
    Tls.load(tls_config(directory, "c"), server=True)  # the new certificate matches the kept key
    # The next run without the public host keeps everything: names are only ever added.
    again = init_certs(directory, parse_node_specs("a,b", ["c=c,10.0.0.3"], []))
    assert not any(c.created or c.reissued for c in again)
    assert "fs3.example.net" in sans("a")
    with pytest.raises(InvalidArgument, match="bad host name"):
        parse_node_specs("a", [], ["good.example,bad!host"])
    # The command: --san (repeatable), and what it did to each file.
    assert fs3_main(["admin", "--json", "certs", "init", "--dir", str(directory), "--hosts", "a,b", "--san", "",
                     "--san", "public.example"]) == 0
    rows = {row["name"]: row for row in json.loads(capsys.readouterr().out)}
    assert (rows["a"]["created"], rows["a"]["reissued"], rows[CLIENT]["reissued"]) == (False, True, False)
    assert "public.example" in sans("b")
    assert fs3_main(["admin", "certs", "init", "--dir", str(directory), "--hosts", "a", "--san", "bad!host"]) == 1
    assert "bad host name" in capsys.readouterr().err
    assert "bad!host" not in sans("a")
    (directory / "b.pem").write_text("not a certificate")  # refused, and left for the operator to look at
    with pytest.raises(InvalidArgument, match=r"b\.pem: not a PEM certificate"):
        init_certs(directory, parse_node_specs("b", [], []))
    assert (directory / "b.pem").read_text() == "not a certificate"


def test_the_certs_init_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "c"
    assert fs3_main(["admin", "--json", "certs", "init", "--dir", str(directory), "--hosts", "mgmtd,meta",
                     "--node", "storage-1=storage1,127.0.0.1"]) == 0
    out = capsys.readouterr().out
    assert "PRIVATE KEY" not in out
    assert {row["name"] for row in json.loads(out)} == {"ca", "mgmtd", "meta", "storage-1", CLIENT}
    assert fs3_main(["admin", "certs", "init", "--dir", str(directory), "--node", "n=bad!host"]) == 1
    assert "bad host name" in capsys.readouterr().err


@pytest.mark.slow
def test_local_up_tls_runs_every_service_with_tls(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``fs3 local up --tls``: certificates made, each service's config has its [tls] table, the
    processes serve only TLS, and ``fs3 admin --dir`` finds the client certificate."""
    from tests.harness import ProcessCluster

    root = tmp_path / "cluster"
    cluster = ProcessCluster(root, storage_nodes=3, targets_per_node=1, token=TOKEN, tls=True)
    try:
        cluster.start_all()
        asyncio.run(cluster.ensure_chains(3))
        cluster.write_cluster_json()
        assert "[tls]" in (root / "storage-2" / "storage.toml").read_text()
        assert stat.S_IMODE((root / "certs" / "storage-2.key").stat().st_mode) == 0o600
        capsys.readouterr()
        assert fs3_main(["admin", "--dir", str(root), "--json", "chains"]) == 0
        assert len(json.loads(capsys.readouterr().out)["chains"]) == 1
        clear = ["admin", "--mgmtd", cluster.mgmtd_address, "--token", TOKEN, "--timeout-ms", "2000", "nodes"]
        assert fs3_main(clear) == 1
        assert "require TLS" in capsys.readouterr().err
        ProcessCluster(tmp_path / "clear", storage_nodes=1, targets_per_node=1)  # made in clear
        with pytest.raises(InvalidArgument, match="without TLS"):
            ProcessCluster(tmp_path / "clear", tls=True)
        again = ProcessCluster(root)
        assert again.tls  # a later start keeps what the cluster was made with
        again.set_mount(tmp_path / "mnt")
        mount_args = again.procs["mount"].args
        assert mount_args[mount_args.index("--tls-cert-file") + 1] == str(root.resolve() / "certs" / "client.pem")
        again.set_mount(None)
    finally:
        cluster.stop_all()
