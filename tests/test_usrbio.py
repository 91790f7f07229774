"""fs3.usrbio: shared-memory rings against a real mount (reads and writes checked against the
file API, bad entries, unlinked files, another user's file, a process dying with a ring, the
mount daemon dying with batches in flight) and the ring's encoding on its own."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fs3.fuse.usrbio_server import RegisteredFile, check_entry
from fs3.usrbio import (
    OP_READ,
    OP_WRITE,
    SQE,
    Completion,
    IoRing,
    Iov,
    MountGone,
    Sqe,
    ring_bytes,
    socket_name,
)
from tests.harness import mounted_cluster, open_mount, require_fuse, test_dir

CHUNK = 64 * 1024
NOBODY = 65534
KIB, MIB = 1024, 1024 * 1024


# -- the encoding, no mount ----------------------------------------------------------------------


def test_entries_round_trip_and_bad_ones_are_named() -> None:
    buf = bytearray(ring_bytes(4))
    entry = Sqe(OP_READ, 1, 7, 3 * MIB + 1, 4096, 8192, (1 << 64) - 1)
    entry.pack_into(buf, 64 + SQE.size)
    assert Sqe.unpack_from(buf, 64 + SQE.size) == entry
    assert len(buf) == 64 + 4 * (40 + 16) and socket_name("0:53") == "usrbio-0-53.sock"

    files = {7: RegisteredFile(fh=1, inode_id=9, readable=True, writable=False),
             8: RegisteredFile(fh=2, inode_id=10, readable=False, writable=True)}
    iovs = {1: 16 * KIB}
    good = Sqe(OP_READ, 1, 7, 0, 4096, 0, 0)
    assert check_entry(good, files, iovs) == 0
    assert check_entry(Sqe(OP_WRITE, 1, 8, 0, 16 * KIB, 0, 0), files, iovs) == 0  # exactly fills the buffer
    bad = {
        "unknown op": (Sqe(9, 1, 7, 0, 1, 0, 0), errno.EINVAL),
        "negative length": (Sqe(OP_READ, 1, 7, 0, -1, 0, 0), errno.EINVAL),
        "negative offset": (Sqe(OP_READ, 1, 7, -4096, 1, 0, 0), errno.EINVAL),
        "negative buffer offset": (Sqe(OP_READ, 1, 7, 0, 1, -1, 0), errno.EINVAL),
        "huge length": (Sqe(OP_READ, 1, 7, 0, (1 << 63) - 1, 0, 0), errno.EINVAL),
        "huge write": (Sqe(OP_WRITE, 1, 8, 1 << 62, 1, 0, 0), errno.EFBIG),
        "unregistered file": (Sqe(OP_READ, 1, 99, 0, 1, 0, 0), errno.EBADF),
        "read of a write-only file": (Sqe(OP_READ, 1, 8, 0, 1, 0, 0), errno.EBADF),
        "write of a read-only file": (Sqe(OP_WRITE, 1, 7, 0, 1, 0, 0), errno.EBADF),
        "unregistered buffer": (Sqe(OP_READ, 2, 7, 0, 1, 0, 0), errno.EFAULT),
        "past the buffer's end": (Sqe(OP_READ, 1, 7, 0, 4096, 16 * KIB - 4095, 0), errno.EFAULT),
        "buffer too small": (Sqe(OP_READ, 1, 7, 0, 16 * KIB + 1, 0, 0), errno.EFAULT),
    }
    for what, (sqe, expected) in bad.items():
        assert check_entry(sqe, files, iovs) == expected, what
    assert Completion(5, -errno.EFAULT).result == -errno.EFAULT
    with pytest.raises(OSError) as caught:
        Completion(5, -errno.EFAULT).check()
    assert caught.value.errno == errno.EFAULT


def test_an_iov_is_viewed_without_copies() -> None:
    with Iov(64 * KIB) as iov:
        iov.view[:4] = b"abcd"
        array = iov.numpy()
        assert bytes(array[:4]) == b"abcd"
        array[4] = 0x65
        assert bytes(iov.view[:5]) == b"abcde"
        words = iov.numpy("uint32", offset=0, count=1)
        assert int(words[0]) == int.from_bytes(b"abcd", "little")
        torch = pytest.importorskip("torch")
        tensor = iov.torch()
        tensor[5] = ord("f")
        assert bytes(iov.view[:6]) == b"abcdef" and tensor.dtype == torch.uint8
        del array, words, tensor
    with pytest.raises(ValueError, match="1 to"):
        Iov(0)


# -- against a mount ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path]]:
    with open_mount(tmp_path_factory.mktemp("usrbio"), CHUNK) as (cluster, mnt):
        yield cluster, mnt


@pytest.fixture
def work(mount: tuple[object, Path], request: pytest.FixtureRequest) -> Path:
    return test_dir(mount[1], request.node.name)


@pytest.fixture(scope="module")
def iov() -> Iterator[Iov]:
    with Iov(8 * MIB) as shared:
        yield shared


def _wait_all(ring: IoRing, count: int) -> dict[int, int]:
    done = ring.wait(min_results=count, timeout_s=60)
    assert len(done) == count, done
    return {c.userdata: c.result for c in done}


@pytest.mark.slow
def test_reads_and_writes_of_every_size_class_match_the_file_api(work: Path, iov: Iov) -> None:
    data = random.Random(1).randbytes(3 * MIB + 12345)
    (work / "f").write_bytes(data)
    # (offset, length): 1 B, 4 KiB, 128 KiB, 1 MiB + odd; inside a chunk, across one, across many.
    ranges = [(0, 1), (CHUNK - 1, 1), (5, 4 * KIB), (CHUNK - 100, 4 * KIB), (3 * CHUNK + 7, 128 * KIB),
              (CHUNK - 1, 128 * KIB), (123, MIB + 4097), (len(data) - 700, 4 * KIB), (len(data) - MIB - 3, MIB + 3)]
    with IoRing(work, entries=16) as ring:
        fid = ring.register(work / "f")
        at = 0
        places = []
        for n, (offset, length) in enumerate(ranges):
            ring.prep_io(iov, fid, offset, length, iov_offset=at, userdata=n)
            places.append(at)
            at += length
        assert ring.submit() == len(ranges)
        results = _wait_all(ring, len(ranges))
        fd = os.open(work / "f", os.O_RDONLY)
        try:
            for n, (offset, length) in enumerate(ranges):
                expected = os.pread(fd, length, offset)
                assert results[n] == len(expected), (n, offset, length)
                assert bytes(iov.view[places[n]:places[n] + len(expected)]) == expected, (n, offset, length)
        finally:
            os.close(fd)

        # Writes of the same classes to a new file, then read back through FUSE and the ring.
        out = work / "g"
        gid = ring.register(out, os.O_RDWR | os.O_CREAT)
        written = bytearray(len(data))
        rng = random.Random(2)
        at = 0
        for n, (offset, length) in enumerate(ranges[:7]):
            payload = rng.randbytes(length)
            iov.view[at:at + length] = payload
            ring.prep_io(iov, gid, offset, length, iov_offset=at, userdata=100 + n, write=True)
            written[offset:offset + length] = payload  # in order: later entries win overlaps
            at += length
        ring.submit()
        results = _wait_all(ring, 7)
        assert all(results[100 + n] == ranges[n][1] for n in range(7)), results
        end = max(o + n for o, n in ranges[:7])
        assert (work / "g").read_bytes() == bytes(written[:end])  # an open after completion sees it all
        iov.view[:end] = bytes(end)
        ring.prep_io(iov, gid, 0, end, userdata=1)
        ring.submit()
        assert _wait_all(ring, 1) == {1: end}
        assert bytes(iov.view[:end]) == bytes(written[:end])
        ring.deregister(gid)
        assert ring.server_stats()["files"] >= 1


@pytest.mark.slow
def test_bad_entries_fail_alone_and_reads_past_the_end_are_short(work: Path, iov: Iov) -> None:
    (work / "f").write_bytes(b"x" * 10_000)
    with IoRing(work, entries=8) as ring, Iov(4096) as small:
        fid = ring.register(work / "f")
        ring.prep_io(small, fid, 0, 4097, userdata=1)               # the buffer is too small
        ring.prep_io(small, fid, 0, 100, iov_offset=4000, userdata=2)  # out of the buffer's range
        ring.prep_io(iov, fid, 0, -5, userdata=3)                    # a negative length
        ring.prep_io(iov, 12345, 0, 5, userdata=4)                   # not a registered file
        ring.prep_io(iov, fid, 0, 5, write=True, userdata=5)         # registered for reading only
        ring.prep_io(iov, fid, 20_000, 4096, userdata=6)             # past the end: 0, as pread
        ring.prep_io(iov, fid, 9_000, 4096, iov_offset=4096, userdata=7)  # across the end: short
        ring.prep_io(small, fid, 0, 4096, userdata=8)                # a good one among them
        ring.submit()
        with pytest.raises(BlockingIOError):  # all 8 entries are in use until reaped
            ring.prep_io(iov, fid, 0, 1)
        results = _wait_all(ring, 8)
        assert results == {1: -errno.EFAULT, 2: -errno.EFAULT, 3: -errno.EINVAL, 4: -errno.EBADF, 5: -errno.EBADF,
                           6: 0, 7: 1000, 8: 4096}
        assert bytes(small.view) == b"x" * 4096 and bytes(iov.view[4096:5096]) == b"x" * 1000
        with pytest.raises(FileNotFoundError):
            ring.register(work / "missing")
        with pytest.raises(IsADirectoryError):
            ring.register(work)


@pytest.mark.slow
def test_a_fuse_descriptor_opened_before_a_ring_write_reads_the_new_bytes(work: Path, iov: Iov) -> None:
    """Ring writes bypass the kernel: a FUSE descriptor opened (and read) before one kept the
    kernel's cached pages and size, and read the old bytes until the file was opened again."""
    path = work / "cached"
    path.write_bytes(b"a" * 10_000)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.pread(fd, 20_000, 0) == b"a" * 10_000  # the kernel now caches these pages and the size
        iov.view[:12_000] = b"b" * 12_000
        with IoRing(work, entries=2) as ring:
            fid = ring.register(path, os.O_RDWR)
            ring.prep_io(iov, fid, 0, 12_000, userdata=1, write=True)
            ring.submit()
            assert _wait_all(ring, 1) == {1: 12_000}
        assert os.pread(fd, 20_000, 0) == b"b" * 12_000
        assert os.fstat(fd).st_size == 12_000
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_file_removed_with_a_batch_in_flight_still_reads(work: Path, iov: Iov) -> None:
    data = random.Random(3).randbytes(2 * MIB)
    (work / "f").write_bytes(data)
    with IoRing(work, entries=64) as ring:
        fid = ring.register(work / "f")
        for n in range(32):
            ring.prep_io(iov, fid, n * 64 * KIB, 64 * KIB, iov_offset=n * 64 * KIB, userdata=n)
        ring.submit()
        os.unlink(work / "f")
        results = _wait_all(ring, 32)
        assert all(r == 64 * KIB for r in results.values())
        assert bytes(iov.view[:2 * MIB]) == data
        iov.view[:MIB] = bytes(MIB)
        ring.prep_io(iov, fid, MIB, MIB, userdata=99)  # and after the unlink, as an open descriptor does
        ring.submit()
        assert _wait_all(ring, 1) == {99: MIB}
        assert bytes(iov.view[:MIB]) == data[MIB:]


