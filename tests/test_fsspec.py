"""fs3 through fsspec: fsspec's own abstract test suites, URLs, pandas and pyarrow unchanged."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import fsspec
import pytest
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
