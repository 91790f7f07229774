"""A mount with data workers (``fs3 mount --workers 3``): what must hold across its processes.

The front process keeps the FUSE session and the namespace; each open file is held by one of three
data-worker processes (:mod:`fs3.vfs.workers`). These tests pick files whose handles land on
different workers (creates go by name, later opens by inode), open the same file from several
processes, from a second mount, after an unlink, with ``O_APPEND`` and through mmap, and kill a
worker: its files answer errors, the rest of the mount keeps serving, a new worker takes its place,
and the mount still unmounts cleanly.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fs3.cli.local import LocalCluster
from fs3.vfs.workers import worker_for_inode, worker_for_name
from tests.harness import mounted_cluster
from tests.test_fuse_mount import _fuse_ops

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse on this machine"),
]

WORKERS = 3
CHUNK = 64 * 1024


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Path]]:
    pytest.importorskip("pyfuse3", reason="the fuse extra is not installed")
    with mounted_cluster(tmp_path_factory.mktemp("fuse-workers"), workers=WORKERS) as (cluster, mnt):
        subprocess.run([sys.executable, "-m", "fs3.cli.main", "admin", "--mgmtd", cluster.mgmtd_address, "--token",
                        "t", "set-layout", "/", "--chunk-size", str(CHUNK)], check=True, capture_output=True)
        yield cluster, mnt


@pytest.fixture
def work(mount: tuple[LocalCluster, Path], request: pytest.FixtureRequest) -> Path:
    name: str = request.node.name
    path = mount[1] / name
    path.mkdir()
    return path


def _worker_pids(cluster: LocalCluster) -> list[int]:
    ready = json.loads(cluster.procs["mount"].ready_file.read_text())
    pids: list[int] = ready["workers"]
    assert len(pids) == WORKERS
    return pids


def _crossing_name(directory: Path, prefix: str) -> Path:
    """A new file whose create lands on one worker and whose next open (by inode) on another."""
    parent = os.stat(directory).st_ino
    for i in range(40):
        path = directory / f"{prefix}{i}"
        path.write_bytes(b"")
        made = worker_for_name(parent, path.name.encode(), WORKERS)
        if worker_for_inode(os.stat(path).st_ino, WORKERS) != made:
            return path
    raise AssertionError("no file name in 40 whose create and open go to different workers")


def _second_mount(cluster: LocalCluster, where: Path, log: Path) -> None:
    where.mkdir()
    started = subprocess.run([sys.executable, "-m", "fs3.cli.main", "mount", cluster.mgmtd_address, str(where),
                              "--token", "t", "--log", str(log)], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr


def _umount(where: Path) -> None:
    subprocess.run([sys.executable, "-m", "fs3.cli.main", "umount", str(where)], capture_output=True)


def test_close_to_open_across_workers_of_one_mount(work: Path) -> None:
    path = _crossing_name(work, "c2o")
    for round_ in range(3):
        payload = os.urandom(CHUNK * (round_ + 1) + 13 * round_)
        with open(path, "wb") as f:
            f.write(payload)
        assert path.stat().st_size == len(payload)
        assert path.read_bytes() == payload
    # A file open for writing: other descriptors (any process) see its writes before the close.
    with open(path, "r+b", buffering=0) as writer:
        writer.write(b"W" * 100)
        assert os.stat(path).st_size >= 100
        reader = subprocess.run([sys.executable, "-c", f"print(open({str(path)!r}, 'rb').read(100))"],
                                capture_output=True, text=True, timeout=60)
        assert reader.stdout.strip() == repr(b"W" * 100), reader.stderr


def test_close_to_open_across_mounts(mount: tuple[LocalCluster, Path], work: Path, tmp_path: Path) -> None:
    cluster, _ = mount
    second = tmp_path / "second"
    _second_mount(cluster, second, tmp_path / "second.log")
    try:
        there = second / work.name
        for round_ in range(3):
            payload = os.urandom(CHUNK * 2 + 31 * round_)
            (work / f"f{round_}").write_bytes(payload)    # written and closed through the workers
            assert (there / f"f{round_}").read_bytes() == payload
            back = os.urandom(CHUNK + round_)
            (there / f"f{round_}").write_bytes(back)      # and back, from the one-process mount
            assert (work / f"f{round_}").read_bytes() == back
            assert (work / f"f{round_}").stat().st_size == len(back)
        # A file held open here, opened again by a name this mount's kernel never saw (a hard
        # link made on the other mount) that a create would send to another worker: the open
        # goes to the worker that holds the file.
        held = work / "held"
        held.write_bytes(b"")
        parent, inode = os.stat(work).st_ino, os.stat(held).st_ino
        link = next(n for n in (f"link{i}" for i in range(40))
                    if worker_for_name(parent, n.encode(), WORKERS) != worker_for_inode(inode, WORKERS))
        with open(held, "rb", buffering=0) as reader:
            os.link(there / "held", there / link)
            fd = os.open(work / link, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.write(fd, b"via the link")
                assert reader.read() == b"via the link"  # before any close: the handles sit together
            finally:
                os.close(fd)
    finally:
        _umount(second)


def test_a_truncate_through_one_descriptor_is_the_size_the_others_report(work: Path) -> None:
    path = work / "t"
    path.write_bytes(b"")
    with open(path, "r+b", buffering=0) as one, open(path, "r+b", buffering=0) as two:
        one.write(b"x" * 5000)
        assert os.fstat(two.fileno()).st_size == 5000
        two.truncate(100)
        assert os.fstat(one.fileno()).st_size == 100
        assert os.stat(path).st_size == 100
        assert one.seek(0) == 0 and one.read() == b"x" * 100


def test_an_unlinked_open_file_stays_usable_across_descriptors(work: Path) -> None:
    path = _crossing_name(work, "gone")
    data = os.urandom(3 * CHUNK + 5)
    fd = os.open(path, os.O_RDWR)
    try:
        os.write(fd, data)
        os.unlink(path)
        assert not path.exists()
        # Reopened by descriptor (an open by inode): the handle must see the first one's writes.
        with open(f"/proc/self/fd/{fd}", "r+b", buffering=0) as again:
            assert again.read() == data
            again.write(b"tail")
        assert os.pread(fd, 4, len(data)) == b"tail"
        assert os.fstat(fd).st_size == len(data) + 4
    finally:
        os.close(fd)


def test_o_append_from_two_processes(work: Path) -> None:
    path = work / "log"
    path.write_bytes(b"")
    code = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND)
for i in range(300):
    os.write(fd, (f"{sys.argv[2]} {i:05d} ".encode()).ljust(63, b".") + b"\\n")
os.close(fd)
"""
    writers = [subprocess.Popen([sys.executable, "-c", code, str(path), tag]) for tag in ("A", "B")]
    for proc in writers:
        assert proc.wait(timeout=120) == 0
    data = path.read_bytes()
    assert len(data) == 600 * 64
    records = [data[i:i + 64] for i in range(0, len(data), 64)]
    for tag in (b"A", b"B"):
        mine = [r for r in records if r.startswith(tag + b" ")]
        assert [int(r.split()[1]) for r in mine] == list(range(300))  # none overwritten, in order


