"""The gRPC API as other languages see it: the shipped stubs and .proto files, the language package
options, server reflection and the health service (their credential rules, NOT_SERVING while a
service stops), all through plain grpcio. docs/grpc.md describes the protocol; the cluster-level
proof (a Node.js client) is tests/test_grpc_node.py."""

from __future__ import annotations

import asyncio
import importlib
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import fs3
from fs3 import common_pb2 as cpb
from fs3 import meta_pb2, mgmtd_pb2, storage_pb2
from fs3.cluster.certs import CLIENT, init_certs, tls_config
from fs3.cluster.topology import MGMTD
from fs3.common.errors import StatusCode
from fs3.common.metrics import ServiceMetrics
from fs3.kv.store import MemKVStore
from fs3.mgmtd.service import MgmtdConfig, MgmtdServicer
from fs3.rpc.dispatch import Dispatcher
from fs3.rpc.grpc_transport import CODE_METADATA_KEY, HEALTH_SERVICE, REFLECTION_SERVICE, TOKEN_METADATA_KEY
from fs3.rpc.methods import service_spec
from fs3.rpc.server import ServiceRuntime
from fs3.rpc.tls import Tls

REPO = Path(__file__).resolve().parent.parent
TOKEN = "grpc-api-token"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PB2_MODULES = [cpb, meta_pb2, mgmtd_pb2, storage_pb2]

# What every .proto declares for code generators in other languages (docs/grpc.md lists them).
LANGUAGE_OPTIONS = {
    "go_package": "fs3/proto/fs3;fs3pb",
    "java_package": "fs3.proto",
    "java_multiple_files": True,
    "csharp_namespace": "Fs3.Proto",
    "objc_class_prefix": "FS3",
    "php_namespace": "Fs3\\Proto",
    "ruby_package": "Fs3::Proto",
}


def language_option_problems(file: descriptor_pb2.FileDescriptorProto) -> list[str]:
    """What a .proto's descriptor lacks or gets wrong of :data:`LANGUAGE_OPTIONS` and the wire
    package ``fs3`` (empty: nothing)."""
    problems = []
    if file.package != "fs3":
        problems.append(f"{file.name}: package {file.package!r}, not 'fs3' (the wire names would change)")
    options: Any = file.options  # fields named by string below
    for name, want in LANGUAGE_OPTIONS.items():
        if not options.HasField(name):
            problems.append(f"{file.name}: no option {name}")
        elif getattr(options, name) != want:
            problems.append(f"{file.name}: option {name} is {getattr(options, name)!r}, not {want!r}")
    if not file.options.java_outer_classname:
        problems.append(f"{file.name}: no option java_outer_classname (Java would clash with a service's name)")
    return problems


def _file_proto(module: Any) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


# -- what ships --------------------------------------------------------------------------------


def test_every_proto_declares_language_packages_and_keeps_the_wire_package() -> None:
    for module in PB2_MODULES:
        assert language_option_problems(_file_proto(module)) == []
    # The wire names the transports use are unchanged by the options.
    assert meta_pb2.DESCRIPTOR.services_by_name["Meta"].full_name == "fs3.Meta"
    assert service_spec("Storage").method("Update").grpc_path == "/fs3.Storage/Update"


def test_the_language_option_check_rejects_a_proto_without_them() -> None:
    bare = descriptor_pb2.FileDescriptorProto(name="fs3/bare.proto", package="fs3")
    problems = language_option_problems(bare)
    assert {p.split(" ", 1)[1] for p in problems} >= {"no option go_package", "no option java_package",
                                                       "no option csharp_namespace"}
    moved = _file_proto(meta_pb2)
    moved.package = "fs3.v2"
    moved.options.java_package = "com.example"
    problems = language_option_problems(moved)
    assert any("package 'fs3.v2'" in p for p in problems)
    assert any("java_package is 'com.example'" in p for p in problems)


def test_the_protos_and_grpc_stubs_ship_with_the_package() -> None:
    """``make proto`` copies the .proto files into the package (package data) and generates the
    ``*_pb2_grpc`` stubs next to the ``*_pb2`` modules."""
    package = Path(fs3.__file__).parent
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["fs3"]
    shipped = {p.name: p for pattern in patterns for p in package.glob(pattern) if p.suffix == ".proto"}
    sources = {p.name: p for p in (REPO / "proto" / "fs3").glob("*.proto")}
    assert set(shipped) == set(sources) and sources, "run `make proto`"
    for name, source in sources.items():
        assert shipped[name].read_bytes() == source.read_bytes(), f"{shipped[name]} is stale: run `make proto`"
    for service in ("Mgmtd", "Meta", "Storage"):
        stubs = importlib.import_module(f"fs3.{service.lower()}_pb2_grpc")
        assert hasattr(stubs, f"{service}Stub") and hasattr(stubs, f"add_{service}Servicer_to_server")


# -- reflection and health on a real server ----------------------------------------------------


@asynccontextmanager
async def mgmtd_runtime(token: str = TOKEN, tls: Tls | None = None) -> AsyncIterator[ServiceRuntime]:
    servicer = MgmtdServicer(MemKVStore(), MgmtdConfig(kv_engine="mem"))
    servicer.start()
    dispatcher = Dispatcher(token=token)
    dispatcher.add_service(service_spec("Mgmtd"), servicer)
    runtime = ServiceRuntime(MGMTD, dispatcher, ServiceMetrics("mgmtd"), tls=tls)
    await runtime.start("127.0.0.1", 0, 0, -1)
    try:
        yield runtime
    finally:
        runtime.stopping.set()
        await runtime.run_until_stopped()
        await servicer.stop()


