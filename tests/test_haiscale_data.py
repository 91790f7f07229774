"""haiscale.data: record shards round-trip on fs3 and locally, corruption is caught and named, the
converter packs directories and text corpora, DataLoader workers (fork, spawn) read what the main
process reads, and the sampler's order is deterministic, disjoint across ranks and resumable."""

from __future__ import annotations

import multiprocessing
import os
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import crc32c
import pytest
import torch
import torch.utils.data

import fs3
from fs3.common.secret_files import write_token_file
from haiscale.data import (
    DistributedRecordSampler,
    LocalFileSystem,
    RecordDataset,
    RecordFormatError,
    RecordFS,
    RecordWriter,
    TensorBatches,
    read_index,
    write_shards,
)
from haiscale.data import records as records_module
from haiscale.data.__main__ import main as cli
from haiscale.data.records import MAX_RECORD_BYTES
from tests.inproc import ClusterThread

pytestmark = pytest.mark.slow  # an in-process cluster, DataLoader workers

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fs(shared_cluster: ClusterThread, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordFS]:
    """A client of the shared cluster; ``fs3:///`` URLs (and the CLI's children) find it through
    ``$FS3_MGMTD`` and ``$FS3_TOKEN_FILE``."""
    cluster = shared_cluster.cluster
    write_token_file(tmp_path / "token", [cluster.token])
    for name in ("FS3_TOKEN", "FS3_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FS3_MGMTD", cluster.mgmtd_address)
    monkeypatch.setenv("FS3_TOKEN_FILE", str(tmp_path / "token"))
    client = fs3.connect()
    yield cast(RecordFS, client)
    client.close()


def _records(n: int) -> list[bytes]:
    """Records of varied sizes, an empty one among them."""
    return [bytes([i % 251]) * ((i * 37) % 300) + i.to_bytes(4, "little") if i != 3 else b"" for i in range(n)]


def _dir(tmp_path: Path, where: str, fs: RecordFS, name: str) -> tuple[Any, str]:
    if where == "local":
        return LocalFileSystem(), str(tmp_path / name)
    return fs, f"/{name}-{os.getpid()}-{tmp_path.name}"


# -- round trip ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", "fs3"])
def test_written_records_read_back_by_index_and_by_batch(where: str, fs: RecordFS, tmp_path: Path) -> None:
    target_fs, directory = _dir(tmp_path, where, fs, "round")
    records = _records(23)
    paths = write_shards(target_fs, directory, records, records_per_file=10)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["shard-00000.rec", "shard-00001.rec", "shard-00002.rec"]
    assert sorted(target_fs.listdir(directory)) == ["shard-00000.rec", "shard-00001.rec", "shard-00002.rec"]
    source: Any = (target_fs, directory) if where == "local" else f"fs3://{directory}"
    with RecordDataset(source) as ds:
        assert len(ds) == 23 and [index.count for index in ds.shards] == [10, 10, 3]
        assert [ds[i] for i in range(23)] == records
        assert ds[-1] == records[-1]
        batch = [22, 0, 9, 10, 3, 9, 15]  # across shards, repeated, an empty record
        assert ds.__getitems__(batch) == [records[i] for i in batch]
        with pytest.raises(IndexError, match="record 23 out of range"):
            ds[23]
    with RecordDataset((target_fs, paths[1:]), transform=len) as ds:  # a list of shards, a transform
        assert ds.__getitems__([0, 12]) == [len(records[10]), len(records[22])]


def test_a_batch_is_one_read_many_call_into_one_buffer(tmp_path: Path) -> None:
    calls: list[int] = []

    class Counting(LocalFileSystem):
        def read_many(self, ranges: Sequence[tuple[Any, int, int]], buffer: Any = None) -> list[memoryview]:
            calls.append(len(ranges))
            return super().read_many(ranges, buffer)

    local = Counting()
    records = [bytes([i]) * 65 for i in range(40)]
    write_shards(local, str(tmp_path / "d"), records, records_per_file=7)
    ds = RecordDataset((local, str(tmp_path / "d")))
    calls.clear()
    batch = [39, 1, 8, 20, 33, 5]
    assert ds.__getitems__(batch) == [records[i] for i in batch]
    assert calls == [6]
    tensor = ds.batch_tensor(batch)
    assert calls == [6, 6]
    assert tensor.dtype == torch.uint8 and tensor.shape == (6, 65)
    assert tensor.tolist() == [list(records[i]) for i in batch]
    ds.close()


