"""Clients across processes: forked children, DataLoader workers (fork, spawn, forkserver), pickling,
and torch's distributed checkpoint finding the cluster and token from a profile alone."""

from __future__ import annotations

import asyncio
import errno
import io
import multiprocessing
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
import torch.utils.data

import fs3
import fs3.aio
from fs3.client.fsspec_impl import FS3FileSystem
from fs3.client.sync_api import FileSystem
from fs3.common.secret_files import write_secret_file, write_token_file
from tests.inproc import InProcessCluster

pytestmark = pytest.mark.slow  # an in-process cluster, forked and spawned workers, torch

_CHILD_TIMEOUT_S = 30


class _Cluster:
    """An in-process cluster on its own loop thread, with a token of its own (never ``tok``, so
    that a test can tell whether the token is in a pickle)."""

    def __init__(self, root: Path) -> None:
        self.token = "e17-" + secrets.token_hex(16)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="fork-cluster-loop")
        self.thread.start()
        self.cluster = InProcessCluster(root, targets_per_node=2, with_meta=True, token=self.token)
        asyncio.run_coroutine_threadsafe(self.cluster.__aenter__(), self.loop).result(60)
        self.address = self.cluster.mgmtd_address

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.cluster.__aexit__(None, None, None), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Cluster]:
    """One cluster, and an environment where it is the ``default`` profile (token in a file) and
    the ``train`` profile: nothing else tells a client where it is."""
    root = tmp_path_factory.mktemp("fork-cluster")
    running = _Cluster(root / "cluster")
    home = root / "home"
    home.mkdir()
    write_token_file(home / "token", [running.token])
    write_secret_file(home / "config.toml", f'[profiles.default]\nmgmtd = "{running.address}"\ntoken_file = "token"\n'
                                            f'[profiles.train]\nmgmtd = "{running.address}"\ntoken_file = "token"\n')
    with pytest.MonkeyPatch.context() as patch:
        for name in ("FS3_MGMTD", "FS3_TOKEN", "FS3_TOKEN_FILE", "FS3_PROFILE"):
            patch.delenv(name, raising=False)
        patch.setenv("FS3_CONFIG", str(home / "config.toml"))
        try:
            yield running
        finally:
            for key, cached in list(FS3FileSystem._cache.items()):  # the fs3:/// instances this module made
                if cached.storage_options.get("mgmtd") in (None, running.address):
                    cached.close()
                    del FS3FileSystem._cache[key]
            running.close()


