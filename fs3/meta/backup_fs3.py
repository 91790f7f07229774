"""Metadata backups kept inside an fs3 cluster, written through the client API (no mount).

``fs3 admin backup --backup-dir fs3:///backups/meta`` (and ``fs3 admin load fs3://...``) name a
directory of a cluster by URL, as fsspec does (:mod:`fs3.client.fsspec_impl`):

* ``fs3:///PATH``: the cluster the command's cluster options name (``--dir``, ``--mgmtd``, the token);
* ``fs3://HOST:PORT/PATH``: the cluster whose mgmtd listens there (token from the options or ``$FS3_TOKEN``);
* ``fs3://NAME@/PATH``: the cluster of profile NAME.

A backup is written as ``NAME.dump.TOKEN.tmp`` (a name of this writer's alone, made with
``O_EXCL``; mode 0600: the dump holds the user table's secret hashes), synced (``fsync``: its
chunks acknowledged by every replica, its length committed in meta) at least every
:data:`~fs3.meta.backup.TMP_TOUCH_S` (which moves its mtime: another run sees a writer at work)
and at the end, closed, then renamed to ``NAME.dump``; so a file under its final name is a whole
dump, as in a local directory. Older backups are removed only after that
(:func:`fs3.meta.backup.backup_to`), and emptied from the trash at once (a cluster with
``trash_days`` would otherwise keep every removed backup, each a copy of the namespace and of
the user table's hashes, for days: ``--keep`` would bound nothing).

A backup kept in the cluster it backs up is lost with that cluster's metadata (it is a file of
the namespace it saves): keep a copy elsewhere too (a local path, another cluster).
"""

from __future__ import annotations

import contextlib
import os
import stat as stat_mod
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fs3.client.files import AsyncFile
from fs3.client.fs import AsyncFileSystem
from fs3.client.meta import path_ref
from fs3.client.profiles import check_profile_name
from fs3.common.errors import InvalidArgument, NotFound
from fs3.kv.api import SnapshotReader
from fs3.meta.backup import TMP_TOUCH_S, temporary_name
from fs3.meta.dump import DumpStats, dump_snapshot

__all__ = ["FS3_URL_PREFIX", "Fs3BackupDir", "Fs3Location", "backup_dir_location", "copy_to_local", "is_fs3_url",
           "parse_fs3_url"]

FS3_URL_PREFIX = "fs3://"
# Bytes gathered before one write to the fs3 file (a dump is many short lines).
_WRITE_PIECE = 1 << 20


def is_fs3_url(text: str) -> bool:
    """Whether ``text`` names a place in an fs3 cluster (``fs3:...``) rather than a local path."""
    return text.startswith("fs3:")


@dataclass(frozen=True)
class Fs3Location:
    """A parsed ``fs3://`` URL: which cluster (``mgmtd`` or ``profile``; neither: the command's
    cluster options) and the absolute path in it."""

    mgmtd: str
    profile: str
    path: str

    def url(self, path: str | None = None) -> str:
        authority = f"{self.profile}@" if self.profile else self.mgmtd
        return f"{FS3_URL_PREFIX}{authority}{self.path if path is None else path}"


def parse_fs3_url(text: str) -> Fs3Location:
    """``fs3:///PATH``, ``fs3://HOST:PORT/PATH`` or ``fs3://NAME@/PATH``; anything else is an
    InvalidArgument that says what is expected."""
    expected = "expected fs3:///PATH (the cluster of the cluster options), fs3://HOST:PORT/PATH or fs3://NAME@/PATH"
    if not text.startswith(FS3_URL_PREFIX):
        raise InvalidArgument(f"bad fs3 URL {text!r}: {expected}")
    authority, slash, path = text[len(FS3_URL_PREFIX):].partition("/")
    if not slash:
        raise InvalidArgument(f"bad fs3 URL {text!r}: no path; {expected}")
    parts = [part for part in path.split("/") if part]  # a//b is a/b, as in a POSIX path
    if any(part in (".", "..") for part in parts):
        raise InvalidArgument(f"bad fs3 URL {text!r}: '.' and '..' are not allowed in the path")
    path = "/" + "/".join(parts)
    profile, at, host_port = authority.rpartition("@")
    if at and (host_port or not profile or ":" in profile):
        raise InvalidArgument(f"bad fs3 URL {text!r}: a profile URL is fs3://NAME@/PATH (no host, no password)")
    if at:
        try:
            check_profile_name(profile)
        except InvalidArgument as exc:
            raise InvalidArgument(f"bad fs3 URL {text!r}: {exc.message}") from None
    if host_port:
        host, colon, port = host_port.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise InvalidArgument(f"bad fs3 URL {text!r}: the cluster is HOST:PORT (its mgmtd); {expected}")
    return Fs3Location(mgmtd=host_port, profile=profile, path=path)


