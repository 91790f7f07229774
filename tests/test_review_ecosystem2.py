"""Second hostile-review cases for profiles, URLs, fork safety, fsspec, metrics and the operator
commands: each one a way the client or a service could send data to the wrong cluster, lose data,
leak, or grow without bound, that once did."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fsspec.callbacks import Callback
from prometheus_client import CollectorRegistry

from fs3.client.fsspec_impl import FS3FileSystem
from fs3.common.errors import StatusCode
from fs3.common.metrics import ServiceMetrics
from fs3.rpc.dispatch import Dispatcher


@pytest.mark.parametrize("url", ["fs3://otherhost.example/data/x", "fs3://prod@otherhost.example/data/x",
                                 "fs3://prod:secret-word@/data/x"])
def test_a_url_naming_a_host_without_a_port_or_a_password_is_refused_not_sent_elsewhere(url: str) -> None:
    # Such a URL named a cluster (or a secret) the client silently dropped: the file went to the
    # default profile's, or $FS3_MGMTD's, cluster instead.
    with pytest.raises(ValueError, match="fs3 URL") as caught:
        FS3FileSystem._get_kwargs_from_urls(url)
    assert "secret-word" not in str(caught.value)


def test_urls_that_name_a_cluster_or_a_profile_still_resolve() -> None:
    assert FS3FileSystem._get_kwargs_from_urls("fs3://h:9000/x") == {"mgmtd": "h:9000"}
    assert FS3FileSystem._get_kwargs_from_urls("fs3://prod@/x") == {"profile": "prod"}
    assert FS3FileSystem._get_kwargs_from_urls("fs3://prod@h:9000/x") == {"profile": "prod", "mgmtd": "h:9000"}
    assert FS3FileSystem._get_kwargs_from_urls("fs3:///x") == {}
    assert FS3FileSystem._get_kwargs_from_urls("/x") == {}


def test_unknown_method_ids_share_one_metrics_label() -> None:
    # Each unauthenticated connection gets one request answered: a new method id per connection
    # added a request counter and a latency histogram to /metrics, without bound.
    registry = CollectorRegistry()
    dispatcher = Dispatcher(token="t", metrics=ServiceMetrics("mgmtd", registry))

    async def send_unknown_ids() -> None:
        for method_id in range(60_000, 60_200):
            reply = await dispatcher.dispatch(method_id, b"", b"", None)
            assert reply.status == StatusCode.UNAUTHENTICATED

    asyncio.run(send_unknown_ids())
    methods = {sample.labels.get("method") for metric in registry.collect() for sample in metric.samples
               if sample.name.startswith("fs3_rpc_")}
    assert methods == {"unknown"}




def _fsspec(shared_cluster: Any, **options: Any) -> FS3FileSystem:
    cluster = shared_cluster.cluster
    return FS3FileSystem(mgmtd=cluster.mgmtd_address, token=cluster.token, skip_instance_cache=True, **options)


class _CancelAfterFirstPiece(Callback):  # type: ignore[misc]
    """Cancels the put it watches once its first piece is written: a batch cancelled half way."""

    def call(self, *args: Any, **kwargs: Any) -> None:
        if self.value:
            task = asyncio.current_task()
            assert task is not None
            task.cancel()


@pytest.mark.slow
def test_a_whole_file_write_that_does_not_finish_leaves_no_short_file(shared_cluster: Any, tmp_path: Path) -> None:
    # A put cancelled half way (a batch's first error cancels the rest; wait_for's timeout) or a
    # pipe that failed after the open committed what had landed: a short (or empty) file under
    # the name, like a complete one.
    source = tmp_path / "source"
    source.write_bytes(b"x" * (3 << 20))
    fs = _fsspec(shared_cluster, asynchronous=True)

    async def run() -> None:
        client = await fs.get_client()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(fs._put_file(str(source), "/rv2-unfinished/put.bin",
                                                   callback=_CancelAfterFirstPiece()))
        with pytest.raises(TypeError):
            await fs._pipe_file("/rv2-unfinished/pipe.bin", "not bytes")
        await fs._put_file(str(source), "/rv2-unfinished/kept.bin")
        assert await fs._cat_file("/rv2-unfinished/kept.bin") == source.read_bytes()
        assert not await fs._exists("/rv2-unfinished/put.bin")
        assert not await fs._exists("/rv2-unfinished/pipe.bin")
        assert not client._open_files  # and no handle left open
        await fs._rm("/rv2-unfinished", recursive=True)
        await fs._close()

    asyncio.run(run())


_FORK_WITH_METRICS = """
import os, pickle, signal, socket, sys
import fs3, fsspec
mgmtd, token = sys.argv[1:3]
with socket.socket() as s, socket.socket() as t:  # two ports free now (port + 1 may be anyone's)
    s.bind(("127.0.0.1", 0))
    t.bind(("127.0.0.1", 0))
    port, other_port = s.getsockname()[1], t.getsockname()[1]