def test_batch_tensor_refuses_records_of_different_sizes(tmp_path: Path) -> None:
    local = LocalFileSystem()
    write_shards(local, str(tmp_path / "d"), [b"ab", b"abc"], records_per_file=5)
    with RecordDataset(str(tmp_path / "d")) as ds, pytest.raises(ValueError, match="records of one size"):
        ds.batch_tensor([0, 1])


# -- corruption ------------------------------------------------------------------------------------


def _one_shard(tmp_path: Path, records: list[bytes]) -> Path:
    path = tmp_path / "one.rec"
    with RecordWriter(LocalFileSystem(), str(path)) as writer:
        for record in records:
            writer.write(record)
    return path


def test_a_flipped_byte_names_the_shard_and_the_record(tmp_path: Path) -> None:
    records = [bytes([i]) * 100 for i in range(6)]
    path = _one_shard(tmp_path, records)
    index = read_index(LocalFileSystem(), str(path))
    start, _ = index.record_range(4)
    data = bytearray(path.read_bytes())
    data[start + 17] ^= 0x40
    path.write_bytes(data)
    with RecordDataset(str(path)) as ds:
        assert ds.__getitems__([0, 5]) == [records[0], records[5]]  # the others still read
        with pytest.raises(RecordFormatError, match=rf"{path}: record 4 fails its checksum"):
            ds.__getitems__([1, 4])
        with pytest.raises(RecordFormatError, match="record 4"):
            ds.batch_tensor([4])
    assert cli(["verify", str(path)]) == 1


def _header(count: int, version: int = 1, tables: bytes = b"", flags: int = 0) -> bytes:
    head = struct.pack("<8sIIQI", b"HSRECORD", version, flags, count, crc32c.crc32c(tables))
    return head + struct.pack("<I", crc32c.crc32c(head))


def test_a_damaged_shard_is_refused_with_its_name_and_no_big_allocation(tmp_path: Path) -> None:
    good = _one_shard(tmp_path, [b"x" * 50, b"y" * 50]).read_bytes()
    cases = {
        "short": (good[:20], "shorter than the 32-byte header"),
        "garbage": (b"\x00garbage" * 100, "not a record shard"),
        "truncated": (good[:-1], "truncated: the file holds"),
        "trailing": (good + b"z", "has bytes past its last record"),
        "header": (good[:9] + bytes([good[9] ^ 1]) + good[10:], "version 257 is not one this reader knows"),
        "header-crc": (good[:16] + bytes([good[16] ^ 1]) + good[17:], "header fails its checksum"),
        "tables": (good[:40] + bytes([good[40] ^ 1]) + good[41:], "tables fail their checksum"),
        "huge": (_header(1 << 40) + b"\0" * 100, "claims 1099511627776 records"),
        "version": (_header(2, version=7) + b"\0" * 100, "version 7"),
    }
    for name, (data, message) in cases.items():
        path = tmp_path / f"{name}.rec"
        path.write_bytes(data)
        tracemalloc.start()
        try:
            with pytest.raises(RecordFormatError, match=message) as caught:
                RecordDataset(str(path))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert str(path) in str(caught.value), name
        assert peak < 1 << 20, (name, peak)
        assert cli(["info", str(path)]) == 1


def test_offsets_out_of_order_are_refused(tmp_path: Path) -> None:
    offsets = struct.pack("<3Q", 64, 74, 69)
    tables = offsets + struct.pack("<2I", 0, 0)
    path = tmp_path / "order.rec"
    path.write_bytes(_header(2, tables=tables) + tables + b"\0" * 5)
    with pytest.raises(RecordFormatError, match="not in order"):
        read_index(LocalFileSystem(), str(path))


