"""``fs3 admin dump | load | backup``: metadata backups, straight from meta's store.

These read (or, to load, write) the store a meta config names (``--meta-config``; a local
cluster's ``--dir``: its first meta's), as ``juicefs dump`` reads its metadata engine, not
through a meta server: a dump needs one snapshot of the whole store, which no request of the
meta protocol holds, and a load must find the store empty, before any server runs on it.

* RocksDB: a dump opens a read-only view beside the running meta (:meth:`RocksKVStore.open_view`);
  a load opens the store itself, so it is refused while a meta server holds it.
* PostgreSQL: one ``REPEATABLE READ`` read-only transaction; a load into an empty database.

``backup --backup-dir`` and ``load``'s file may also be an ``fs3://`` URL: a directory (a file)
of an fs3 cluster, written (read) through the client API, no mount (:mod:`fs3.meta.backup_fs3`;
``fs3:///PATH`` is the cluster of the cluster options).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fs3.common.errors import FS3Error, InvalidArgument, IoError
from fs3.kv.api import SnapshotReader

if TYPE_CHECKING:
    from fs3.client.fs import AsyncFileSystem

__all__ = ["META_BACKUP_COMMANDS", "add_meta_backup_commands", "run_meta_backup_command"]

META_BACKUP_COMMANDS = frozenset({"dump", "load", "backup"})
log = logging.getLogger(__name__)


def add_meta_backup_commands(admin_sub: Any) -> None:
    """The three subcommands, on ``fs3 admin``'s subparsers."""
    meta_config = argparse.ArgumentParser(add_help=False)
    meta_config.add_argument("--meta-config", help="the meta server's config (TOML) naming its store "
                             "(default with --dir: the local cluster's first meta)")
    dump = admin_sub.add_parser("dump", parents=[meta_config],
                                help="write a consistent snapshot of the metadata (docs/operations.md)")
    dump.add_argument("--out", default="-", help="file to write (atomically), or - for stdout (default)")
    dump.add_argument("--page-records", type=int, default=1000, help="pairs read per page (memory bound)")
    load = admin_sub.add_parser("load", parents=[meta_config],
                                help="load a dump into an EMPTY meta store (before its meta server starts)")
    load.add_argument("file", help="the dump file, or fs3://CLUSTER/PATH of one kept in a (running) fs3 cluster")
    load.add_argument("--batch-records", type=int, default=500, help="pairs written per transaction")
    backup = admin_sub.add_parser("backup", parents=[meta_config],
                                  help="dump into a directory, keeping the newest K; --every-s to repeat")
    backup.add_argument("--backup-dir", required=True,
                        help="directory for the backups: local (or on an fs3 mount), or fs3:///PATH in the cluster of "
                        "the cluster options (fs3://HOST:PORT/PATH, fs3://PROFILE@/PATH: another), no mount needed; "
                        "keep a copy outside the cluster too (docs/operations.md)")
    backup.add_argument("--keep", type=int, default=7, help="backups kept (the oldest are removed after a new one)")
    backup.add_argument("--every-s", type=float, default=0.0, help="repeat every this many seconds (0: once)")
    backup.add_argument("--page-records", type=int, default=1000, help="pairs read per page (memory bound)")


def _meta_config(args: argparse.Namespace) -> Any:
    from fs3.cluster.topology import META
    from fs3.common.config import load_config
    from fs3.meta.server import MetaConfig

    path = args.meta_config
    if path is None and getattr(args, "dir", None):
        path = str(Path(args.dir) / META / "meta.toml")
    if path is None:
        raise InvalidArgument(f"fs3 admin {args.command} needs --meta-config (the meta server's TOML) or --dir")
    if not Path(path).is_file():
        raise InvalidArgument(f"{path}: no such meta config")
    return load_config(MetaConfig, path, env_prefix="FS3_META")


Take = Callable[[], Awaitable[SnapshotReader]]


async def _snapshot_source(config: Any) -> tuple[Take, Callable[[], Awaitable[None]]]:
    """How to take a snapshot of the store ``config`` names, and how to let the engine go."""
    if config.kv_engine == "postgres":
        from fs3.kv.postgres import PostgresTxnEngine

        pg = await PostgresTxnEngine.open(config.postgres_config())
        return pg.snapshot, pg.close
    if config.kv_engine != "rocksdb":
        raise InvalidArgument(f"kv_engine {config.kv_engine!r} keeps nothing to dump")
    from fs3.kv.store import RocksKVStore
    from fs3.kv.txn import StoreSnapshot

    path = Path(config.data_dir) / "kv"

    async def take() -> SnapshotReader:
        return StoreSnapshot(RocksKVStore.open_view(path))

    async def nothing() -> None:
        return None

    return take, nothing


