"""A randomized single-file exerciser: random operations on one file, checked byte by byte against a model.

The classic file-system exerciser pattern (fsx): a seed gives a list of operations on one file —
writes, reads, truncates down and up, ``mmap`` reads and writes, ``fsync``, ``stat``, opens with
``O_TRUNC`` or ``O_APPEND``, close and reopen, several handles at once — and every operation is
applied to the file under test and to an in-memory model. Every read (through a handle, through
``mmap``, through a fresh handle) and every size must match the model exactly: bytes never written
(holes, extensions by truncate) read as zeros.

The operation list is a pure function of the seed, so a failure replays exactly. A failing run is
shrunk (operations dropped while it still fails) and reported with the seed and the operation
list, which :func:`run_ops` replays as is (``FS3_FSX_REPLAY`` in ``tests/test_fsx.py``).

Within one process the expected semantics are POSIX's: every handle sees every write and every
truncate the moment it returns. Files under test implement :class:`FileUnderTest`: the FUSE mount
(plain ``os`` calls), the client library (``fs3.client``), and an in-memory file used to test the
exerciser itself.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from fs3.client.sync_api import FileSystem, RawFile

__all__ = ["ClientFile", "Failure", "FileUnderTest", "HangGuard", "MemoryFile", "Model", "Op", "PosixFile",
           "exercise", "format_failure", "generate", "minimize", "parse_replay", "run_ops"]

MODES = ("rw", "trunc", "append", "ro")
SLOTS = 3
_KINDS = ("open", "close", "write", "read", "ftruncate", "truncate", "fsync", "stat", "mmap_read", "mmap_write",
          "check")


class Op(NamedTuple):
    """One operation. ``arg``: the open mode, a write's data seed, or (mmap writes) the data seed
    with bit 0 saying whether to ``msync`` before unmapping."""

    kind: str
    slot: int = 0
    offset: int = 0
    length: int = 0
    arg: int | str = 0


def data_for(seed: int, length: int) -> bytes:
    """The bytes a write with this seed writes (never all zeros, so a lost write shows)."""
    return random.Random(seed).randbytes(length).replace(b"\x00", b"\x01")


class FileUnderTest(Protocol):
    """One file, opened through up to :data:`SLOTS` handles. Calls are always valid for the model's
    state (a slot is open before it is used; writes only on writable slots)."""

    supports_mmap: bool

    def create(self) -> None: ...

    def open(self, slot: int, mode: str) -> None: ...

    def close(self, slot: int) -> None: ...

    def pwrite(self, slot: int, offset: int, data: bytes) -> None:
        """Write at ``offset`` (a slot opened in ``append`` mode writes at the end instead)."""

    def pread(self, slot: int, offset: int, length: int) -> bytes: ...

    def ftruncate(self, slot: int, size: int) -> None: ...

    def truncate(self, size: int) -> None:
        """Truncate by path (the open handles stay open)."""

    def fsync(self, slot: int) -> None: ...

    def size(self) -> int: ...

    def read_fresh(self) -> bytes:
        """The whole file through a handle opened (and closed) for this read."""

    def mmap_read(self, slot: int, offset: int, length: int) -> bytes: ...

    def mmap_write(self, slot: int, offset: int, data: bytes, sync: bool) -> None: ...

    def close_all(self) -> None: ...


class Model:
    """What the file must hold: its bytes, and which slots are open in which mode."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.slots: dict[int, str] = {}

    def write(self, slot: int, offset: int, data: bytes) -> int:
        """Apply a write; returns where it landed (the end, for an append handle)."""
        if self.slots[slot] == "append":
            offset = len(self.data)
        if offset > len(self.data):
            self.data += bytes(offset - len(self.data))
        self.data[offset:offset + len(data)] = data
        return offset

    def truncate(self, size: int) -> None:
        if size < len(self.data):
            del self.data[size:]
        else:
            self.data += bytes(size - len(self.data))

    def open(self, slot: int, mode: str) -> None:
        self.slots[slot] = mode
        if mode == "trunc":
            self.truncate(0)


