"""The small-file path of the mount's VFS: fewer meta calls per create, close and unlink, and what
each shortcut must keep: the directory seen as this mount changed it, close-to-open across
mounts, and a removed file gone for everyone once the unlink returns."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from fs3 import meta_pb2 as mpb
from fs3.client.closes import BATCH_MAX
from fs3.common.posix import O_RDONLY, O_WRONLY
from fs3.vfs import Vfs
from tests.test_vfs import ME, ROOT, count_meta_calls, read_file, stale, with_two_mounts, with_vfs, write_file

pytestmark = pytest.mark.slow  # in-process clusters


def test_create_and_unlink_answer_the_directory_as_they_left_it(tmp_path: Path) -> None:
    """The kernel asks for a directory's attributes after every create and unlink in it (its next
    path walk checks search permission): the answer is the directory as meta's create or remove
    left it, with no call of its own, and shows this mount's change (mtime, nlink of a subdirectory)."""
    async def body(vfs: Vfs) -> None:
        d = await vfs.mkdir(ROOT, b"d", 0o755, ME)
        before = await vfs.getattr(d.inode_id, ME)
        await asyncio.sleep(0.01)  # a later create gets a later mtime
        calls = count_meta_calls(vfs)
        fh, f = await vfs.create(d.inode_id, b"f", stat.S_IFREG | 0o644, O_WRONLY, ME)
        created = await vfs.getattr(d.inode_id, ME)
        assert calls == ["Open"]
        assert created.mtime_ns > before.mtime_ns and created.ctime_ns > before.ctime_ns
        await vfs.write(fh, 0, b"x" * 4096)
        await vfs.flush(fh)
        await vfs.release(fh)
        calls.clear()
        await vfs.unlink(d.inode_id, b"f", ME)
        removed = await vfs.getattr(d.inode_id, ME)
        assert "BatchStat" not in calls
        assert removed.mtime_ns > created.mtime_ns
        with pytest.raises(OSError) as info:  # gone at once, its queued session end sent with the unlink
            await vfs.getattr(f.inode_id, ME)
        assert stale(info)
        sub = await vfs.mkdir(d.inode_id, b"sub", 0o755, ME)
        assert (await vfs.getattr(d.inode_id, ME)).nlink == 3
        calls.clear()
        await vfs.rmdir(d.inode_id, b"sub", ME)
        assert (await vfs.getattr(d.inode_id, ME)).nlink == 2
        assert calls == ["Remove"]
        with pytest.raises(OSError):
            await vfs.getattr(sub.inode_id, ME)
    with_vfs(tmp_path, body)


