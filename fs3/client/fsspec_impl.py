"""fs3 as an fsspec file system: ``fsspec.filesystem("fs3", mgmtd="HOST:PORT", token=...)``.

Registered under the ``fs3`` protocol through the ``fsspec.specs`` entry point, so URLs like
``fs3://HOST:PORT/datasets/train.parquet`` work in pandas, pyarrow, zarr, xarray,
``torch.distributed.checkpoint`` and anything else that takes fsspec URLs. What a URL leaves out
comes from a profile or the environment (:mod:`fs3.client.profiles`): ``fs3://NAME@/path`` uses
profile NAME, ``fs3:///path`` ``$FS3_MGMTD``/``$FS3_TOKEN`` or the ``default`` profile — which is
how code that rebuilds the file system from the URL alone (torch's checkpointer) finds the token.

Built on :class:`fsspec.asyn.AsyncFileSystem` over the asyncio client (:mod:`fs3.aio`): every
operation is a coroutine (``_cat_file``, ``_pipe_file``, ``_put_file`` ...), so fsspec's batch
calls (``cat``, ``get``, ``put``, ``copy``, ``rm`` of many paths) run them concurrently instead of
one file after another. Blocking calls run those coroutines on fsspec's own IO loop; with
``asynchronous=True`` (what zarr v3 asks for) the file system is used from the caller's running
loop. The asyncio client is bound to the loop it was made in, so it is made lazily in the loop
that first needs it, and made again after a fork (the parent's loop does not run in the child).

Files are :class:`fsspec.spec.AbstractBufferedFile` objects (``size``, ``blocksize``,
``_fetch_range``, ``_upload_chunk``), which is what fsspec's caches (``blockcache::``,
``simplecache::``, ``filecache::``) and readers such as pyarrow expect; each keeps one fs3 handle
open from ``open`` to ``close``, so errors (no such file, permission) surface at ``open`` as they do
locally and a written file's length is committed at ``close``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime
import errno
import io
import logging
import os
import stat as stat_mod
import threading
import uuid
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from fsspec.asyn import AbstractAsyncStreamedFile, AsyncFileSystem, _run_coros_in_chunks, get_loop, sync, sync_wrapper
from fsspec.callbacks import DEFAULT_CALLBACK
from fsspec.spec import AbstractBufferedFile, make_instance
from fsspec.utils import infer_storage_options, isfilelike

from fs3.client.files import AsyncFile
from fs3.client.fs import AsyncFileSystem as ClientFileSystem
from fs3.client.fs import ClientConfig, connect
from fs3.client.raw_io import BufferedFsync, RawHandleIO, seek_on_loop

__all__ = ["FS3AsyncFile", "FS3File", "FS3FileSystem"]

P = ParamSpec("P")
T = TypeVar("T")
log = logging.getLogger(__name__)

# Pieces a copy, get or put moves at a time: memory bounded per file, whatever its size, and for a
# batch (fsspec runs up to its batch size of files at once). The fs3 handle sends and prefetches
# whole chunks in the background, so a small piece costs no throughput.
_COPY_PIECE_BYTES = 1024 * 1024
# fsspec's own options, which fsspec reads from the constructor's keywords (never client options).
_FSSPEC_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths"})


def _for_another_process(options: dict[str, Any]) -> dict[str, Any]:
    """Client options for a copy of the file system in another process: see
    :meth:`fs3.aio.ClientConfig.for_another_process`."""
    port = options.get("metrics_port")
    return {**options, "metrics_port": -1} if isinstance(port, int) and port > 0 else options


def _close_client(loop: asyncio.AbstractEventLoop, client: ClientFileSystem, pid: int) -> None:
    """Close a client the file system dropped (collected, or at exit) on the loop it lives in,
    without waiting: a collection may run on that very loop's thread. Best effort: a client that
    never says goodbye is dropped by meta when its lease lapses.

    Only in the process that made it: after a fork the parent's loop does not run in the child,
    and the sockets are the parent's to close.
    """
    if os.getpid() != pid or loop.is_closed() or not loop.is_running():
        return
    with contextlib.suppress(RuntimeError):  # the loop stopped in between
        asyncio.run_coroutine_threadsafe(client.close(), loop)


def _close_in_background(file: Any) -> None:
    """Close a file dropped without ``close`` (from ``__del__``) without blocking the collector.

    A collection runs in whatever thread allocates at the time, which may be the thread of the
    loop the close must wait on (or, in tests, of the cluster serving it): waiting there would hang
    it. So the close (the last block written, then the handle closed) runs in a short thread.
    """
    # Not a daemon: the interpreter waits for it at exit, so a file dropped just before the program
    # ends still lands (a daemon thread was stopped half way and the file's bytes lost).
    threading.Thread(target=_close_quietly, args=(file,), name="fs3-fsspec-close", daemon=False).start()


# Files open for writing made by the blocking API, closed at exit if the program left them open: at
# exit fsspec's IO loop (a daemon thread) still runs while ``atexit`` callbacks do, but not when the
# interpreter finalizes what is left, when a ``__del__`` close could no longer reach it and the
# file's bytes were lost without a word.
_writers: weakref.WeakSet[Any] = weakref.WeakSet()


def _close_writers_at_exit() -> None:
    for file in list(_writers):
        fs = getattr(file, "_fs3", None) or getattr(getattr(file, "raw", None), "_fs", None)
        if file.closed or getattr(file, "_pid", None) != os.getpid() or fs is None or fs._pid != os.getpid():
            continue  # closed, or the parent's (a forked child leaves the parent's files to it)
        loop = fs._loop
        if loop is None or loop.is_closed() or not loop.is_running():
            continue
        _close_quietly(file)


atexit.register(_close_writers_at_exit)


def _close_quietly(file: Any) -> None:
    try:
        file.close()
    except Exception as exc:
        log.warning("fs3: closing %s, dropped without close, failed: %s", getattr(file, "name", file), exc)


class FS3FileSystem(AsyncFileSystem):  # type: ignore[misc]
    """The ``fs3`` protocol: one cluster (``mgmtd``, ``token``) seen through fsspec.

    ``asynchronous``, ``loop`` and ``batch_size`` are fsspec's (see
    :class:`fsspec.asyn.AsyncFileSystem`); ``auto_mkdir`` creates a written file's parents; every
    other keyword is a client option (:class:`fs3.aio.ClientConfig`: ``transport``,
    ``rpc_timeout_ms``, ``uid`` ...), checked here so that a misspelt one fails at once.
    """

    protocol = "fs3"
    root_marker = "/"
    _pid: int  # fsspec's: the process the file system was made in

    def __init__(self, mgmtd: str | None = None, token: str | None = None, auto_mkdir: bool = True,
                 asynchronous: bool = False, loop: asyncio.AbstractEventLoop | None = None,
                 batch_size: int | None = None, **kwargs: Any) -> None:
        super().__init__(mgmtd=mgmtd, token=token, auto_mkdir=auto_mkdir, asynchronous=asynchronous, loop=loop,
                         batch_size=batch_size, **kwargs)
        # Like object stores (and fsspec's local file system with auto_mkdir): writing a file
        # creates its parent directories, which is what pandas, pyarrow and checkpointers expect.
        self.auto_mkdir = auto_mkdir
        # What is left out (the address, the token, TLS) the client finds in a profile or the
        # environment when it connects (fs3.client.profiles): profile= and token_file= pass through.
        self._address = mgmtd
        self._token = token
        self._options = {k: v for k, v in kwargs.items() if k not in _FSSPEC_OPTIONS}
        unknown = set(self._options) - set(ClientConfig.__dataclass_fields__) - {"profile", "token_file"}
        if unknown:
            raise TypeError(f"unknown client options: {', '.join(sorted(unknown))}")
        # The client of each loop that uses the file system (one, unless ``asynchronous`` code calls
        # from several), made by a task so that concurrent first calls share one connection. One per
        # loop, kept: calls alternating between loops reuse their loop's client, never pile up new ones.
        self._clients: dict[asyncio.AbstractEventLoop, asyncio.Task[ClientFileSystem]] = {}
        if not asynchronous and not self._on_own_loop():
            # Blocking use connects now, so a wrong address or token fails here, as it did before
            # the first call; from inside fsspec's loop (a URL resolved by fsspec's generic file
            # system) the first call connects.
            self._sync(self.get_client)

    # -- the client ------------------------------------------------------------------------------

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """fsspec's IO loop (None when ``asynchronous``). After a fork, the child's own: fsspec
        starts a new loop in the child, and the client is made again on it at first use."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            if not self.asynchronous:
                self._loop = get_loop()
            self._clients = {}  # the parent's, on loops that do not run here
            self._options = _for_another_process(self._options)  # a fixed metrics port stays the parent's
        return self._loop  # type: ignore[no-any-return]

    def __reduce__(self) -> tuple[Any, ...]:
        """fsspec's pickle (its storage options), less a fixed metrics port: an unpickled copy (a
        ``spawn`` worker) binding the port its original holds failed at every call."""
        return make_instance, (type(self), self.storage_args, _for_another_process(self.storage_options))

    def _on_own_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    def _sync(self, func: Callable[..., Coroutine[Any, Any, T]], *args: Any, **kwargs: Any) -> T:
        """Run a coroutine function on the file system's loop and wait for it (blocking calls)."""
        return sync(self.loop, func, *args, **kwargs)  # type: ignore[no-any-return]

    async def get_client(self) -> ClientFileSystem:
        """The :mod:`fs3.aio` client under this file system, connected on first use and shared by
        every call: for what fsspec has no call for (xattrs, layouts, ``statvfs``). Await it, and
        use it, on the file system's loop (``fs.loop``; the caller's when ``asynchronous``)."""
        loop = asyncio.get_running_loop()
        self.loop  # noqa: B018 - notices a fork before the checks below
        task = self._clients.get(loop)
        if task is None:
            for gone in [other for other in list(self._clients) if other.is_closed()]:
                self._clients.pop(gone, None)  # its client went with its loop
            task = self._clients[loop] = loop.create_task(self._connect())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            raise
        except BaseException:
            if self._clients.get(loop) is task:
                del self._clients[loop]  # the next call tries again
            raise

    async def _connect(self) -> ClientFileSystem:
        client = await connect(self._address, self._token, **self._options)
        loop = asyncio.get_running_loop()
        if not self.asynchronous:
            weakref.finalize(self, _close_client, loop, client, os.getpid())
            # At exit, open files are closed before any client: atexit runs callbacks last registered
            # first, and weakref.finalize registers its own the first time one is made.
            atexit.unregister(_close_writers_at_exit)
            atexit.register(_close_writers_at_exit)
        return client

    async def _close(self) -> None:
        """Close the calling loop's client (its sessions and connections); the next call connects again."""
        self.loop  # noqa: B018 - after a fork, the parent's clients are not this process's to close
        task = self._clients.pop(asyncio.get_running_loop(), None)
        if task is not None:
            try:
                client = await task
            except Exception:
                return
            await client.close()

    close = sync_wrapper(_close)

    # -- paths -----------------------------------------------------------------------------------

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        path = str(path)
        if path.startswith("fs3://"):
            rest = path[len("fs3://"):]
            path = "/" + rest.split("/", 1)[1] if "/" in rest else "/"
        path = path.rstrip("/") or "/"
        return path if path.startswith("/") else "/" + path

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict[str, Any]:
        options = infer_storage_options(path)
        host, port, profile = options.get("host"), options.get("port"), options.get("username")
        # What a URL names is never dropped: a host without its port (or a password) silently left
        # out sent the file to the default profile's or $FS3_MGMTD's cluster instead.
        if host and not port:
            raise ValueError(f"fs3 URL names host {host!r} without a port: write fs3://HOST:PORT/path "
                             "(or fs3://NAME@/path for a profile)")
        if options.get("password"):  # never quoted: it may be a token
            raise ValueError("fs3 URLs carry no password: give the token by profile, token_file= or $FS3_TOKEN_FILE")
        found: dict[str, Any] = {"mgmtd": f"{host}:{port}"} if host and port else {}
        if profile:
            found["profile"] = profile  # fs3://NAME@/path
        return found

    def unstrip_protocol(self, name: str) -> str:
        """The URL of ``name``. A URL names one mgmtd (a host:port), so of several addresses given as a
        list the first stands for the cluster (they are alternates of the same one)."""
        profile = self.storage_options.get("profile")
        mgmtd = self.storage_options.get("mgmtd") or ""
        if not isinstance(mgmtd, str):
            mgmtd = next(iter(mgmtd), "")
        return f"fs3://{profile + '@' if profile else ''}{mgmtd}{name}"

    # -- listing ---------------------------------------------------------------------------------

    @staticmethod
    def _info_from(path: str, st: os.stat_result, link_target: str | None = None) -> dict[str, Any]:
        if stat_mod.S_ISDIR(st.st_mode):
            kind = "directory"
        elif stat_mod.S_ISREG(st.st_mode):
            kind = "file"
        else:
            kind = "other"
        info = {"name": path, "size": st.st_size if kind == "file" else 0, "type": kind,
                "mode": st.st_mode, "ino": st.st_ino, "nlink": st.st_nlink, "uid": st.st_uid, "gid": st.st_gid,
                "mtime": st.st_mtime, "created": st.st_ctime, "islink": stat_mod.S_ISLNK(st.st_mode)}
        if link_target is not None:
            info["destination"] = link_target
        return info

    async def _info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        client = await self.get_client()
        path = self._strip_protocol(path)
        lst = await client.lstat(path)
        if stat_mod.S_ISLNK(lst.st_mode):
            target = await client.readlink(path)
            try:
                return self._info_from(path, await client.stat(path), target)
            except FileNotFoundError:
                return self._info_from(path, lst, target)
        return self._info_from(path, lst)

    async def _ls(self, path: str, detail: bool = True, **kwargs: Any) -> list[Any]:
        client = await self.get_client()
        path = self._strip_protocol(path)
        st = await client.stat(path)
        if not stat_mod.S_ISDIR(st.st_mode):
            return [self._info_from(path, st)] if detail else [path]
        base = path.rstrip("/")
        entries = [self._info_from(f"{base}/{e.name}", e.stat()) for e in await client.scandir(path)]
        return entries if detail else [e["name"] for e in entries]

    async def _exists(self, path: str, **kwargs: Any) -> bool:
        return await (await self.get_client()).exists(self._strip_protocol(path))

    async def _isdir(self, path: str) -> bool:
        return await (await self.get_client()).isdir(self._strip_protocol(path))

    async def _isfile(self, path: str) -> bool:
        return await (await self.get_client()).isfile(self._strip_protocol(path))

    async def _size(self, path: str) -> int:
        return int((await (await self.get_client()).stat(self._strip_protocol(path))).st_size)

    async def _created(self, path: str) -> datetime.datetime:
        st = await (await self.get_client()).stat(self._strip_protocol(path))
        return datetime.datetime.fromtimestamp(st.st_ctime, tz=datetime.UTC)

    async def _modified(self, path: str) -> datetime.datetime:
        st = await (await self.get_client()).stat(self._strip_protocol(path))
        return datetime.datetime.fromtimestamp(st.st_mtime, tz=datetime.UTC)

    created = sync_wrapper(_created)
    modified = sync_wrapper(_modified)

    # -- directories -----------------------------------------------------------------------------

    async def _mkdir(self, path: str, create_parents: bool = True, **kwargs: Any) -> None:
        client = await self.get_client()
        path = self._strip_protocol(path)
        if create_parents:
            await client.makedirs(path, exist_ok=False)
        else:
            await client.mkdir(path)

    async def _makedirs(self, path: str, exist_ok: bool = False) -> None:
        await (await self.get_client()).makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    async def _rmdir(self, path: str) -> None:
        await (await self.get_client()).rmdir(self._strip_protocol(path))

    rmdir = sync_wrapper(_rmdir)

    async def _make_parent(self, path: str) -> None:
        parent = path.rsplit("/", 1)[0]
        if self.auto_mkdir and parent:
            await (await self.get_client()).makedirs(parent, exist_ok=True)

    # -- removing and moving ---------------------------------------------------------------------

    async def _rm_file(self, path: str, **kwargs: Any) -> None:
        await (await self.get_client()).remove(self._strip_protocol(path))

    async def _rm(self, path: Any, recursive: bool = False, batch_size: int | None = None,
                  maxdepth: int | None = None, **kwargs: Any) -> None:
        """Files concurrently, then directories deepest first (each depth concurrently): a
        directory goes only once everything in it has. A directory named without ``recursive``
        is removed if empty. The root is refused before anything goes (``rm("", recursive=True)``,
        an empty prefix, would otherwise empty the whole cluster and only then fail on ``/``)."""
        client = await self.get_client()
        for named in path if isinstance(path, list) else [path]:
            if self._strip_protocol(named) == "/":
                raise OSError(errno.EINVAL, f"fs3: refusing to remove the root ({named!r}); remove its entries "
                                            "by name (fs.rm(fs.ls('/', detail=False), recursive=True))")
        paths = await self._expand_path(path, recursive=recursive, maxdepth=maxdepth)
        batch_size = batch_size or self.batch_size
        modes = await _run_coros_in_chunks([self._lstat_mode(client, p) for p in paths], batch_size=batch_size,
                                           nofiles=True, return_exceptions=True)
        # fsspec's expansion lists what a symlink to a directory points to, as paths through the
        # link: those are another tree's, never removed here (rm -r LINK removes the link only).
        links = {p for p, mode in zip(paths, modes, strict=True) if isinstance(mode, int) and stat_mod.S_ISLNK(mode)}
        kept = [(p, mode) for p, mode in zip(paths, modes, strict=True) if not _below_any(p, links)]
        files = [p for p, mode in kept if not (isinstance(mode, int) and stat_mod.S_ISDIR(mode))]  # errors: remove says
        dirs = [p for p, mode in kept if isinstance(mode, int) and stat_mod.S_ISDIR(mode)]
        await self._gather([client.remove(p) for p in files], batch_size)
        for depth in sorted({p.count("/") for p in dirs}, reverse=True):
            await self._gather([client.rmdir(p) for p in dirs if p.count("/") == depth], batch_size)

    @staticmethod
    async def _lstat_mode(client: ClientFileSystem, path: str) -> int:
        """The mode of ``path`` itself, not of what a link points to (a link goes as a file does)."""
        return int((await client.lstat(path)).st_mode)

    async def _gather(self, coros: list[Coroutine[Any, Any, Any]], batch_size: int | None) -> None:
        """Run ``coros`` concurrently (at most ``batch_size`` at once); the first error is raised."""
        results = await _run_coros_in_chunks(coros, batch_size=batch_size, nofiles=True, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _mv(self, path1: Any, path2: Any, recursive: bool = False, maxdepth: int | None = None,
                  **kwargs: Any) -> None:
        """One path to one path is an atomic rename on meta, whatever the size; anything else
        (lists, globs) is fsspec's copy then remove."""
        if isinstance(path1, str) and isinstance(path2, str) and not any(c in path1 for c in "*?["):
            client = await self.get_client()
            src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
            if await client.isdir(dst) and not await client.isdir(src):
                dst = f"{dst.rstrip('/')}/{src.rsplit('/', 1)[-1]}"
            await client.rename(src, dst)
            return
        await self._copy(path1, path2, recursive=recursive, maxdepth=maxdepth, **kwargs)
        await self._rm(path1, recursive=recursive)

    mv = sync_wrapper(_mv)

    async def _mv_file(self, path1: str, path2: str) -> None:
        await (await self.get_client()).rename(self._strip_protocol(path1), self._strip_protocol(path2))

    # -- whole files -----------------------------------------------------------------------------

    async def _cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        client = await self.get_client()
        afile = await client.open(self._strip_protocol(path), "rb")
        try:
            size = afile.length
            first = 0 if start is None else (max(0, size + start) if start < 0 else start)
            last = size if end is None else (max(0, size + end) if end < 0 else min(end, size))
            return await afile.pread(first, last - first) if last > first else b""
        finally:
            await afile.close()

    async def _pipe_file(self, path: str, value: Any, mode: str = "overwrite", **kwargs: Any) -> None:
        """``mode="create"`` refuses an existing file (``FileExistsError``), as fsspec asks."""
        async def fill(afile: AsyncFile) -> None:
            await afile.write(value)

        await self._write_whole(self._strip_protocol(path), "xb" if mode == "create" else "wb", fill)

    async def _cp_file(self, path1: str, path2: str, **kwargs: Any) -> None:
        client = await self.get_client()
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        if await client.isdir(src):
            await client.makedirs(dst, exist_ok=True)
            return
        fin = await client.open(src, "rb")
        try:
            async def fill(fout: AsyncFile) -> None:
                while piece := await fin.read(_COPY_PIECE_BYTES):
                    await fout.write(piece)

            await self._write_whole(dst, "wb", fill)
        finally:
            await fin.close()

    async def _put_file(self, lpath: str, rpath: str, callback: Any = DEFAULT_CALLBACK, mode: str = "overwrite",
                        **kwargs: Any) -> None:
        client = await self.get_client()
        rpath = self._strip_protocol(rpath)
        if os.path.isdir(lpath):
            await client.makedirs(rpath, exist_ok=True)
            return
        with open(lpath, "rb") as local:
            callback.set_size(os.fstat(local.fileno()).st_size)

            async def fill(afile: AsyncFile) -> None:
                while piece := await asyncio.to_thread(local.read, _COPY_PIECE_BYTES):
                    await afile.write(piece)
                    callback.relative_update(len(piece))

            await self._write_whole(rpath, "xb" if mode == "create" else "wb", fill)

    async def _write_whole(self, path: str, mode: str, fill: Callable[[AsyncFile], Awaitable[None]]) -> None:
        """Write a whole file (``put``, ``pipe``, ``copy``): ``fill`` writes it, then the close commits it.

        A write that does not finish (an error, a cancelled batch: fsspec cancels the rest of a
        batch at its first error, and ``wait_for`` cancels at its timeout) leaves no file behind.
        Closed as it was, the handle committed what had landed so far: a short file under the
        name, indistinguishable from a complete one. (``"wb"`` had already emptied a file there.)
        """
        client = await self.get_client()
        afile = await self._open_handle(path, mode)
        try:
            await fill(afile)
            await afile.close()
        except BaseException:
            await _discard_unfinished(client, afile, path)
            raise

    async def _get_file(self, rpath: str, lpath: Any, callback: Any = DEFAULT_CALLBACK, **kwargs: Any) -> None:
        client = await self.get_client()
        rpath = self._strip_protocol(rpath)
        try:
            afile = await client.open(rpath, "rb")
        except IsADirectoryError:
            if not isfilelike(lpath):
                os.makedirs(lpath, exist_ok=True)
            return
        try:
            callback.set_size(afile.length)
            if isfilelike(lpath):
                await self._copy_out(afile, lpath, callback)
            else:
                with open(lpath, "wb") as local:
                    await self._copy_out(afile, local, callback)
        finally:
            await afile.close()

    @staticmethod
    async def _copy_out(afile: AsyncFile, local: Any, callback: Any) -> None:
        while piece := await afile.read(_COPY_PIECE_BYTES):
            await asyncio.to_thread(local.write, piece)
            callback.relative_update(len(piece))

    async def _touch(self, path: str, truncate: bool = True, **kwargs: Any) -> None:
        client = await self.get_client()
        path = self._strip_protocol(path)
        if truncate or not await client.exists(path):
            await (await self._open_handle(path, "wb")).close()
        else:
            await client.utime(path)

    touch = sync_wrapper(_touch)

    # -- open files ------------------------------------------------------------------------------

    async def _open_handle(self, path: str, mode: str) -> AsyncFile:
        """An fs3 handle for a binary ``mode``. A file written where its parent is missing gets
        its parents (``auto_mkdir``) and is opened again: one call to meta when they exist, as
        they do for all but the first file of a directory (zarr writes every chunk this way)."""
        client = await self.get_client()
        try:
            return await client.open(path, mode)
        except FileNotFoundError:
            if not (self.auto_mkdir and any(c in mode for c in "wax")):
                raise
        await self._make_parent(path)
        return await client.open(path, mode)

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, autocommit: bool = True,
              cache_options: Any = None, **kwargs: Any) -> Any:
        """``rb``/``wb``/``ab``/``xb``: an :class:`FS3File`. ``+`` modes (read and write one
        handle at any offset): a buffered random-access file over the same handle."""
        path = self._strip_protocol(path)
        if "+" in mode:
            if not autocommit:
                raise NotImplementedError("fs3: a file open for reading and writing commits on close, not in a "
                                          "transaction")
            afile = self._sync(self._open_handle, path, mode)
            raw = _RandomAccessRaw(self, afile, mode)
            random_access = _BufferedRandom(raw, block_size or min(afile.chunk_size, 1 << 20))
            random_access._pid = os.getpid()
            _writers.add(random_access)
            return random_access
        return FS3File(self, path, mode, block_size=block_size, autocommit=autocommit,
                       cache_options=cache_options, **kwargs)

    async def open_async(self, path: str, mode: str = "rb", **kwargs: Any) -> FS3AsyncFile:
        """An async file (``await f.read()``, ``await f.write()``) for asyncio code."""
        if "b" not in mode or kwargs.get("compression"):
            raise ValueError("fs3: open_async takes binary modes and no compression")
        if mode not in ("rb", "wb", "ab", "xb"):
            raise ValueError(f"fs3: open_async does not take mode {mode!r}")
        path = self._strip_protocol(path)
        afile = await self._open_handle(path, mode)
        return FS3AsyncFile(self, path, mode, afile, **kwargs)