def _readable(mode: str | None) -> bool:
    return mode is not None


def _writable(mode: str | None) -> bool:
    return mode in ("rw", "trunc", "append")


# -- generating operations ------------------------------------------------------------------------


def generate(seed: int, count: int, chunk_size: int, with_mmap: bool = True) -> list[Op]:
    """``count`` operations for ``seed`` on a file of up to six chunks (a pure function of its inputs)."""
    rng = random.Random(seed)
    max_size = 6 * chunk_size
    model = Model()
    ops: list[Op] = []

    def offset_in(size: int) -> int:
        pick = rng.random()
        if pick < 0.35 or size == 0:
            # Near a chunk boundary: the cases that cross chunks or land on the first byte of one.
            boundary = rng.randrange(0, max_size // chunk_size + 1) * chunk_size
            return max(0, min(max_size, boundary + rng.randint(-3, 3)))
        if pick < 0.8:
            return rng.randrange(0, size + 1)
        return min(max_size, size + rng.randrange(1, 2 * chunk_size))  # past the end: a hole

    def length(limit: int) -> int:
        pick = rng.random()
        n = rng.randint(1, 16) if pick < 0.3 else rng.randint(1, chunk_size) if pick < 0.7 else \
            rng.randint(chunk_size, 5 * chunk_size // 2)
        return max(1, min(n, limit))

    while len(ops) < count:
        size = len(model.data)
        open_slots = sorted(model.slots)
        writable = [s for s in open_slots if _writable(model.slots[s])]
        mappable = [s for s in open_slots if model.slots[s] in ("rw", "trunc")]
        kind = rng.choices(
            _KINDS,
            weights=[8 if len(open_slots) < SLOTS else 2, 3 if open_slots else 0, 30 if writable else 0,
                     20 if open_slots else 0, 7 if writable else 0, 5, 3 if open_slots else 0, 4,
                     5 if with_mmap and mappable and size else 0, 5 if with_mmap and mappable and size else 0, 2])[0]
        if kind == "open":
            slot = rng.randrange(SLOTS)
            mode = rng.choices(MODES, weights=[5, 1, 2, 2])[0]
            model.slots.pop(slot, None)
            model.open(slot, mode)
            ops.append(Op("open", slot, arg=mode))
        elif kind == "close":
            slot = rng.choice(open_slots)
            del model.slots[slot]
            ops.append(Op("close", slot))
        elif kind == "write":
            slot = rng.choice(writable)
            offset = offset_in(size)
            n = length(max_size - offset) if offset < max_size else 1
            if model.slots[slot] == "append":
                n = max(1, min(n, max_size - size))
            model.write(slot, offset, data_for(len(ops), n))
            ops.append(Op("write", slot, offset, n, len(ops)))
        elif kind == "read":
            offset = offset_in(size)
            ops.append(Op("read", rng.choice(open_slots), offset, length(5 * chunk_size // 2)))
        elif kind in ("ftruncate", "truncate"):
            new = rng.choice([0, rng.randrange(0, size + 1), offset_in(size), offset_in(size),
                              min(max_size, size + rng.randrange(1, 2 * chunk_size))])
            model.truncate(new)
            ops.append(Op(kind, rng.choice(writable) if kind == "ftruncate" else 0, new))
        elif kind == "fsync":
            ops.append(Op("fsync", rng.choice(open_slots)))
        elif kind in ("stat", "check"):
            ops.append(Op(kind))
        else:
            offset = rng.randrange(0, size)
            n = length(size - offset)
            slot = rng.choice(mappable)
            if kind == "mmap_read":
                ops.append(Op("mmap_read", slot, offset, n))
            else:
                seed_and_sync = len(ops) * 2 + rng.randrange(2)
                model.write(slot, offset, data_for(seed_and_sync, n))
                ops.append(Op("mmap_write", slot, offset, n, seed_and_sync))
    return ops


# -- running operations ---------------------------------------------------------------------------


@dataclass
class Failure:
    """Where a run first disagreed with the model, and how."""

    index: int
    op: Op | None
    message: str


def _first_difference(got: bytes, want: bytes) -> str:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return f"first difference at byte {i}: got {got[i:i + 8].hex()} want {want[i:i + 8].hex()}"
    return f"got {len(got)} bytes, want {len(want)}"


def run_ops(file: FileUnderTest, ops: Sequence[Op], model: Model | None = None) -> Failure | None:
    """Apply ``ops`` to ``file`` and to the model; the first disagreement (or error), else None.

    An operation the model's state makes invalid (a closed slot, mmap of an empty file) is skipped,
    so any sub-list of a generated list is a valid run: that is what lets :func:`minimize` drop
    operations freely. Finishes by closing every handle and reading the file afresh.
    """
    model = model or Model()
    index = -1
    op: Op | None = None
    try:
        file.create()
        for index, op in enumerate(ops):
            failure = _apply(file, model, op)
            if failure is not None:
                return Failure(index, op, failure)
        index, op = len(ops), None
        file.close_all()
        model.slots.clear()
        if file.size() != len(model.data):
            return Failure(index, None, f"after closing every handle: size {file.size()}, model {len(model.data)}")
        got = file.read_fresh()
        if got != bytes(model.data):
            return Failure(index, None, f"after closing every handle: {_first_difference(got, bytes(model.data))}")
    except Exception as exc:  # any error of the file under test is a finding
        return Failure(index, op, f"{type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(Exception):  # the run's verdict is already decided
            file.close_all()
    return None


def _apply(file: FileUnderTest, model: Model, op: Op) -> str | None:
    mode = model.slots.get(op.slot)
    size = len(model.data)
    if op.kind == "open":
        if mode is not None:
            file.close(op.slot)
            del model.slots[op.slot]
        model.open(op.slot, str(op.arg))
        file.open(op.slot, str(op.arg))
    elif op.kind == "close":
        if mode is not None:
            file.close(op.slot)
            del model.slots[op.slot]
    elif op.kind == "write":
        if _writable(mode):
            data = data_for(int(op.arg), op.length)
            model.write(op.slot, op.offset, data)
            file.pwrite(op.slot, op.offset, data)
    elif op.kind == "read":
        if _readable(mode):
            got = file.pread(op.slot, op.offset, op.length)
            want = bytes(model.data[op.offset:op.offset + op.length])
            if got != want:
                return f"read [{op.offset}, +{op.length}) of a {size}-byte file: {_first_difference(got, want)}"
    elif op.kind == "ftruncate":
        if _writable(mode):
            model.truncate(op.offset)
            file.ftruncate(op.slot, op.offset)
    elif op.kind == "truncate":
        model.truncate(op.offset)
        file.truncate(op.offset)
    elif op.kind == "fsync":
        if mode is not None:
            file.fsync(op.slot)
    elif op.kind == "stat":
        if file.size() != size:
            return f"stat: size {file.size()}, model {size}"
    elif op.kind == "check":
        got = file.read_fresh()
        if got != bytes(model.data):
            return f"fresh read: {_first_difference(got, bytes(model.data))}"
    elif op.kind in ("mmap_read", "mmap_write"):
        if mode not in ("rw", "trunc") or not file.supports_mmap or op.offset >= size:
            return None
        n = min(op.length, size - op.offset)
        if op.kind == "mmap_read":
            got = file.mmap_read(op.slot, op.offset, n)
            want = bytes(model.data[op.offset:op.offset + n])
            if got != want:
                return f"mmap read [{op.offset}, +{n}) of a {size}-byte file: {_first_difference(got, want)}"
        else:
            data = data_for(int(op.arg), n)
            model.write(op.slot, op.offset, data)
            file.mmap_write(op.slot, op.offset, data, sync=bool(int(op.arg) & 1))
    else:
        raise ValueError(f"unknown operation {op.kind!r}")
    return None


def minimize(make_file: Callable[[], FileUnderTest], ops: Sequence[Op], max_runs: int = 150,
             max_seconds: float = 60.0) -> list[Op]:
    """A shorter list that still fails: drop ever smaller runs of operations while it keeps failing.

    Bounded by ``max_runs`` replays and ``max_seconds``; the result fails, but need not be minimal.
    """
    current = list(ops)
    failure = run_ops(make_file(), current)
    if failure is None:
        return current
    current = current[:failure.index + 1]  # what follows the failure is not needed to show it
    deadline = time.monotonic() + max_seconds
    runs = 0
    step = max(1, len(current) // 2)
    while step >= 1 and runs < max_runs and time.monotonic() < deadline:
        start = 0
        shrunk = False
        while start < len(current) and runs < max_runs and time.monotonic() < deadline:
            candidate = current[:start] + current[start + step:]
            runs += 1
            found = run_ops(make_file(), candidate)
            if found is not None:
                current = candidate[:found.index + 1]
                shrunk = True
            else:
                start += step
        if not shrunk:
            step //= 2
    return current


def format_failure(name: str, seed: int | None, chunk_size: int, ops: Sequence[Op], failure: Failure,
                   shrunk: Sequence[Op]) -> str:
    """The report of a failing run: enough to replay it without the seed's generator."""
    shown = shrunk if shrunk else ops
    replay = json.dumps({"chunk_size": chunk_size, "ops": [list(o) for o in shown]})
    lines = [f"fsx ({name}) seed {seed}, chunk size {chunk_size}: operation {failure.index} of {len(ops)} "
             f"{tuple(failure.op) if failure.op else '(final check)'}: {failure.message}",
             f"shrunk to {len(shown)} operations; replay with FS3_FSX_REPLAY='{replay}'"]
    lines += [f"  {i:3d} {tuple(o)}" for i, o in enumerate(shown)]
    return "\n".join(lines)


def parse_replay(text: str) -> tuple[int, list[Op]]:
    """``(chunk_size, operations)`` from ``FS3_FSX_REPLAY`` (as :func:`format_failure` prints it)."""
    raw = json.loads(text)
    if not isinstance(raw, dict) or not isinstance(raw.get("ops"), list) or not isinstance(raw.get("chunk_size"), int):
        raise ValueError('FS3_FSX_REPLAY must be {"chunk_size": N, "ops": [[kind, slot, offset, length, arg], ...]}')
    ops = []
    for r in raw["ops"]:
        if not isinstance(r, list) or len(r) != 5 or r[0] not in _KINDS:
            raise ValueError(f"not an operation: {r!r}")
        ops.append(Op(str(r[0]), int(r[1]), int(r[2]), int(r[3]), r[4] if isinstance(r[4], str) else int(r[4])))
    return raw["chunk_size"], ops


def chunk_size_for(seed: int, chunk_sizes: Sequence[int]) -> int:
    return chunk_sizes[seed % len(chunk_sizes)]


def exercise(name: str, make_file: Callable[[int], FileUnderTest], seeds: Sequence[int], count: int,
             chunk_sizes: Sequence[int], with_mmap: bool = True, replay: tuple[int, list[Op]] | None = None,
             max_reports: int = 3, guard: HangGuard | None = None) -> list[str]:
    """Run every seed (or the replayed list); the reports of the failing ones (shrunk), in order.

    ``make_file(chunk_size)`` gives a fresh file whose layout has that chunk size; seed ``s`` uses
    ``chunk_sizes[s % len(chunk_sizes)]``. With a ``guard`` (whose :meth:`HangGuard.wrap` the
    files are made with), a run that hung ends the exercise: its report has the whole list.
    """
    reports: list[str] = []
    runs: list[tuple[int | None, int, list[Op]]] = [(None, replay[0], replay[1])] if replay is not None else [
        (seed, chunk_size_for(seed, chunk_sizes), generate(seed, count, chunk_size_for(seed, chunk_sizes), with_mmap))
        for seed in seeds]
    for seed, chunk_size, ops in runs:
        failure = run_ops(make_file(chunk_size), ops)
        if failure is not None and guard is not None and guard.hung:
            reports.append(format_failure(name, seed, chunk_size, ops, Failure(
                failure.index, failure.op, f"hung for {guard.limit_s:.0f} s, then {guard.action}: {failure.message}"),
                ops))
            break  # nothing more can run
        if failure is not None:
            shrunk = minimize(lambda c=chunk_size: make_file(c), ops)  # type: ignore[misc]
            again = run_ops(make_file(chunk_size), shrunk)
            reports.append(format_failure(name, seed, chunk_size, ops, failure if again is None else again, shrunk))
            if len(reports) >= max_reports:
                break  # enough to act on; each shrink replays the run many times
    return reports


class HangGuard:
    """Watches the calls into files it wrapped: one that takes longer than ``limit_s`` gets
    ``on_hang`` called once (for a FUSE mount: kill the daemon, so the kernel fails the call —
    a process waiting on a FUSE request cannot be interrupted otherwise, and a hung mount would
    hang the whole test run)."""

    def __init__(self, limit_s: float, on_hang: Callable[[], None], action: str) -> None:
        self.limit_s = limit_s
        self.action = action
        self.hung = False
        self._on_hang = on_hang
        self._started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="fsx-hang-guard", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(min(1.0, self.limit_s / 4)):
            started = self._started
            if started is not None and not self.hung and time.monotonic() - started > self.limit_s:
                self.hung = True
                self._on_hang()

    def call(self, fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        self._started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self._started = None

    def wrap(self, file: FileUnderTest) -> FileUnderTest:
        return _Guarded(self, file)  # type: ignore[return-value]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class _Guarded:
    def __init__(self, guard: HangGuard, file: FileUnderTest) -> None:
        self._guard = guard
        self._file = file
        self.supports_mmap = file.supports_mmap

    def __getattr__(self, name: str) -> object:
        method = getattr(self._file, name)
        return lambda *args, **kwargs: self._guard.call(method, *args, **kwargs)


# -- files under test -----------------------------------------------------------------------------


class MemoryFile:
    """An in-memory file with POSIX semantics: the exerciser's own reference, and (subclassed with a
    planted bug) its known-bad input."""

    supports_mmap = True

    def __init__(self) -> None:
        self.data = bytearray()
        self.modes: dict[int, str] = {}

    def create(self) -> None:
        self.data = bytearray()

    def open(self, slot: int, mode: str) -> None:
        self.modes[slot] = mode
        if mode == "trunc":
            self.data = bytearray()

    def close(self, slot: int) -> None:
        del self.modes[slot]

    def pwrite(self, slot: int, offset: int, data: bytes) -> None:
        if self.modes[slot] == "append":
            offset = len(self.data)
        if offset > len(self.data):
            self.data += bytes(offset - len(self.data))
        self.data[offset:offset + len(data)] = data

    def pread(self, slot: int, offset: int, length: int) -> bytes:
        return bytes(self.data[offset:offset + length])

    def ftruncate(self, slot: int, size: int) -> None:
        self.truncate(size)

    def truncate(self, size: int) -> None:
        if size < len(self.data):
            del self.data[size:]
        else:
            self.data += bytes(size - len(self.data))

    def fsync(self, slot: int) -> None:
        pass

    def size(self) -> int:
        return len(self.data)

    def read_fresh(self) -> bytes:
        return bytes(self.data)

    def mmap_read(self, slot: int, offset: int, length: int) -> bytes:
        return self.pread(slot, offset, length)

    def mmap_write(self, slot: int, offset: int, data: bytes, sync: bool) -> None:
        self.data[offset:offset + len(data)] = data

    def close_all(self) -> None:
        self.modes.clear()


_OPEN_FLAGS = {"rw": os.O_RDWR, "trunc": os.O_RDWR | os.O_TRUNC, "append": os.O_RDWR | os.O_APPEND,
               "ro": os.O_RDONLY}


class PosixFile:
    """A file reached through ``os`` calls (a FUSE mount, or a local directory as a reference)."""

    supports_mmap = True

    def __init__(self, path: str) -> None:
        self.path = path
        self.fds: dict[int, int] = {}

    def create(self) -> None:
        os.close(os.open(self.path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644))

    def open(self, slot: int, mode: str) -> None:
        self.fds[slot] = os.open(self.path, _OPEN_FLAGS[mode])

    def close(self, slot: int) -> None:
        os.close(self.fds.pop(slot))

    def pwrite(self, slot: int, offset: int, data: bytes) -> None:
        # Linux appends on an O_APPEND descriptor whatever the offset (pwrite(2), BUGS).
        written = os.pwrite(self.fds[slot], data, offset)
        if written != len(data):
            raise OSError(f"short write: {written} of {len(data)} bytes")

    def pread(self, slot: int, offset: int, length: int) -> bytes:
        return os.pread(self.fds[slot], length, offset)

    def ftruncate(self, slot: int, size: int) -> None:
        os.ftruncate(self.fds[slot], size)

    def truncate(self, size: int) -> None:
        os.truncate(self.path, size)

    def fsync(self, slot: int) -> None:
        os.fsync(self.fds[slot])

    def size(self) -> int:
        return os.stat(self.path).st_size

    def read_fresh(self) -> bytes:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            parts = []
            while piece := os.read(fd, 1 << 20):
                parts.append(piece)
            return b"".join(parts)
        finally:
            os.close(fd)

    def _map(self, slot: int, offset: int, length: int) -> tuple[mmap.mmap, int]:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        return mmap.mmap(self.fds[slot], offset + length - start, offset=start), offset - start

    def mmap_read(self, slot: int, offset: int, length: int) -> bytes:
        mapped, at = self._map(slot, offset, length)
        with mapped:
            return bytes(mapped[at:at + length])

    def mmap_write(self, slot: int, offset: int, data: bytes, sync: bool) -> None:
        mapped, at = self._map(slot, offset, len(data))
        with mapped:
            mapped[at:at + len(data)] = data
            if sync:
                mapped.flush()

    def close_all(self) -> None:
        for slot in list(self.fds):
            self.close(slot)


_CLIENT_MODES = {"rw": "r+b", "trunc": "w+b", "append": "a+b", "ro": "rb"}


class ClientFile:
    """A file reached through the blocking client library (``fs3.connect``): unbuffered files
    (``buffering=0``) over :class:`~fs3.client.files.AsyncFile`, ``truncate`` and ``stat`` by path.

    Reads alternate between the positional path (``pread``) and seek-and-read, which goes through
    the handle's sequential read-ahead.
    """

    supports_mmap = False

    def __init__(self, fs: FileSystem, path: str) -> None:
        self.fs = fs
        self.path = path
        self.files: dict[int, RawFile] = {}

    def create(self) -> None:
        self.fs.open(self.path, "wb", buffering=0).close()

    def open(self, slot: int, mode: str) -> None:
        self.files[slot] = self.fs.open(self.path, _CLIENT_MODES[mode], buffering=0)

    def close(self, slot: int) -> None:
        self.files.pop(slot).close()

    def pwrite(self, slot: int, offset: int, data: bytes) -> None:
        raw = self.files[slot]
        raw.seek(offset)
        written = raw.write(data)
        if written != len(data):
            raise OSError(f"short write: {written} of {len(data)} bytes")

    def pread(self, slot: int, offset: int, length: int) -> bytes:
        raw = self.files[slot]
        if offset % 2:
            return self.fs._run(raw.afile.pread(offset, length))
        raw.seek(offset)
        return raw.read(length) or b""

    def ftruncate(self, slot: int, size: int) -> None:
        self.files[slot].truncate(size)

    def truncate(self, size: int) -> None:
        self.fs.truncate(self.path, size)

    def fsync(self, slot: int) -> None:
        self.files[slot].fsync()

    def size(self) -> int:
        return self.fs.stat(self.path).st_size

    def read_fresh(self) -> bytes:
        return self.fs.read_bytes(self.path)

    def mmap_read(self, slot: int, offset: int, length: int) -> bytes:
        raise NotImplementedError("the client library has no mmap")

    def mmap_write(self, slot: int, offset: int, data: bytes, sync: bool) -> None:
        raise NotImplementedError("the client library has no mmap")

    def close_all(self) -> None:
        for slot in list(self.files):
            self.close(slot)
