"""Which data worker holds which open file (:mod:`fs3.vfs.workers`), without processes or a mount.

The mount tests (test_fuse_workers.py) cover the behaviour through the kernel; here the routing
rules that the kernel rarely exercises: a create racing with an open of the same file elsewhere
in the mount ends on the worker that holds the file, and a dead worker's files move on.
"""

from __future__ import annotations

import asyncio
import errno
import os
import types
from typing import Any, cast

import pytest

from fs3 import meta_pb2 as mpb
from fs3.client.fs import AsyncFileSystem
from fs3.client.meta import name_ref
from fs3.common.posix import O_CREAT, O_TRUNC, O_WRONLY
from fs3.vfs.workers import DataWorker, DataWorkers, ReadSlots, WorkerVfs, worker_for_name


class FakeWorker:
    """Answers opens with a canned inode; records every call."""

    def __init__(self, index: int, inode_id: int) -> None:
        self.index = index
        self.alive = True
        self.inode_id = inode_id
        self.calls: list[tuple[Any, ...]] = []
        self.hids = 0

    async def request(self, op: str, *args: Any) -> Any:
        self.calls.append((op, *args))
        if op == "open":
            self.hids += 1
            rsp = mpb.OpenRsp(inode=mpb.Inode(inode_id=self.inode_id, type=mpb.FILE), created=False)
            return rsp.SerializeToString(), self.hids
        return None


def _pool(count: int, inode_id: int) -> tuple[DataWorkers, list[FakeWorker]]:
    fakes = [FakeWorker(i, inode_id) for i in range(count)]
    return DataWorkers(cast(list[DataWorker], fakes)), fakes


def _vfs(pool: DataWorkers) -> WorkerVfs:
    fs = cast(AsyncFileSystem, types.SimpleNamespace(metadata=None))
    return WorkerVfs(fs, pool)


def test_a_create_of_a_file_open_on_another_worker_moves_there() -> None:
    pool, fakes = _pool(3, inode_id=7)
    holder = fakes[1]
    pool.claim(7, cast(DataWorker, holder))  # a handle of inode 7 is open on worker 1
    name = next(n for n in (b"n%d" % i for i in range(40)) if worker_for_name(1, n, 3) != 1)
    creator = fakes[worker_for_name(1, name, 3)]
    vfs = _vfs(pool)
    rsp = asyncio.run(vfs._open_at_meta(name_ref(1, name), O_CREAT | O_WRONLY | O_TRUNC, mpb.User(uid=0)))
    assert rsp.inode.inode_id == 7
    assert [c[0] for c in creator.calls] == ["open", "close"]   # opened by name, then let go
    op, target, flags, *_ = holder.calls[-1]
    assert op == "open" and target == 7 and flags == O_WRONLY  # again by inode, nothing to create or cut
    assert pool.owner(7) is cast(DataWorker, holder)
    assert vfs._opened[id(rsp)][1] is cast(DataWorker, holder)


def test_handles_of_an_inode_stay_together_and_a_dead_workers_files_move_on() -> None:
    pool, fakes = _pool(3, inode_id=10)
    first = pool.claim(10)
    assert pool.claim(10) is first          # a second handle: the same worker
    pool.release(10, first)
    assert pool.owner(10) is first          # one handle still open
    cast(FakeWorker, first).alive = False
    assert pool.owner(10) is None
    moved = pool.claim(10)
    assert moved is not first and moved.alive
    pool.release(10, first)                 # the dead worker's handle closes: the new owner stays
    assert pool.owner(10) is moved
    pool.release(10, moved)
    assert pool.owner(10) is None
    for fake in fakes:
        fake.alive = False
    with pytest.raises(OSError, match="every data worker"):
        pool.claim(11)


def test_read_slots_are_shared_between_two_mappings_and_bounded() -> None:
    front = ReadSlots.create(slots=2, slot_bytes=4096)
    worker = ReadSlots(os.dup(front.fd), slots=2, slot_bytes=4096)  # as the worker maps the inherited fd
    try:
        first, second = front.take(), front.take()
        assert first is not None and second is not None and front.take() is None  # then reads use the socket
        worker.fill(second, b"data for the front")
        assert front.read(second, 18) == b"data for the front"
        front.give(second)
        assert front.take() == second
    finally:
        worker.close()
        front.close()