_CHILD_AS_NOBODY = """
import errno, os, sys
from fs3.usrbio import Iov, IoRing
os.setgroups([]); os.setgid({nobody}); os.setuid({nobody})
fd = int(sys.argv[1])
with IoRing(".") as ring, Iov(4096) as iov:  # relative: the test's directories above are root's alone
    try:
        ring.register("secret")
        print("path: registered")
    except PermissionError:
        print("path: EACCES")
    try:
        ring.register(fd)
        print("fd: registered")
    except PermissionError:
        print("fd: EACCES")
    fid = ring.register("public")
    ring.prep_io(iov, fid, 0, 6)
    ring.submit()
    print("public:", ring.wait(1, timeout_s=60)[0].result, bytes(iov.view[:6]).decode())
"""


@pytest.mark.slow
def test_a_ring_is_no_way_around_permissions(work: Path) -> None:
    """Another user cannot register a 0600 file: not by path (the kernel's check), and not with a
    descriptor root opened and handed down (the daemon opens it again as that user)."""
    os.chmod(work, 0o755)
    (work / "secret").write_bytes(b"secret")
    os.chmod(work / "secret", 0o600)
    (work / "public").write_bytes(b"public")
    os.chmod(work / "public", 0o644)
    fd = os.open(work / "secret", os.O_RDONLY)
    try:
        root = Path(__file__).resolve().parents[1]
        done = subprocess.run([sys.executable, "-c", _CHILD_AS_NOBODY.format(nobody=NOBODY), str(fd)],
                              pass_fds=[fd], cwd=work, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(root)})
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["path: EACCES", "fd: EACCES", "public: 6 public"], done.stdout