def test_every_other_check_rejects_its_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    local = LocalFileSystem()
    tables = struct.pack("<2Q", 40, 40) + struct.pack("<I", 0)  # one record; the tables end at 52
    for name, data, message in (
        ("flags", _header(1, tables=tables, flags=1) + tables, "header flags 0x1"),
        ("start", _header(1, tables=tables) + tables, "first record starts at 40"),
    ):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(RecordFormatError, match=message):
            read_index(local, str(tmp_path / name))
    path = _one_shard(tmp_path, [b"a" * 10, b"b" * 10])
    with RecordDataset(str(path)) as ds:
        os.truncate(path, path.stat().st_size - 3)  # shrunk after it was indexed
        with pytest.raises(RecordFormatError, match="record 1 is truncated: read 7 of its 10 bytes"):
            ds.__getitems__([0, 1])
        with pytest.raises(ValueError, match="at least one index"):
            ds.batch_tensor([])
    with pytest.raises(ValueError, match="holds 4 bytes, the ranges need 10"):
        local.read_many([(str(path), 0, 10)], bytearray(4))
    with pytest.raises(ValueError, match="not negative"):
        local.read_many([(str(path), -1, 10)])
    with pytest.raises(ValueError, match="writable"):
        local.read_many([(str(path), 0, 1)], b"x")
    writer = RecordWriter(local, str(tmp_path / "closed.rec"))
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        writer.write(b"late")
    with pytest.raises(ValueError, match="records per file"):
        write_shards(local, str(tmp_path / "none"), [b"x"], records_per_file=0)
    with pytest.raises(ValueError, match="negative"):
        DistributedRecordSampler(10, num_replicas=1, rank=0).state_dict(consumed=-1)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"x")
    assert cli(["convert", str(tmp_path / "src"), str(tmp_path / "o"), "--records-per-file", "1",
                "--record-bytes", "4"]) == 2
    assert "go with --text" in capsys.readouterr().err
    assert cli(["info", "fs3://user:secret@host:1/x"]) == 2
    err = capsys.readouterr().err
    assert "carry no password" in err and "secret" not in err


def test_a_failed_writer_leaves_nothing_under_the_final_name(fs: RecordFS, tmp_path: Path) -> None:
    directory = f"/crash-{tmp_path.name}"
    fs.makedirs(directory)
    with pytest.raises(RuntimeError), RecordWriter(fs, f"{directory}/a.rec") as writer:
        writer.write(b"half")
        raise RuntimeError("the job died")
    assert fs.listdir(directory) == []

    class NoRename(LocalFileSystem):
        def replace(self, src: str, dst: str) -> None:
            raise OSError("disk full")

    local_dir = tmp_path / "local"
    local_dir.mkdir()
    with pytest.raises(OSError, match="disk full"), RecordWriter(NoRename(), str(local_dir / "b.rec")) as writer:
        writer.write(b"abc")
    assert os.listdir(local_dir) == []  # the temporary file went too

    def failing() -> Iterator[bytes]:
        yield from [b"r"] * 5
        raise RuntimeError("the source went away")

    with pytest.raises(RuntimeError, match="went away"):
        write_shards(fs, f"{directory}/set", failing(), records_per_file=2)
    assert fs.listdir(f"{directory}/set") == []  # the two finished shards were removed again


# -- the converter ---------------------------------------------------------------------------------


def _tree(root: Path) -> list[bytes]:
    """A small tree of files; their contents in the converter's order (sorted by path)."""
    files = {"b/2.bin": b"two" * 40, "a.txt": b"first", "b/1.bin": b"", "c/d/e.bin": bytes(range(256)),
             "b/10.bin": b"ten"}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    os.symlink(root / "a.txt", root / "link")  # not followed
    return [files[name] for name in sorted(files, key=lambda n: n.split("/"))]


def test_convert_a_directory_into_fs3_and_read_it_back(fs: RecordFS, tmp_path: Path) -> None:
    src = tmp_path / "src"
    expected = _tree(src)
    dest = f"/convert-dir-{tmp_path.name}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "haiscale.data", "convert", str(src), f"fs3://{dest}",
                          "--records-per-file", "2"], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "wrote 5 records in 3 shards" in run.stdout
    with RecordDataset(f"fs3://{dest}") as ds:
        assert ds.__getitems__(list(range(len(ds)))) == expected
    assert cli(["verify", f"fs3://{dest}"]) == 0


