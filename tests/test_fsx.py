"""The randomized single-file exerciser (``tests/fsx.py``) on the FUSE mount and on the client library.

Each seed is a list of random operations on one file (writes, reads, truncates down and up by
handle and by path, ``mmap`` reads and writes, ``fsync``, ``O_TRUNC`` and ``O_APPEND`` opens,
close and reopen, up to three handles at once, files of several chunks with holes), checked byte
by byte against an in-memory model. Chunks are small (4-16 KiB) so a few dozen operations cross
many chunk boundaries.

Knobs (environment), for long runs (``make fsx FSX_SEEDS=500``):

* ``FS3_FSX_SEEDS`` — seeds per file under test (default 24); ``FS3_FSX_FIRST`` — the first seed;
* ``FS3_FSX_OPS`` — operations per seed (default 60);
* ``FS3_FSX_REPLAY`` — replay one failing list exactly as a report printed it.

The exerciser is itself tested: it must agree with a local file system, and it must catch files
with planted bugs (a dropped truncate, a truncate that keeps the old bytes, a misplaced append, a
lost ``mmap`` write), a model that disagrees with a correct file, and a client library whose
handle truncate is sabotaged.
"""

from __future__ import annotations

import errno
import itertools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import fs3
from fs3.client.files import AsyncFile
from fs3.client.sync_api import FileSystem
from tests.fsx import (
    ClientFile,
    HangGuard,
    MemoryFile,
    Model,
    Op,
    PosixFile,
    exercise,
    generate,
    parse_replay,
    run_ops,
)
from tests.harness import mounted_cluster, require_fuse
from tests.inproc import ClusterThread

pytestmark = pytest.mark.slow  # in-process clusters (and the FUSE mount)

CHUNK_SIZES = (4096, 8192, 16384)
SEEDS = int(os.environ.get("FS3_FSX_SEEDS", "24"))
FIRST = int(os.environ.get("FS3_FSX_FIRST", "1"))
OPS = int(os.environ.get("FS3_FSX_OPS", "60"))
REPLAY = parse_replay(os.environ["FS3_FSX_REPLAY"]) if os.environ.get("FS3_FSX_REPLAY") else None
RUN_TIMEOUT_S = 900 + SEEDS * OPS // 10  # a safety net that grows with a long run
HANG_LIMIT_S = 60.0  # one call into the mount taking longer is a hang


def _check(reports: list[str]) -> None:
    assert not reports, "\n\n".join(reports)


# -- the exerciser itself ---------------------------------------------------------------------------


def test_the_model_agrees_with_a_local_file_system(tmp_path: Path) -> None:
    """The model is POSIX: a local directory (the kernel's own file system) passes every seed."""
    names = itertools.count()
    _check(exercise("local", lambda chunk: PosixFile(str(tmp_path / f"f{next(names)}")), range(1, 21), 80,
                    CHUNK_SIZES))


def test_operation_lists_are_a_function_of_the_seed() -> None:
    assert generate(5, 50, 4096) == generate(5, 50, 4096)
    assert generate(5, 50, 4096) != generate(6, 50, 4096)
    kinds = {op.kind for seed in range(1, 30) for op in generate(seed, 60, 4096)}
    assert kinds == {"open", "close", "write", "read", "ftruncate", "truncate", "fsync", "stat", "mmap_read",
                     "mmap_write", "check"}
    modes = {op.arg for seed in range(1, 30) for op in generate(seed, 60, 4096) if op.kind == "open"}
    assert modes == {"rw", "trunc", "append", "ro"}


class _DropsPathTruncates(MemoryFile):
    def truncate(self, size: int) -> None:
        pass


