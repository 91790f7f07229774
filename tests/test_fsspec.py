"""fs3 through fsspec: fsspec's own abstract test suites, URLs, pandas, pyarrow, zarr and xarray
unchanged; batch calls concurrent; asyncio use; fsspec's caches and rsync."""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import pickle
import zipfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import xarray as xr
import zarr
from fsspec.asyn import sync
from fsspec.generic import rsync
from fsspec.spec import AbstractBufferedFile
from fsspec.tests.abstract import (
    AbstractCopyTests,
    AbstractFixtures,
    AbstractGetTests,
    AbstractOpenTests,
    AbstractPipeTests,
    AbstractPutTests,
)

from fs3.client.fsspec_impl import FS3FileSystem

pytestmark = pytest.mark.slow  # fsspec's own test suite against a running in-process cluster

_dirs = itertools.count()


class FS3Fixtures(AbstractFixtures):  # type: ignore[misc]
    @pytest.fixture(scope="class")
    @classmethod
    def fs(cls, shared_cluster: Any) -> Iterator[FS3FileSystem]:
        cluster = shared_cluster.cluster
        fs = fsspec.filesystem("fs3", mgmtd=cluster.mgmtd_address, token=cluster.token, skip_instance_cache=True)
        yield fs
        fs.close()

    @pytest.fixture
    def fs_join(self) -> Callable[..., str]:
        return lambda *parts: "/".join(parts)

    @pytest.fixture
    def fs_path(self, fs: FS3FileSystem) -> str:
        path = f"/fsspec-{next(_dirs)}"
        fs.makedirs(path)
        return path


class TestFS3Copy(AbstractCopyTests, FS3Fixtures):  # type: ignore[misc]
    pass


class TestFS3Get(AbstractGetTests, FS3Fixtures):  # type: ignore[misc]
    pass


class TestFS3Put(AbstractPutTests, FS3Fixtures):  # type: ignore[misc]
    pass


class TestFS3Open(AbstractOpenTests, FS3Fixtures):  # type: ignore[misc]
    pass


class TestFS3Pipe(AbstractPipeTests, FS3Fixtures):  # type: ignore[misc]
    pass


def test_urls_and_registration(shared_cluster: Any) -> None:
    cluster = shared_cluster.cluster
    assert fsspec.get_filesystem_class("fs3") is FS3FileSystem
    url = f"fs3://{cluster.mgmtd_address}/urls/hello.txt"
    with fsspec.open(url, "w", token=cluster.token) as f:
        f.write("hello")
    with fsspec.open(url, "r", token=cluster.token) as f:
        assert f.read() == "hello"
    fs, path = fsspec.core.url_to_fs(url, token=cluster.token)
    assert isinstance(fs, FS3FileSystem) and path == "/urls/hello.txt"
    assert fs.info(path)["size"] == 5 and fs.ls("/urls", detail=False) == ["/urls/hello.txt"]
    fs.mv("/urls/hello.txt", "/urls/renamed.txt")
    assert fs.cat_file("/urls/renamed.txt") == b"hello"
    assert fs.cat_file("/urls/renamed.txt", start=1, end=3) == b"el"


def test_pandas_and_pyarrow_read_and_write_fs3(shared_cluster: Any) -> None:
    pd = pytest.importorskip("pandas")
    pq = pytest.importorskip("pyarrow.parquet")
    cluster = shared_cluster.cluster
    options = {"token": cluster.token}
    frame = pd.DataFrame({"step": range(1000), "loss": [1.0 / (i + 1) for i in range(1000)]})
    base = f"fs3://{cluster.mgmtd_address}/frames"
    frame.to_csv(f"{base}/a.csv", index=False, storage_options=options)
    pd.testing.assert_frame_equal(pd.read_csv(f"{base}/a.csv", storage_options=options), frame)
    frame.to_parquet(f"{base}/a.parquet", storage_options=options)
    pd.testing.assert_frame_equal(pd.read_parquet(f"{base}/a.parquet", storage_options=options), frame)
    fs = fsspec.filesystem("fs3", mgmtd=cluster.mgmtd_address, token=cluster.token)
    table = pq.read_table("/frames/a.parquet", filesystem=fs)
    assert table.num_rows == 1000
    pq.write_table(table, "/frames/b.parquet", filesystem=fs)
    assert pq.read_table("/frames/b.parquet", filesystem=fs).equals(table)