def test_a_workers_fs3_error_keeps_its_type_in_the_front() -> None:
    """The VFS decides by type (an open by a stale name: ``NotFound`` → ``ESTALE``, so the kernel
    looks the name up again); an errno alone would turn it into ``ENOENT`` for the caller."""
    from fs3.common.errors import NotFound, PermissionDenied
    from fs3.vfs.workers import error_from_worker, worker_error

    for error in (NotFound("gone"), PermissionDenied("no")):
        back = error_from_worker(worker_error(error))
        assert type(back) is type(error) and str(error) in str(back)
    back = error_from_worker(worker_error(OSError(errno.EBADF, "closed")))
    assert type(back) is OSError and back.errno == errno.EBADF
    back = error_from_worker(worker_error(RuntimeError("bug")))
    assert isinstance(back, OSError) and back.errno == errno.EIO and "RuntimeError" in str(back)


def test_a_cancelled_read_gives_its_shared_slot_back_once_the_worker_answered() -> None:
    """A read the kernel interrupts leaves the worker writing into its slot: the slot is not reused
    before the worker's answer, and is not lost after it (16 interruptions used to leave every
    later read on the socket)."""
    from fs3.vfs.workers import RemoteFile

    async def scenario() -> None:
        slots = ReadSlots.create(slots=1, slot_bytes=4096)
        answered = asyncio.Event()

        class SlowWorker(FakeWorker):
            async def request(self, op: str, *args: Any) -> Any:
                if op == "pread_into":
                    await answered.wait()
                    return 3, (0, False, False)
                return await super().request(op, *args)

        worker = SlowWorker(0, inode_id=5)
        worker.slots = slots  # type: ignore[attr-defined]
        pool = DataWorkers([cast(DataWorker, worker)])
        fs = cast(AsyncFileSystem, types.SimpleNamespace(track_file=lambda f: None))
        rsp = mpb.OpenRsp(inode=mpb.Inode(inode_id=5, type=mpb.FILE, size=3))
        remote = RemoteFile(fs, pool, cast(DataWorker, worker), 1, rsp, "f", True, False, False)
        read = asyncio.create_task(remote.pread(0, 3))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert slots.take() is None  # the read holds the only slot
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        assert slots.take() is None  # the worker may still write into it
        answered.set()
        for _ in range(10):
            await asyncio.sleep(0)
        assert slots.take() == 0  # answered: the slot is free again
        slots.close()

    asyncio.run(scenario())


def test_a_file_stays_with_its_worker_until_the_workers_close_is_done() -> None:
    """An open racing a close of the file's last handle goes to the worker still closing it (where
    its last writes land), never to another one whichever workers are alive then."""
    from fs3.vfs.workers import RemoteFile

    async def scenario() -> None:
        closing = asyncio.Event()
        closed = asyncio.Event()

        class ClosingWorker(FakeWorker):
            async def request(self, op: str, *args: Any) -> Any:
                if op == "close":
                    closing.set()
                    await closed.wait()
                    return None
                return await super().request(op, *args)

        workers = [ClosingWorker(0, inode_id=9), ClosingWorker(1, inode_id=9)]
        pool = DataWorkers(cast(list[DataWorker], workers))
        holder = pool.claim(9)
        fs = cast(AsyncFileSystem, types.SimpleNamespace(track_file=lambda f: None, untrack_file=lambda f: None,
                                                         open_files=lambda inode_id: []))
        rsp = mpb.OpenRsp(inode=mpb.Inode(inode_id=9, type=mpb.FILE))
        remote = RemoteFile(fs, pool, holder, 1, rsp, "f", True, True, False)
        close = asyncio.create_task(remote.close())
        await closing.wait()
        assert pool.owner(9) is holder      # still closing there: an open now goes to it
        again = pool.claim(9)
        assert again is holder
        pool.release(9, again)
        closed.set()
        await close
        assert pool.owner(9) is None

    asyncio.run(scenario())