def test_released_handles_end_their_sessions_in_batches(tmp_path: Path) -> None:
    """A handle whose flush published its length (or that never wrote) ends its session in a batch
    with others: no Close per file; every session ends all the same (an unlinked file is collected)."""
    async def body(vfs: Vfs) -> None:
        calls = count_meta_calls(vfs)
        vfs.fs.session_closes.gather_s = 3600.0  # nothing goes out before the drain below, however slow
        files = [await write_file(vfs, ROOT, b"f%03d" % i, b"%03d" % i * 1000) for i in range(BATCH_MAX + 10)]
        for f in files:
            assert await read_file(vfs, f.inode_id) == b"%03d" % (files.index(f)) * 1000
        await vfs.fs.session_closes.drain()
        assert "Close" not in calls
        # One call per BATCH_MAX sessions (a write and a read handle per file).
        assert calls.count("CloseSessions") == -(-2 * len(files) // BATCH_MAX)
        assert len(vfs.fs.session_closes) == 0
        # Nothing holds the files any more: each is gone as soon as its name is.
        other = await vfs.fs.metadata.open(mpb.PathRef(parent=ROOT, path=b"f000"), O_RDONLY)
        assert other.session_id
        for i in range(len(files)):
            await vfs.unlink(ROOT, b"f%03d" % i, ME)
        gone = await vfs.fs.metadata.batch_stat([f.inode_id for f in files[1:]])
        assert all(inode.inode_id == 0 for inode in gone)
        # ...but a session still open keeps its file (the unlinked-open case is untouched).
        assert (await vfs.fs.metadata.batch_stat([files[0].inode_id]))[0].inode_id == files[0].inode_id
        await vfs.fs.metadata.close(files[0].inode_id, other.session_id, length_hint=0, wrote=False, acked=True)
        assert (await vfs.fs.metadata.batch_stat([files[0].inode_id]))[0].inode_id == 0
    with_vfs(tmp_path, body)


def test_a_length_published_at_close_is_seen_by_another_mounts_open(tmp_path: Path) -> None:
    """Close-to-open with the session's end still queued on the writer's mount: the flush made the
    length and the bytes visible, so an open on another mount right after sees all of them."""
    async def body(a: Vfs, b: Vfs) -> None:
        for size in (1, 4096, 70_000, 200_000):  # within a chunk, and across chunks
            data = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
            f = await write_file(a, ROOT, b"f%d" % size, data)
            assert len(a.fs.session_closes) >= 1  # the writer's session has not ended yet
            assert (await b.lookup(ROOT, b"f%d" % size, ME)).size == size
            assert await read_file(b, f.inode_id) == data
            # Rewritten in place by A (open, write, close): B's next open sees the new bytes.
            fh, _ = await a.open(f.inode_id, O_WRONLY, ME)
            await a.write(fh, 0, b"new")
            await a.flush(fh)
            await a.release(fh)
            assert (await read_file(b, f.inode_id))[:3] == b"new"
    with_two_mounts(tmp_path, body)


def test_a_file_replaced_on_another_mount_right_after_this_one_closed_it(tmp_path: Path) -> None:
    """Mount A writes a file and closes it (its session's end queued); mount B replaces the file by
    rename and removes the result: the old file, no longer held by anyone once A's queue goes out,
    is collected, and A, coming back by inode, is told ESTALE rather than shown the old file."""
    async def body(a: Vfs, b: Vfs) -> None:
        old = await write_file(a, ROOT, b"f", b"old")
        new = await write_file(b, ROOT, b"f.tmp", b"new")
        await b.rename(ROOT, b"f.tmp", ROOT, b"f", 0, ME)
        with pytest.raises(OSError) as info:  # A's kernel still maps "f" to the old file
            await a.open(old.inode_id, O_RDONLY, ME)
        assert stale(info)
        assert (await a.lookup(ROOT, b"f", ME)).inode_id == new.inode_id
        assert await read_file(a, new.inode_id) == b"new"
        await b.unlink(ROOT, b"f", ME)
        await a.fs.session_closes.drain()
        assert [i.inode_id for i in await b.fs.metadata.batch_stat([old.inode_id, new.inode_id])] == [0, 0]
    with_two_mounts(tmp_path, body)


def test_concurrent_creates_and_unlinks_leave_the_directory_as_meta_has_it(tmp_path: Path) -> None:
    """Answers to creates and unlinks in one directory may come back in any order: the directory
    this mount then shows is meta's latest, never one an earlier answer carried."""
    async def body(vfs: Vfs) -> None:
        d = await vfs.mkdir(ROOT, b"d", 0o755, ME)
        for _ in range(3):
            handles = await asyncio.gather(*(vfs.create(d.inode_id, b"f%d" % i, stat.S_IFREG | 0o644, O_WRONLY, ME)
                                             for i in range(20)))
            shown = await vfs.getattr(d.inode_id, ME)
            [actual] = await vfs.fs.metadata.batch_stat([d.inode_id])
            assert (shown.mtime_ns, shown.ctime_ns) == (actual.mtime_ns, actual.ctime_ns)
            for fh, _ in handles:
                await vfs.release(fh)
            await asyncio.gather(*(vfs.unlink(d.inode_id, b"f%d" % i, ME) for i in range(20)))
            shown = await vfs.getattr(d.inode_id, ME)
            [actual] = await vfs.fs.metadata.batch_stat([d.inode_id])
            assert (shown.mtime_ns, shown.ctime_ns) == (actual.mtime_ns, actual.ctime_ns)
    with_vfs(tmp_path, body)


def test_close_sessions_ends_only_what_it_may(tmp_path: Path) -> None:
    """``CloseSessions`` ends sessions without a length to publish: a session already gone is
    skipped, one with a length to publish or of another client, or too many at once, is refused
    (and nothing of that batch is ended)."""
    from fs3.common.errors import BadHandle, InvalidArgument
    from fs3.meta.limits import CLOSE_SESSIONS_MAX

    async def body(a: Vfs, b: Vfs) -> None:
        meta = a.fs.metadata
        opened = [await meta.open(mpb.PathRef(parent=ROOT, path=b"f%d" % i), O_WRONLY | os.O_CREAT, mode=0o644)
                  for i in range(3)]
        sessions = [(o.inode.inode_id, o.session_id) for o in opened]
        other = await b.fs.metadata.open(mpb.PathRef(parent=ROOT, path=b"f0"), O_RDONLY)
        with pytest.raises(BadHandle):  # B's session is not A's to end
            await meta.close_sessions([*sessions, (other.inode.inode_id, other.session_id)])
        with pytest.raises(InvalidArgument):
            await meta.close_sessions([(sessions[0][0], sessions[0][1])] * (CLOSE_SESSIONS_MAX + 1))
        req = mpb.CloseSessionsReq(sessions=[mpb.CloseReq(inode_id=sessions[0][0], session_id=sessions[0][1],
                                                          wrote=True, length_hint=5)])
        with pytest.raises(InvalidArgument):
            await a.fs.meta.call("CloseSessions", req, mpb.CloseSessionsRsp)
        assert await meta.close_sessions(sessions[:1]) == 1
        assert await meta.close_sessions(sessions) == 2  # the first one is gone already: skipped
        for i in range(3):  # no session holds them: removed files are gone at once
            await a.unlink(ROOT, b"f%d" % i, ME)
        found = await meta.batch_stat([o.inode.inode_id for o in opened])
        assert found[1].inode_id == 0 and found[2].inode_id == 0
        assert found[0].inode_id == opened[0].inode.inode_id  # B's session still holds f0
    with_two_mounts(tmp_path, body)


def test_a_batch_that_fails_is_dropped_and_the_queue_still_drains() -> None:
    """Meta unreachable: the batch is logged and dropped (the lease's expiry ends those sessions),
    later batches go out, and a drain returns rather than retrying for ever."""
    from typing import cast

    from fs3.client.closes import SessionCloses
    from fs3.client.meta import Meta
    from fs3.common.errors import Unavailable

    sent: list[list[tuple[int, bytes]]] = []

    class FlakyMeta:
        async def close_sessions(self, sessions: list[tuple[int, bytes]]) -> int:
            sent.append(list(sessions))
            if len(sent) == 1:
                raise Unavailable("meta is down")
            return len(sessions)

    async def main() -> None:
        closes = SessionCloses(cast(Meta, FlakyMeta()), gather_s=3600.0)
        for i in range(BATCH_MAX + 1):
            await closes.close_later(i, b"s%d" % i)
        await closes.settle(7)  # queued: everything goes now
        assert len(closes) == 0 and [len(b) for b in sent] == [BATCH_MAX, 1]
        await closes.close_later(1, b"again")
        await closes.settle(999)  # nothing queued for it: nothing sent yet
        assert len(sent) == 2
        await closes.drain()
        assert sent[-1] == [(1, b"again")] and closes.sent_batches == 2

    asyncio.run(main())


def test_times_set_right_after_close_do_not_wait_for_the_session_end(tmp_path: Path) -> None:
    """tar, ``cp -p`` and rsync set a file's times and mode right after closing it: those calls
    go to meta alone, the session's end stays queued."""
    async def body(vfs: Vfs) -> None:
        calls = count_meta_calls(vfs)
        vfs.fs.session_closes.gather_s = 3600.0
        f = await write_file(vfs, ROOT, b"extracted", b"x" * 4096)
        changed = await vfs.setattr(f.inode_id, ME, mtime_ns=1_000_000_000, mode=0o600)
        assert changed.mtime_ns == 1_000_000_000 and stat.S_IMODE(changed.mode) == 0o600
        assert calls == ["Open", "Sync", "SetAttr"] and len(vfs.fs.session_closes) == 1
        await vfs.fs.session_closes.drain()
        assert calls[-1] == "CloseSessions"
    with_vfs(tmp_path, body)