def test_checkpoint_style_writes(shared_cluster: Any) -> None:
    """What torch.distributed.checkpoint's FsspecWriter does: makedirs, write to a temp name, rename, read back."""
    cluster = shared_cluster.cluster
    fs = fsspec.filesystem("fs3", mgmtd=cluster.mgmtd_address, token=cluster.token)
    fs.makedirs("/ckpt/step-100", exist_ok=True)
    shards = {f"__{rank}_0.distcp": bytes([rank]) * (300_000 + rank) for rank in range(4)}
    for name, data in shards.items():
        with fs.open(f"/ckpt/step-100/{name}.tmp", "wb") as f:
            f.write(data)
        fs.mv(f"/ckpt/step-100/{name}.tmp", f"/ckpt/step-100/{name}")
    with fs.open("/ckpt/step-100/.metadata", "wb") as f:
        f.write(b"meta")
    assert sorted(fs.ls("/ckpt/step-100", detail=False)) == sorted(
        [f"/ckpt/step-100/{n}" for n in shards] + ["/ckpt/step-100/.metadata"])
    for name, data in shards.items():
        with fs.open(f"/ckpt/step-100/{name}", "rb") as f:
            f.seek(100_000)
            assert f.read(10) == data[100_000:100_010]
            f.seek(0)
            assert f.read() == data


def _fs(shared_cluster: Any, **options: Any) -> FS3FileSystem:
    cluster = shared_cluster.cluster
    fs = fsspec.filesystem("fs3", mgmtd=cluster.mgmtd_address, token=cluster.token, **options)
    assert isinstance(fs, FS3FileSystem)
    return fs


class InFlight:
    """Wraps a client call to count how many run at once (each held a moment, so that calls
    issued together overlap and calls issued one after another do not)."""

    def __init__(self, call: Callable[..., Awaitable[Any]]) -> None:
        self.call = call
        self.now = 0
        self.most = 0
        self.calls = 0

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.now += 1
        self.calls += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(0.05)
            return await self.call(*args, **kwargs)
        finally:
            self.now -= 1