class FS3File(AbstractBufferedFile):  # type: ignore[misc]
    """A file open on fs3 in fsspec's shape: reads through fsspec's cache (``cache_type``) in
    ``blocksize`` pieces (``_fetch_range``); writes gathered into ``blocksize`` blocks
    (``_upload_chunk``), and the file's length committed on ``close``.

    One fs3 handle stays open from ``open`` to ``close``: ``open`` fails as a local open does
    (``FileNotFoundError``, ``PermissionError``, ``IsADirectoryError``), and every read after it
    uses the same session. With ``autocommit=False`` (an fsspec transaction) the bytes go to a
    hidden name beside the file and ``commit`` renames it into place.
    """

    DEFAULT_BLOCK_SIZE = 4 * 1024 * 1024
    # fsspec's state of a written file: the block being gathered, and how much went before it.
    buffer: io.BytesIO
    offset: int | None
    closed: bool

    def __init__(self, fs: FS3FileSystem, path: str, mode: str = "rb", block_size: Any = "default",
                 autocommit: bool = True, cache_type: str = "readahead", cache_options: Any = None,
                 size: int | None = None, **kwargs: Any) -> None:
        if mode not in ("rb", "wb", "ab", "xb"):
            raise ValueError(f"fs3: unsupported file mode {mode!r}")
        if not autocommit and mode != "wb":
            raise NotImplementedError("fs3: only 'wb' files take part in a transaction")
        self._fs3 = fs
        self._handle_path = path if autocommit else self._temp_name(path)
        self._afile: AsyncFile | None = fs._sync(fs._open_handle, self._handle_path, mode)
        try:
            super().__init__(fs, path, mode, block_size=block_size, autocommit=autocommit, cache_type=cache_type,
                             cache_options=cache_options, size=self._afile.length if mode == "rb" else None,
                             **kwargs)
        except BaseException:
            with contextlib.suppress(Exception):
                fs._sync(self._afile.close)
            raise
        if mode == "ab":
            self.loc = self._afile.length
        self._pid = os.getpid()
        if mode != "rb":
            _writers.add(self)

    @staticmethod
    def _temp_name(path: str) -> str:
        parent, _, name = path.rpartition("/")
        return f"{parent}/.{name}.fs3-{uuid.uuid4().hex}.tmp"

    @property
    def handle(self) -> AsyncFile:
        if self._afile is None:
            raise ValueError("I/O operation on closed file.")
        return self._afile

    # -- fsspec's hooks --------------------------------------------------------------------------

    def _fetch_range(self, start: int, end: int) -> bytes:
        return self._fs3._sync(self.handle.pread, start, end - start)

    def _initiate_upload(self) -> None:
        """Nothing to start: the handle was opened (and the file created) at ``open``."""

    def _upload_chunk(self, final: bool = False) -> bool:
        with self.buffer.getbuffer() as block:
            if len(block):
                # The fs3 handle copies the block into its chunk buffers before write returns.
                self._fs3._sync(self.handle.write, block)
        if final:
            afile, self._afile = self.handle, None
            self._fs3._sync(afile.close)  # meta learns the length: the file's bytes are committed
        return True

    # -- beyond fsspec's defaults ----------------------------------------------------------------

    def seek(self, loc: int, whence: int = 0) -> int:
        """Reads seek anywhere; a written file too (the block so far is sent first), like a local one."""
        if self.mode == "rb":
            return super().seek(loc, whence)  # type: ignore[no-any-return]
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        self._send_block()
        if whence == 0:
            target = int(loc)
        elif whence == 1:
            target = self.loc + int(loc)
        elif whence == 2:
            target = self.handle.end_of_file() + int(loc)
        else:
            raise ValueError(f"invalid whence ({whence}, should be 0, 1 or 2)")
        if target < 0:
            raise ValueError("Seek before start of file")
        self.loc = position = self._fs3._sync(seek_on_loop, self.handle, target)
        return position

    def seekable(self) -> bool:
        return not self.closed

    def _send_block(self) -> None:
        """Send what is buffered now, whatever its size (before a seek or an fsync)."""
        if self.buffer.tell():
            if self.offset is None:
                self.offset = 0
            self._upload_chunk(final=False)
            self.offset += self.buffer.tell()
            self.buffer = io.BytesIO()

    def fsync(self) -> None:
        """What is written so far is durable on storage and its length known to meta."""
        if self.closed:
            raise ValueError("I/O operation on closed file.")
        if self.mode != "rb":
            self._send_block()
            self._fs3._sync(self.handle.fsync)

    def close(self) -> None:
        """Finish the writes (the last block, then the handle's close, which commits the length)
        or drop the read cache; the handle is closed even when the last write fails."""
        if getattr(self, "_unclosable", False) or self.closed:
            return
        failed = True
        try:
            if self.mode == "rb":
                cache, self.cache = getattr(self, "cache", None), None
                close_cache = getattr(cache, "close", None)
                if callable(close_cache):
                    close_cache()  # the block cache's file
            elif not self.forced:
                self.flush(force=True)
            failed = False
        finally:
            self.closed = True
            afile, self._afile = self._afile, None
            if afile is not None and not afile.closed:
                if failed:  # the first error is the one to see; the handle goes regardless
                    with contextlib.suppress(Exception):
                        self._fs3._sync(afile.close)
                else:
                    self._fs3._sync(afile.close)
            if self.mode != "rb":
                self._fs3.invalidate_cache(self.path)
                self._fs3.invalidate_cache(self._fs3._parent(self.path))

    def __del__(self) -> None:
        if not self.closed:
            _close_in_background(self)

    def commit(self) -> None:
        """End of a transaction: the hidden file takes the file's name (atomic)."""
        if self._handle_path != self.path:
            self._fs3.mv(self._handle_path, self.path)

    def discard(self) -> None:
        """A transaction that failed: the hidden file goes, the named one was never touched."""
        if self._handle_path != self.path:
            self._fs3.rm_file(self._handle_path)


