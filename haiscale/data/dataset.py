"""A map-style torch dataset over record shards, reading each batch with one scattered read.

``RecordDataset("fs3:///datasets/corpus")`` indexes every shard of the directory once (header and
tables, checked), then serves record ``i`` by number. Torch's DataLoader hands a map-style dataset
that has ``__getitems__`` the whole batch of indices at once; here that becomes ONE ``read_many``
call for all the batch's byte ranges, whichever shards they lie in, into one buffer — the fs3
client fetches the ranges concurrently from the storage targets, so a batch costs about one round
trip, not one per sample. Every record is checked against its CRC32C before it is returned.

Safe in DataLoader workers under fork, spawn and forkserver: the dataset holds the shards' tables
(plain arrays) and the file system (fs3's client reconnects after a fork and pickles as its
settings), and opens its shard files lazily in each process, keyed by the process id, so no open
file crosses a fork or a pickle.
"""

from __future__ import annotations

import os
import posixpath
import threading
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any, cast

import numpy as np
import torch
import torch.utils.data

import fs3
from fs3.client.fsspec_impl import FS3FileSystem
from haiscale.data.records import LocalFileSystem, RecordFS, ShardIndex, read_index
from haiscale.data.usrbio_fs import UsrbioFileSystem, usrbio_enabled

__all__ = ["RecordDataset", "TensorBatches", "list_shards", "open_location"]

Source = str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | tuple[Any, str | Sequence[str]]


def open_location(location: str | os.PathLike[str]) -> tuple[RecordFS, str, bool]:
    """``(fs, path, owned)`` for an ``fs3://`` URL or a local path; ``owned`` when the file system
    was connected here (the caller closes it).

    A local path on an fs3 mount that serves usrbio is read through it (:class:`UsrbioFileSystem`;
    ``HAISCALE_USRBIO=0``: plain reads). URLs follow the fsspec driver's rules (:mod:`fs3.client.fsspec_impl`): ``fs3://HOST:PORT/path``,
    ``fs3://PROFILE@/path`` (a profile of the client's config file), ``fs3:///path`` (the
    environment, ``$FS3_MGMTD`` and ``$FS3_TOKEN_FILE``, or the ``default`` profile). A URL never
    carries a token.
    """
    text = os.fspath(location)
    if not text.startswith("fs3://"):
        path = os.path.abspath(text)
        if usrbio_enabled(path):  # on an fs3 mount: batches through usrbio rather than a FUSE read per record
            return UsrbioFileSystem(), path, True
        return LocalFileSystem(), path, False
    options = FS3FileSystem._get_kwargs_from_urls(text)
    path = FS3FileSystem._strip_protocol(text)
    # The client has every call RecordFS names (read_many among them).
    return cast(RecordFS, fs3.connect(options.get("mgmtd"), profile=options.get("profile"))), path, True


def list_shards(fs: RecordFS, path: str) -> list[str]:
    """``path`` itself if it is a file, else its ``*.rec`` files in name order (hidden ones, such as a
    writer's temporary files, left out)."""
    if not fs.isdir(path):
        return [path]
    names = sorted(name for name in fs.listdir(path) if name.endswith(".rec") and not name.startswith("."))
    if not names:
        raise FileNotFoundError(f"{path}: no record shards (*.rec) in this directory")
    return [posixpath.join(path, name) for name in names]


class _Shard:
    """One shard: its file system, its checked tables, and where its records start in the data set."""

    def __init__(self, fs: RecordFS, index: ShardIndex, first: int) -> None:
        self.fs = fs
        self.index = index
        self.first = first