def test_batch_cat_get_and_put_run_concurrently(shared_cluster: Any, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fs = _fs(shared_cluster, skip_instance_cache=True)
    try:
        client = sync(fs.loop, fs.get_client)
        files = {f"/batch/f{i:02d}": bytes([i]) * (1000 + i) for i in range(24)}
        writes = InFlight(client.storage.write)
        monkeypatch.setattr(client.storage, "write", writes)
        fs.pipe(files)
        assert writes.calls >= len(files) and writes.most >= 4, (writes.calls, writes.most)

        reads = InFlight(client.storage.read)
        monkeypatch.setattr(client.storage, "read", reads)
        assert fs.cat(sorted(files)) == files
        assert reads.calls >= len(files) and reads.most >= 4, (reads.calls, reads.most)

        reads.most = 0
        fs.get("/batch/", str(tmp_path / "got"), recursive=True)
        assert {f"/batch/{p.name}": p.read_bytes() for p in (tmp_path / "got").iterdir()} == files
        assert reads.most >= 4

        writes.most = 0
        fs.put(str(tmp_path / "got"), "/batch-put", recursive=True)
        assert fs.cat(sorted(fs.find("/batch-put"))) == {f"/batch-put/{p[len('/batch/'):]}": data
                                                         for p, data in files.items()}
        assert writes.most >= 4
    finally:
        fs.close()


def test_asynchronous_file_system_inside_a_running_loop(shared_cluster: Any) -> None:
    cluster = shared_cluster.cluster

    async def main() -> None:
        loop = asyncio.get_running_loop()
        # What zarr v3 asks for: the fsspec URL with asynchronous=True, used from the caller's loop.
        fs, path = fsspec.core.url_to_fs(f"fs3://{cluster.mgmtd_address}/aio/a.bin", token=cluster.token,
                                         asynchronous=True, loop=loop)
        assert isinstance(fs, FS3FileSystem) and fs.asynchronous and path == "/aio/a.bin"
        await fs._pipe_file(path, b"hello")
        await fs._pipe({"/aio/b.bin": b"b" * 300_000, "/aio/c.bin": b"c"})
        assert await fs._cat_file(path) == b"hello"
        assert await fs._cat_file("/aio/b.bin", start=-3) == b"bbb"
        assert await fs._cat_ranges(["/aio/a.bin", "/aio/b.bin"], [1, 10], [3, 12]) == [b"el", b"bb"]
        assert sorted(await fs._ls("/aio", detail=False)) == ["/aio/a.bin", "/aio/b.bin", "/aio/c.bin"]
        assert (await fs._info("/aio/b.bin"))["size"] == 300_000
        assert await fs._exists(path) and not await fs._exists("/aio/none")
        with pytest.raises(FileNotFoundError):
            await fs._cat_file("/aio/none")
        with pytest.raises(FileExistsError):
            await fs._pipe_file(path, b"again", mode="create")

        f = await fs.open_async("/aio/d.bin", "wb")
        await f.write(b"written ")
        await f.write(b"async")
        await f.close()
        f = await fs.open_async("/aio/d.bin", "rb")
        assert f.size == 13 and await f.read(7) == b"written" and await f.read() == b" async"
        await f.close()

        await fs._rm("/aio", recursive=True)
        assert not await fs._exists("/aio")
        await fs._close()

    asyncio.run(main())


def test_client_options_are_checked_at_construction(shared_cluster: Any) -> None:
    cluster = shared_cluster.cluster
    with pytest.raises(TypeError, match="unknown client options: bogus"):
        fsspec.filesystem("fs3", mgmtd=cluster.mgmtd_address, token=cluster.token, bogus=1, asynchronous=True)
    fs = _fs(shared_cluster, rpc_timeout_ms=5_000, skip_instance_cache=True, use_listings_cache=False)
    assert sync(fs.loop, fs.get_client).config.rpc_timeout_ms == 5_000
    fs.close()


def test_file_objects_have_fsspec_shape(shared_cluster: Any) -> None:
    fs = _fs(shared_cluster)
    other = _fs(shared_cluster, skip_instance_cache=True)  # another client: sees what meta has
    data = bytes(range(256)) * 800  # 200 KiB
    try:
        with fs.open("/shape/f.bin", "wb", block_size=64 * 1024) as f:
            assert isinstance(f, AbstractBufferedFile) and f.blocksize == 64 * 1024
            f.write(data)
            # Three full blocks went out, the last part is still buffered: nothing is committed yet.
            assert other.info("/shape/f.bin")["size"] < len(data)
        assert other.info("/shape/f.bin")["size"] == len(data)

        with fs.open("/shape/f.bin", "rb", block_size=4096) as f:
            assert isinstance(f, AbstractBufferedFile) and f.size == len(data) and f.blocksize == 4096
            assert f.seek(100_000) == 100_000 and f.read(4) == data[100_000:100_004] and f.tell() == 100_004
            buffer = bytearray(10)
            assert f.readinto(buffer) == 10 and bytes(buffer) == data[100_004:100_014]
            assert f.seek(-6, 2) == len(data) - 6 and f.read() == data[-6:]
            assert f.read(5) == b""

        with fs.open("/shape/f.bin", "ab") as f:
            assert f.tell() == len(data)
            f.write(b"tail")
        with fs.open("/shape/f.bin", "r+b") as f:  # one handle, read and written anywhere
            f.seek(2)
            f.write(b"XY")
            f.seek(0)
            assert f.read(6) == data[:2] + b"XY" + data[4:6]
        with fs.open("/shape/f.bin", "wb") as f:  # a written file seeks, as a local one does
            f.write(b"0123456789")
            f.seek(2)
            f.write(b"ab")
            f.fsync()
            assert other.cat_file("/shape/f.bin") == b"01ab456789"
        with fs.open("/shape/a.zip", "wb") as f, zipfile.ZipFile(f, "w") as archive:  # seeks back to headers
            archive.writestr("one.txt", "1" * 1000)
            archive.writestr("two.txt", "2")
        with fs.open("/shape/a.zip", "rb") as f, zipfile.ZipFile(f) as archive:
            assert archive.read("one.txt") == b"1" * 1000 and archive.read("two.txt") == b"2"
        fs.rm_file("/shape/a.zip")
        with fs.open("/shape/t.txt", "w") as f:
            f.write("text\nlines\n")
        with fs.open("/shape/t.txt", "r") as f:
            assert f.readlines() == ["text\n", "lines\n"]

        # Errors are the OSError a local open raises, at open.
        with pytest.raises(FileNotFoundError):
            fs.open("/shape/missing.bin", "rb")
        with pytest.raises(IsADirectoryError):
            fs.open("/shape", "rb")
        with pytest.raises(FileExistsError):
            fs.open("/shape/f.bin", "xb")
        with pytest.raises(FileNotFoundError):
            _fs(shared_cluster, auto_mkdir=False).open("/no-such-dir/f.bin", "wb")
        with pytest.raises(NotADirectoryError):
            fs.open("/shape/f.bin/under", "rb")

        # A transaction: files appear under their names only when it ends, and not at all if it fails.
        with fs.transaction:
            with fs.open("/shape/tx.bin", "wb") as f:
                f.write(b"committed")
            assert not fs.exists("/shape/tx.bin")
        assert fs.cat_file("/shape/tx.bin") == b"committed"
        with pytest.raises(RuntimeError), fs.transaction:
            with fs.open("/shape/tx2.bin", "wb") as f:
                f.write(b"lost")
            raise RuntimeError("abort")
        assert fs.ls("/shape", detail=False) == ["/shape/f.bin", "/shape/t.txt", "/shape/tx.bin"]
    finally:
        other.close()


def test_blockcache_simplecache_and_filecache_over_fs3(shared_cluster: Any, tmp_path: Path) -> None:
    cluster = shared_cluster.cluster
    data = bytes(range(256)) * 4000  # ~1 MiB
    _fs(shared_cluster).pipe("/cached/f.bin", data)
    url = f"fs3://{cluster.mgmtd_address}/cached/f.bin"
    for cache in ("blockcache", "simplecache", "filecache"):
        options = {"fs3": {"token": cluster.token}, cache: {"cache_storage": str(tmp_path / cache)}}
        for _ in range(2):  # filled, then served from the cache
            with fsspec.open(f"{cache}::{url}", "rb", **options) as f:
                f.seek(300_000)
                assert f.read(1000) == data[300_000:301_000], cache
                f.seek(0)
                assert f.read() == data, cache
        assert any((tmp_path / cache).iterdir()), f"{cache} kept nothing"


def test_rsync_between_a_local_directory_and_fs3(shared_cluster: Any, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's generic rsync makes the file systems from the URLs and storage options alone."""
    cluster = shared_cluster.cluster
    for name in ("FS3_MGMTD", "FS3_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    source = tmp_path / "src"
    (source / "sub" / "deeper").mkdir(parents=True)
    (source / "a.txt").write_text("a")
    (source / "sub" / "b.bin").write_bytes(b"b" * 100_000)
    (source / "sub" / "deeper" / "c.txt").write_text("c")
    remote = f"fs3://{cluster.mgmtd_address}/rsync/dst"
    how = {"default_method": "options", "storage_options": {"fs3": {"token": cluster.token}}}

    copied = rsync(str(source), remote, inst_kwargs=how)
    assert sorted(copied.values()) == [f"{remote}/a.txt", f"{remote}/sub/b.bin", f"{remote}/sub/deeper/c.txt"]
    fs = _fs(shared_cluster)
    assert fs.cat_file("/rsync/dst/sub/b.bin") == b"b" * 100_000

    # Again: only what changed goes; delete_missing removes what the source no longer has.
    (source / "a.txt").write_text("a, longer")
    (source / "sub" / "deeper" / "c.txt").unlink()
    copied = rsync(str(source), remote, inst_kwargs=how, delete_missing=True)
    assert list(copied.values()) == [f"{remote}/a.txt"]
    assert fs.cat_file("/rsync/dst/a.txt") == b"a, longer" and not fs.exists("/rsync/dst/sub/deeper/c.txt")

    back = tmp_path / "back"
    rsync(remote, str(back), inst_kwargs=how)
    assert sorted(str(p.relative_to(back)) for p in back.rglob("*") if p.is_file()) == ["a.txt", "sub/b.bin"]
    assert (back / "sub" / "b.bin").read_bytes() == b"b" * 100_000 and (back / "sub" / "deeper").is_dir()


def test_zarr_v3_round_trip(shared_cluster: Any) -> None:
    cluster = shared_cluster.cluster
    url = f"fs3://{cluster.mgmtd_address}/zarr/grid.zarr"
    options = {"token": cluster.token}
    values = np.arange(120 * 80, dtype="float32").reshape(120, 80)
    array = zarr.create_array(store=url, shape=values.shape, chunks=(32, 32), dtype="float32",
                              storage_options=options, attributes={"units": "m"})
    array[:] = values
    array[5:7, 70:] = -1.0
    values[5:7, 70:] = -1.0
    again = zarr.open_array(url, mode="r", storage_options=options)
    assert again.attrs["units"] == "m" and again.metadata.zarr_format == 3
    np.testing.assert_array_equal(again[:], values)
    np.testing.assert_array_equal(again[100:, 10:20], values[100:, 10:20])
    fs = _fs(shared_cluster)
    assert fs.exists("/zarr/grid.zarr/zarr.json") and fs.exists("/zarr/grid.zarr/c/3/2")


def test_xarray_to_zarr_and_open_zarr(shared_cluster: Any) -> None:
    cluster = shared_cluster.cluster
    url = f"fs3://{cluster.mgmtd_address}/xarray/weather.zarr"
    options = {"token": cluster.token}
    rng = np.random.default_rng(7)
    dataset = xr.Dataset(
        {"temperature": (("time", "station"), rng.normal(15, 5, (48, 6))),
         "rain": (("time", "station"), rng.random((48, 6)))},
        coords={"time": np.arange(48), "station": np.arange(100, 106)},
        attrs={"source": "test"})
    dataset.to_zarr(url, storage_options=options, zarr_format=3, consolidated=False)
    back = xr.open_zarr(url, storage_options=options, consolidated=False)
    xr.testing.assert_identical(back.load(), dataset)
    more = dataset.assign_coords(time=dataset.time + 48)
    more.to_zarr(url, storage_options=options, append_dim="time", consolidated=False)
    grown = xr.open_zarr(url, storage_options=options, consolidated=False).load()
    assert grown.sizes["time"] == 96
    xr.testing.assert_identical(grown.isel(time=slice(48, None)), more)


def _read_in_child(fs: FS3FileSystem, path: str, results: Any) -> None:
    results.put(fs.cat_file(path))


def test_a_file_system_made_before_a_fork_works_in_the_child_and_pickles(shared_cluster: Any) -> None:
    fs = _fs(shared_cluster)
    fs.pipe("/fork/f", b"from the parent")
    assert pickle.loads(pickle.dumps(fs)).cat_file("/fork/f") == b"from the parent"
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_read_in_child, args=(fs, "/fork/f", results))
    child.start()
    try:
        assert results.get(timeout=30) == b"from the parent"
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0
    assert fs.cat_file("/fork/f") == b"from the parent"  # the parent's client is untouched