class _TruncateKeepsOldBytes(MemoryFile):
    """Shrinking only moves the end: a later extension shows the old bytes instead of zeros."""

    def create(self) -> None:
        super().create()
        self.end = 0

    def truncate(self, size: int) -> None:
        if size < len(self.data):
            self.end = size
        else:
            self.data += bytes(size - len(self.data))
            self.end = size

    def pwrite(self, slot: int, offset: int, data: bytes) -> None:
        if self.modes[slot] == "append":
            offset = self.end
        if offset > len(self.data):
            self.data += bytes(offset - len(self.data))
        self.data[offset:offset + len(data)] = data
        self.end = max(self.end, offset + len(data))

    def open(self, slot: int, mode: str) -> None:
        super().open(slot, mode)
        if mode == "trunc":
            self.end = 0

    def pread(self, slot: int, offset: int, length: int) -> bytes:
        return bytes(self.data[offset:min(offset + length, self.end)])

    def size(self) -> int:
        return self.end

    def read_fresh(self) -> bytes:
        return bytes(self.data[:self.end])


class _AppendsAtTheOffset(MemoryFile):
    def pwrite(self, slot: int, offset: int, data: bytes) -> None:
        if offset > len(self.data):
            self.data += bytes(offset - len(self.data))
        self.data[offset:offset + len(data)] = data


class _LosesUnsyncedMmapWrites(MemoryFile):
    def mmap_write(self, slot: int, offset: int, data: bytes, sync: bool) -> None:
        if sync:
            super().mmap_write(slot, offset, data, sync)


@pytest.mark.parametrize("bad", [_DropsPathTruncates, _TruncateKeepsOldBytes, _AppendsAtTheOffset,
                                 _LosesUnsyncedMmapWrites])
def test_the_exerciser_catches_a_planted_bug(bad: type[MemoryFile]) -> None:
    assert not exercise("memory", lambda chunk: MemoryFile(), range(1, 31), 60, CHUNK_SIZES)
    reports = exercise("planted", lambda chunk: bad(), range(1, 31), 60, CHUNK_SIZES, max_reports=1)
    assert len(reports) == 1, f"{bad.__name__} was not caught"
    report = reports[0]
    assert "seed " in report and "FS3_FSX_REPLAY=" in report
    chunk_size, shrunk = parse_replay(report.split("FS3_FSX_REPLAY='")[1].split("'")[0])
    seed = int(report.split("seed ")[1].split(",")[0])
    assert run_ops(bad(), shrunk) is not None, "the printed reproduction must fail again"
    assert run_ops(MemoryFile(), shrunk) is None, "and only because of the bug"
    assert len(shrunk) < len(generate(seed, 60, chunk_size)), "the reproduction is shrunk"


def test_the_exerciser_catches_a_model_that_disagrees_with_the_file() -> None:
    class LosesLastByte(Model):
        def write(self, slot: int, offset: int, data: bytes) -> int:
            return super().write(slot, offset, data[:-1] + bytes(1))

    ops = generate(3, 60, 4096)
    assert run_ops(MemoryFile(), ops) is None
    failure = run_ops(MemoryFile(), ops, model=LosesLastByte())
    assert failure is not None and ("read" in failure.message or "difference" in failure.message)


def test_a_hung_call_is_reported_and_ends_the_exercise() -> None:
    """A call that never returns (a FUSE request never answered) must not hang the test run."""
    released = threading.Event()

    class Hangs(MemoryFile):
        def pwrite(self, slot: int, offset: int, data: bytes) -> None:
            assert released.wait(30), "the guard never stepped in"
            raise OSError(errno.ENOTCONN, "Transport endpoint is not connected")

    guard = HangGuard(0.5, released.set, "the file was let go")
    try:
        reports = exercise("hangs", lambda chunk: guard.wrap(Hangs()), range(1, 4), 40, CHUNK_SIZES, guard=guard)
    finally:
        guard.close()
    assert len(reports) == 1 and "hung for 0 s, then the file was let go" in reports[0]
    assert "seed 1," in reports[0] and "FS3_FSX_REPLAY=" in reports[0]


