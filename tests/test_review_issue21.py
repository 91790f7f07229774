"""Attacks on fs3.usrbio and the mount's data workers: each test is a way one of them broke."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fs3.usrbio import IoRing, Iov
from tests.harness import mounted_cluster, open_mount, require_fuse, test_dir

KIB, MIB = 1024, 1024 * 1024


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path]]:
    with open_mount(tmp_path_factory.mktemp("review21")) as (cluster, mnt):
        yield cluster, mnt


@pytest.fixture
def work(mount: tuple[object, Path], request: pytest.FixtureRequest) -> Path:
    return test_dir(mount[1], request.node.name)


def _stats(work: Path) -> dict[str, int]:
    with IoRing(work, entries=1) as probe:
        stats = probe.server_stats()
    stats["rings"] -= 1  # the probe itself
    return stats


def _wait_at_rest(work: Path, before: dict[str, int], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        now = _stats(work)
        if (now["rings"], now["files"], now["releasing"], now["open_handles"]) == \
                (before["rings"], before["files"], 0, before["open_handles"]):
            return
        assert time.monotonic() < deadline, (before, now)
        time.sleep(0.1)


@pytest.mark.slow
def test_a_ring_closed_while_a_deregister_waits_for_its_batch_still_closes_the_file(
        mount: tuple[object, Path], work: Path) -> None:
    """A deregister waits for the batches in flight; the application closing the ring meanwhile
    cancels that wait, and the file it had already taken off the ring must still be closed."""
    cluster = mount[0]
    (work / "f").write_bytes(b"x" * MIB)
    before = _stats(work)
    storages = [name for name in cluster.procs if name.startswith("storage")]  # type: ignore[attr-defined]
    with Iov(MIB) as iov:
        ring = IoRing(work, entries=16)
        fid = ring.register(work / "f")
        for name in storages:  # the batch cannot finish while storage is stopped
            os.killpg(cluster.procs[name].pid, signal.SIGSTOP)  # type: ignore[attr-defined]
        try:
            ring.prep_io(iov, fid, 0, 64 * KIB)
            ring.submit()
            ring._send(json.dumps({"op": "deregister", "file": fid}).encode())
            time.sleep(1.0)  # the deregister is waiting for the batch now
            ring.close()
            time.sleep(0.5)
        finally:
            for name in storages:
                os.killpg(cluster.procs[name].pid, signal.SIGCONT)  # type: ignore[attr-defined]
    _wait_at_rest(work, before)


@pytest.mark.slow
def test_a_ring_read_on_a_mount_with_workers_never_returns_bytes_a_worker_still_buffers(tmp_path: Path) -> None:
    """A FUSE descriptor's write sits in a data worker's buffer; the front's ring read took the
    worker's length (so it reported the whole range read) but not its bytes: it returned the
    old data as the file's. The worker's writes now land first, as in one process."""
    require_fuse()
    with mounted_cluster(tmp_path, workers=2) as (_, mnt), Iov(MIB) as iov:
        (mnt / "f").write_bytes(b"a" * 300)
        fd = os.open(mnt / "f", os.O_RDWR)
        try:
            with IoRing(mnt, entries=4) as ring:
                fid = ring.register(mnt / "f")
                os.pwrite(fd, b"c" * 500, 0)  # buffered in the worker: not flushed, not closed
                ring.prep_io(iov, fid, 0, 1000)
                ring.submit()
                done = ring.wait(1, timeout_s=60)
                assert [c.result for c in done] == [500]
                assert bytes(iov.view[:500]) == b"c" * 500
        finally:
            os.close(fd)


class _RingNearTheWrap(IoRing):
    """A ring whose free-running counters start just before they wrap at 2**32 (as after about
    four billion I/Os on one ring: half a day of a data loader at 100k IOPS)."""

    def _control(self, request: dict[str, object], fds: list[int] | None = None) -> dict[str, object]:
        if request.get("op") == "ring":
            from fs3.usrbio import CQ_HEAD_AT, SQ_TAIL_AT

            start = (1 << 32) - 2
            struct.pack_into("<I", self._ring, SQ_TAIL_AT, start)
            struct.pack_into("<I", self._ring, CQ_HEAD_AT, start)
            self._sq_tail = self._cq_head = start
        return super()._control(request, fds)


@pytest.mark.slow
def test_ring_counters_wrap_on_a_ring_of_any_size(work: Path) -> None:
    """Slots were ``index % entries`` of 32-bit counters: for a ring whose size does not divide
    2**32 the slot jumps at the wrap, and an entry still pending was overwritten by the next
    one (its I/O lost, another served twice). Rings now have a power-of-two number of slots."""
    data = bytes(range(256)) * 64
    (work / "f").write_bytes(data)
    with Iov(MIB) as iov, _RingNearTheWrap(work, entries=3) as ring:
        fid = ring.register(work / "f")
        for round_ in range(3):
            for n in range(3):
                ring.prep_io(iov, fid, n * 1000 + round_, 100, iov_offset=n * 4096, userdata=n)
            ring.submit()
            done = {c.userdata: c.result for c in ring.wait(3, timeout_s=60)}
            assert done == {0: 100, 1: 100, 2: 100}, (round_, done)
            for n in range(3):
                assert bytes(iov.view[n * 4096:n * 4096 + 100]) == data[n * 1000 + round_:n * 1000 + round_ + 100]


def test_a_rings_groups_are_the_ones_it_connected_with() -> None:
    """The daemon read the peer's supplementary groups from /proc/<pid>/status when it accepted:
    a process could connect, then change its groups (or exit, its pid going to another user's
    process) before that; the kernel's own record of the connect (SO_PEERGROUPS) is used now."""
    if os.geteuid() != 0:
        pytest.skip("setgroups needs root")
    code = ("import os, socket\nfrom fs3.fuse.usrbio_server import peer_credentials\n"
            "os.setgroups([1111, 1112])\na, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            "os.setgroups([2222])\npid, user = peer_credentials(a)\n"
            "print(pid == os.getpid(), user.uid, list(user.groups))\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "0", "[1111,", "1112]"]


_SEND_MOUNT_FDS = """
import os, socket, sys, time
from fs3.usrbio import IoRing
fd = os.open(sys.argv[1] + "/f", os.O_RDONLY)
for message in (b"S", b'{"op": "stats"}', b'{"op": "iov", "size": 100}', b'{"op": "ring", "entries": 4}'):
    with IoRing(sys.argv[1], entries=4) as ring:
        socket.send_fds(ring._sock, [message], [fd])
        time.sleep(0.2)
    os.stat(sys.argv[1] + "/f")
print("sent", flush=True)
"""


@pytest.mark.slow
def test_a_descriptor_of_the_mount_sent_where_none_belongs_does_not_deadlock_the_daemon(work: Path) -> None:
    """The daemon closed the descriptors of a refused message (and fstat'ed an Iov's) on its
    event loop: for a descriptor of its own mount, close is a FUSE flush the blocked loop had
    to answer itself, so any user hung the whole mount with one message. (The attack runs in a
    child; a deadlocked mount has its FUSE connection aborted so that this fails, not hangs.)"""
    (work / "f").write_bytes(b"f" * 100)
    mnt = work.parent
    root = Path(__file__).resolve().parents[1]
    child = subprocess.Popen([sys.executable, "-c", _SEND_MOUNT_FDS, str(work)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(root)})
    deadline = time.monotonic() + 60
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if child.poll() is None:
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            fields = line.split()
            if fields[4] == str(mnt):
                with open(f"/sys/fs/fuse/connections/{fields[2].split(':')[1]}/abort", "w") as abort:
                    abort.write("1")
        child.kill()
        child.wait(timeout=30)
        pytest.fail("the mount daemon deadlocked")
    out, err = child.communicate()
    assert child.returncode == 0 and out == b"sent\n", err.decode()


@pytest.mark.slow
def test_a_file_id_out_of_range_is_refused_not_masked_onto_another_file(work: Path) -> None:
    """prep_io masked the file id to the entry's 32 bits: id 2**32 + n read registered file n."""
    (work / "f").write_bytes(b"f" * 100)
    with Iov(MIB) as iov, IoRing(work, entries=4) as ring:
        fid = ring.register(work / "f")
        for bad in (fid + (1 << 32), -1):
            with pytest.raises(ValueError, match="file can have the id"):
                ring.prep_io(iov, bad, 0, 10)
        assert ring.outstanding == 0