def test_convert_a_text_corpus_into_fixed_records(fs: RecordFS, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "2.txt").write_bytes(b"0123456789" * 7)
    (corpus / "1.txt").write_bytes(b"abcdefghij" * 3 + b"!")
    text = (corpus / "1.txt").read_bytes() + (corpus / "2.txt").read_bytes()
    dest = f"/convert-text-{tmp_path.name}"
    assert cli(["convert", str(corpus), f"fs3://{dest}", "--records-per-file", "4", "--text",
                "--record-bytes", "9", "--stride", "11", "--json"]) == 0
    expected = [text[i:i + 9] for i in range(0, len(text) - 8, 11)]
    assert f'"records": {len(expected)}' in capsys.readouterr().out
    with RecordDataset(f"fs3://{dest}") as ds:
        assert ds.__getitems__(list(range(len(ds)))) == expected
        assert ds.batch_tensor([0, 1]).tolist() == [list(expected[0]), list(expected[1])]
    # Overlapping records (stride < size), one file: what a byte-level GPT trains on (block_size + 1).
    assert cli(["convert", str(corpus / "2.txt"), str(tmp_path / "gpt"), "--records-per-file", "100", "--text",
                "--record-bytes", "5", "--stride", "3"]) == 0
    data = (corpus / "2.txt").read_bytes()
    assert RecordDataset(str(tmp_path / "gpt")).__getitems__(list(range(22))) == [data[i:i + 5]
                                                                                  for i in range(0, 66, 3)]
    assert cli(["info", f"fs3://{dest}"]) == 0
    assert f"{dest}/shard-00000.rec: 4 records, 36 bytes" in capsys.readouterr().out


def test_convert_refuses_bad_input_and_writes_nothing(fs: RecordFS, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "tiny.txt").write_bytes(b"abc")
    (tmp_path / "huge").mkdir()
    with open(tmp_path / "huge" / "sparse.bin", "wb") as f:  # a record bigger than a record may be
        f.truncate(MAX_RECORD_BYTES + 1)
    dest = str(tmp_path / "out")
    cases = [
        (["convert", str(tmp_path / "huge"), dest, "--records-per-file", "2"], "larger than the 268435456"),
        (["convert", str(tmp_path / "tiny.txt"), dest, "--records-per-file", "2", "--text", "--record-bytes",
          str(1 << 40)], "larger than the 268435456"),
        (["convert", str(tmp_path / "missing"), dest, "--records-per-file", "2"], "no such file or directory"),
        (["convert", str(tmp_path / "empty"), dest, "--records-per-file", "2"], "no files to convert"),
        (["convert", str(tmp_path / "tiny.txt"), dest, "--records-per-file", "2", "--text", "--record-bytes", "4"],
         "holds 3 bytes, not enough for one record of 4"),
        (["convert", str(tmp_path / "tiny.txt"), dest, "--records-per-file", "2", "--text"], "needs --record-bytes"),
    ]
    for argv, message in cases:
        assert cli(argv) == 2
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        cli(["convert", str(tmp_path / "empty"), dest, "--records-per-file", "0"])
    assert exited.value.code == 2 and "must be at least 1, not 0" in capsys.readouterr().err
    assert not os.path.exists(dest)
    # A destination that holds shards already is left as it is.
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"new")
    write_shards(LocalFileSystem(), dest, [b"old"], records_per_file=1)
    assert cli(["convert", str(tmp_path / "src"), dest, "--records-per-file", "1"]) == 2
    assert "already holds record shards" in capsys.readouterr().err
    assert RecordDataset(dest)[0] == b"old"


def test_a_record_larger_than_a_record_may_be_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records_module, "MAX_RECORD_BYTES", 8)
    with RecordWriter(LocalFileSystem(), str(tmp_path / "shard.rec")) as writer:
        writer.write(b"12345678")
        with pytest.raises(ValueError, match="a record of 9 bytes is larger than the 8"):
            writer.write(b"123456789")
    assert RecordDataset(str(tmp_path / "shard.rec"))[0] == b"12345678"


# -- DataLoader workers ----------------------------------------------------------------------------


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_read_the_same_batches(fs: RecordFS, tmp_path: Path, context: str) -> None:
    directory = f"/loader-{context}-{tmp_path.name}"
    records = [bytes([i]) * 33 for i in range(24)]
    write_shards(fs, directory, records, records_per_file=5)
    ds = RecordDataset(f"fs3://{directory}")
    ds.__getitems__([0])  # the parent has its files open: the workers must not use them
    sampler = DistributedRecordSampler(ds, num_replicas=1, rank=0, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2, timeout=240,
                                         multiprocessing_context=multiprocessing.get_context(context))
    batches = list(loader)
    order = list(sampler)
    assert batches == [ds.__getitems__(order[i:i + 4]) for i in range(0, 24, 4)]
    if context == "fork":  # the tensor path too: whole batches read in the workers
        tensors = torch.utils.data.DataLoader(TensorBatches(ds), batch_size=None, num_workers=2, timeout=240,
                                              sampler=torch.utils.data.BatchSampler(sampler, 6, drop_last=True),
                                              multiprocessing_context=multiprocessing.get_context(context))
        assert [t.tolist() for t in tensors] == [[list(records[i]) for i in order[j:j + 6]] for j in range(0, 24, 6)]
    ds.close()


