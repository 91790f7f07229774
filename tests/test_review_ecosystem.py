"""Hostile-review cases for profiles, fork safety, fsspec and the operator commands: each one a
way the client could leak a token, lose or destroy data, or hang, that once did."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fsspec.asyn import sync

from fs3.client.fsspec_impl import FS3FileSystem
from fs3.client.profiles import resolve
from fs3.common.errors import InvalidArgument
from fs3.common.secret_files import write_token_file

TOKEN = "prod-token-0123456789abcdef"


def _config(tmp_path: Path, mode: int = 0o600) -> dict[str, str]:
    write_token_file(tmp_path / "prod.token", [TOKEN])
    config = tmp_path / "config.toml"
    config.write_text('[profiles.prod]\nmgmtd = ["10.0.0.1:9000", "10.0.0.2:9000"]\ntoken_file = "prod.token"\n')
    config.chmod(mode)
    return {"FS3_CONFIG": str(config)}


def test_a_named_profile_never_sends_its_token_to_a_cluster_the_url_names(tmp_path: Path) -> None:
    env = _config(tmp_path)
    # fs3://prod@evil:9000/x: the URL names the profile and another cluster.
    options = FS3FileSystem._get_kwargs_from_urls("fs3://prod@10.6.6.6:9000/x")
    with pytest.raises(InvalidArgument, match="not sent") as caught:
        resolve(options["mgmtd"], profile=options["profile"], environ=env)
    assert TOKEN not in str(caught.value)
    # One of the profile's own mgmtd addresses is the profile's cluster.
    assert resolve("10.0.0.2:9000", profile="prod", environ=env).token == TOKEN
    assert resolve("10.0.0.2:9000", environ=env | {"FS3_PROFILE": "prod"}).token == TOKEN
    # A token the caller passes goes where the caller says.
    assert resolve("10.6.6.6:9000", "mine", profile="prod", environ=env).token == "mine"


@pytest.mark.parametrize("mode", [0o666, 0o620])
def test_a_config_that_others_may_change_cannot_send_a_token_file(tmp_path: Path, mode: int) -> None:
    # Another user who may write the config would point the profile's mgmtd at a host of theirs.
    env = _config(tmp_path, mode)
    with pytest.raises(InvalidArgument, match="chmod"):
        resolve(profile="prod", environ=env)
    os.chmod(env["FS3_CONFIG"], 0o644)  # readable is fine: the token is in its own file
    assert resolve(profile="prod", environ=env).token == TOKEN


def _fsspec(shared_cluster: Any) -> FS3FileSystem:
    cluster = shared_cluster.cluster
    return FS3FileSystem(mgmtd=cluster.mgmtd_address, token=cluster.token, skip_instance_cache=True)


@pytest.mark.slow
def test_fsspec_rm_recursive_of_a_symlink_removes_the_link_not_what_it_points_to(shared_cluster: Any) -> None:
    fs = _fsspec(shared_cluster)
    try:
        fs.pipe({"/rv-keep/a": b"precious", "/rv-keep/sub/b": b"precious too", "/rv-work/f": b"x"})
        fs.makedirs("/rv-keep/empty")
        sync(fs.loop, _symlink, fs, "/rv-keep", "/rv-work/link")
        fs.rm("/rv-work/link", recursive=True)  # like rm -r LINK: the link goes, the tree stays
        assert not fs.exists("/rv-work/link")
        assert fs.cat("/rv-keep/a") == b"precious" and fs.cat("/rv-keep/sub/b") == b"precious too"
        assert fs.isdir("/rv-keep/empty")
        sync(fs.loop, _symlink, fs, "/rv-keep", "/rv-work/link2")
        fs.rm("/rv-work", recursive=True)
        assert not fs.exists("/rv-work") and fs.cat("/rv-keep/a") == b"precious"
    finally:
        fs.rm("/rv-keep", recursive=True)
        fs.close()


async def _symlink(fs: FS3FileSystem, target: str, path: str) -> None:
    await (await fs.get_client()).symlink(target, path)


@pytest.mark.slow
def test_an_asynchronous_file_system_used_from_two_loops_keeps_one_client_per_loop(
        shared_cluster: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import fs3.client.fsspec_impl as impl

    made: list[Any] = []
    real_connect = impl.connect  # type: ignore[attr-defined]

    async def counting_connect(*args: Any, **kwargs: Any) -> Any:
        made.append(await real_connect(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(impl, "connect", counting_connect)
    cluster = shared_cluster.cluster
    fs = FS3FileSystem(mgmtd=cluster.mgmtd_address, token=cluster.token, asynchronous=True,
                       skip_instance_cache=True)
    loops = [asyncio.new_event_loop() for _ in range(2)]
    threads = [threading.Thread(target=loop.run_forever, daemon=True) for loop in loops]
    for thread in threads:
        thread.start()

    async def use(i: int) -> bytes:
        await fs._pipe_file(f"/rv-two-loops-{i}", b"x" * i)
        return bytes(await fs._cat_file(f"/rv-two-loops-{i}"))

    try:
        for i in range(6):  # calls alternate between the loops
            assert asyncio.run_coroutine_threadsafe(use(i), loops[i % 2]).result(30) == b"x" * i
        assert len(made) == 2  # not one new connection (never closed) per switch of loop
        for loop in loops:
            asyncio.run_coroutine_threadsafe(fs._close(), loop).result(30)
        assert all(client._closed for client in made)
    finally:
        for loop, thread in zip(loops, threads, strict=True):
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
            loop.close()


_LEFT_OPEN = """
import sys
mgmtd, token, kind = sys.argv[1:4]
if kind == "blocking":
    import fs3
    fs = fs3.connect(mgmtd, token=token)
    f = fs.open("/rv-left-open-blocking", "w")
    f.write("written, never closed")
    b = fs.open("/rv-left-open-blocking-raw", "wb", buffering=0)
    b.write(b"written, never closed")
