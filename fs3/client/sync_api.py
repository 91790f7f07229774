"""The blocking API: ``fs = fs3.connect("host:port", token=...)``, then ``fs.open``, ``fs.stat`` ...

Wraps :class:`~fs3.client.fs.AsyncFileSystem`, which runs on a private event loop in a daemon
thread; each call hands a coroutine to that loop and waits for its result. Files are real
``io`` objects: ``open`` returns a buffered binary file (``io.BufferedReader`` /
``BufferedWriter`` / ``BufferedRandom`` with an ``fsync`` method) over a raw fs3 file, or an
``io.TextIOWrapper`` for text modes — exactly what the built-in ``open`` returns locally.
"""

from __future__ import annotations

import asyncio
import atexit
import errno
import io
import logging
import os
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar

from fs3 import meta_pb2 as mpb
from fs3.client import forking
from fs3.client.files import AsyncFile
from fs3.client.fs import AsyncFileSystem, ClientConfig, DirEntry, PathLike, client_config, connect_settings
from fs3.client.oserrors import os_errors
from fs3.client.profiles import ClusterSettings, resolve
from fs3.client.raw_io import BufferedFsync, RawHandleIO, seek_on_loop
from fs3.client.read_many import READ_MANY_RANGES_MAX

__all__ = ["File", "FileSystem", "connect"]

P = ParamSpec("P")
T = TypeVar("T")
log = logging.getLogger(__name__)