async def run_meta_backup_command(args: argparse.Namespace) -> int:
    config = _meta_config(args)
    if args.command == "load":
        from fs3.meta.backup import load_dump
        from fs3.meta.server import open_engine

        # The copy out of fs3 comes first: the store is opened only once the whole dump is here, so a
        # backup that cannot be read (kept in the very cluster whose meta is stopped for this load)
        # fails before the store is touched, and names why.
        async with _local_copy(args) as path:
            try:
                engine, close = await open_engine(config)
            except IoError as exc:
                raise IoError(f"{exc.message} (a meta server running on this store holds it: stop it first)") from None
            try:
                stats = await load_dump(engine, path, args.batch_records)
            finally:
                await close()
        if stats.cluster_id != config.cluster_id:
            log.warning("the dump was taken of cluster %r, loaded into cluster %r", stats.cluster_id,
                        config.cluster_id)
        print(f"loaded {stats.records} records in {stats.batches} batches: "
              + ", ".join(f"{n} {kind}" for kind, n in sorted(stats.counts.items())))
        return 0
    take, close = await _snapshot_source(config)
    try:
        if args.command == "dump":
            return await _dump(take, args, config.cluster_id)
        return await _backups(take, args, config.cluster_id)
    finally:
        await close()


@contextlib.asynccontextmanager
async def _connected(args: argparse.Namespace, url: str) -> AsyncIterator[tuple[AsyncFileSystem, Any]]:
    """A client of the cluster ``url`` names (``fs3:///``: the cluster options'), and the parsed URL."""
    from fs3.cli.cluster import client_tls, resolve_cluster, resolve_token
    from fs3.client.fs import ClientConfig, connect
    from fs3.meta.backup_fs3 import parse_fs3_url

    where = parse_fs3_url(url)
    if where.profile:
        fs = await connect(profile=where.profile, rpc_timeout_ms=args.timeout_ms)
    else:
        config = ClientConfig(transport=args.transport, tls=client_tls(args), rpc_timeout_ms=args.timeout_ms)
        if where.mgmtd:
            fs = await connect(where.mgmtd, resolve_token(args), config)
        else:
            mgmtd, token = resolve_cluster(args)
            fs = await connect(mgmtd, token, config)
    try:
        yield fs, where
    finally:
        await fs.close()


@contextlib.asynccontextmanager
async def _local_copy(args: argparse.Namespace) -> AsyncIterator[Path]:
    """The dump to load as a local file: ``args.file`` itself, or a copy of the fs3 file it names
    (in a private temporary directory, removed after)."""
    from fs3.meta.backup_fs3 import copy_to_local, is_fs3_url

    if not is_fs3_url(args.file):
        if not Path(args.file).is_file():
            # Before the store is opened: a mistyped name must not make (or lock) a store first.
            raise InvalidArgument(f"{args.file}: no such dump file (load reads a file twice, so not a pipe)")
        yield Path(args.file)
        return
    with tempfile.TemporaryDirectory(prefix="fs3-load-") as scratch:
        try:
            async with _connected(args, args.file) as (fs, where):
                local = await copy_to_local(fs, where.path, Path(scratch))
        except InvalidArgument:
            raise
        except (FS3Error, OSError) as exc:
            raise IoError(f"cannot read {args.file}: {exc} (a load needs the cluster that keeps the backup "
                          "running; a backup kept in the cluster being restored cannot be read while its "
                          "meta is stopped: copy it out first, or load a local copy)") from None
        yield local


async def _dump(take: Callable[[], Awaitable[SnapshotReader]], args: argparse.Namespace, cluster_id: str) -> int:
    from fs3.meta.backup import dump_to_file, dump_to_stream

    if args.out == "-":
        stats = await dump_to_stream(await take(), sys.stdout.buffer, cluster_id, args.page_records)
        sys.stdout.buffer.flush()
    else:
        stats = await dump_to_file(await take(), Path(args.out), cluster_id, args.page_records)
    print(f"dumped {sum(stats.counts.values())} records in {stats.pages} pages"
          + (f" ({stats.open_removed} files removed while open, dumped as GC jobs)" if stats.open_removed else ""),
          file=sys.stderr)
    return 0


async def _backups(take: Callable[[], Awaitable[SnapshotReader]], args: argparse.Namespace, cluster_id: str) -> int:
    from fs3.meta.backup import BackupDir, LocalBackupDir, backup_to
    from fs3.meta.backup_fs3 import Fs3BackupDir, backup_dir_location, is_fs3_url

    if args.every_s < 0:
        raise InvalidArgument("--every-s must not be negative")
    if args.keep < 1 or args.page_records < 1:  # refused now, not logged at every interval of a loop
        raise InvalidArgument(f"--keep and --page-records must be at least 1, got {args.keep} and "
                              f"{args.page_records}")
    if is_fs3_url(args.backup_dir):
        backup_dir_location(args.backup_dir)  # a bad URL refused now, not logged at every interval of a loop
    while True:
        started = time.monotonic()
        try:
            if is_fs3_url(args.backup_dir):
                async with _connected(args, args.backup_dir) as (fs, where):
                    directory: BackupDir = Fs3BackupDir(fs, where)
                    name, removed = await backup_to(take, directory, args.keep, cluster_id, args.page_records)
            else:
                directory = LocalBackupDir(Path(args.backup_dir))
                name, removed = await backup_to(take, directory, args.keep, cluster_id, args.page_records)
            print(f"backup {directory.location(name)} written" + (f"; removed {len(removed)} older" if removed else ""),
                  flush=True)
        except Exception as exc:
            if not args.every_s:
                raise
            log.error("backup failed (next in %.0f s): %s", args.every_s, exc)  # a loop outlives one failure
        if not args.every_s:
            return 0
        await asyncio.sleep(max(0.0, args.every_s - (time.monotonic() - started)))