def _in_child(body: Callable[[], None]) -> int:
    """Run ``body`` in a forked child (an alarm turns a hang into a failure); its exit status."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(_CHILD_TIMEOUT_S)
            body()
            code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_a_forked_child_reconnects_under_its_own_id(cluster: _Cluster) -> None:
    fs = fs3.connect()  # the default profile
    fs.makedirs("/fork", exist_ok=True)
    fs.write_bytes("/fork/parent.txt", b"from the parent")
    reader = fs.open("/fork/parent.txt", "rb")
    writer = fs.open("/fork/open-in-parent.bin", "wb")
    writer.write(b"parent bytes ")
    parent_id = fs.afs.client_id
    read, write = os.pipe()

    def child() -> None:
        assert fs.read_bytes("/fork/parent.txt") == b"from the parent"
        fs.write_bytes("/fork/child.txt", b"from the child")
        os.write(write, fs.afs.client_id)
        assert fs.afs.meta.lease_started  # the child keeps a lease of its own
        # Handles the parent opened fail at once, clearly; closing a reader releases nothing.
        for call in (reader.read, lambda: writer.write(b"x" * (1 << 21)), writer.flush):
            with pytest.raises(OSError, match=r"before os\.fork") as caught:
                call()
            assert caught.value.errno == 9
        reader.close()

    assert _in_child(child) == 0
    child_id = os.read(read, 64)
    os.close(read)
    os.close(write)
    assert len(child_id) == 16 and child_id != parent_id
    assert fs.read_bytes("/fork/child.txt") == b"from the child"
    # The parent's client and handles are untouched by the child.
    assert fs.afs.client_id == parent_id and reader.read() == b"from the parent"
    writer.write(b"and more")
    writer.close()
    reader.close()
    assert fs.read_bytes("/fork/open-in-parent.bin") == b"parent bytes and more"
    fs.close()


def test_an_asyncio_client_in_a_forked_child(cluster: _Cluster) -> None:
    loop = asyncio.new_event_loop()
    afs = loop.run_until_complete(fs3.aio.connect(cluster.address, token=cluster.token))
    loop.run_until_complete(afs.write_bytes("/fork/aio.txt", b"aio"))
    handle = loop.run_until_complete(afs.open("/fork/aio.txt", "rb"))
    parent_id = afs.client_id

    def child() -> None:
        async def use() -> None:
            assert afs.client_id != parent_id
            assert await afs.read_bytes("/fork/aio.txt") == b"aio"
            await afs.write_bytes("/fork/aio-child.txt", b"aio child")
            with pytest.raises(OSError, match=r"before os\.fork"):
                await handle.read()
            await handle.close()  # the parent's session: nothing sent
            await afs.close()

        asyncio.run(use())

    assert _in_child(child) == 0
    assert loop.run_until_complete(afs.read_bytes("/fork/aio-child.txt")) == b"aio child"
    assert loop.run_until_complete(handle.read()) == b"aio"
    loop.run_until_complete(handle.close())
    loop.run_until_complete(afs.close())
    loop.close()


def test_the_grpc_transport_is_refused_in_a_forked_child_not_hung(cluster: _Cluster) -> None:
    # gRPC's core does not survive fork; a client that was made in the parent (never connected
    # here: the test process must not start gRPC threads) refuses clearly in the child.
    afs = fs3.aio.AsyncFileSystem(cluster.address, cluster.token, fs3.aio.ClientConfig(transport="grpc"))

    def child() -> None:
        from fs3.client.forking import ForkedGrpcError

        with pytest.raises(ForkedGrpcError, match="transport='framed'"):
            asyncio.run(afs.stat("/"))
        with pytest.raises(ForkedGrpcError):
            fs3.connect(cluster.address, token=cluster.token, transport="grpc")
        fs3.connect().close()  # the framed transport is fine

    assert _in_child(child) == 0


def test_a_file_system_pickles_its_settings_not_its_state(cluster: _Cluster) -> None:
    from_profile = fs3.connect()
    data = pickle.dumps(from_profile)
    assert cluster.token.encode() not in data  # a token file travels as its path
    copy = pickle.loads(data)
    assert isinstance(copy, FileSystem) and copy._afs is None  # connects on first use
    assert copy.exists("/fork/parent.txt") and copy.afs.client_id != from_profile.afs.client_id
    inline = fs3.connect(cluster.address, token=cluster.token)
    assert pickle.loads(pickle.dumps(inline)).read_bytes("/fork/parent.txt") == b"from the parent"
    from_profile.close()
    assert pickle.loads(pickle.dumps(from_profile)).exists("/")  # a closed one pickles too
    for fs in (copy, inline):
        fs.close()


class Shards(torch.utils.data.Dataset[dict[str, Any]]):
    """A dataset holding fs3 clients made in the parent: ``fs3.connect`` and an fsspec file system."""

    def __init__(self, client: FileSystem, fsspec_fs: Any, paths: list[str]) -> None:
        self.client = client
        self.fsspec_fs = fsspec_fs
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path = self.paths[index]
        with self.fsspec_fs.open(path, "rb") as f:
            via_fsspec = f.read()
        return {"index": index, "data": self.client.read_bytes(path), "fsspec": via_fsspec, "pid": os.getpid(),
                "client_id": self.client.afs.client_id.hex()}


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_read_what_the_parent_wrote(cluster: _Cluster, context: str) -> None:
    client = fs3.connect()
    fsspec_fs, _ = fsspec.core.url_to_fs("fs3:///")  # the default profile, found by the URL alone
    paths = [f"/loader/{context}/shard-{i}.bin" for i in range(4)]
    for i, path in enumerate(paths):
        fsspec_fs.pipe_file(path, bytes([i]) * (1000 + i))
    mp_context = multiprocessing.get_context(context)
    if context == "forkserver":  # the server imports torch once, not each worker (test time)
        mp_context.set_forkserver_preload(["torch.utils.data", __name__])
    loader = torch.utils.data.DataLoader(Shards(client, fsspec_fs, paths), batch_size=None, num_workers=2,
                                         multiprocessing_context=mp_context, timeout=60)
    items = sorted(loader, key=lambda item: item["index"])
    assert [item["data"] for item in items] == [bytes([i]) * (1000 + i) for i in range(4)]
    assert [item["fsspec"] for item in items] == [item["data"] for item in items]
    pids = {item["pid"] for item in items}
    assert len(pids) == 2 and os.getpid() not in pids
    ids = {item["pid"]: item["client_id"] for item in items}
    assert len(set(ids.values())) == 2 and client.afs.client_id.hex() not in ids.values()
    assert client.read_bytes(paths[0]) == bytes([0]) * 1000  # the parent's client still works
    client.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_dcp_round_trip_with_the_profile_alone(cluster: _Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    # An fs3 file has no descriptor: fileno() raises io.UnsupportedOperation, and DCP's
    # sync_files=True falls back to os.sync() (counted here, not run); the file is durable on fs3
    # when DCP closes it, before the metadata is renamed into place.
    syncs: list[int] = []
    monkeypatch.setattr(os, "sync", lambda: syncs.append(1))
    fs, _ = fsspec.core.url_to_fs("fs3:///")
    with fs.open("/ckpt/probe", "wb") as f:
        with pytest.raises(io.UnsupportedOperation):
            os.fsync(f.fileno())
        f.write(b"x")
        f.fsync()
    state = {"weight": torch.arange(4096, dtype=torch.float32).reshape(64, 64), "step": torch.tensor(7)}
    for url in ("fs3:///ckpt/step-7", "fs3://train@/ckpt/step-7-train"):
        dcp_save(state, checkpoint_id=url, storage_writer=FsspecWriter(url, sync_files=True))
        loaded = {"weight": torch.zeros(64, 64), "step": torch.tensor(0)}
        dcp_load(loaded, checkpoint_id=url, storage_reader=FsspecReader(url))
        assert torch.equal(loaded["weight"], state["weight"]) and int(loaded["step"]) == 7
    assert syncs  # DCP reached its sync path and went on
    # A fresh client, elsewhere, sees the whole checkpoint.
    with fs3.connect(profile="train") as other:
        assert ".metadata" in other.listdir("/ckpt/step-7")


def test_a_stopped_client_fails_its_files_at_once_and_exits_cleanly(cluster: _Cluster) -> None:
    """A file whose file system was closed fails its calls with EBADF instead of waiting for a loop
    that will never answer; a process that exits with files still referenced (a dataset's shard
    handles, say) exits at once, whatever order the interpreter collects them in."""
    fs = fs3.connect()
    fs.makedirs("/fork", exist_ok=True)
    fs.write_bytes("/fork/stopped.txt", b"kept open")
    kept = fs.open("/fork/stopped.txt", "rb", buffering=0)
    fs.close()
    with pytest.raises(OSError) as caught:
        kept.read()
    assert caught.value.errno == errno.EBADF and "stopped" in str(caught.value)
    script = ("import builtins, fs3\n"
              "fs = fs3.connect()\n"
              "builtins.kept = [fs.open('/fork/stopped.txt', 'rb'), fs.open('/fork/stopped.txt', 'rb', buffering=0)]\n"
              "builtins.kept.append(builtins.kept)  # a cycle: collected late, after the loop thread\n"
              "assert builtins.kept[0].read() == b'kept open'\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=_CHILD_TIMEOUT_S,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert run.returncode == 0, run.stderr
    assert "Exception ignored" not in run.stderr, run.stderr