# Discards of unfinished files still running after their caller was cancelled again (the loop keeps
# only weak references to tasks).
_discards: set[asyncio.Task[None]] = set()


async def _discard_unfinished(client: ClientFileSystem, afile: AsyncFile, path: str) -> None:
    """Remove the file an unfinished whole-file write left (if ``path`` still names it), then
    release its handle; neither is stopped by a second cancellation, whose error the caller sees
    anyway. Best effort: the write's own error is the one raised."""

    async def discard() -> None:
        with contextlib.suppress(Exception):
            if (await client.lstat(path)).st_ino == afile.inode.inode_id:
                await client.remove(path)  # first, so that the name is gone before any flush
        with contextlib.suppress(Exception):
            await afile.close()

    task = asyncio.ensure_future(discard())
    _discards.add(task)
    task.add_done_callback(_discards.discard)
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.shield(task)


def _below_any(path: str, links: set[str]) -> bool:
    """Whether ``path`` lies under one of ``links`` (reached through a symlink)."""
    parent = path.rpartition("/")[0]
    while parent:
        if parent in links:
            return True
        parent = parent.rpartition("/")[0]
    return False


class FS3AsyncFile(AbstractAsyncStreamedFile):  # type: ignore[misc]
    """The async file of :meth:`FS3FileSystem.open_async`: one fs3 handle, awaited reads and writes."""

    closed: bool

    def __init__(self, fs: FS3FileSystem, path: str, mode: str, afile: AsyncFile, **kwargs: Any) -> None:
        self._afile = afile
        self._loop = asyncio.get_running_loop()
        super().__init__(fs, path, mode, size=afile.length if mode == "rb" else None, **kwargs)
        if mode == "ab":
            self.loc = afile.length

    async def _fetch_range(self, start: int, end: int) -> bytes:
        return await self._afile.pread(start, end - start)

    async def _upload_chunk(self, final: bool = False) -> bool:
        with self.buffer.getbuffer() as block:
            if len(block):
                await self._afile.write(block)
        if final:
            await self._afile.close()
        return True

    async def close(self) -> None:
        if self.closed:
            return
        try:
            await super().close()
        finally:
            self.closed = True
            if not self._afile.closed:
                await self._afile.close()

    def __del__(self) -> None:
        """Dropped without ``close``: the close runs as a task of its loop, never waited on here."""
        if not self.closed and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_close_task, self._loop, self)