def backup_dir_location(text: str) -> Fs3Location:
    """The directory ``--backup-dir`` names by an fs3 URL: not the root, whose every entry each
    backup would list (a directory of the backups' own keeps that listing short)."""
    where = parse_fs3_url(text)
    if where.path == "/":
        raise InvalidArgument(f"{text}: backups go in a directory of their own below the root, "
                              f"e.g. {where.url('/backups/meta')}")
    return where


class Fs3BackupDir:
    """A directory of an fs3 cluster, written through ``fs`` (a :class:`~fs3.meta.backup.BackupDir`)."""

    def __init__(self, fs: AsyncFileSystem, location: Fs3Location) -> None:
        if location.path == "/":
            raise InvalidArgument("backups go in a directory of their own below the root")
        self.fs = fs
        self.where = location
        self.directory = location.path.rstrip("/") or "/"

    def _path(self, name: str) -> str:
        return f"{self.directory.rstrip('/')}/{name}"

    def location(self, name: str) -> str:
        return self.where.url(self._path(name))

    async def prepare(self) -> None:
        await self.fs.makedirs(self.directory, mode=0o700, exist_ok=True)

    async def names(self) -> list[str]:
        return [entry.name for entry in await self.fs.scandir(self.directory)
                if entry.is_file(follow_symlinks=False)]

    async def mtime_ns(self, name: str) -> int | None:
        try:
            return (await self.fs.lstat(self._path(name))).st_mtime_ns
        except FileNotFoundError:
            return None

    async def write(self, name: str, reader: SnapshotReader, cluster_id: str, page_records: int) -> DumpStats:
        tmp_name = temporary_name(name)
        tmp, final = self._path(tmp_name), self._path(name)
        try:
            # O_EXCL on a name of this writer's alone: nothing another run writes is removed or renamed.
            out = await self.fs.open(tmp, "xb", perms=0o600)
        except BaseException:
            await reader.close()
            raise
        try:
            stats = await _dump_into(reader, out, cluster_id, page_records)
            await out.fsync()
            await out.close()
            await self.fs.rename(tmp, final)
        except BaseException:
            with contextlib.suppress(Exception):
                await out.close()
            with contextlib.suppress(Exception):  # the error raised is the one that matters
                await self.remove(tmp_name)
            raise
        return stats

    async def remove(self, name: str) -> None:
        """Remove ``name`` and empty its trash entry (when the cluster keeps a trash): a removed
        backup must not live on, taking space and holding the namespace, for ``trash_days``."""
        try:
            inode_id = await self.fs.metadata.remove(path_ref(self._path(name).encode()))
        except NotFound:
            return
        with contextlib.suppress(NotFound):  # no trash, or purged already (another run)
            await self.fs.metadata.trash_purge(inode_id)


async def _dump_into(reader: SnapshotReader, out: AsyncFile, cluster_id: str, page_records: int) -> DumpStats:
    """Dump ``reader`` (closed after) into ``out`` in pieces of :data:`_WRITE_PIECE` bytes, synced
    at least every :data:`~fs3.meta.backup.TMP_TOUCH_S` (its mtime: a writer at work)."""
    pending = bytearray()
    synced = time.monotonic()

    async def emit(line: bytes) -> None:
        nonlocal synced
        pending.extend(line)
        if len(pending) >= _WRITE_PIECE:
            await out.write(bytes(pending))
            pending.clear()
            if time.monotonic() - synced >= TMP_TOUCH_S:
                await out.fsync()
                synced = time.monotonic()

    try:
        stats = await dump_snapshot(reader, emit, cluster_id, time.time_ns() // 1_000_000, page_records)
    finally:
        await reader.close()
    if pending:
        await out.write(bytes(pending))
    return stats


async def copy_to_local(fs: AsyncFileSystem, path: str, directory: Path) -> Path:
    """Copy the fs3 file ``path`` into a new file (mode 0600) in the local ``directory``, in pieces:
    a load reads its file twice, and must read the same bytes both times."""
    st = await fs.stat(path)
    if not stat_mod.S_ISREG(st.st_mode):
        raise InvalidArgument(f"{path}: not a regular file")
    fd, name = tempfile.mkstemp(prefix="fs3-load-", suffix=".dump", dir=directory)
    try:
        src = await fs.open(path, "rb")
        try:
            with os.fdopen(fd, "wb") as dst:
                while piece := await src.read(_WRITE_PIECE):
                    dst.write(piece)
        finally:
            await src.close()
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    return Path(name)