def test_mmap_reads_and_writes(work: Path) -> None:
    path = work / "m"
    data = bytearray(os.urandom(3 * CHUNK + 5))
    path.write_bytes(data)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        assert m[:] == data
        m[CHUNK - 2:CHUNK + 2] = b"MMAP"
        m.flush()
    data[CHUNK - 2:CHUNK + 2] = b"MMAP"
    assert path.read_bytes() == bytes(data)


def test_a_stopped_worker_is_replaced_and_its_files_answer_errors_not_hang(mount: tuple[LocalCluster, Path],
                                                                           tmp_path: Path) -> None:
    """A worker that stops answering (SIGSTOP here; wedged in general) never closes its link: the
    front's ping finds it silent, kills it, its files answer EIO and a new worker serves."""
    cluster, _ = mount
    where = tmp_path / "stopping"
    where.mkdir()
    started = subprocess.run([sys.executable, "-m", "fs3.cli.main", "mount", cluster.mgmtd_address, str(where),
                              "--token", "t", "--workers", "2", "--worker-timeout-s", "2",
                              "--log", str(tmp_path / "stopping.log")], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    try:
        # This mount's daemon, found by its mount point (an argument of its own): any other mount on
        # the machine (another test's, another checkout's) has the same options.
        mounted_at = os.fsencode(where.resolve()) + b"\0"
        fronts = [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()
                  and _cmdline_has(int(entry.name), mounted_at) and _cmdline_has(int(entry.name), b"--foreground\0")
                  and _running(int(entry.name))]
        assert len(fronts) == 1, fronts
        front = fronts[0]
        before = _live_workers(front)
        assert len(before) == 2
        fd = os.open(where / "held", os.O_CREAT | os.O_WRONLY, 0o644)
        os.write(fd, b"x" * 4096)
        for pid in before:
            os.kill(pid, signal.SIGSTOP)
        started_at = time.monotonic()
        with pytest.raises(OSError) as failed:
            os.close(fd)  # its worker is stopped: an error within the timeout, never a hang
        assert failed.value.errno == errno.EIO
        assert time.monotonic() - started_at < 60
        deadline = time.monotonic() + 60
        while set(_live_workers(front)) & set(before) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not set(_live_workers(front)) & set(before), "the stopped workers were not killed"
        # New workers take their places (until one is ready, with every worker gone, opens fail).
        deadline = time.monotonic() + 60
        while True:
            try:
                (where / "after").write_bytes(b"served")
                break
            except OSError as exc:
                assert exc.errno == errno.EIO and time.monotonic() < deadline, exc
                time.sleep(0.2)
        assert (where / "after").read_bytes() == b"served"
        # The write needed one new worker; the other one's replacement may start a moment later.
        deadline = time.monotonic() + 60
        while len(_live_workers(front)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(_live_workers(front)) == 2
    finally:
        for pid in _live_workers(front) if "front" in locals() else []:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
        _umount(where)


def _cmdline_has(pid: int, text: bytes) -> bool:
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_a_killed_worker_fails_its_files_and_the_mount_still_serves_and_unmounts(mount: tuple[LocalCluster, Path],
                                                                                 work: Path) -> None:
    """Runs last: it unmounts the module's mount."""
    cluster, mnt = mount
    big = work / "big"
    address = cluster.procs["mount"].info["metrics"]
    released = _fuse_ops(address).get("release", 0)
    big.write_bytes(os.urandom(16 * CHUNK))
    # The kernel sends the writer's release after close(2) returned; until its worker has closed
    # the handle, a new open goes to that worker (the one the create chose by name).
    deadline = time.monotonic() + 30
    while _fuse_ops(address).get("release", 0) < released + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    reader = os.open(big, os.O_RDONLY)
    writer = os.open(big, os.O_WRONLY)
    assert len(os.pread(reader, 4096, 0)) == 4096
    victim = _worker_pids(cluster)[worker_for_inode(os.stat(big).st_ino, WORKERS)]
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _running(victim) and time.monotonic() < deadline:
        time.sleep(0.05)

    def errno_of_call(fn: object, *args: object) -> int:
        try:
            fn(*args)  # type: ignore[operator]
        except OSError as exc:
            return exc.errno or 0
        return 0

    # Its open files answer errors (never hang)...
    assert errno_of_call(os.pread, reader, 4096, 12 * CHUNK) == errno.EIO
    assert errno_of_call(os.pwrite, writer, b"x" * 10, 0) == errno.EIO
    os.close(reader)  # nothing of the reader's was lost
    errno_of_call(os.close, writer)  # the writer's close may answer the error too
    # ... while the rest of the mount serves: new files go to the workers left, the dead one's
    # file opens again on one of them.
    for i in range(6):
        (work / f"after{i}").write_bytes(b"after %d" % i)
        assert (work / f"after{i}").read_bytes() == b"after %d" % i
    assert big.stat().st_size == 16 * CHUNK
    assert len(big.read_bytes()) == 16 * CHUNK
    # A new worker takes the dead one's place.
    front_pid = cluster.procs["mount"].pid
    assert front_pid
    deadline = time.monotonic() + 60
    while len(_live_workers(front_pid)) < WORKERS and time.monotonic() < deadline:
        time.sleep(0.1)
    workers_now = _live_workers(front_pid)
    assert len(workers_now) == WORKERS and victim not in workers_now
    # And it unmounts cleanly: the front releases what it holds and ends the workers left.
    proc = cluster.procs["mount"]
    front = proc.pid
    assert front
    others = workers_now
    os.kill(front, signal.SIGTERM)
    assert proc.popen is not None
    assert proc.popen.wait(timeout=60) == 0
    assert not os.path.ismount(mnt)
    deadline = time.monotonic() + 30
    while any(_running(p) for p in others) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_running(p) for p in others)


def _live_workers(front: int) -> list[int]:
    """The data workers the mount's front process runs now."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == front and b"fs3.vfs.workers" in cmdline and _running(int(entry.name)):
            found.append(int(entry.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False