def _stats(work: Path) -> dict[str, int]:
    with IoRing(work, entries=1) as probe:
        stats = probe.server_stats()
    stats["rings"] -= 1  # the probe itself
    return stats


def _gauges(mount: tuple[object, Path]) -> dict[str, float]:
    """The mount's usrbio gauges, from its /metrics endpoint."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    address = mount[0].procs["mount"].info["metrics"]  # type: ignore[attr-defined]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as rsp:
        families = text_string_to_metric_families(rsp.read().decode())
        return {s.name: s.value for f in families for s in f.samples
                if s.name in ("fs3_usrbio_rings", "fs3_usrbio_files", "fs3_usrbio_mapped_bytes")}


@pytest.mark.slow
def test_a_process_that_dies_holding_a_ring_releases_it(mount: tuple[object, Path], work: Path) -> None:
    (work / "f").write_bytes(b"y" * MIB)
    before = _stats(work)
    code = (f"import os, signal\nfrom fs3.usrbio import Iov, IoRing\niov = Iov({MIB})\nring = IoRing({str(work)!r})\n"
            f"for _ in range(3): ring.register({str(work / 'f')!r})\n"
            f"ring.register({str(work / 'w')!r}, os.O_RDWR | os.O_CREAT)\n"
            "for n in range(64): ring.prep_io(iov, 1, n * 4096, 4096, iov_offset=n * 4096)\n"
            "ring.submit()\nprint('held', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n")
    root = Path(__file__).resolve().parents[1]
    died = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert died.returncode == -9 and "held" in died.stdout, died.stderr
    deadline = time.monotonic() + 30
    while True:
        now = _stats(work)
        if (now["rings"], now["files"], now["releasing"], now["open_handles"]) == \
                (before["rings"], before["files"], 0, before["open_handles"]):
            break
        assert time.monotonic() < deadline, (before, now)
        time.sleep(0.1)
    at_rest = {"fs3_usrbio_rings": 0.0, "fs3_usrbio_files": 0.0, "fs3_usrbio_mapped_bytes": 0.0}
    while (gauges := _gauges(mount)) != at_rest:  # no ring is open now (the probes' are released in turn)
        assert time.monotonic() < deadline, gauges
        time.sleep(0.1)


@pytest.mark.slow
def test_a_record_dataset_on_the_mount_reads_through_usrbio(work: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """haiscale's RecordDataset given a path on the mount reads its batches through a ring (one
    submit per batch), with the same records as plain reads; files elsewhere are read plainly."""
    from haiscale.data import LocalFileSystem, RecordDataset, write_shards
    from haiscale.data.usrbio_fs import UsrbioFileSystem

    records = [bytes([i % 251]) * ((i * 977) % 70_000) + i.to_bytes(4, "little") for i in range(40)]
    write_shards(LocalFileSystem(), str(work / "ds"), records, records_per_file=16)
    submits: list[int] = []
    real_submit = IoRing.submit

    def counting_submit(ring: IoRing) -> int:
        submits.append(ring.outstanding)
        return real_submit(ring)

    monkeypatch.setattr(IoRing, "submit", counting_submit)
    with RecordDataset(str(work / "ds")) as ds:
        assert isinstance(ds._shards[0].fs, UsrbioFileSystem)
        batch = [39, 0, 17, 16, 5, 33, 5]  # across the three shards, one repeated
        submits.clear()  # (the shards' tables were read the same way)
        assert ds.__getitems__(batch) == [records[i] for i in batch]
        assert len(submits) == 1
        assert [ds[i] for i in range(40)] == records
    monkeypatch.setenv("HAISCALE_USRBIO", "0")
    with RecordDataset(str(work / "ds")) as ds:
        assert type(ds._shards[0].fs) is LocalFileSystem
    # A file off the mount goes the plain way, in the same call.
    (tmp_path / "local.bin").write_bytes(b"local bytes")
    (work / "mounted.bin").write_bytes(b"mounted bytes")
    fs = UsrbioFileSystem()
    try:
        views = fs.read_many([(str(tmp_path / "local.bin"), 6, 100), (str(work / "mounted.bin"), 8, 5)])
        assert [bytes(v) for v in views] == [b"bytes", b"bytes"]
    finally:
        fs.close()


@pytest.mark.slow
def test_a_client_breaking_the_protocol_only_hurts_its_own_ring(work: Path, iov: Iov) -> None:
    """An unsealed buffer is refused (the daemon would SIGBUS if it shrank under the mapping); a
    ring claiming more entries than it holds is dropped with a clear error; the mount serves on."""
    import struct as struct_module

    from fs3.usrbio import SQ_TAIL_AT

    (work / "f").write_bytes(b"z" * 4096)
    with IoRing(work, entries=4) as ring:
        unsealed = os.memfd_create("unsealed", os.MFD_CLOEXEC)
        try:
            os.ftruncate(unsealed, 4096)
            with pytest.raises(PermissionError, match="F_SEAL_SHRINK"):
                ring._control({"op": "iov", "size": 4096}, [unsealed])
        finally:
            os.close(unsealed)
        with pytest.raises(OSError) as bad:
            ring._control({"op": "no-such-request"})
        assert bad.value.errno == errno.EINVAL
        struct_module.pack_into("<I", ring._ring, SQ_TAIL_AT, 1000)  # 1000 entries on a ring of 4
        ring._outstanding = 4
        ring._send(b"S" + struct_module.pack("<I", 1000))
        with pytest.raises(ConnectionError, match="1000 entries submitted"):
            ring.wait(1, timeout_s=30)
    with IoRing(work, entries=4) as again:  # everyone else, this process included, is served
        fid = again.register(work / "f")
        again.prep_io(iov, fid, 0, 4096)
        again.submit()
        assert again.wait(1, timeout_s=30)[0].result == 4096


@pytest.mark.slow  # last: it kills and restarts the module's mount
def test_the_mount_daemon_dying_mid_batch_is_a_clear_error_and_a_remount_serves_again(
        mount: tuple[object, Path], iov: Iov) -> None:
    from tests.harness import ProcessCluster

    cluster, mnt = mount
    assert isinstance(cluster, ProcessCluster)
    work = mnt / "daemon-dies"
    work.mkdir()
    data = random.Random(4).randbytes(4 * MIB)
    (work / "f").write_bytes(data)
    ring = IoRing(work, entries=128)
    fid = ring.register(work / "f")
    for n in range(128):
        ring.prep_io(iov, fid, (n % 64) * 64 * KIB, 64 * KIB, iov_offset=(n % 64) * 64 * KIB, userdata=n)
    ring.submit()
    cluster.kill("mount")
    with pytest.raises(MountGone, match=str(work)):
        while True:  # whatever finished before the kill is reaped; then the loss is reported
            ring.wait(min_results=ring.outstanding, timeout_s=30)
            if not ring.outstanding:
                ring.prep_io(iov, fid, 0, 1)
                ring.submit()
    ring.close()
    subprocess.run([sys.executable, "-m", "fs3.cli.main", "umount", str(mnt)], capture_output=True, check=True)
    cluster.start("mount")
    assert (work / "f").read_bytes() == data  # nothing corrupted
    with IoRing(work, entries=64) as again:
        fid = again.register(work / "f")
        iov.view[:4 * MIB] = bytes(4 * MIB)
        for n in range(64):
            again.prep_io(iov, fid, n * 64 * KIB, 64 * KIB, iov_offset=n * 64 * KIB, userdata=n)
        again.submit()
        assert set(_wait_all(again, 64).values()) == {64 * KIB}
        assert bytes(iov.view[:4 * MIB]) == data  # the same Iov, registered with the new daemon


@pytest.mark.slow
def test_rings_serve_a_mount_with_data_workers(tmp_path: Path) -> None:
    """With ``--workers N`` the FUSE handles live in data workers while a ring's files are read by
    the front process itself: each sees what the other wrote once it completed or was closed."""
    require_fuse()
    data = random.Random(3).randbytes(2 * MIB + 77)
    with mounted_cluster(tmp_path, workers=2) as (_, mnt), Iov(4 * MIB) as shared:
        (mnt / "by-fuse").write_bytes(data)
        with IoRing(mnt, entries=8) as ring:
            fid = ring.register(mnt / "by-fuse")
            ring.prep_io(shared, fid, 0, len(data) + 100, userdata=1)
            ring.submit()
            assert _wait_all(ring, 1) == {1: len(data)}
            assert bytes(shared.view[:len(data)]) == data
            # A file a FUSE descriptor (in a worker) holds open while the ring writes it.
            fd = os.open(mnt / "shared", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                gid = ring.register(mnt / "shared", os.O_RDWR)
                shared.view[:4 * KIB] = data[:4 * KIB]
                ring.prep_io(shared, gid, 8 * KIB, 4 * KIB, write=True, userdata=2)
                ring.submit()
                assert _wait_all(ring, 1) == {2: 4 * KIB}
            finally:
                os.close(fd)
            assert (mnt / "shared").read_bytes() == bytes(8 * KIB) + data[:4 * KIB]