def test_a_bad_replay_is_refused_with_a_clear_error() -> None:
    for text in ("[]", '{"ops": []}', '{"chunk_size": 4096, "ops": [["explode", 0, 0, 0, 0]]}',
                 '{"chunk_size": 4096, "ops": [["write", 0]]}'):
        with pytest.raises(ValueError):
            parse_replay(text)
    assert parse_replay('{"chunk_size": 4096, "ops": [["open", 1, 0, 0, "rw"]]}') == (4096, [Op("open", 1, 0, 0, "rw")])


# -- the client library -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client_dirs(shared_cluster: ClusterThread) -> Iterator[tuple[FileSystem, dict[int, str]]]:
    fs = fs3.connect(shared_cluster.cluster.mgmtd_address, token=shared_cluster.cluster.token)
    try:
        dirs = {}
        for chunk in CHUNK_SIZES:
            dirs[chunk] = f"/fsx-{chunk}"
            fs.makedirs(dirs[chunk], exist_ok=True)
            fs.set_layout(dirs[chunk], chunk_size=chunk)
        yield fs, dirs
    finally:
        fs.close()


def _client_files(client_dirs: tuple[FileSystem, dict[int, str]], tag: str) -> Any:
    fs, dirs = client_dirs
    names = itertools.count()
    return lambda chunk: ClientFile(fs, f"{dirs[chunk]}/{tag}{next(names)}")


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_client_library_matches_the_model(client_dirs: tuple[FileSystem, dict[int, str]]) -> None:
    _check(exercise("client", _client_files(client_dirs, "c"), range(FIRST, FIRST + SEEDS), OPS, CHUNK_SIZES,
                    with_mmap=False, replay=REPLAY))


@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_client_library_with_a_length_hint_after_every_write(client_dirs: tuple[FileSystem, dict[int, str]],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Background length hints race with every truncate (normally they go once a second)."""
    monkeypatch.setattr("fs3.client.files._HINT_INTERVAL_S", 0.0)
    _check(exercise("client, eager hints", _client_files(client_dirs, "h"), range(FIRST, FIRST + max(1, SEEDS // 4)),
                    OPS, CHUNK_SIZES, with_mmap=False, replay=REPLAY))


def test_a_client_that_drops_handle_truncates_is_caught(client_dirs: tuple[FileSystem, dict[int, str]],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    async def dropped(self: AsyncFile, size: int | None = None) -> int:
        size = self.tell() if size is None else size
        await self.flush()
        self.fs.size_changed(self.inode.inode_id, size)  # the handles believe it; meta never hears of it
        return size

    monkeypatch.setattr(AsyncFile, "_truncate", dropped)
    reports = exercise("client, truncates dropped", _client_files(client_dirs, "s"), range(1, 21), 60, CHUNK_SIZES,
                       with_mmap=False, max_reports=1)
    assert reports and "ftruncate" in reports[0]


# -- the FUSE mount ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fuse_dirs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[int, Path], HangGuard]]:
    require_fuse()
    with mounted_cluster(tmp_path_factory.mktemp("fsx")) as (cluster, mnt):
        with fs3.connect(cluster.mgmtd_address, token="t") as fs:
            for chunk in CHUNK_SIZES:
                fs.mkdir(f"/fsx-{chunk}")
                fs.set_layout(f"/fsx-{chunk}", chunk_size=chunk)
        guard = HangGuard(HANG_LIMIT_S, lambda: cluster.kill("mount"), "the mount daemon was killed")
        try:
            yield {chunk: mnt / f"fsx-{chunk}" for chunk in CHUNK_SIZES}, guard
        finally:
            guard.close()
        if os.path.ismount(mnt):
            subprocess.run(["fusermount3", "-uz", str(mnt)], check=False)


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S)
def test_fuse_mount_matches_the_model(fuse_dirs: tuple[dict[int, Path], HangGuard]) -> None:
    dirs, guard = fuse_dirs
    names = itertools.count()
    _check(exercise("fuse", lambda chunk: guard.wrap(PosixFile(str(dirs[chunk] / f"f{next(names)}"))),
                    range(FIRST, FIRST + SEEDS), OPS, CHUNK_SIZES, replay=REPLAY, guard=guard))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