else:
    import fsspec
    fs = fsspec.filesystem("fs3", mgmtd=mgmtd, token=token)
    f = fs.open("/rv-left-open-fsspec", "wb")
    f.write(b"written, never closed")
    fs.open("/rv-left-open-fsspec-dropped", "wb").write(b"written, never closed")
    r = fs.open("/rv-left-open-fsspec-plus", "wb+")
    r.write(b"written, never closed")
    big = fs.open("/rv-left-open-fsspec-big", "wb")
    big.write(b"w" * 5_000_000)
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["blocking", "fsspec"])
def test_files_left_open_when_the_program_ends_keep_what_was_written(shared_cluster: Any, kind: str) -> None:
    """A script that writes and ends without ``close`` (a local file keeps its bytes then)."""
    cluster = shared_cluster.cluster
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run([sys.executable, "-c", _LEFT_OPEN, cluster.mgmtd_address, cluster.token, kind],
                          env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "destroyed but it is pending" not in done.stderr, done.stderr  # files closed before clients
    fs = _fsspec(shared_cluster)
    try:
        names = ["-blocking", "-blocking-raw"] if kind == "blocking" else ["-fsspec", "-fsspec-dropped",
                                                                           "-fsspec-plus"]
        for name in names:
            assert fs.cat(f"/rv-left-open{name}") == b"written, never closed", name
        if kind == "fsspec":
            assert fs.cat("/rv-left-open-fsspec-big") == b"w" * 5_000_000
    finally:
        fs.close()


@pytest.mark.slow
def test_rmr_removes_exactly_the_path_named_and_never_follows_a_symlink(shared_cluster: Any,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from fs3.cli.ops import rmr_command
    from fs3.client.fs import connect

    cluster = shared_cluster.cluster

    async def main() -> None:
        fs = await connect(cluster.mgmtd_address, cluster.token)
        try:
            await fs.makedirs("/rv-rmr/tree/sub", exist_ok=True)
            await fs.makedirs("/rv-rmr-keep/sub", exist_ok=True)
            for path in ("/rv-rmr/x", "/rv-rmr/x ", "/rv-rmr/tree/f", "/rv-rmr-keep/a", "/rv-rmr-keep/sub/b"):
                await fs.write_bytes(path, b"data")
            await fs.symlink("/rv-rmr-keep", "/rv-rmr/tree/inside")
            await fs.symlink("/rv-rmr-keep", "/rv-rmr/link")

            def rmr(path: str) -> Any:
                return rmr_command(fs, argparse.Namespace(path=path, threads=4, json=True))

            await rmr("/rv-rmr/x ")  # a name with a trailing space is that name, not "/rv-rmr/x"
            assert await fs.exists("/rv-rmr/x") and not await fs.exists("/rv-rmr/x ")
            await rmr("/rv-rmr/link/")  # the link itself goes, never what it points to
            assert not await fs.islink("/rv-rmr/link") and "link" not in await fs.listdir("/rv-rmr")
            await rmr("/rv-rmr/tree")
            assert not await fs.exists("/rv-rmr/tree")
            assert sorted(await fs.listdir("/rv-rmr-keep")) == ["a", "sub"]
            assert await fs.read_bytes("/rv-rmr-keep/sub/b") == b"data"
        finally:
            await fs.close()

    asyncio.run(main())
    assert capsys.readouterr().out.count('"path"') == 3


@pytest.mark.slow
def test_fsspec_rm_of_the_root_is_refused_before_anything_goes(shared_cluster: Any) -> None:
    fs = _fsspec(shared_cluster)
    try:
        fs.pipe("/rv-root-keep/a", b"precious")
        for spelled in ("", "/", "fs3:///", ["/rv-root-keep/nothing-here", "/"]):
            with pytest.raises(OSError, match="refusing to remove the root"):
                fs.rm(spelled, recursive=True)
            assert fs.cat("/rv-root-keep/a") == b"precious"
    finally:
        fs.rm("/rv-root-keep", recursive=True)
        fs.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["wb", "w", "wb0"])
def test_a_blocking_file_dropped_and_collected_in_the_clients_loop_thread_keeps_its_bytes(
        shared_cluster: Any, mode: str) -> None:
    """The collector runs in whatever thread allocates, the client's loop thread included."""
    import gc

    import fs3

    cluster = shared_cluster.cluster
    fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
    path = f"/rv-dropped-{mode}"
    try:
        f = fs.open(path, mode[:2], buffering=0) if mode == "wb0" else fs.open(path, mode)
        f.write(b"kept" if "b" in mode else "kept")
        cycle: list[Any] = [f]
        cycle.append(cycle)  # only the cyclic collector frees it
        del f, cycle
        gc.disable()
        try:
            runner = fs._runner
            assert runner is not None
            asyncio.run_coroutine_threadsafe(_collect(), runner.loop).result(30)
        finally:
            gc.enable()
        deadline = time.monotonic() + 10
        while fs.read_bytes(path) != b"kept" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fs.read_bytes(path) == b"kept"
    finally:
        fs.close()


async def _collect() -> None:
    import gc

    gc.collect()


def test_a_config_that_others_may_change_cannot_send_the_environments_token(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('[profiles.default]\nmgmtd = "10.0.0.1:9000"\n')  # no token: FS3_TOKEN goes there
    config.chmod(0o666)
    env = {"FS3_CONFIG": str(config), "FS3_TOKEN": TOKEN}
    with pytest.raises(InvalidArgument, match="chmod go-w"):
        resolve(environ=env)
    config.chmod(0o644)
    assert resolve(environ=env).token == TOKEN
