"""The ``io`` raw layer over one open fs3 handle, for Python's own buffered file objects to sit on.

Two blocking front ends put an :class:`io.RawIOBase` over an :class:`~fs3.client.files.AsyncFile`:
the blocking API (:mod:`fs3.client.sync_api`, every binary file) and the fsspec file system
(:mod:`fs3.client.fsspec_impl`, its ``+`` modes). What the raw layer does with the handle is the
same in both — it says what the handle may do, and runs each read, write, truncate, flush, fsync and
close of it to completion — so it is written once, here. What differs stays with each: which event
loop runs the handle's coroutines (:meth:`RawHandleIO._run`: the blocking API's own loop thread,
or fsspec's IO loop), whether a forked child may touch a handle its parent opened
(:meth:`RawHandleIO._owned_here`), how a seek reaches the handle, and how a file dropped without
``close`` is closed.
"""

from __future__ import annotations

import abc
import io
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from fs3.client.files import AsyncFile

__all__ = ["BufferedFsync", "RawHandleIO"]

P = ParamSpec("P")
T = TypeVar("T")


class RawHandleIO(io.RawIOBase):
    """Unbuffered binary access to one open fs3 handle; see the module doc for what subclasses add.

    ``seek`` is left to the subclasses, which both run it on the client's loop through
    :func:`seek_on_loop`: ``AsyncFile.seek`` is a plain call, but moving the position cancels the
    handle's read-ahead tasks, which only the loop's own thread may do.
    """

    def __init__(self, afile: AsyncFile, mode: str) -> None:
        super().__init__()
        self.afile = afile
        self.name = afile.name
        self.mode = mode

    @abc.abstractmethod
    def _run(self, func: Callable[P, Coroutine[Any, Any, T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``func(*args, **kwargs)`` on the loop that owns the handle and wait for its result."""

    def _owned_here(self) -> bool:
        """Whether this process may use the handle for a flush or a close. A front end whose handles
        do not cross ``os.fork()`` says no in a child: there the handle is the parent's, and a flush
        or close sent from the child would act on it behind the parent's back."""
        return True

    def readable(self) -> bool:
        return self.afile.readable

    def writable(self) -> bool:
        return self.afile.writable

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._checkClosed()
        return self._run(self.afile.readinto, buffer)

    def write(self, data: Any) -> int:
        self._checkClosed()
        # No copy: the caller's buffer is copied into the file's chunk buffers before write returns.
        return self._run(self.afile.write, data)

    def tell(self) -> int:
        self._checkClosed()
        return self.afile.tell()

    def truncate(self, size: int | None = None) -> int:
        self._checkClosed()
        return self._run(self.afile.truncate, size)

    def flush(self) -> None:
        if not self.closed and self._owned_here():
            self._run(self.afile.flush)

    def fsync(self) -> None:
        self._checkClosed()
        self._run(self.afile.fsync)

    def close(self) -> None:
        if not self.closed:
            try:
                if self._owned_here():
                    self._run(self.afile.close)
            finally:
                super().close()


class BufferedFsync:
    """``fsync()`` for a buffered object over a :class:`RawHandleIO` (a mixin, before the ``io``
    class): push the buffer into the raw layer, then make the data durable — ``io``'s buffered
    classes have no ``fsync`` of their own, and a local file's is ``os.fsync`` on its descriptor."""

    def fsync(self) -> None:
        self.flush()  # type: ignore[attr-defined]
        raw = self.raw  # type: ignore[attr-defined]
        assert isinstance(raw, RawHandleIO)
        raw.fsync()


async def seek_on_loop(afile: AsyncFile, offset: int, whence: int = 0) -> int:
    """``AsyncFile.seek`` on the loop that owns the handle: a seek that moves cancels read-ahead
    tasks, and asyncio tasks may only be cancelled from their own loop's thread."""
    return afile.seek(offset, whence)