blocking = fs3.connect(mgmtd, token=token, metrics_port=port)
blocking.listdir("/")
ffs = fsspec.filesystem("fs3", mgmtd=mgmtd, token=token, metrics_port=other_port, skip_instance_cache=True)
ffs.ls("/")
assert blocking.afs.metrics_address == f"127.0.0.1:{port}"
pid = os.fork()
if pid == 0:
    signal.alarm(30)
    try:
        blocking.makedirs("/rv2-fork-metrics", exist_ok=True)
        ffs.pipe_file("/rv2-fork-metrics/child", b"child")
        os._exit(0)
    except BaseException as exc:
        print("child:", type(exc).__name__, exc, flush=True)
        os._exit(1)
assert os.waitpid(pid, 0)[1] == 0
assert pickle.loads(pickle.dumps(blocking)).config.metrics_port == -1
assert pickle.loads(pickle.dumps(ffs)).storage_options["metrics_port"] == -1
assert ffs.cat_file("/rv2-fork-metrics/child") == b"child"
print("ok")
"""


@pytest.mark.slow
def test_a_client_with_a_fixed_metrics_port_works_in_a_forked_child_and_pickles(shared_cluster: Any) -> None:
    # The child connected anew with the parent's metrics port, which the parent holds: every call
    # of a forked (DataLoader) worker failed with EADDRINUSE, and so did an unpickled copy's.
    cluster = shared_cluster.cluster
    done = subprocess.run([sys.executable, "-c", _FORK_WITH_METRICS, cluster.mgmtd_address, cluster.token],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr


def test_warmup_reads_while_it_walks_so_memory_does_not_grow_with_the_tree() -> None:
    # It collected every path of the tree before reading one: tens of millions of files meant GBs.
    import argparse

    from fs3.cli.ops import warmup_command

    class Tree:
        """A file system whose walk yields 2,000 files, recording how far the reads lag behind."""

        def __init__(self) -> None:
            self.yielded = 0
            self.read = 0
            self.worst_lag = 0

        async def isdir(self, path: str) -> bool:
            return path == "/big"

        async def isfile(self, path: str) -> bool:
            self.read += 1
            return False

        async def walk(self, path: str) -> Any:
            for page in range(20):
                names = [f"f{page}-{i}" for i in range(100)]
                for _ in names:
                    self.yielded += 1
                    self.worst_lag = max(self.worst_lag, self.yielded - self.read)
                yield f"/big/d{page}", [], names

    tree = Tree()
    args = argparse.Namespace(path="/big", threads=4, json=True)
    assert asyncio.run(warmup_command(tree, args)) == 0
    assert tree.read == 2000
    # One directory page plus the bounded queue (4 x threads) and the files being read.
    assert tree.worst_lag <= 100 + 4 * 4 + 4 + 100, tree.worst_lag


def test_an_fs3_mgmtd_naming_no_address_is_refused_up_front(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from fs3.client.profiles import resolve
    from fs3.common.errors import InvalidArgument

    monkeypatch.delenv("FS3_CONFIG", raising=False)
    monkeypatch.delenv("FS3_PROFILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    for value in (",", " , ", " "):
        monkeypatch.setenv("FS3_MGMTD", value)
        with pytest.raises(InvalidArgument, match="names no address"):
            resolve()


def test_a_file_system_made_with_several_mgmtd_addresses_names_itself_in_a_url_that_parses() -> None:
    # unstrip_protocol put the list's repr into the URL ("fs3://['h1:9000', ...]/x").
    fs = FS3FileSystem.__new__(FS3FileSystem)
    fs.storage_options = {"mgmtd": ["h1:9000", "h2:9001"]}
    url = fs.unstrip_protocol("/data/x")
    assert url == "fs3://h1:9000/data/x"
    assert FS3FileSystem._get_kwargs_from_urls(url) == {"mgmtd": "h1:9000"}
