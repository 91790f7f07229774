"""Metadata backups kept in an fs3 cluster through the client API (no mount): ``fs3 admin backup
--backup-dir fs3:///PATH`` keeps the newest K there, written as a temporary file and renamed, and
``fs3 admin load fs3://...`` loads one into an empty store."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

import fs3.aio
from fs3 import meta_pb2 as mpb
from fs3.cli.main import main
from fs3.client.fs import AsyncFileSystem
from fs3.client.meta import path_ref
from fs3.common.errors import InvalidArgument, IoError, PermissionDenied
from fs3.common.posix import O_RDONLY
from fs3.kv.store import RocksKVStore, WriteBatch
from fs3.meta import schema
from fs3.meta.backup import TMP_STALE_S, backup_to, is_backup_name
from fs3.meta.backup_fs3 import Fs3BackupDir, backup_dir_location, parse_fs3_url
from fs3.meta.dump import is_dumped_key
from fs3.meta.formats import META_FORMAT
from fs3.meta.service import MetaServiceConfig
from tests.inproc import InProcessCluster
from tests.test_meta_dump import engine_with, failing_snapshots, random_store, read_back

pytestmark = pytest.mark.slow  # an in-process cluster

BACKUPS = "/backups/meta"


def _in_a_cluster(tmp_path: Path, body: Callable[[AsyncFileSystem], Awaitable[None]], trash_days: float = 0) -> None:
    """Runs ``body`` with a client of a fresh in-process cluster with meta (closed after)."""

    async def run() -> None:
        async with InProcessCluster(tmp_path / "c", targets_per_node=2, with_meta=True,
                                    meta_config=MetaServiceConfig(root_mode=0o777, trash_days=trash_days)) as cluster:
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                await body(fs)
            finally:
                await fs.close()

    asyncio.run(run())


def _meta_config(tmp_path: Path, name: str) -> Path:
    config = tmp_path / f"{name}.toml"
    config.write_text(f'data_dir = "{tmp_path / name}"\nkv_engine = "rocksdb"\ncluster_id = "fs3-url"\n')
    config.chmod(0o600)
    return config


async def _names(fs: AsyncFileSystem) -> list[str]:
    return sorted(await fs.listdir(BACKUPS))


def test_url_forms() -> None:
    assert parse_fs3_url("fs3:///backups/meta/").path == "/backups/meta"
    assert parse_fs3_url("fs3://10.0.0.1:9000/b").mgmtd == "10.0.0.1:9000"
    assert parse_fs3_url("fs3://prod@/b").profile == "prod"
    assert parse_fs3_url("fs3:///backups//meta").path == "/backups/meta"
    assert parse_fs3_url("fs3://prod@/a//b/").url() == "fs3://prod@/a/b"
    for bad in ("fs3:/backups", "fs3://host/b", "fs3://a@h:1/b", "fs3://host:9000", "fs3:///a/../b", "fs3://:x@/b",
                "fs3://a@b@/x", "fs3://pr od@/x", "fs3://h:0/x", "fs3://h:65536/x"):
        with pytest.raises(InvalidArgument):
            parse_fs3_url(bad)
    for root in ("fs3:///", "fs3://h:1//", "fs3://prod@/"):  # every backup would list the whole root
        assert parse_fs3_url(root).path == "/"
        with pytest.raises(InvalidArgument, match="below the root"):
            backup_dir_location(root)


def test_backups_in_fs3_keep_the_newest_and_prune_leftovers(tmp_path: Path) -> None:
    engine = engine_with(random_store(random.Random(24), 12))
    clock = iter(range(2_000_000_000_000_000_000, 3_000_000_000_000_000_000, 1_000_000_000))

    async def body(fs: AsyncFileSystem) -> None:
        directory = Fs3BackupDir(fs, parse_fs3_url(f"fs3://{BACKUPS}"))
        # What a killed run left: a partial temporary file untouched for longer than TMP_STALE_S, and a
        # fresh one (maybe another run's, still writing).
        await fs.makedirs(BACKUPS, exist_ok=True)
        await fs.write_bytes(f"{BACKUPS}/fs3-meta-20000101T000000.000Z.dump.tmp", b"partial")
        long_ago_s = time.time() - TMP_STALE_S - 60
        await fs.utime(f"{BACKUPS}/fs3-meta-20000101T000000.000Z.dump.tmp", (long_ago_s, long_ago_s))
        await fs.write_bytes(f"{BACKUPS}/fs3-meta-29990101T000000.000Z.dump.tmp", b"another writer's")
        made = []
        for _ in range(3):
            name, _removed = await backup_to(engine.snapshot, directory, 2, "c", now_ns=lambda: next(clock))
            made.append(name)
        assert await _names(fs) == sorted([*made[1:], "fs3-meta-29990101T000000.000Z.dump.tmp"])
        # Private: the dump holds every name and the user table's hashes. Another user (as a mount
        # passes each caller's uid) cannot read a backup.
        other = mpb.User(uid=4242, gid=4242)
        for name in made[1:]:
            st = await fs.stat(f"{BACKUPS}/{name}")
            assert st.st_mode & 0o777 == 0o600
            with pytest.raises(PermissionDenied):
                await fs.metadata.open(path_ref(f"{BACKUPS}/{name}".encode()), O_RDONLY, user=other)
            assert read_back((await fs.read_bytes(f"{BACKUPS}/{name}")).splitlines(keepends=True))

        # A backup whose dump fails leaves no temporary file and removes no older backup.
        with pytest.raises(IoError):
            await backup_to(failing_snapshots(engine), directory, 1, "c", now_ns=lambda: next(clock))
        assert [n for n in await _names(fs) if is_backup_name(n)] == made[1:]
        assert sum(n.endswith(".tmp") for n in await _names(fs)) == 1  # only the newer writer's

    _in_a_cluster(tmp_path, body)


def test_backup_and_load_commands_with_an_fs3_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """The cluster's own meta store backed up into the cluster by ``fs3:///``, then loaded from
    there (a running cluster) into an empty store."""
    data = random_store(random.Random(25), 30)
    source = RocksKVStore(tmp_path / "src" / "kv")  # the store backed up, open as under a running meta
    batch = WriteBatch()
    for key, value in data.items():
        batch.put(key, value)
    source.write(batch)
    src, dst = _meta_config(tmp_path, "src"), _meta_config(tmp_path, "dst")

    async def run() -> None:
        async with InProcessCluster(tmp_path / "c", targets_per_node=2, with_meta=True,
                                    meta_config=MetaServiceConfig(root_mode=0o777)) as cluster:
            monkeypatch.setenv("FS3_TOKEN", cluster.token)
            cli = ["admin", "--mgmtd", cluster.mgmtd_address]
            for _ in range(3):
                assert await asyncio.to_thread(main, [*cli, "backup", "--meta-config", str(src), "--backup-dir",
                                                      f"fs3://{BACKUPS}", "--keep", "2"]) == 0
                await asyncio.sleep(0.002)  # names are per millisecond
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                names = await _names(fs)
            finally:
                await fs.close()
            assert len(names) == 2 and all(is_backup_name(n) for n in names)
            assert f"fs3://{BACKUPS}/{names[1]} written" in capsys.readouterr().out
            # A bad URL and a missing file are clear errors; nothing is written.
            assert await asyncio.to_thread(main, [*cli, "backup", "--meta-config", str(src),
                                                  "--backup-dir", "fs3://nohost/b"]) == 1
            assert "bad fs3 URL" in capsys.readouterr().err
            assert await asyncio.to_thread(main, [*cli, "load", f"fs3://{BACKUPS}/missing.dump",
                                                  "--meta-config", str(dst)]) == 1
            assert "cannot read" in capsys.readouterr().err
            assert not (tmp_path / "dst" / "kv").exists()  # the store is opened only once the dump is here
            # A truncated copy in fs3 is refused with why, writing nothing: a later load still finds the store empty.
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
            try:
                whole = await fs.read_bytes(f"{BACKUPS}/{names[1]}")
                await fs.write_bytes("/cut.dump", whole[:len(whole) // 2])
            finally:
                await fs.close()
            assert await asyncio.to_thread(main, [*cli, "load", "fs3:///cut.dump", "--meta-config", str(dst)]) == 1
            assert "dump" in capsys.readouterr().err
            url = f"fs3://{cluster.mgmtd_address}{BACKUPS}/{names[1]}"
            assert await asyncio.to_thread(main, [*cli, "load", url, "--meta-config", str(dst)]) == 0

    try:
        asyncio.run(run())
    finally:
        source.close()
    loaded = RocksKVStore.open_view(tmp_path / "dst" / "kv")
    try:
        contents = dict(loaded.scan(b""))
    finally:
        loaded.close()
    next_key = schema.counter_key("next_inode")
    expected = {k: v for k, v in data.items() if is_dumped_key(k) and k != next_key}
    assert contents[META_FORMAT.record_key]  # the dump's meta format, stamped by the load
    assert {k: v for k, v in contents.items() if k not in (next_key, META_FORMAT.record_key)} == expected



def test_two_runs_of_the_same_name_never_rename_each_others_file(tmp_path: Path) -> None:
    """Two backup runs that chose the same name (the same millisecond; two hosts): the one that
    finishes first must not rename the other's temporary file, half written, to the backup's name;
    both finish, and the file under the name is always a whole dump."""
    engine = engine_with(random_store(random.Random(26), 12))
    now = 2_500_000_000_000_000_000

    def gated(opened: asyncio.Event, release: asyncio.Event) -> Any:
        async def take() -> Any:
            snap = await engine.snapshot()
            scan = snap.scan

            async def scan_later(*args: Any, **kwargs: Any) -> Any:
                opened.set()
                await release.wait()
                return await scan(*args, **kwargs)
            snap.scan = scan_later  # type: ignore[method-assign]
            return snap
        return take

    async def body(fs: AsyncFileSystem) -> None:
        directory = Fs3BackupDir(fs, parse_fs3_url(f"fs3://{BACKUPS}"))
        opened = [asyncio.Event(), asyncio.Event()]
        release = [asyncio.Event(), asyncio.Event()]
        first = asyncio.create_task(backup_to(gated(opened[0], release[0]), directory, 2, "c", now_ns=lambda: now))
        await opened[0].wait()
        second = asyncio.create_task(backup_to(gated(opened[1], release[1]), directory, 2, "c", now_ns=lambda: now))
        await opened[1].wait()
        release[0].set()
        name, _ = await first
        # The second run is still writing: what is under the name is the first run's whole dump.
        assert read_back((await fs.read_bytes(f"{BACKUPS}/{name}")).splitlines(keepends=True))
        release[1].set()
        assert (await second)[0] == name
        assert read_back((await fs.read_bytes(f"{BACKUPS}/{name}")).splitlines(keepends=True))
        assert await _names(fs) == [name]

    _in_a_cluster(tmp_path, body)


def test_removed_backups_do_not_stay_in_the_trash(tmp_path: Path) -> None:
    """With a trash kept, a backup removed as beyond --keep (a copy of the whole namespace and of the
    user table's hashes) is emptied from it at once: K bounds what the backups keep, and for how long."""
    engine = engine_with(random_store(random.Random(27), 12))
    clock = iter(range(2_000_000_000_000_000_000, 3_000_000_000_000_000_000, 1_000_000_000))

    async def body(fs: AsyncFileSystem) -> None:
        directory = Fs3BackupDir(fs, parse_fs3_url(f"fs3://{BACKUPS}"))
        made = [(await backup_to(engine.snapshot, directory, 1, "c", now_ns=lambda: next(clock)))[0]
                for _ in range(3)]
        assert await _names(fs) == made[-1:]
        assert not (await fs.metadata.trash_list()).entries
        # The directories made for the backups are private too: no other user lists them.
        assert (await fs.stat("/backups")).st_mode & 0o077 == 0
        with pytest.raises(PermissionDenied):
            await fs.metadata.read_dir(path_ref(BACKUPS.encode()), limit=10, with_attrs=False,
                                       user=mpb.User(uid=4242, gid=4242))

    _in_a_cluster(tmp_path, body, trash_days=1)


def test_a_long_backup_syncs_as_it_goes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backup written into fs3 syncs every TMP_TOUCH_S (here: every piece), which moves its mtime
    (another run sees a writer at work), and still ends a whole dump."""
    from fs3.client.files import AsyncFile
    from fs3.meta import backup_fs3

    engine = engine_with(random_store(random.Random(28), 12_000))  # a dump of several MiB
    monkeypatch.setattr(backup_fs3, "TMP_TOUCH_S", 0)
    fsync = AsyncFile.fsync
    synced: list[int] = []

    async def counting(self: AsyncFile) -> None:
        await fsync(self)
        synced.append((await self.fs.stat(self.name)).st_size)
    monkeypatch.setattr(AsyncFile, "fsync", counting)

    async def body(fs: AsyncFileSystem) -> None:
        directory = Fs3BackupDir(fs, parse_fs3_url(f"fs3://{BACKUPS}"))
        name, _ = await backup_to(engine.snapshot, directory, 1, "c")
        data = await fs.read_bytes(f"{BACKUPS}/{name}")
        assert read_back(data.splitlines(keepends=True))
        assert len(synced) >= 3 and synced == sorted(synced) and synced[0] < len(data) == synced[-1], synced

    _in_a_cluster(tmp_path, body)
