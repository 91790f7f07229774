"""Fuzzing every RPC method on both transports, and refusing clients without the cluster token.

Random bytes go straight to each service's dispatcher (the decode path); random *decodable*
messages go over the framed and gRPC transports (the handlers). Every answer must be OK or a
typed error that is not INTERNAL (an unexpected exception), the services must keep answering,
and afterwards the namespace must check clean and every replica must be identical.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError, Message

import fs3.aio
from fs3.common.errors import FS3Error, StatusCode, Unauthenticated
from fs3.rpc.auth import SERVICE
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.methods import MethodSpec, service_spec
from fs3.rpc.server import BoundAddresses
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # an in-process cluster

SERVICES = ("Mgmtd", "Storage", "Meta")
# Would legitimately take the cluster apart (they are admin operations that succeed on valid input).
DESTRUCTIVE = {"MarkTargetOffline", "CreateChainTable", "SyncDone"}


def _random_message(method: MethodSpec, rng: random.Random) -> Message:
    """A message decoded from random bytes (unknown fields, odd values), or an empty one."""
    for _ in range(20):
        raw = rng.randbytes(rng.randrange(0, 64))
        try:
            return method.request_type.FromString(raw)
        except (DecodeError, RuntimeError, ValueError):
            continue
    return method.request_type()


def _addresses(cluster: InProcessCluster, transport: str) -> dict[str, str]:
    assert cluster.mgmtd_runtime is not None
    node = next(iter(cluster.nodes.values()))

    def pick(bound: BoundAddresses) -> str:
        return bound.grpc if transport == "grpc" else bound.framed

    meta_bound = cluster._meta_runtime.bound
    storage_address = node.config.grpc_address if transport == "grpc" else node.config.framed_address
    return {"Mgmtd": pick(cluster.mgmtd_runtime.bound), "Storage": storage_address, "Meta": pick(meta_bound)}


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_fuzzed_requests_get_typed_errors_and_break_nothing(tmp_path: Path, transport: str) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, transport=transport, with_meta=True) as cluster:
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, transport=transport)
            await fs.makedirs("/keep/sub")
            await fs.write_bytes("/keep/file", b"important" * 1000)
            channels = RealChannelFactory(cluster.token, transport)  # type: ignore[arg-type]
            addresses = _addresses(cluster, transport)
            rng = random.Random(20261203)
            codes: dict[int, int] = {}
            for service in SERVICES:
                for method in service_spec(service).methods:
                    if method.name in DESTRUCTIVE:
                        continue
                    for _ in range(25):
                        request = _random_message(method, rng)
                        payload = rng.randbytes(rng.randrange(0, 300)) if method.request_has_payload else b""
                        try:
                            await channels.get(addresses[service]).call(method, request, payload, timeout_ms=5_000)
                            codes[0] = codes.get(0, 0) + 1
                        except FS3Error as exc:
                            assert exc.code != StatusCode.INTERNAL, f"{service}.{method.name}: {exc} for {request}"
                            codes[exc.code] = codes.get(exc.code, 0) + 1
            # Raw garbage straight into every dispatcher: the decode path answers with a typed error.
            assert cluster.mgmtd_runtime is not None
            dispatchers = {"Mgmtd": cluster.mgmtd_runtime.dispatcher, "Storage": cluster.runtimes[0].dispatcher,
                           "Meta": cluster._meta_runtime.dispatcher}
            for service, dispatcher in dispatchers.items():
                for method in service_spec(service).methods:
                    if method.name in DESTRUCTIVE:
                        continue
                    for _ in range(25):
                        reply = await dispatcher.dispatch(method.method_id, rng.randbytes(rng.randrange(1, 80)),
                                                          b"", SERVICE)
                        assert reply.status != StatusCode.INTERNAL, f"{service}.{method.name}: {reply.message!r}"
                reply = await dispatcher.dispatch(0xFFFF, b"", b"", SERVICE)
                assert reply.status == StatusCode.UNKNOWN_METHOD
            assert len(codes) > 3
            # Everything still answers, the namespace is intact, the data readable, replicas identical.
            assert await fs.read_bytes("/keep/file") == b"important" * 1000
            report = await fs.fsck()
            assert list(report.problems) == [], list(report.problems)[:5]
            verify = await cluster.admin().verify()
            assert verify.ok, verify.as_dict()
            await channels.close()
            await fs.close()

    asyncio.run(body())


@pytest.mark.parametrize("transport", ["framed", "grpc"])
def test_every_service_refuses_a_missing_or_wrong_token(tmp_path: Path, transport: str) -> None:
    async def body() -> None:
        async with InProcessCluster(tmp_path, transport=transport, with_meta=True) as cluster:
            addresses = _addresses(cluster, transport)
            for token in (None, "wrong-token"):
                channels = RealChannelFactory(token, transport)  # type: ignore[arg-type]
                try:
                    for service in SERVICES:
                        method = service_spec(service).methods[0]
                        with pytest.raises(Unauthenticated):
                            await channels.get(addresses[service]).call(method, method.request_type(),
                                                                        timeout_ms=5_000)
                finally:
                    await channels.close()

    asyncio.run(body())