def _close_task(loop: asyncio.AbstractEventLoop, file: FS3AsyncFile) -> None:
    task = loop.create_task(file.close())
    _dropped_closes.add(task)
    task.add_done_callback(_dropped_closes.discard)


# Closes of dropped async files still running (the loop keeps only weak references to tasks).
_dropped_closes: set[asyncio.Task[None]] = set()


class _BufferedRandom(BufferedFsync, io.BufferedRandom):
    """A ``+`` mode file; one dropped without ``close`` is closed in the background."""

    _pid = 0  # the process that opened it

    def __del__(self) -> None:
        if not self.closed:
            _close_in_background(self)


class _RandomAccessRaw(RawHandleIO):
    """The raw layer of a ``+`` mode file: one fs3 handle, each call — a seek too, which cancels
    read-ahead tasks of that loop — run on the file system's loop (fsspec's IO loop)."""

    def __init__(self, fs: FS3FileSystem, afile: AsyncFile, mode: str) -> None:
        super().__init__(afile, mode)
        self._fs = fs

    def _run(self, func: Callable[P, Coroutine[Any, Any, T]], *args: P.args, **kwargs: P.kwargs) -> T:
        return self._fs._sync(func, *args, **kwargs)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        return self._run(seek_on_loop, self.afile, offset, whence)

    def __del__(self) -> None:
        if not self.closed:
            _close_in_background(self)

