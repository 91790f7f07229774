"""The asyncio file-system API: ``fs = await fs3.aio.connect("host:port", token=...)``.

Methods mirror :mod:`os` (``stat``, ``listdir``, ``mkdir``, ``rename`` ...) and raise the same
``OSError`` subclasses with the same errno as a local file system would. Paths are absolute in
the fs3 namespace (a relative path is taken from the root). ``open`` returns an
:class:`~fs3.client.files.AsyncFile`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import stat as stat_mod
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fs3 import meta_pb2 as mpb
from fs3.client import forking
from fs3.client.closes import SessionCloses
from fs3.client.files import AsyncFile
from fs3.client.meta import Meta, path_ref
from fs3.client.meta_client import MetaClient
from fs3.client.oserrors import os_errors
from fs3.client.profiles import ClusterSettings, resolve
from fs3.client.read_many import BatchReadMetrics, read_many
from fs3.client.routing import RoutingCache
from fs3.client.storage_client import StorageClient, StorageClientConfig
from fs3.common.clock import Clock
from fs3.common.metrics import ClientMetrics, MetricsEndpoint, start_metrics_endpoint
from fs3.common.posix import O_APPEND, O_CREAT, O_EXCL, O_RDONLY, O_RDWR, O_TRUNC, O_WRONLY
from fs3.rpc.auth import parse_user_token
from fs3.rpc.channel import RealChannelFactory, Transport
from fs3.rpc.tls import TlsConfig

__all__ = ["KIND_OF_MODE", "TYPE_BITS", "AsyncFileSystem", "ClientConfig", "DirEntry", "client_config", "connect",
           "connect_settings", "open_flags", "stat_result"]

# The largest size a truncate can ask for (a file's size is a signed 64-bit offset to the kernel and
# POSIX); meta refuses any size past its file's layout with EFBIG.
_SIZE_MAX = (1 << 63) - 1

PathLike = str | bytes | os.PathLike[str] | os.PathLike[bytes]

# Inode type <-> the S_IFMT bits of st_mode (used by the API, the VFS and the FUSE adapter).
TYPE_BITS = {
    mpb.FILE: stat_mod.S_IFREG, mpb.DIRECTORY: stat_mod.S_IFDIR, mpb.SYMLINK: stat_mod.S_IFLNK,
    mpb.FIFO: stat_mod.S_IFIFO, mpb.SOCKET: stat_mod.S_IFSOCK, mpb.CHAR_DEVICE: stat_mod.S_IFCHR,
    mpb.BLOCK_DEVICE: stat_mod.S_IFBLK,
}
KIND_OF_MODE: dict[int, mpb.InodeType] = {
    stat_mod.S_IFREG: mpb.FILE, stat_mod.S_IFIFO: mpb.FIFO, stat_mod.S_IFSOCK: mpb.SOCKET,
    stat_mod.S_IFCHR: mpb.CHAR_DEVICE, stat_mod.S_IFBLK: mpb.BLOCK_DEVICE, 0: mpb.FILE,
}
ST_DEV = 0xF53


@dataclass
class ClientConfig:
    transport: Transport = "framed"
    rpc_timeout_ms: int = 10_000
    retry_total_ms: int = 60_000
    inflight_per_file: int = 8
    # Identity sent to meta (default: a user token's, which meta tells; else this process's). With a
    # user token meta refuses any identity but the token's (EPERM).
    uid: int | None = None
    gid: int | None = None
    groups: list[int] | None = None
    umask: int | None = None         # applied to created files and directories (default: the process umask)
    storage: StorageClientConfig = field(default_factory=StorageClientConfig)
    tls: TlsConfig | None = None     # mutual TLS to every service: the CA and this client's certificate
    # This client's /metrics endpoint (bytes, caches, process; a mount adds its FUSE operations):
    # a port (0: any free one, see ``AsyncFileSystem.metrics_address``); -1: none.
    metrics_port: int = -1
    metrics_host: str = "127.0.0.1"

    def for_another_process(self) -> ClientConfig:
        """This config for a copy of the client in another process (a forked child, an unpickled
        copy in a ``spawn`` worker): a fixed metrics port is the first process's — binding it again
        failed with EADDRINUSE while that one ran, so every call of the copy failed — and the copy
        serves no endpoint of its own; port 0 (any free one) stays."""
        return dataclasses.replace(self, metrics_port=-1) if self.metrics_port > 0 else self


def stat_result(inode: mpb.Inode) -> os.stat_result:
    """An ``os.stat_result`` for an inode (times in seconds and nanoseconds)."""
    mode = TYPE_BITS.get(inode.type, 0) | inode.mode
    blksize = inode.layout.chunk_size if inode.type == mpb.FILE and inode.layout.chunk_size else 4096
    return os.stat_result(
        (mode, inode.inode_id, ST_DEV, inode.nlink, inode.uid, inode.gid, inode.size,
         inode.atime_ns // 1_000_000_000, inode.mtime_ns // 1_000_000_000, inode.ctime_ns // 1_000_000_000),
        {"st_atime": inode.atime_ns / 1e9, "st_mtime": inode.mtime_ns / 1e9, "st_ctime": inode.ctime_ns / 1e9,
         "st_atime_ns": inode.atime_ns, "st_mtime_ns": inode.mtime_ns, "st_ctime_ns": inode.ctime_ns,
         "st_blksize": blksize, "st_blocks": -(-inode.size // 512), "st_rdev": inode.rdev})


def open_flags(mode: str) -> tuple[int, bool, bool, bool]:
    """``(flags, readable, writable, append)`` for a Python ``open`` mode string."""
    chars = set(mode)
    if not chars <= set("rwaxbt+") or len(mode) != len(chars) or len(chars & set("rwax")) != 1 \
            or {"b", "t"} <= chars:
        raise ValueError(f"invalid mode: {mode!r}")
    plus = "+" in chars
    if "r" in chars:
        flags = O_RDWR if plus else O_RDONLY
    elif "w" in chars:
        flags = (O_RDWR if plus else O_WRONLY) | O_CREAT | O_TRUNC
    elif "a" in chars:
        flags = (O_RDWR if plus else O_WRONLY) | O_CREAT | O_APPEND
    else:
        flags = (O_RDWR if plus else O_WRONLY) | O_CREAT | O_EXCL
    readable = "r" in chars or plus
    writable = "r" not in chars or plus
    return flags, readable, writable, "a" in chars


def _bytes_path(path: PathLike) -> bytes:
    raw = os.fsencode(path)
    if b"\x00" in raw:
        raise ValueError("embedded null byte")
    return raw if raw.startswith(b"/") else b"/" + raw


@dataclass(frozen=True)
class DirEntry:
    """Like ``os.DirEntry``: name, path, inode and the attributes read with the listing."""

    name: str
    path: str
    inode_id: int
    attrs: mpb.Inode

    def inode(self) -> int:
        return self.inode_id

    def is_dir(self, follow_symlinks: bool = True) -> bool:
        return self.attrs.type == mpb.DIRECTORY

    def is_file(self, follow_symlinks: bool = True) -> bool:
        return self.attrs.type == mpb.FILE

    def is_symlink(self) -> bool:
        return self.attrs.type == mpb.SYMLINK

    def stat(self, follow_symlinks: bool = True) -> os.stat_result:
        return stat_result(self.attrs)


class AsyncFileSystem:
    """A connection to one fs3 cluster (routing, meta and storage clients) for asyncio code.

    ``metadata`` (:class:`~fs3.client.meta.Meta`) is the one way to metadata, for this API, its
    open files and the VFS; ``meta`` is the transport under it (request ids, retries, the lease).
    Every public method turns ``FS3Error`` into the ``OSError`` a local file system would raise.
    """

    def __init__(self, mgmtd: str | list[str], token: str | None = None, config: ClientConfig | None = None,
                 clock: Clock | None = None) -> None:
        """``clock`` (monotonic; the event loop's by default) times retries and the lease."""
        self.config = config or ClientConfig()
        self._addresses = [mgmtd] if isinstance(mgmtd, str) else list(mgmtd)
        self._clock = clock
        if self.config.transport == "grpc" and forking.grpc_inherited():
            raise forking.ForkedGrpcError()
        self._connect(RealChannelFactory(token, self.config.transport, self.config.tls))
        self._user_token = bool(token and parse_user_token(token))
        # The identity a user token binds (meta's answer to WhoAmI at start); None: not bound.
        self.bound_user: mpb.User | None = None
        if self.config.umask is None:
            current = os.umask(0)
            os.umask(current)
            self.umask = current
        else:
            self.umask = self.config.umask
        self._closed = False
        # inode -> this client's open handles on it (and the writable ones): handles of one file
        # see each other's writes and size changes, as descriptors of a local file do. Weak: a
        # handle dropped without close is not kept alive (nor its length counted) by this table.
        self._open_files: dict[int, weakref.WeakSet[AsyncFile]] = {}
        self._open_writers: dict[int, weakref.WeakSet[AsyncFile]] = {}
        # Kept always (a counter step per call); served once start() opens the endpoint.
        self.metrics = ClientMetrics()
        self.batch_read_metrics = BatchReadMetrics(self.metrics.registry)
        self._metrics_endpoint: MetricsEndpoint | None = None
        forking.register(self)

    def _connect(self, channels: RealChannelFactory) -> None:
        """The connection to the cluster, under a new client id: channels, routing, meta, storage."""
        self.client_id = os.urandom(16)
        self.channels = channels
        self.routing = RoutingCache(self._addresses, self.channels, self.config.rpc_timeout_ms)
        self.storage = StorageClient(self.routing, self.channels, self.client_id, self.config.storage)
        self.meta = MetaClient(self.routing, self.channels, self.client_id, self._user,
                               self.config.rpc_timeout_ms, self.config.retry_total_ms, self._clock)
        self.metadata = Meta(self.meta)
        self.session_closes = SessionCloses(self.metadata)

    def _after_fork_in_child(self) -> None:
        """In a forked child: leave the parent's connections, sessions and lease to the parent and
        connect anew, lazily, under a client id of this process's own (see :mod:`fs3.client.forking`).

        Nothing is sent here (the child has no running loop yet): the first call registers the new
        id, and starts the lease if the parent's client kept one. Handles the parent opened fail
        from now on in this process (``EBADF``); the same token and TLS material are used.
        """
        for handles in self._open_files.values():
            for afile in handles:
                afile.forked()
        self._open_files, self._open_writers = {}, {}
        old = self.channels
        forking.keep_inherited(old, self.routing, self.storage, self.meta)
        lease_wanted = self.meta.lease_started
        forking.keep_inherited(self._metrics_endpoint)  # the parent's server: its thread is not here
        self._metrics_endpoint = None
        self.config = self.config.for_another_process()
        if old.transport == "grpc":
            forking.note_grpc()
            self._connect(forking.RefusingChannels(old.token, old.transport, old.tls))
        else:
            self._connect(RealChannelFactory(old.token, old.transport, old.tls))
        if lease_wanted and not self._closed:
            self.meta.resume_lease_lazily()

    def _user(self) -> mpb.User:
        config = self.config
        bound = self.bound_user
        if bound is not None:  # a user token: what the config leaves out is the token's
            return mpb.User(uid=bound.uid if config.uid is None else config.uid,
                            gid=bound.gid if config.gid is None else config.gid,
                            groups=bound.groups if config.groups is None else config.groups)
        uid = os.getuid() if config.uid is None else config.uid
        gid = os.getgid() if config.gid is None else config.gid
        groups = os.getgroups() if config.groups is None and config.uid is None else (config.groups or [])
        return mpb.User(uid=uid, gid=gid, groups=groups)

    async def start(self) -> AsyncFileSystem:
        await self.routing.refresh()
        if self._user_token:
            who = await self.metadata.who_am_i()
            self.bound_user = who.user if who.bound else None
        await self.metadata.renew()
        self.metadata.start_lease()
        if self.config.metrics_port >= 0 and self._metrics_endpoint is None:
            self._metrics_endpoint = start_metrics_endpoint(self.metrics.registry, self.config.metrics_host,
                                                            self.config.metrics_port)
        return self

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of this client's /metrics endpoint (None when it serves none)."""
        endpoint = self._metrics_endpoint
        return f"{self.config.metrics_host}:{endpoint.port}" if endpoint is not None else None

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._metrics_endpoint is not None:
            # In a thread: the HTTP server notices the shutdown at its next poll (up to half a second).
            await asyncio.to_thread(self._metrics_endpoint.close)
            self._metrics_endpoint = None
        await self.session_closes.drain()
        await self.metadata.stop()
        await self.channels.close()

    async def __aenter__(self) -> AsyncFileSystem:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- this client's open files ----------------------------------------------------------------

    def track_file(self, afile: AsyncFile) -> None:
        """A handle was opened (called by :class:`AsyncFile` itself)."""
        self._open_files.setdefault(afile.inode.inode_id, weakref.WeakSet()).add(afile)
        if afile.writable:
            self._open_writers.setdefault(afile.inode.inode_id, weakref.WeakSet()).add(afile)

    def untrack_file(self, afile: AsyncFile) -> None:
        """A handle was closed."""
        for table in (self._open_files, self._open_writers):
            handles = table.get(afile.inode.inode_id)
            if handles is not None:
                handles.discard(afile)
                if not handles:
                    del table[afile.inode.inode_id]

    def open_files(self, inode_id: int) -> list[AsyncFile]:
        """This client's open handles on an inode."""
        return list(self._open_files.get(inode_id, ()))

    def open_writers(self, inode_id: int) -> list[AsyncFile]:
        """This client's handles open for writing on an inode, less those of a lapsed lease: their
        unsent bytes are lost (every call on them fails), so nobody may wait on them or see them."""
        return [f for f in self._open_writers.get(inode_id, ()) if not f.stale]

    async def settle_writers(self, inode_id: int) -> None:
        """Before the file's size changes: every write of this client's handles lands on storage
        and meta learns how far they reach (see :meth:`AsyncFile.settle`).

        A length the quotas refuse (``EDQUOT``: a handle that wrote without a byte credit, see
        fs3.meta.quota) is left for the handle's close to publish, and the size change goes on:
        with the file open, the truncate clears storage from its new size on and charges its own
        growth, so nothing the refused length covered escapes the quota; refusing it would leave
        the handle no way to give the bytes up but a close."""
        for afile in self.open_writers(inode_id):
            try:
                await afile.settle()
            except OSError as exc:
                if exc.errno != errno.EDQUOT:
                    raise

    def size_changed(self, inode_id: int, size: int) -> None:
        """The file's size was set (truncate, ``O_TRUNC``): every open handle forgets the old end."""
        for afile in self.open_files(inode_id):
            afile.set_known_length(size)

    def with_local_length(self, inode: mpb.Inode) -> mpb.Inode:
        """The inode with the size this client's writers know when it is larger than meta's
        (meta learns a handle's length at flush, fsync and close)."""
        writers = self.open_writers(inode.inode_id)
        if writers:
            longest = max(f.length for f in writers)
            if longest > inode.size:
                inode = mpb.Inode.FromString(inode.SerializeToString())
                inode.size = longest
        return inode

    async def _settle_path(self, path: PathLike) -> None:
        """Settle this client's writers of the file ``path`` names, if it has any open at all."""
        if not self._open_writers:
            return
        try:
            inode = await self._inode(path)
        except OSError:
            return  # the operation that follows reports it
        await self.settle_writers(inode.inode_id)

    # -- attributes ------------------------------------------------------------------------------

    async def _inode(self, path: PathLike, follow: bool = True) -> mpb.Inode:
        with os_errors(path):
            return await self.metadata.lookup(path_ref(_bytes_path(path)), follow=follow)

    async def stat(self, path: PathLike, follow_symlinks: bool = True) -> os.stat_result:
        return stat_result(self.with_local_length(await self._inode(path, follow_symlinks)))

    async def lstat(self, path: PathLike) -> os.stat_result:
        return await self.stat(path, follow_symlinks=False)

    async def exists(self, path: PathLike) -> bool:
        try:
            await self._inode(path)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def isdir(self, path: PathLike) -> bool:
        try:
            return (await self._inode(path)).type == mpb.DIRECTORY
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def isfile(self, path: PathLike) -> bool:
        try:
            return (await self._inode(path)).type == mpb.FILE
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def islink(self, path: PathLike) -> bool:
        try:
            return (await self._inode(path, follow=False)).type == mpb.SYMLINK
        except (FileNotFoundError, NotADirectoryError):
            return False

    async def statvfs(self, path: PathLike = "/") -> os.statvfs_result:
        """As ``os.statvfs``; inside a directory with a quota, the quota's size and free space."""
        with os_errors(path):
            inode_id = (await self._inode(path, follow=True)).inode_id
            rsp = await self.metadata.statfs(inode_id=inode_id)
        block = 4096
        files, free_files = 1 << 40, (1 << 40) - rsp.inodes_allocated
        if rsp.inodes_limit:
            files, free_files = rsp.inodes_limit, max(0, rsp.inodes_limit - rsp.inodes_used)
        return os.statvfs_result((block, block, rsp.capacity_bytes // block, rsp.free_bytes // block,
                                  rsp.free_bytes // block, files, free_files, free_files, 0, rsp.name_max))

    # -- directories -----------------------------------------------------------------------------

    async def iter_entries(self, path: PathLike = "/", with_attrs: bool = True,
                           page: int = 1000) -> AsyncIterator[mpb.DirEntry]:
        """Every entry of a directory, fetched in pages (a consistent resume point per page)."""
        raw = _bytes_path(path)
        start_after = b""
        while True:
            with os_errors(path):
                listed = await self.metadata.read_dir(path_ref(raw), start_after=start_after, limit=page,
                                                      with_attrs=with_attrs)
            for entry in listed.entries:
                yield entry
            if not listed.more or not listed.entries:
                return
            start_after = listed.entries[-1].name

    async def listdir(self, path: PathLike = "/") -> list[str]:
        return [os.fsdecode(e.name) async for e in self.iter_entries(path, with_attrs=False)]

    async def scandir(self, path: PathLike = "/") -> list[DirEntry]:
        base = os.fsdecode(path).rstrip("/")
        return [DirEntry(os.fsdecode(e.name), f"{base}/{os.fsdecode(e.name)}", e.inode_id, e.attrs)
                async for e in self.iter_entries(path)]

    async def walk(self, top: PathLike = "/", topdown: bool = True) -> AsyncIterator[tuple[str, list[str], list[str]]]:
        top_s = os.fsdecode(top)
        try:
            entries = await self.scandir(top_s)
        except OSError:
            return
        dirs = [e.name for e in entries if e.is_dir()]
        files = [e.name for e in entries if not e.is_dir()]
        if topdown:
            yield top_s, dirs, files
        for name in dirs:
            async for item in self.walk(f"{top_s.rstrip('/')}/{name}", topdown):
                yield item
        if not topdown:
            yield top_s, dirs, files

    async def mkdir(self, path: PathLike, mode: int = 0o777) -> None:
        with os_errors(path):
            await self.metadata.make_node(path_ref(_bytes_path(path)), mpb.DIRECTORY, mode=mode & ~self.umask)

    async def makedirs(self, path: PathLike, mode: int = 0o777, exist_ok: bool = False) -> None:
        parts = [p for p in os.fsdecode(path).split("/") if p]
        current = ""
        for index, part in enumerate(parts):
            current += "/" + part
            try:
                await self.mkdir(current, mode)
            except FileExistsError:
                if index == len(parts) - 1 and not exist_ok:
                    raise
                if not await self.isdir(current):
                    raise

    async def rmdir(self, path: PathLike) -> None:
        with os_errors(path):
            await self.metadata.remove(path_ref(_bytes_path(path)), directory=True)

    async def remove(self, path: PathLike) -> None:
        with os_errors(path):
            await self.metadata.remove(path_ref(_bytes_path(path)))

    unlink = remove

    async def rename(self, src: PathLike, dst: PathLike, flags: int = 0) -> None:
        """POSIX rename (replaces ``dst``); ``flags``: ``RENAME_NOREPLACE`` / ``RENAME_EXCHANGE``."""
        with os_errors(src, dst):
            await self.metadata.rename(path_ref(_bytes_path(src)), path_ref(_bytes_path(dst)), flags=flags)

    async def replace(self, src: PathLike, dst: PathLike) -> None:
        await self.rename(src, dst)

    async def link(self, src: PathLike, dst: PathLike) -> None:
        with os_errors(src, dst):
            await self.metadata.link(path_ref(_bytes_path(src)), path_ref(_bytes_path(dst)))

    async def symlink(self, target: PathLike, path: PathLike) -> None:
        with os_errors(path):
            await self.metadata.make_node(path_ref(_bytes_path(path)), mpb.SYMLINK, symlink_target=os.fsencode(target))

    async def readlink(self, path: PathLike) -> str:
        with os_errors(path):
            return os.fsdecode(await self.metadata.read_link(path_ref(_bytes_path(path))))

    async def mknod(self, path: PathLike, mode: int = 0o600, device: int = 0) -> None:
        kind = KIND_OF_MODE.get(stat_mod.S_IFMT(mode))
        if kind is None:
            raise OSError(22, "mknod: unsupported file type", os.fsdecode(path))
        with os_errors(path):
            await self.metadata.make_node(path_ref(_bytes_path(path)), kind, mode=stat_mod.S_IMODE(mode) & ~self.umask,
                                          rdev=device)

    # -- attributes that change ------------------------------------------------------------------

    async def _setattr(self, path: PathLike, follow: bool, mask: int, *, mode: int = 0, uid: int = 0, gid: int = 0,
                       size: int = 0, atime_ns: int = 0, mtime_ns: int = 0) -> mpb.Inode:
        with os_errors(path):
            return await self.metadata.set_attr(path_ref(_bytes_path(path)), mask, follow=follow, mode=mode, uid=uid,
                                                gid=gid, size=size, atime_ns=atime_ns, mtime_ns=mtime_ns)

    async def chmod(self, path: PathLike, mode: int, follow_symlinks: bool = True) -> None:
        await self._setattr(path, follow_symlinks, mask=mpb.SET_MODE, mode=mode)

    async def chown(self, path: PathLike, uid: int, gid: int, follow_symlinks: bool = True) -> None:
        mask = (mpb.SET_UID if uid != -1 else 0) | (mpb.SET_GID if gid != -1 else 0)
        if mask:
            await self._setattr(path, follow_symlinks, mask=mask, uid=max(uid, 0), gid=max(gid, 0))

    async def utime(self, path: PathLike, times: tuple[float, float] | None = None, *,
                    ns: tuple[int, int] | None = None, follow_symlinks: bool = True) -> None:
        if times is not None and ns is not None:
            raise ValueError("utime: you may specify either 'times' or 'ns' but not both")
        if times is None and ns is None:
            await self._setattr(path, follow_symlinks, mask=mpb.SET_ATIME_NOW | mpb.SET_MTIME_NOW)
            return
        if times is not None:
            ns = (int(times[0] * 1e9), int(times[1] * 1e9))
        assert ns is not None
        await self._setattr(path, follow_symlinks, mask=mpb.SET_ATIME | mpb.SET_MTIME, atime_ns=ns[0],
                            mtime_ns=ns[1])

    async def truncate(self, path: PathLike, length: int) -> None:
        if length < 0:
            raise OSError(22, "negative length", os.fsdecode(path))
        if length > _SIZE_MAX:
            raise OSError(errno.EFBIG, f"length {length} exceeds {_SIZE_MAX}, the largest any file may have",
                          os.fsdecode(path))
        await self._settle_path(path)
        inode = await self._setattr(path, True, mask=mpb.SET_SIZE, size=length)
        self.size_changed(inode.inode_id, length)

    async def set_layout(self, path: PathLike, chunk_size: int | None = None, stripe: int | None = None,
                         table_id: int | None = None) -> None:
        """Set a directory's default layout for files created in it from now on."""
        current = (await self._inode(path)).layout
        layout = mpb.Layout(table_id=current.table_id if table_id is None else table_id,
                            chunk_size=current.chunk_size if chunk_size is None else chunk_size,
                            stripe=current.stripe if stripe is None else stripe)
        with os_errors(path):
            await self.metadata.set_layout(path_ref(_bytes_path(path)), layout)

    async def layout(self, path: PathLike) -> mpb.Layout:
        return (await self._inode(path)).layout

    # -- xattrs ----------------------------------------------------------------------------------

    async def getxattr(self, path: PathLike, attribute: str | bytes, *, follow_symlinks: bool = True) -> bytes:
        with os_errors(path):
            return await self.metadata.get_xattr(path_ref(_bytes_path(path)), os.fsencode(attribute),
                                                 follow=follow_symlinks)

    async def setxattr(self, path: PathLike, attribute: str | bytes, value: bytes, flags: int = 0, *,
                       follow_symlinks: bool = True) -> None:
        with os_errors(path):
            await self.metadata.set_xattr(path_ref(_bytes_path(path)), os.fsencode(attribute), bytes(value),
                                          flags=flags, follow=follow_symlinks)

    async def listxattr(self, path: PathLike = "/", *, follow_symlinks: bool = True) -> list[str]:
        with os_errors(path):
            names = await self.metadata.list_xattr(path_ref(_bytes_path(path)), follow=follow_symlinks)
        return [os.fsdecode(n) for n in names]

    async def removexattr(self, path: PathLike, attribute: str | bytes, *, follow_symlinks: bool = True) -> None:
        with os_errors(path):
            await self.metadata.remove_xattr(path_ref(_bytes_path(path)), os.fsencode(attribute),
                                             follow=follow_symlinks)

    # -- files -----------------------------------------------------------------------------------

    async def open(self, path: PathLike, mode: str = "rb", perms: int = 0o666) -> AsyncFile:
        """Open a binary file (``"rb"``, ``"wb"``, ``"ab"``, ``"xb"``, ``"r+b"`` ...)."""
        flags, readable, writable, append = open_flags(mode.replace("t", "") if "b" in mode else mode + "b")
        if flags & O_TRUNC:
            await self._settle_path(path)
        with os_errors(path):
            rsp = await self.metadata.open(path_ref(_bytes_path(path)), flags, mode=perms & ~self.umask)
        if rsp.inode.type == mpb.DIRECTORY:
            raise IsADirectoryError(21, "Is a directory", os.fsdecode(path))
        if flags & O_TRUNC and not rsp.created:
            self.size_changed(rsp.inode.inode_id, 0)
        return AsyncFile(self, os.fsdecode(path), rsp, readable, writable, append, self.config.inflight_per_file)

    async def read_many(self, ranges: Sequence[tuple[AsyncFile | PathLike, int, int]],
                        buffer: Any = None) -> list[memoryview]:
        """Read many ranges at once: ``ranges`` is a sequence of ``(file, offset, length)``, ``file``
        a path (opened for the call, permission-checked as any open, closed after) or a handle of
        this client open for reading; no meta call is made for a handle.

        The ranges land back to back in ``buffer`` (any writable, contiguous buffer holding at
        least the sum of the lengths; None: a new bytearray), range ``i`` at the sum of the
        lengths before it; one ``memoryview`` per range is returned, a slice of the buffer, short
        where the file ends first (like ``os.pread``). The pieces bound for one storage node
        travel in few BatchRead calls, all nodes asked at once (:mod:`fs3.client.read_many`).

        Bad input reads nothing: a negative offset or length is ``EINVAL``, a closed handle or one
        not open for reading ``EBADF``, more than 65,536 ranges or 1 GiB, or a buffer too small, a
        ``ValueError``; a missing path is ``FileNotFoundError``.
        """
        return await read_many(self, ranges, buffer)

    async def read_bytes(self, path: PathLike) -> bytes:
        f = await self.open(path, "rb")
        try:
            with os_errors(path):
                return await f.read()
        finally:
            with os_errors(path):
                await f.close()

    async def write_bytes(self, path: PathLike, data: bytes) -> int:
        f = await self.open(path, "wb")
        try:
            with os_errors(path):
                return await f.write(data)
        finally:
            with os_errors(path):
                await f.close()

    async def fsck(self, check_chunks: bool = True) -> mpb.FsckRsp:
        with os_errors():
            return await self.metadata.fsck(check_chunks)


def client_config(settings: ClusterSettings, config: ClientConfig | None, options: dict[str, object]) -> ClientConfig:
    """The client's settings: ``config`` or client ``options`` (not both). The profile in use fills
    in what the caller left out: its transport (when neither names one) and its TLS (a TLS cluster
    cannot be reached without it)."""
    if config is not None and options:
        raise TypeError("give config or client options, not both")
    if config is None:
        unknown = set(options) - set(ClientConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown client options: {', '.join(sorted(unknown))}")
        from_profile: dict[str, object] = {}
        if settings.transport and "transport" not in options:
            from_profile["transport"] = settings.transport
        if settings.tls is not None and "tls" not in options:
            from_profile["tls"] = settings.tls
        return ClientConfig(**{**from_profile, **options})  # type: ignore[arg-type]
    if config.tls is None and settings.tls is not None:
        return dataclasses.replace(config, tls=settings.tls)
    return config


async def connect(mgmtd: str | list[str] | None = None, token: str | None = None, config: ClientConfig | None = None,
                  *, profile: str | None = None, token_file: str | None = None, **options: object) -> AsyncFileSystem:
    """Connect to the cluster whose mgmtd listens at ``mgmtd`` (``HOST:PORT``).

    What is left out (the address, the token, TLS) comes from a profile or the environment
    (:mod:`fs3.client.profiles`): ``await fs3.aio.connect()`` alone uses ``$FS3_MGMTD`` /
    ``$FS3_TOKEN`` or the ``default`` profile.

    A public edge like every method of the API: a cluster that cannot be reached, or refuses the
    token, is the ``OSError`` a local file system would raise; an option the client does not have
    is a ``TypeError``, as for any unexpected keyword argument.
    """
    with os_errors():
        settings = resolve(mgmtd, token, token_file=token_file, profile=profile)
    return await connect_settings(settings, client_config(settings, config, options))


async def connect_settings(settings: ClusterSettings, config: ClientConfig) -> AsyncFileSystem:
    """Connect with settings already resolved (the blocking client's first call, in any process)."""
    fs = AsyncFileSystem(list(settings.mgmtd), settings.token, config)
    try:
        with os_errors(settings.mgmtd[0] if len(settings.mgmtd) == 1 else None):
            return await fs.start()
    except BaseException:
        await fs.close()
        raise