class _LoopThread:
    """One event loop in a daemon thread, shared by a file system and its files."""

    def __init__(self) -> None:
        self.pid = os.getpid()  # the loop's thread runs in this process only (not in a forked child)
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:  # pragma: no cover - uvloop is a dependency
            self.loop = asyncio.new_event_loop()
        running = threading.Event()
        self.loop.call_soon(running.set)
        self.thread = threading.Thread(target=self.loop.run_forever, name="fs3-client-loop", daemon=True)
        self.thread.start()
        running.wait()  # from here on, a loop that is not running has stopped for good

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self.pid != os.getpid():
            coro.close()
            raise OSError(errno.EBADF, "fs3 file opened before os.fork() in the parent process: a file handle "
                                       "does not cross fork; open the file again in this process")
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError("blocking fs3 call made from the fs3 client's own event loop")
        # A stopped loop would never answer: its file system was closed, or the interpreter is exiting
        # (daemon threads no longer run then, though their loop still looks running).
        if sys.is_finalizing() or not self.loop.is_running():
            coro.close()
            raise OSError(errno.EBADF, "the fs3 client has stopped (its file system was closed, or the "
                                       "interpreter is exiting)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        if not self.thread.is_alive():
            self.loop.close()


class RawFile(RawHandleIO):
    """Unbuffered binary access to one open fs3 file (the raw layer under the buffered objects).

    Runs the handle on the file system's loop thread; in a forked child it flushes and closes
    nothing (the handle is the parent's, and that loop does not run in the child). A seek calls the
    handle from the caller's thread. ``readall`` reads the rest in one call rather than ``io``'s
    loop of ``readinto``, and ``fileno`` says why there is none.
    """

    _fs3_wrapped = False  # a buffered file over it closes it

    def __init__(self, runner: _LoopThread, afile: AsyncFile) -> None:
        super().__init__(afile, "rb")
        self._runner = runner

    def _run(self, func: Callable[P, Coroutine[Any, Any, T]], *args: P.args, **kwargs: P.kwargs) -> T:
        return self._runner.run(func(*args, **kwargs))

    def _owned_here(self) -> bool:
        return self._runner.pid == os.getpid()

    def readall(self) -> bytes:
        self._checkClosed()
        return self._run(self.afile.read, -1)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._checkClosed()
        return self._run(seek_on_loop, self.afile, offset, whence)

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fs3 files have no file descriptor (mount fs3 with FUSE for that)")

    def __del__(self) -> None:
        _finalize(self, io.RawIOBase.__del__)


def _finalize(file: Any, default: Any) -> None:
    """Close a file dropped without ``close``. A collection may run in the client's loop thread
    (whichever thread allocates), where a blocking close cannot wait on that very loop: it failed
    there ("Exception ignored") and the file's buffered bytes were lost. There the close runs in a
    short thread of its own (the interpreter waits for it at exit); elsewhere as io's own does."""
    if sys.is_finalizing():
        return  # the loop thread no longer runs: nothing could answer (open writers closed at exit, before)
    try:
        raw = None if file.closed else _raw_of(file)
    except ValueError:  # detached
        raw = None
    if raw is not None and threading.current_thread() is raw._runner.thread:
        if getattr(file, "_fs3_wrapped", False):
            return  # the file over this one closes it, after pushing its own buffer into it
        threading.Thread(target=_close_dropped, args=(file,), name="fs3-close-dropped", daemon=False).start()
        return
    default(file)


def _close_dropped(file: Any) -> None:
    try:
        file.close()
    except Exception as exc:
        log.warning("fs3: closing %s, dropped without close, failed: %s", getattr(file, "name", "a file"), exc)


class _Fsync(BufferedFsync):
    """The buffered objects' base: ``fsync()`` (see :class:`~fs3.client.raw_io.BufferedFsync`) and
    the mark that a text file over one closes it."""

    _fs3_wrapped = False  # a text file over it closes it


class BufferedReader(_Fsync, io.BufferedReader):
    pass


class BufferedWriter(_Fsync, io.BufferedWriter):
    def __del__(self) -> None:
        _finalize(self, io.BufferedWriter.__del__)


class BufferedRandom(_Fsync, io.BufferedRandom):
    def __del__(self) -> None:
        _finalize(self, io.BufferedRandom.__del__)


class _TextFile(io.TextIOWrapper):
    """A text mode file (a dropped one is closed as the binary ones are)."""

    def __del__(self) -> None:
        _finalize(self, io.TextIOWrapper.__del__)


File = BufferedReader | BufferedWriter | BufferedRandom


# Files open for writing, closed at exit if the program did not: at exit the loop threads (daemon
# threads) still run while ``atexit`` callbacks do, but no longer when the interpreter finalizes the
# objects left, so a file closed only then — by its ``__del__`` — would wait on a loop that never
# runs again, and its bytes (the buffer, the chunk pieces not yet sent) were lost without a word.
_writers: weakref.WeakSet[Any] = weakref.WeakSet()


def _raw_of(file: Any) -> RawFile | None:
    while not isinstance(file, RawFile):
        file = getattr(file, "buffer", None) or getattr(file, "raw", None)
        if file is None:
            return None
    return file


def _close_writers_at_exit() -> None:
    for file in list(_writers):
        raw = _raw_of(file)
        if file.closed or raw is None or raw._runner.pid != os.getpid() or not raw._runner.thread.is_alive():
            continue  # closed, the parent's (a forked child), or its file system closed first
        try:
            file.close()
        except Exception as exc:
            log.warning("fs3: closing %s, left open at exit, failed: %s", getattr(raw, "name", "a file"), exc)


atexit.register(_close_writers_at_exit)


class FileSystem:
    """A blocking, ``os``-like view of one fs3 cluster. Thread-safe; close it (or use ``with``).

    Connects on first use, and again, under a new client id, in a child forked after that (a
    DataLoader worker): see :mod:`fs3.client.forking`. Pickles as its connection settings, not its
    state — unpickled (a ``spawn``/``forkserver`` worker), it is a new client that connects on first
    use; a token read from a token file travels as the file's path.
    """

    def __init__(self, settings: ClusterSettings, config: ClientConfig,
                 afs: AsyncFileSystem | None = None, runner: _LoopThread | None = None) -> None:
        self.settings = settings
        self.config = config
        self._afs = afs
        self._runner = runner
        self._lock = threading.Lock()
        self._closed = False
        forking.register(self)

    def __repr__(self) -> str:  # never print a secret
        return f"fs3.FileSystem(mgmtd={','.join(self.settings.mgmtd)!r}{', closed' if self._closed else ''})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (FileSystem, (self.settings, self.config.for_another_process()))

    def _after_fork_in_child(self) -> None:
        """The parent's loop thread is gone in the child: connect anew on the next call."""
        forking.keep_inherited(self._runner, self._afs)
        self._afs, self._runner = None, None
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self.config = self.config.for_another_process()  # a fixed metrics port stays the parent's

    def _connected(self) -> tuple[AsyncFileSystem, _LoopThread]:
        if self._closed:
            raise ValueError("the fs3 file system is closed")
        afs, runner = self._afs, self._runner
        if afs is not None and runner is not None:
            return afs, runner
        with self._lock:
            if self._afs is None or self._runner is None:
                runner = _LoopThread()
                try:
                    self._afs = runner.run(connect_settings(self.settings, self.config))
                except BaseException:
                    runner.stop()
                    raise
                self._runner = runner
            return self._afs, self._runner

    @property
    def afs(self) -> AsyncFileSystem:
        """The asyncio client under this one (connected on first use)."""
        return self._connected()[0]

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise ValueError("the fs3 file system is closed")
        return self._connected()[1].run(coro)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            afs, runner, self._afs, self._runner = self._afs, self._runner, None, None
        if afs is not None and runner is not None:
            try:
                runner.run(afs.close())
            finally:
                runner.stop()

    def __enter__(self) -> FileSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- files -----------------------------------------------------------------------------------

    def open(self, path: PathLike, mode: str = "r", buffering: int = -1, encoding: str | None = None,
             errors: str | None = None, newline: str | None = None, perms: int = 0o666) -> Any:
        """Like the built-in ``open``: binary modes give buffered binary files, others a text wrapper."""
        binary = "b" in mode
        afs, runner = self._connected()
        afile = self._run(afs.open(path, mode if binary else mode.replace("t", "") + "b", perms))
        raw = RawFile(runner, afile)
        raw.mode = mode
        if buffering == 0:
            if not binary:
                raw.close()
                raise ValueError("can't have unbuffered text I/O")
            if afile.writable:
                _writers.add(raw)
            return raw
        size = buffering if buffering > 1 else min(afile.chunk_size, 1 << 20)
        buffered: BufferedReader | BufferedWriter | BufferedRandom
        raw._fs3_wrapped = True  # closed by the buffered file over it (see _finalize)
        if afile.readable and afile.writable:
            buffered = BufferedRandom(raw, size)
        elif afile.writable:
            buffered = BufferedWriter(raw, size)
        else:
            buffered = BufferedReader(raw, size)
        if not binary:
            buffered._fs3_wrapped = True
        file: Any = buffered if binary else _TextFile(buffered, encoding=encoding or "utf-8", errors=errors,
                                                      newline=newline)
        if afile.writable:
            _writers.add(file)
        return file

    def read_bytes(self, path: PathLike) -> bytes:
        return self._run(self.afs.read_bytes(path))

    def read_many(self, ranges: Sequence[tuple[Any, int, int]], buffer: Any = None) -> list[memoryview]:
        """Many ``(file, offset, length)`` ranges in one call (see ``AsyncFileSystem.read_many``):
        ``file`` is a path or a file this file system's ``open`` returned in a readable mode (any
        buffering). Bytes a file object still buffers from its own writes are flushed first, as its
        ``read`` would; the results are memoryviews of ``buffer`` (a new bytearray when None)."""
        if len(ranges) > READ_MANY_RANGES_MAX:
            raise ValueError(f"{len(ranges)} ranges exceed {READ_MANY_RANGES_MAX} per read_many call")
        converted: list[tuple[Any, Any, Any]] = []
        to_flush: dict[int, Any] = {}
        for entry in ranges:
            if not isinstance(entry, tuple | list) or len(entry) != 3:
                raise TypeError(f"a read_many range is (file, offset, length), not {entry!r}")
            file, offset, length = entry
            if not isinstance(file, str | bytes | os.PathLike | AsyncFile):
                raw = _raw_of(file)
                if raw is None:
                    raise TypeError(f"a read_many range's file is a path or an fs3 file, not {type(file).__name__}")
                if file.closed or raw.closed:
                    raise OSError(errno.EBADF, "I/O on a closed file", raw.name)
                if file is not raw and raw.afile.writable:
                    to_flush[id(file)] = file
                file = raw.afile
            converted.append((file, offset, length))
        for file in to_flush.values():
            file.flush()  # its write buffer is this program's writes: a read sees them
        return self._run(self.afs.read_many(converted, buffer))

    def write_bytes(self, path: PathLike, data: bytes) -> int:
        return self._run(self.afs.write_bytes(path, data))

    # -- os-like ---------------------------------------------------------------------------------

    def stat(self, path: PathLike, follow_symlinks: bool = True) -> os.stat_result:
        return self._run(self.afs.stat(path, follow_symlinks))

    def lstat(self, path: PathLike) -> os.stat_result:
        return self._run(self.afs.lstat(path))

    def exists(self, path: PathLike) -> bool:
        return self._run(self.afs.exists(path))

    def isdir(self, path: PathLike) -> bool:
        return self._run(self.afs.isdir(path))

    def isfile(self, path: PathLike) -> bool:
        return self._run(self.afs.isfile(path))

    def islink(self, path: PathLike) -> bool:
        return self._run(self.afs.islink(path))

    def statvfs(self, path: PathLike = "/") -> os.statvfs_result:
        return self._run(self.afs.statvfs(path))

    def listdir(self, path: PathLike = "/") -> list[str]:
        return self._run(self.afs.listdir(path))

    def scandir(self, path: PathLike = "/") -> Iterator[DirEntry]:
        return iter(self._run(self.afs.scandir(path)))

    def walk(self, top: PathLike = "/", topdown: bool = True) -> Iterator[tuple[str, list[str], list[str]]]:
        top_s = os.fsdecode(top)
        try:
            entries = list(self.scandir(top_s))
        except OSError:
            return
        dirs = [e.name for e in entries if e.is_dir()]
        files = [e.name for e in entries if not e.is_dir()]
        if topdown:
            yield top_s, dirs, files
        for name in dirs:
            yield from self.walk(f"{top_s.rstrip('/')}/{name}", topdown)
        if not topdown:
            yield top_s, dirs, files

    def mkdir(self, path: PathLike, mode: int = 0o777) -> None:
        self._run(self.afs.mkdir(path, mode))

    def makedirs(self, path: PathLike, mode: int = 0o777, exist_ok: bool = False) -> None:
        self._run(self.afs.makedirs(path, mode, exist_ok))

    def rmdir(self, path: PathLike) -> None:
        self._run(self.afs.rmdir(path))

    def remove(self, path: PathLike) -> None:
        self._run(self.afs.remove(path))

    unlink = remove

    def rename(self, src: PathLike, dst: PathLike, flags: int = 0) -> None:
        self._run(self.afs.rename(src, dst, flags))

    def replace(self, src: PathLike, dst: PathLike) -> None:
        self._run(self.afs.replace(src, dst))

    def link(self, src: PathLike, dst: PathLike) -> None:
        self._run(self.afs.link(src, dst))

    def symlink(self, target: PathLike, path: PathLike) -> None:
        self._run(self.afs.symlink(target, path))

    def readlink(self, path: PathLike) -> str:
        return self._run(self.afs.readlink(path))

    def mknod(self, path: PathLike, mode: int = 0o600, device: int = 0) -> None:
        self._run(self.afs.mknod(path, mode, device))

    def chmod(self, path: PathLike, mode: int, follow_symlinks: bool = True) -> None:
        self._run(self.afs.chmod(path, mode, follow_symlinks))

    def chown(self, path: PathLike, uid: int, gid: int, follow_symlinks: bool = True) -> None:
        self._run(self.afs.chown(path, uid, gid, follow_symlinks))

    def utime(self, path: PathLike, times: tuple[float, float] | None = None, *, ns: tuple[int, int] | None = None,
              follow_symlinks: bool = True) -> None:
        self._run(self.afs.utime(path, times, ns=ns, follow_symlinks=follow_symlinks))

    def truncate(self, path: PathLike, length: int) -> None:
        self._run(self.afs.truncate(path, length))

    def getxattr(self, path: PathLike, attribute: str | bytes, *, follow_symlinks: bool = True) -> bytes:
        return self._run(self.afs.getxattr(path, attribute, follow_symlinks=follow_symlinks))

    def setxattr(self, path: PathLike, attribute: str | bytes, value: bytes, flags: int = 0, *,
                 follow_symlinks: bool = True) -> None:
        self._run(self.afs.setxattr(path, attribute, value, flags, follow_symlinks=follow_symlinks))

    def listxattr(self, path: PathLike = "/", *, follow_symlinks: bool = True) -> list[str]:
        return self._run(self.afs.listxattr(path, follow_symlinks=follow_symlinks))

    def removexattr(self, path: PathLike, attribute: str | bytes, *, follow_symlinks: bool = True) -> None:
        self._run(self.afs.removexattr(path, attribute, follow_symlinks=follow_symlinks))

    def set_layout(self, path: PathLike, chunk_size: int | None = None, stripe: int | None = None,
                   table_id: int | None = None) -> None:
        self._run(self.afs.set_layout(path, chunk_size, stripe, table_id))

    def layout(self, path: PathLike) -> mpb.Layout:
        return self._run(self.afs.layout(path))

    def fsck(self, check_chunks: bool = True) -> mpb.FsckRsp:
        return self._run(self.afs.fsck(check_chunks))


def connect(mgmtd: str | list[str] | None = None, token: str | None = None, config: ClientConfig | None = None,
            *, profile: str | None = None, token_file: str | None = None, **options: Any) -> FileSystem:
    """Connect to an fs3 cluster: ``fs3.connect("127.0.0.1:9000", token_file="...")``.

    Whatever is left out (the address, the token, TLS) comes from a profile or the environment:
    ``fs3.connect()`` alone uses ``$FS3_MGMTD``/``$FS3_TOKEN`` or the ``default`` profile of
    ``~/.config/fs3/config.toml`` (:mod:`fs3.client.profiles`). Connects at once, so that a wrong
    address or token fails here.
    """
    with os_errors():
        settings = resolve(mgmtd, token, token_file=token_file, profile=profile)
    fs = FileSystem(settings, client_config(settings, config, options))
    fs._connected()
    return fs
