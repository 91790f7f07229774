"""Record reads through :mod:`fs3.usrbio` for shards on an fs3 FUSE mount.

:class:`~haiscale.data.records.LocalFileSystem` reads a batch of records with one ``pread`` per
record: through an fs3 mount, one FUSE request (and one Python request in the mount daemon) per
record. :class:`UsrbioFileSystem` is the same file system with ``read_many`` going through a
usrbio ring instead: the whole batch in one submit, read by the daemon with one ``BatchRead``
per storage node into shared memory, then copied once into the caller's buffer. Files on other
file systems are read as ``LocalFileSystem`` reads them.

:func:`~haiscale.data.dataset.open_location` picks it for a local path whose mount serves usrbio
(``HAISCALE_USRBIO=0`` keeps ``LocalFileSystem``). Rings, buffers and registrations belong to one
process: a forked or unpickled copy makes its own on first use.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from fs3.usrbio import IOV_BYTES_MAX, IoRing, Iov, server_socket
from haiscale.data.records import LocalFileSystem, _prepare_ranges

__all__ = ["UsrbioFileSystem", "usrbio_enabled"]

_IOV_BYTES_MIN = 16 << 20
_REGISTERED_MAX = 4096     # files remembered per process (a dataset's shards, usually far fewer)


def usrbio_enabled(path: str) -> bool:
    """Whether reads of ``path`` can go through usrbio: on an fs3 mount that serves it, unless
    ``$HAISCALE_USRBIO`` is ``0``."""
    return os.environ.get("HAISCALE_USRBIO", "1") != "0" and server_socket(path) is not None


class UsrbioFileSystem(LocalFileSystem):
    """:class:`LocalFileSystem` whose ``read_many`` uses a usrbio ring per fs3 mount."""

    def __init__(self, entries: int = 256) -> None:
        self.entries = entries
        self._pid = -1
        self._rings: dict[int, IoRing | None] = {}       # st_dev -> ring (None: not usrbio)
        self._files: dict[Any, tuple[int, int]] = {}     # file key -> (st_dev, file id)
        self._held: dict[Any, Any] = {}                  # file key -> the file object (ids stay unique)
        self._iov: Iov | None = None

    def __repr__(self) -> str:
        return f"UsrbioFileSystem(entries={self.entries})"

    def __getstate__(self) -> dict[str, Any]:
        return {"entries": self.entries}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["entries"])  # type: ignore[misc]

    def _this_process(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's rings are the parent's
            self._pid, self._rings, self._files, self._held, self._iov = os.getpid(), {}, {}, {}, None

    def _buffer(self, size_bytes: int) -> Iov:
        if self._iov is None or self._iov.size_bytes < size_bytes:
            if self._iov is not None:
                self._iov.close()
            want = _IOV_BYTES_MIN
            while want < size_bytes:
                want *= 2
            self._iov = Iov(min(want, IOV_BYTES_MAX))
        return self._iov

    def _locate(self, file: Any) -> tuple[IoRing | None, int]:
        """The ring serving ``file`` (a path or an open file) and its id there; (None, 0) when it is
        not on a usrbio mount."""
        key = file if isinstance(file, str) else (id(file), file.fileno())
        known = self._files.get(key)
        if known is not None:
            return self._rings[known[0]], known[1]
        st = os.stat(file) if isinstance(file, str) else os.fstat(file.fileno())
        if st.st_dev not in self._rings:
            where = file if isinstance(file, str) else f"/proc/self/fd/{file.fileno()}"
            sock = server_socket(where)
            self._rings[st.st_dev] = IoRing(where, entries=self.entries) if sock is not None else None
        ring = self._rings[st.st_dev]
        if ring is None:
            return None, 0
        file_id = ring.register(file if isinstance(file, str) else file.fileno())
        if len(self._files) >= _REGISTERED_MAX:
            self._files.clear()
            self._held.clear()
        self._files[key] = (st.st_dev, file_id)
        self._held[key] = file
        return ring, file_id

    def read_many(self, ranges: Sequence[tuple[Any, int, int]], buffer: Any = None) -> list[memoryview]:
        """Each ``(file, offset, length)`` into ``buffer`` (or a new bytearray), back to back in
        range order; one view per range, short where its file ends (``LocalFileSystem``'s)."""
        views = _prepare_ranges(ranges, buffer)
        self._this_process()
        got = [0] * len(ranges)
        by_ring: dict[int, tuple[IoRing, list[tuple[int, int]]]] = {}
        for index, (file, offset, length) in enumerate(ranges):
            ring, file_id = self._locate(file)
            if ring is None:  # not on a usrbio mount: as LocalFileSystem reads it
                got[index] = LocalFileSystem.read_many(self, [(file, offset, length)], views[index])[0].nbytes
            elif length:
                by_ring.setdefault(id(ring), (ring, []))[1].append((index, file_id))
        for ring, entries in by_ring.values():
            self._read_on(ring, entries, ranges, views, got)
        return [view[:n] for view, n in zip(views, got, strict=True)]

    def _read_on(self, ring: IoRing, entries: list[tuple[int, int]], ranges: Sequence[tuple[Any, int, int]],
                 views: list[memoryview], got: list[int]) -> None:
        """Read ``entries`` ((range index, file id) each) on ``ring``: batches that fit the ring and
        the buffer, each copied out of the shared buffer once it completes."""
        iov = self._buffer(max(ranges[index][2] for index, _ in entries))
        at = 0
        while at < len(entries):
            placed: dict[int, int] = {}  # range index -> where it lands in the buffer
            used = 0
            while at < len(entries) and len(placed) < ring.entries:
                index, file_id = entries[at]
                _, offset, length = ranges[index]
                if used + length > iov.size_bytes:
                    break
                ring.prep_io(iov, file_id, offset, length, iov_offset=used, userdata=index)
                placed[index] = used
                used += length
                at += 1
            ring.submit()
            finished = ring.wait(min_results=len(placed))  # all of them, before any error is raised
            for done in finished:
                n = done.check()
                start = placed[done.userdata]
                views[done.userdata][:n] = iov.view[start:start + n]
                got[done.userdata] = n

    def close(self) -> None:
        """Close this process's rings (their registrations go with them) and its buffer."""
        if self._pid == os.getpid():
            for ring in self._rings.values():
                if ring is not None:
                    ring.close()
            if self._iov is not None:
                self._iov.close()
        self._pid, self._rings, self._files, self._held, self._iov = -1, {}, {}, {}, None