# -- the sampler -----------------------------------------------------------------------------------


def test_the_sampler_order_is_deterministic_per_seed_and_epoch() -> None:
    def order(seed: int, epoch: int, rank: int = 0) -> list[int]:
        sampler = DistributedRecordSampler(100, num_replicas=1, rank=rank, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(5, 2) == order(5, 2)
    assert sorted(order(5, 2)) == list(range(100))
    assert order(5, 2) != order(5, 3)
    assert order(5, 2) != order(6, 2)
    assert order(1, 0) != order(0, 1)  # seed and epoch do not just add up
    unshuffled = DistributedRecordSampler(10, num_replicas=2, rank=1, shuffle=False)
    assert list(unshuffled) == [1, 3, 5, 7, 9]


@pytest.mark.parametrize(("length", "drop_last"), [(103, True), (103, False), (100, True)])
def test_ranks_are_disjoint_and_cover_the_epoch(length: int, drop_last: bool) -> None:
    parts = []
    for rank in range(4):
        sampler = DistributedRecordSampler(length, num_replicas=4, rank=rank, seed=9, drop_last=drop_last)
        sampler.set_epoch(1)
        parts.append(list(sampler))
        assert len(sampler) == len(parts[-1])
    assert len({len(part) for part in parts}) == 1
    everything = [i for part in parts for i in part]
    if drop_last:
        assert len(set(everything)) == len(everything) == length - length % 4
    else:
        assert set(everything) == set(range(length)) and len(everything) == 104


@pytest.mark.parametrize("drop_last", [True, False])
def test_a_resumed_sampler_yields_exactly_the_remaining_indices(drop_last: bool) -> None:
    first = DistributedRecordSampler(51, num_replicas=2, rank=1, seed=4, drop_last=drop_last)
    first.set_epoch(3)
    full = list(first)
    it = iter(first)
    head = [next(it) for _ in range(7)]
    state = first.state_dict()
    assert head == full[:7]

    resumed = DistributedRecordSampler(51, num_replicas=2, rank=1, seed=4, drop_last=drop_last)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # a training loop sets the epoch it resumes in
    assert len(resumed) == len(full) - 7
    assert list(resumed) == full[7:]
    assert list(resumed) == full  # the next iteration of the same epoch is whole again

    loader_state = first.state_dict(consumed=10)  # a DataLoader reads ahead: the caller says what it used
    other = DistributedRecordSampler(51, num_replicas=2, rank=1, seed=4, drop_last=drop_last)
    other.load_state_dict(loader_state)
    assert list(other) == full[10:]

    done = DistributedRecordSampler(51, num_replicas=2, rank=1, seed=4, drop_last=drop_last)
    done.set_epoch(3)
    list(done)
    finished = DistributedRecordSampler(51, num_replicas=2, rank=1, seed=4, drop_last=drop_last)
    finished.load_state_dict(done.state_dict())
    finished.set_epoch(3)
    assert list(finished) == []  # a checkpoint at the end of an epoch resumes with the next one

    # On another number of ranks, every remaining sample of the epoch is read once.
    orders = [DistributedRecordSampler(50, num_replicas=2, rank=r, seed=4) for r in range(2)]
    for sampler in orders:
        sampler.set_epoch(3)
    state = orders[0].state_dict(consumed=4)
    seen = [i for sampler in orders for i in list(sampler)[:4]]
    rest = []
    for rank in range(3):
        sampler = DistributedRecordSampler(50, num_replicas=3, rank=rank, seed=4)
        sampler.load_state_dict(state)
        rest += list(sampler)
    assert sorted(seen + rest) == list(range(50))


def test_a_sampler_state_for_another_order_is_refused() -> None:
    sampler = DistributedRecordSampler(50, num_replicas=2, rank=0, seed=4)
    state = sampler.state_dict()
    for key, value in (("seed", 5), ("length", 51), ("shuffle", False), ("version", 9), ("position", 10**6)):
        with pytest.raises(ValueError, match=key if key != "position" else "outside an epoch"):
            sampler.load_state_dict({**state, key: value})
    for replicas, rank in ((0, 0), (2, 2), (2, -1)):
        with pytest.raises(ValueError):
            DistributedRecordSampler(10, num_replicas=replicas, rank=rank)
    batches = list(torch.utils.data.BatchSampler(sampler, 8, drop_last=True))
    assert [len(b) for b in batches] == [8, 8, 8]