def _code(exc: grpc.aio.AioRpcError) -> str | None:
    return dict(exc.trailing_metadata() or ()).get(CODE_METADATA_KEY)


async def list_services(channel: grpc.aio.Channel, token: str | None) -> list[str]:
    """The services ``channel``'s server lists through reflection (grpcurl's ``list``)."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    metadata = ((TOKEN_METADATA_KEY, token),) if token else None
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                     metadata=metadata, timeout=5)
    names: list[str] = []
    async for rsp in call:
        names += [s.name for s in rsp.list_services_response.service]
    return names


def test_health_answers_without_a_token_per_service_and_not_serving_while_stopping() -> None:
    async def body() -> None:
        seen_while_stopping: list[int] = []
        async with mgmtd_runtime() as runtime, grpc.aio.insecure_channel(runtime.bound.grpc) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "fs3.Mgmtd"):
                rsp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert rsp.status == SERVING, service
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await health.Check(health_pb2.HealthCheckRequest(service="fs3.Meta"), timeout=5)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # not served on this port

            # A watcher hears the change as soon as the stop begins, while the service still runs.
            watch = health.Watch(health_pb2.HealthCheckRequest(service="fs3.Mgmtd"), timeout=10)
            assert (await watch.read()).status == SERVING

            async def on_stop() -> None:
                for service in ("", "fs3.Mgmtd"):
                    rsp = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                    seen_while_stopping.append(rsp.status)
                seen_while_stopping.append((await watch.read()).status)

            runtime.stopping.set()
            await runtime.run_until_stopped(on_stop)
        assert seen_while_stopping == [NOT_SERVING] * 3
    asyncio.run(body())


def test_reflection_lists_and_describes_the_services_for_admitted_callers_only() -> None:
    async def body() -> None:
        async with mgmtd_runtime() as runtime, grpc.aio.insecure_channel(runtime.bound.grpc) as channel:
            for token in (None, "wrong-token", "fs3u.0123456789abcdef"):  # the last: not a token's shape
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await list_services(channel, token)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, token
                assert _code(caught.value) == str(int(StatusCode.UNAUTHENTICATED))
            names = await list_services(channel, TOKEN)
            assert sorted(names) == sorted(["fs3.Mgmtd", HEALTH_SERVICE, REFLECTION_SERVICE])
            # A user token is admitted as on the port's client methods (meta verifies it per request).
            assert "fs3.Mgmtd" in await list_services(channel, "fs3u.0123456789abcdef." + "x" * 32)

            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="fs3.Mgmtd")]),
                metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5)
            files = {}
            async for rsp in call:
                for raw in rsp.file_descriptor_response.file_descriptor_proto:
                    parsed = descriptor_pb2.FileDescriptorProto.FromString(raw)
                    files[parsed.name] = parsed
            assert {"fs3/mgmtd.proto", "fs3/common.proto"} <= set(files)
            assert language_option_problems(files["fs3/mgmtd.proto"]) == []
            assert [m.name for m in files["fs3/mgmtd.proto"].service[0].method][:2] == ["Heartbeat", "GetRoutingInfo"]
    asyncio.run(body())


def test_the_shipped_stubs_call_a_service_with_the_token_metadata() -> None:
    mgmtd_pb2_grpc: Any = importlib.import_module("fs3.mgmtd_pb2_grpc")  # generated, untyped

    async def body() -> None:
        async with mgmtd_runtime() as runtime, grpc.aio.insecure_channel(runtime.bound.grpc) as channel:
            stub = mgmtd_pb2_grpc.MgmtdStub(channel)
            rsp = await stub.GetRoutingInfo(mgmtd_pb2.GetRoutingInfoReq(), metadata=((TOKEN_METADATA_KEY, TOKEN),),
                                            timeout=5)
            assert rsp.changed and rsp.routing.routing_version >= 1
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListNodes(cpb.Empty(), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert _code(caught.value) == str(int(StatusCode.UNAUTHENTICATED))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListNodes(cpb.Empty(), metadata=((TOKEN_METADATA_KEY, "fs3u.0123456789abcdef." + "x" * 32),),
                                     timeout=5)
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED  # a service method
            assert _code(caught.value) == str(int(StatusCode.PERMISSION_DENIED))
    asyncio.run(body())


def test_with_mutual_tls_health_and_reflection_need_a_client_certificate(tmp_path: Path) -> None:
    init_certs(tmp_path, {name: ["127.0.0.1", "localhost"] for name in (MGMTD,)})
    client = Tls.load(tls_config(tmp_path, CLIENT))
    assert client is not None
    anonymous = grpc.ssl_channel_credentials(root_certificates=(tmp_path / "ca.pem").read_bytes())

    async def body() -> None:
        async with mgmtd_runtime(tls=Tls.load(tls_config(tmp_path, MGMTD), server=True)) as runtime:
            address = runtime.bound.grpc
            async with grpc.aio.secure_channel(address, client.grpc_channel_credentials()) as channel:
                rsp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert rsp.status == SERVING
                assert "fs3.Mgmtd" in await list_services(channel, TOKEN)
            for credentials in (anonymous, None):
                opened = (grpc.aio.secure_channel(address, credentials) if credentials is not None
                          else grpc.aio.insecure_channel(address))
                async with opened as channel:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
                    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    asyncio.run(body())