class RecordDataset(torch.utils.data.Dataset[Any]):
    """Records of one or more shards as a map-style dataset: ``len()``, ``ds[i]``, ``ds.__getitems__(batch)``.

    ``source``: an ``fs3://`` URL or local path of a shard or a directory of shards, a list of them,
    or a pair ``(fs, paths)`` of a file system (``fs3.connect(...)``, :class:`LocalFileSystem`) and a
    path or list of paths on it. ``transform`` maps each record's bytes to what the dataset returns.
    File systems connected from URLs belong to the dataset (:meth:`close`); a passed one stays the
    caller's.
    """

    def __init__(self, source: Source, *, transform: Callable[[bytes], Any] | None = None) -> None:
        self.transform = transform
        self._owned: list[RecordFS] = []
        self._shards: list[_Shard] = []
        try:
            for fs, paths in self._resolve(source):
                for path in paths:
                    index = read_index(fs, path)
                    self._shards.append(_Shard(fs, index, self._len()))
        except BaseException:
            self.close()
            raise
        self._starts = np.asarray([shard.first for shard in self._shards], dtype=np.int64)
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def _resolve(self, source: Source) -> list[tuple[RecordFS, list[str]]]:
        if isinstance(source, tuple) and len(source) == 2 and not isinstance(source[0], str | os.PathLike):
            fs: RecordFS = source[0]
            paths: Any = source[1]
            names: list[str] = [paths] if isinstance(paths, str) else list(paths)
            return [(fs, [shard for name in names for shard in list_shards(fs, name)])]
        items = [source] if isinstance(source, str | os.PathLike) else list(source)
        if not items:
            raise ValueError("a record dataset needs at least one shard or directory")
        connected: dict[tuple[Any, ...], RecordFS] = {}  # one connection per cluster the URLs name
        out: list[tuple[RecordFS, list[str]]] = []
        for item in items:
            text = os.fspath(item)
            key: tuple[Any, ...] = ("local",)
            if text.startswith("fs3://"):
                options = FS3FileSystem._get_kwargs_from_urls(text)
                key = ("fs3", options.get("mgmtd"), options.get("profile"))
            if key in connected:
                fs = connected[key]
                path = FS3FileSystem._strip_protocol(text) if key[0] == "fs3" else os.path.abspath(text)
            else:
                fs, path, owned = open_location(text)
                connected[key] = fs
                if owned:
                    self._owned.append(fs)
            out.append((fs, list_shards(fs, path)))
        return out

    def _len(self) -> int:
        if not self._shards:
            return 0
        last = self._shards[-1]
        return last.first + last.index.count

    def __len__(self) -> int:
        return self._len()

    def __repr__(self) -> str:
        return f"RecordDataset({len(self._shards)} shards, {len(self)} records)"

    @property
    def shards(self) -> list[ShardIndex]:
        """The shards' checked tables, in dataset order."""
        return [shard.index for shard in self._shards]

    # -- per-process files -------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_files"], state["_lock"] = {}, None  # open files never travel to another process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    def _file(self, number: int) -> Any:
        """Shard ``number`` open for reading in this process (opened on first use). In a forked child
        the parent's files are forgotten, not closed: they are the parent's."""
        if self._pid != os.getpid():
            self._files, self._pid, self._lock = {}, os.getpid(), threading.Lock()
        file = self._files.get(number)
        if file is None:
            with self._lock:
                file = self._files.get(number)
                if file is None:
                    shard = self._shards[number]
                    file = self._files[number] = shard.fs.open(shard.index.path, "rb", buffering=0)
        return file

    def close(self) -> None:
        """Close this process's shard files and the file systems the dataset connected."""
        if getattr(self, "_pid", None) == os.getpid():
            for file in self._files.values():
                with suppress(OSError):
                    file.close()
            self._files = {}
        owned, self._owned = self._owned, []
        for fs in owned:
            fs.close()

    def __enter__(self) -> RecordDataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------------------

    def locate(self, index: int) -> tuple[int, int]:
        """``(shard number, record within the shard)`` of dataset record ``index`` (negative counts
        from the end, as for a list)."""
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError(f"record {index} out of range: the dataset holds {n}")
        number = int(np.searchsorted(self._starts, index, side="right")) - 1
        return number, index - self._shards[number].first

    def _read(self, indices: Sequence[int], buffer: Any = None) -> tuple[list[memoryview], list[tuple[int, int]]]:
        """Read the records ``indices`` name with one ``read_many`` call per file system (one for a
        data set on one cluster), each checked; their views (into ``buffer``) and locations."""
        where = [self.locate(int(i)) for i in indices]
        groups: dict[int, list[int]] = {}  # file system (by id) -> positions in the batch
        for pos, (number, _) in enumerate(where):
            groups.setdefault(id(self._shards[number].fs), []).append(pos)
        lengths = [self._shards[number].index.record_range(local)[1] for number, local in where]
        if buffer is None:
            buffer = bytearray(sum(lengths))
        whole = memoryview(buffer).cast("B")
        starts = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()
        views: list[memoryview] = [whole[0:0]] * len(where)
        for positions in groups.values():
            fs = self._shards[where[positions[0]][0]].fs
            ranges = [(self._file(where[p][0]), *self._shards[where[p][0]].index.record_range(where[p][1]))
                      for p in positions]
            if len(groups) == 1:  # the common case: straight into the caller's buffer
                got = fs.read_many(ranges, buffer=whole)
            else:  # records of several clusters: each one's into a buffer of its own, then into place
                got = []
                for p, view in zip(positions, fs.read_many(ranges), strict=True):
                    whole[starts[p]:starts[p] + view.nbytes] = view
                    got.append(whole[starts[p]:starts[p] + view.nbytes])
            for p, view in zip(positions, got, strict=True):
                views[p] = view
        for (number, local), view in zip(where, views, strict=True):
            self._shards[number].index.check(local, view)
        return views, where

    def __getitem__(self, index: int) -> Any:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The records ``indices`` name, read with one ``read_many`` call and checked; a record that
        fails its checksum raises :class:`~haiscale.data.records.RecordFormatError` naming its shard file and index."""
        views, _ = self._read(indices)
        records = [bytes(view) for view in views]
        return records if self.transform is None else [self.transform(record) for record in records]

    def batch_tensor(self, indices: Sequence[int]) -> torch.Tensor:
        """Fixed-size records as one ``uint8`` tensor ``[len(indices), record_bytes]``, read straight
        into the tensor's memory (no per-record copy) and checked. ``transform`` does not apply."""
        if not indices:
            raise ValueError("batch_tensor needs at least one index")
        where = [self.locate(int(i)) for i in indices]
        lengths = {self._shards[number].index.record_range(local)[1] for number, local in where}
        if len(lengths) != 1:
            raise ValueError(f"batch_tensor needs records of one size; this batch has sizes {sorted(lengths)[:4]}")
        out = torch.empty((len(indices), lengths.pop()), dtype=torch.uint8)
        self._read(indices, out.view(-1).numpy())
        return out


class TensorBatches(torch.utils.data.Dataset[torch.Tensor]):
    """A view of a :class:`RecordDataset` of fixed-size records whose items are whole batches:
    ``DataLoader(TensorBatches(ds), batch_size=None, sampler=BatchSampler(sampler, B, drop_last=True))``
    gives ``[B, record_bytes]`` uint8 tensors, each read by :meth:`RecordDataset.batch_tensor` in a
    worker."""

    def __init__(self, dataset: RecordDataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: Sequence[int]) -> torch.Tensor:
        return self.dataset.batch_tensor(indices)

