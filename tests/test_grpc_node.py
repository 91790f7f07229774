"""The public gRPC API from another language, against a real cluster (``fs3 local``'s launcher).

A Node.js client (tests/grpc_node/client.js, @grpc/grpc-js and @grpc/proto-loader from npm, the
.proto files that ship in the package, nothing else of fs3) follows docs/grpc.md with a user token:
it reads a file the Python client wrote, creates files, writes data spanning several chunks on
several chains, closes them with their length, stats one, reads it back byte for byte and removes
it; the Python client then reads the file Node kept. The same cluster answers reflection and
health through plain grpcio.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import fs3
from fs3 import meta_pb2
from fs3.client.admin import AdminClient
from fs3.client.sync_api import FileSystem
from fs3.common.errors import StatusCode
from fs3.common.secret_files import write_token_file
from fs3.rpc.channel import RealChannelFactory
from fs3.rpc.grpc_transport import HEALTH_SERVICE, REFLECTION_SERVICE
from tests.harness import ProcessCluster
from tests.test_grpc_api import list_services

pytestmark = pytest.mark.slow

NODE_DIR = Path(__file__).resolve().parent / "grpc_node"
NPM_TIMEOUT_S = 300
NODE_TIMEOUT_S = 60
CHUNK_SIZE = 64 * 1024
USER_UID = 4242


def node_program() -> str:
    """``node``, with the client's npm packages installed (``make install`` does it; a checkout
    where it has not run installs them here); skips only when that cannot be done."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("Node.js and npm are not installed (make install installs Debian's nodejs and npm as root)")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js" / "package.json").exists():
        try:
            done = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                                  capture_output=True, text=True, timeout=NPM_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"npm ci in {NODE_DIR} did not finish within {NPM_TIMEOUT_S} s")
        if done.returncode != 0:
            pytest.skip(f"npm could not install the Node client's packages: {done.stderr.strip()[-500:]}")
    return node


@dataclass
class GrpcCluster:
    cluster: ProcessCluster
    fs: FileSystem
    user_token_file: Path
    grpc_addresses: dict[str, str]


@pytest.fixture(scope="module")
def grpc_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GrpcCluster]:
    """Two storage nodes with two targets each, two chains of two replicas, meta and mgmtd; a
    directory ``/grpc`` with a 64 KiB chunk size owned by a user whose token is in a 0600 file."""
    root = tmp_path_factory.mktemp("grpc-node")
    cluster = ProcessCluster(root / "cluster", storage_nodes=2, targets_per_node=2)
    try:
        cluster.start_all()
        chains = asyncio.run(cluster.ensure_chains(2))
        assert len(chains) == 2
        # Where the gRPC endpoints are: cluster.json, as `fs3 local up` writes it.
        described = json.loads(cluster.write_cluster_json().read_text())
        addresses = {name: str(p["grpc"]) for name, p in described["processes"].items() if p.get("grpc")}
        fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
        fs.mkdir("/grpc", 0o755)
        fs.set_layout("/grpc", chunk_size=CHUNK_SIZE)
        fs.chown("/grpc", USER_UID, USER_UID)

        async def add_user() -> str:
            channels = RealChannelFactory(cluster.token)
            try:
                meta = await AdminClient(cluster.mgmtd_address, channels).metadata()
                return (await meta.add_user("grpc-node", USER_UID, USER_UID, [])).token
            finally:
                await channels.close()

        user_token_file = root / "user-token"
        write_token_file(user_token_file, [asyncio.run(add_user())])
        yield GrpcCluster(cluster, fs, user_token_file, addresses)
        fs.close()
    finally:
        cluster.stop_all()


def test_a_node_client_writes_reads_stats_and_removes_a_file_through_grpc_alone(grpc_cluster: GrpcCluster) -> None:
    node = node_program()
    fs = grpc_cluster.fs
    # A file of the Python client's, for Node to read: chunk placement must agree both ways.
    theirs = os.urandom(3 * CHUNK_SIZE - 1000)
    fs.write_bytes("/grpc/python.bin", theirs)
    size = 2 * CHUNK_SIZE + 12_345   # three chunks, the last one partial
    proto_dir = resources.files("fs3") / "proto"   # the copy that ships in the package
    env = {
        "PATH": os.environ.get("PATH", ""),
        "FS3_GRPC_MGMTD": grpc_cluster.grpc_addresses["mgmtd"],
        "FS3_TOKEN_FILE": str(grpc_cluster.user_token_file),   # by file: never in argv or the output
        "FS3_PROTO_DIR": str(proto_dir),
        "FS3_DIR": "/grpc",
        "FS3_READ_PATH": "/grpc/python.bin",
        "FS3_WRITE_BYTES": str(size),
    }
    done = subprocess.run([node, str(NODE_DIR / "client.js")], env=env, capture_output=True, text=True,
                          timeout=NODE_TIMEOUT_S)
    assert done.returncode == 0, f"node client failed:\n{done.stderr[-4000:]}"
    token = grpc_cluster.user_token_file.read_text().strip()
    assert token not in done.stdout and token not in done.stderr
    report = json.loads(done.stdout)

    assert report["read_other"] == {"size": len(theirs), "sha256": hashlib.sha256(theirs).hexdigest()}
    written = report["node.bin"]
    assert written["chunk_size"] == CHUNK_SIZE and written["closed_size"] == size
    assert sorted(written["chains"]) == sorted(fs.layout("/grpc/kept.bin").chains)
    assert len(written["chains"]) == 2                       # striped over both chains
    # Four acknowledged updates per file: three chunks, the middle one written in two pieces.
    assert report["updates"] == 2 * 4
    assert report["stat"] == {"size": size, "type": meta_pb2.FILE, "mode": 0o644, "uid": USER_UID}
    assert report["read_back"]["identical"] is True
    assert report["read_back"]["sha256"] == report["sha256"] and report["read_back"]["size"] == size
    assert sorted(report["read_back"]["chains"]) == sorted(written["chains"])
    not_found = {"code": int(StatusCode.NOT_FOUND), "grpc_code": grpc.StatusCode.NOT_FOUND.value[0]}
    assert report["after_remove"] == not_found
    assert not fs.exists("/grpc/node.bin")

    # The file Node kept reads the same through the Python client (framed transport).
    kept = fs.read_bytes("/grpc/kept.bin")
    assert len(kept) == size and hashlib.sha256(kept).hexdigest() == report["sha256"]
    assert fs.stat("/grpc/kept.bin").st_uid == USER_UID


def test_every_service_of_a_cluster_answers_health_and_reflection(grpc_cluster: GrpcCluster) -> None:
    """Through plain grpcio: health without a token, reflection with the cluster token."""
    cluster_token = grpc_cluster.cluster.token
    expected = {"mgmtd": "fs3.Mgmtd", "meta": "fs3.Meta", "storage-1": "fs3.Storage", "storage-2": "fs3.Storage"}
    assert set(grpc_cluster.grpc_addresses) == set(expected)

    async def body() -> None:
        for name, service in expected.items():
            async with grpc.aio.insecure_channel(grpc_cluster.grpc_addresses[name]) as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for asked in ("", service):
                    rsp = await stub.Check(health_pb2.HealthCheckRequest(service=asked), timeout=5)
                    assert rsp.status == health_pb2.HealthCheckResponse.SERVING, (name, asked)
                names = await list_services(channel, cluster_token)
                assert service in names and HEALTH_SERVICE in names and REFLECTION_SERVICE in names, name
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await list_services(channel, None)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    asyncio.run(body())
