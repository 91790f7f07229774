"""One client's handles on one file: truncates that stay done, and handles that see each other.

Each test is a sequence the randomized exerciser (``tests/test_fsx.py``) found, shrunk, on the
client library; the same code serves the FUSE mount (``tests/test_fuse_mount.py`` runs the
mount's versions). Chunks are 8 KiB so the files span several of them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import fs3.aio
from fs3.client.fs import AsyncFileSystem
from tests.inproc import ClusterThread

CHUNK = 8192
_dirs = itertools.count()


Body = Callable[[AsyncFileSystem, str, Callable[[str], Awaitable[tuple[int, bytes]]]], Awaitable[None]]


def with_fs(shared_cluster: ClusterThread, body: Body) -> None:
    """Run ``body(fs, directory, contents)`` with a client of the shared cluster, a fresh directory
    of 8 KiB chunks, and ``contents(path)``: size and bytes as a second client sees them."""
    async def main() -> None:
        cluster = shared_cluster.cluster
        fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)
        other = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token)

        async def contents(path: str) -> tuple[int, bytes]:
            return (await other.stat(path)).st_size, await other.read_bytes(path)

        try:
            directory = f"/handles-{next(_dirs)}"
            await fs.mkdir(directory)
            await fs.set_layout(directory, chunk_size=CHUNK)
            await body(fs, directory, contents)
        finally:
            await other.close()
            await fs.close()

    asyncio.run(main())


def test_a_truncate_on_an_open_handle_also_removes_its_chunks_past_a_hole(shared_cluster: Any) -> None:
    """open(O_TRUNC); pwrite 1 byte at 2.5 chunks; ftruncate to 0.25 chunk; pwrite 1 byte at 1.25
    chunks; close. The first write's chunk lies past a hole and meta had not been told of it: the
    truncate left it, and the close's length brought it back (size 2.5 chunks + 1)."""
    async def body(fs: AsyncFileSystem, d: str, contents: Any) -> None:
        f = await fs.open(f"{d}/f", "w+b")
        await f.pwrite(5 * CHUNK // 2, b"a")
        await f.truncate(CHUNK // 4)
        await f.pwrite(5 * CHUNK // 4, b"b")
        await f.close()
        assert await contents(f"{d}/f") == (5 * CHUNK // 4 + 1, bytes(5 * CHUNK // 4) + b"b")

    with_fs(shared_cluster, body)


def test_a_truncate_by_path_lands_another_handles_writes_first(shared_cluster: Any) -> None:
    """Bytes still buffered in a handle when the file is truncated by path were written before the
    truncate: they must go with it, not land after it and bring the old length back."""
    async def body(fs: AsyncFileSystem, d: str, contents: Any) -> None:
        f = await fs.open(f"{d}/f", "w+b")
        await f.pwrite(3 * CHUNK + 3, b"x" * 12)
        await fs.truncate(f"{d}/f", 0)
        await f.pwrite(1, b"y" * (2 * CHUNK))
        await f.close()
        assert await contents(f"{d}/f") == (2 * CHUNK + 1, b"\0" + b"y" * (2 * CHUNK))

    with_fs(shared_cluster, body)


def test_an_o_trunc_open_lands_another_handles_writes_first(shared_cluster: Any) -> None:
    async def body(fs: AsyncFileSystem, d: str, contents: Any) -> None:
        appender = await fs.open(f"{d}/f", "a+b")
        await appender.write(b"z" * (3 * CHUNK // 2))
        emptied = await fs.open(f"{d}/f", "w+b")
        assert appender.length == 0 and await appender.pread(0, 10) == b""
        await appender.write(b"after")  # the end is now 0
        await emptied.close()
        await appender.close()
        assert await contents(f"{d}/f") == (5, b"after")

    with_fs(shared_cluster, body)


def test_every_handle_learns_a_size_change_and_what_the_others_wrote(shared_cluster: Any) -> None:
    async def body(fs: AsyncFileSystem, d: str, contents: Any) -> None:
        await fs.write_bytes(f"{d}/f", b"")
        reader = await fs.open(f"{d}/f", "rb")
        await fs.truncate(f"{d}/f", 2209)  # up: the reader must see the zeros, not an empty file
        assert await reader.pread(965, 10_000) == bytes(2209 - 965)
        writer = await fs.open(f"{d}/f", "r+b")
        await writer.pwrite(4 * CHUNK + 1, b"w" * 11)
        assert (await fs.stat(f"{d}/f")).st_size == 4 * CHUNK + 12  # stat counts this client's writes
        await writer.close()
        assert await reader.pread(4 * CHUNK, 100) == b"\0" + b"w" * 11  # written by a handle now closed
        await fs.truncate(f"{d}/f", 100)
        assert await reader.pread(0, 1000) == bytes(100)
        await reader.close()

    with_fs(shared_cluster, body)


def test_overlapping_writes_of_two_handles_land_in_order(shared_cluster: Any) -> None:
    """Each handle buffers per chunk: the later write must win where the two overlap, whichever
    handle sends its buffer last."""
    async def body(fs: AsyncFileSystem, d: str, contents: Any) -> None:
        first = await fs.open(f"{d}/f", "w+b")
        second = await fs.open(f"{d}/f", "r+b")
        await first.pwrite(8771, b"1" * 12124)
        await second.pwrite(16381, b"2" * 9272)
        await second.close()
        await first.close()
        want = bytes(8771) + b"1" * (16381 - 8771) + b"2" * 9272
        assert await contents(f"{d}/f") == (len(want), want)

    with_fs(shared_cluster, body)


def test_an_append_goes_to_the_end_another_handle_wrote(shared_cluster: Any) -> None:
    async def body(fs: AsyncFileSystem, d: str, contents: Any) -> None:
        appender = await fs.open(f"{d}/f", "a+b")
        writer = await fs.open(f"{d}/f", "r+b")
        await writer.pwrite(0, b"w" * (CHUNK + 7))
        await appender.write(b"tail")
        await writer.close()
        await appender.close()
        assert await contents(f"{d}/f") == (CHUNK + 11, b"w" * (CHUNK + 7) + b"tail")

    with_fs(shared_cluster, body)


def test_read_ahead_does_not_serve_bytes_another_handle_overwrote(shared_cluster: Any) -> None:
    async def body(fs: AsyncFileSystem, d: str, contents: Any) -> None:
        await fs.write_bytes(f"{d}/f", b"o" * (8 * CHUNK))
        reader = await fs.open(f"{d}/f", "rb")
        writer = await fs.open(f"{d}/f", "r+b")
        assert await reader.read(CHUNK) == b"o" * CHUNK  # sequential: the next chunks are fetched ahead
        await writer.pwrite(2 * CHUNK, b"n" * CHUNK)
        assert await reader.read(2 * CHUNK) == b"o" * CHUNK + b"n" * CHUNK
        await writer.close()
        await reader.close()

    with_fs(shared_cluster, body)


def test_a_read_in_progress_survives_another_handles_write_and_truncate(shared_cluster: Any) -> None:
    """A write or a truncate through another handle drops this handle's read-ahead; a read that
    is waiting for a piece fetched ahead must still get its bytes (the FUSE exerciser, seed 1223:
    the read's request was never answered, and the kernel's page lock hung the writer)."""
    async def body(fs: AsyncFileSystem, d: str, contents: Any) -> None:
        await fs.write_bytes(f"{d}/f", b"o" * (8 * CHUNK))
        reader = await fs.open(f"{d}/f", "rb")
        writer = await fs.open(f"{d}/f", "r+b")
        assert await reader.read(CHUNK) == b"o" * CHUNK  # sequential: the next pieces are fetched ahead
        reading = asyncio.create_task(reader.read(4 * CHUNK))
        await asyncio.sleep(0)  # the read now waits for a piece fetched ahead
        await writer.pwrite(6 * CHUNK, b"n")  # past what the read asked for
        assert await reading == b"o" * (4 * CHUNK)
        assert await reader.read(2 * CHUNK) == b"o" * CHUNK + b"n" + b"o" * (CHUNK - 1)
        reader.seek(0)
        assert await reader.read(CHUNK) == b"o" * CHUNK
        reading = asyncio.create_task(reader.read(4 * CHUNK))
        await asyncio.sleep(0)
        await writer.truncate(6 * CHUNK)
        assert await reading == b"o" * (4 * CHUNK)
        assert await reader.read() == b"o" * CHUNK
        await writer.close()
        await reader.close()

    with_fs(shared_cluster, body)
