"""Hostile input and failures against haiscale's data and checkpoint paths: each test is a case that
once got through (a crash instead of a fallback, a huge allocation, space never given back, a
resume refused), kept so that it stays refused or handled.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from haiscale.checkpoint import CheckpointCorrupt
from haiscale.checkpoint import format as fmt
from haiscale.checkpoint.store import LocalStore
from haiscale.data import DistributedRecordSampler
from haiscale.data.records import LocalFileSystem, RecordFormatError, read_index, write_shards
from haiscale.sharding import Shard
from tests.test_haiscale_checkpoint import Where, _assert_same, _rewrite_index, _trained


@pytest.fixture
def local(tmp_path: Path) -> Where:
    return Where(None, str(tmp_path / "ckpt"))


# -- checkpoint loading: hostile indexes -----------------------------------------------------------

def test_a_shard_claiming_a_huge_whole_tensor_falls_back_without_allocating_it(
        local: Where, caplog: pytest.LogCaptureFixture) -> None:
    """A shard's ``global_shape`` is not bounded by any file size: a loader that sized its output by
    it before checking what the saved pieces cover tried to allocate 2**60 floats (a RuntimeError
    out of ``load_latest`` instead of a fallback to the previous checkpoint)."""
    model, opt = _trained(0)
    extra = {"piece": Shard(torch.arange(4, dtype=torch.float32), (4,), 0)}
    with local.manager(keep=None) as ckpt:
        ckpt.save(1, model, opt, extra=extra)
        ckpt.save(2, model, opt, extra=extra)
        ckpt.wait()

    def huge(body: dict[str, Any]) -> None:
        (entry,) = [e for e in body["tensors"] if e["name"] == "extra/piece"]
        entry["global_shape"] = [1 << 40, 1 << 20]

    _rewrite_index(local, "step-00000002", huge)
    with caplog.at_level(logging.WARNING), local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.extra["piece"], torch.arange(4, dtype=torch.float32))
    assert "saved by no rank" in caplog.text


@pytest.mark.parametrize("tree", [
    {"__dict__": 5},
    {"__dict__": [[1, 2, 3]]},
    {"__dict__": [[["unhashable"], 1]]},
    {"__tuple__": 7},
    [{"__dict__": "x"}],
])
def test_a_malformed_state_tree_is_corrupt_not_a_crash(tree: Any) -> None:
    """Tree nodes an index may hold are checked like every other field: a malformed one is
    :class:`CheckpointCorrupt` (the loader falls back), never a TypeError or ValueError escaping."""
    index = fmt.RankIndex(0, 1, 5, "ab", {"rank-00000.bin": 4096},
                          {"w": fmt.Entry("w", "rank-00000.bin", 0, 16, "float32", (4,), (1,))},
                          {"model": {"__dict__": [["w", {"__tensor__": "w"}]]}, "extra": tree})
    with pytest.raises(CheckpointCorrupt):
        fmt.parse_index(fmt.render_index(index), "i", rank=0, step=5)


def test_a_malformed_tree_in_a_published_checkpoint_falls_back(
        local: Where, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained(0)
    with local.manager(keep=None) as ckpt:
        ckpt.save(1, model, opt, extra={"n": 1})
        ckpt.save(2, model, opt, extra={"n": 2})
        ckpt.wait()
    _rewrite_index(local, "step-00000002", lambda body: body["trees"].update(extra={"__dict__": 5}))
    with caplog.at_level(logging.WARNING), local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 1 and loaded.extra == {"n": 1}


def _python_rng_truncated(body: dict[str, Any]) -> None:
    rng = dict(body["trees"]["rng"]["__dict__"])
    python = dict(rng["python"]["__dict__"])
    python["state"] = python["state"][:5]
    rng["python"] = {"__dict__": [[k, v] for k, v in python.items()]}
    body["trees"]["rng"] = {"__dict__": [[k, v] for k, v in rng.items()]}


def test_a_bad_rng_state_changes_nothing_and_falls_back(local: Where) -> None:
    """The RNG state was put back after the model and optimizer were loaded: one the generators
    refuse (a Python state of the wrong size) raised out of ``load_latest`` with the model already
    overwritten by the newer checkpoint — half-loaded, and no fallback."""
    older, opt_older = _trained(1)
    newer, opt_newer = _trained(2)
    with local.manager(keep=None) as ckpt:
        ckpt.save(1, older, opt_older)
        ckpt.save(2, newer, opt_newer)
        ckpt.wait()
    _rewrite_index(local, "step-00000002", _python_rng_truncated)
    model, opt = _trained(3)
    with local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 1
    _assert_same(model, older, opt, opt_older)


def test_a_model_that_does_not_match_leaves_the_rng_as_it_was(local: Where) -> None:
    """An error that is not a fallback (the model does not match the checkpoint) changes nothing:
    the generators keep their states too."""
    model, opt = _trained(0)
    with local.manager() as ckpt:
        ckpt.save(1, model, opt)
        ckpt.wait()
    other = torch.nn.Linear(3, 3)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    with local.manager() as ckpt, pytest.raises((RuntimeError, ValueError)):
        ckpt.load_latest(other)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_stray_file_named_like_a_step_is_skipped(local: Where, caplog: pytest.LogCaptureFixture) -> None:
    """A regular file named ``step-N`` (or a step whose manifest is a directory) made
    ``load_latest`` raise NotADirectoryError instead of trying the checkpoint before it."""
    model, opt = _trained(0)
    with local.manager() as ckpt:
        ckpt.save(1, model, opt)
        ckpt.wait()
    Path(local.path("step-00000009")).write_bytes(b"not a checkpoint")
    os.makedirs(local.path("step-00000008", "manifest.json"))
    with caplog.at_level(logging.WARNING), local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 1
    assert "step-00000009" in caplog.text and "step-00000008" in caplog.text


# -- checkpoint saving: nothing is written that the loader would refuse --------------------------

def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("extra", [
    {"deep": _nested(fmt.MAX_TREE_DEPTH + 5)},
    {"k" * (fmt.MAX_NAME_CHARS + 1): torch.zeros(2)},
], ids=["too-deep", "tensor-name-too-long"])
def test_a_state_the_loader_would_refuse_is_refused_at_save(local: Where, extra: Any) -> None:
    """The loader refuses trees nested deeper than MAX_TREE_DEPTH and tensor names longer than
    MAX_NAME_CHARS; the saver wrote them anyway, so the checkpoint was published, ``keep`` removed
    the good ones before it, and the failure showed only at the resume (falling back past it)."""
    model, opt = _trained(0)
    with local.manager(keep=1) as ckpt:
        ckpt.save(1, model, opt)
        ckpt.wait()
        with pytest.raises(ValueError, match=r"deeper|longer"):
            ckpt.save(2, model, opt, extra=extra)
        ckpt.wait()
    assert local.listdir() == ["step-00000001"]
    with local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 1


def test_an_index_bigger_than_the_loader_reads_is_refused_at_save(
        local: Where, monkeypatch: pytest.MonkeyPatch) -> None:
    """An ``extra`` whose JSON makes the rank's index bigger than MAX_INDEX_BYTES was written; its
    checkpoint could never be loaded."""
    monkeypatch.setattr(fmt, "MAX_INDEX_BYTES", 64 << 10)  # the real bound is 64 MiB: same check, less memory
    model, opt = _trained(0)
    with local.manager(keep=1) as ckpt:
        ckpt.save(1, model, opt, extra={"small": list(range(10))})
        ckpt.wait()
        with pytest.raises(ValueError, match="index"):
            ckpt.save(2, model, opt, extra={"big": list(range(20_000))})
            ckpt.wait()
    assert [n for n in local.listdir() if not n.startswith(".")] == ["step-00000001"]
    with local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 1 and loaded.extra == {"small": list(range(10))}


def test_a_failed_replacing_publish_puts_the_published_step_back(local: Where) -> None:
    """Publishing a step that is already published sets the old directory aside, renames the new one
    into place, then removes the old. When the second rename failed (here: a second job on the same
    directory cleaned this run's temporary directory away, as it does for other runs' leftovers at
    its step), the good checkpoint stayed under its hidden aside name: step 1 was simply gone."""
    model, opt = _trained(0)
    with local.manager(run_id="aaaa") as first:
        first.save(1, model, opt, extra={"by": "first"})
        first.wait()

    def other_job_cleans_up(phase: str, step: int) -> None:
        if phase == "manifest_written":
            with local.manager(run_id="cccc") as other:
                other._clean_up(step)  # what another job's publish of this step does

    with local.manager(run_id="bbbb", observer=other_job_cleans_up) as second:
        second.save(1, model, opt, extra={"by": "second"})
        with pytest.raises(OSError):
            second.wait()
    assert "step-00000001" in local.listdir()
    with local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 1 and loaded.extra == {"by": "first"}


# -- checkpoint saving: a full disk ----------------------------------------------------------------

class _QuotaStore(LocalStore):
    """A local directory of ``quota_bytes``: a write past it fails with ENOSPC part way, as a full
    disk does (what is written before stays, as on a real file system)."""

    def __init__(self, root: str, quota_bytes: int) -> None:
        self.root = root
        self.quota_bytes = quota_bytes

    def _used(self) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(self.root) for f in files)

    def write_file(self, path: str, pieces: Iterable[memoryview | bytes]) -> None:
        def limited() -> Iterable[memoryview | bytes]:
            for piece in pieces:
                room = self.quota_bytes - self._used()
                if len(piece) > room:
                    yield memoryview(piece)[:max(room, 0)]
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                yield piece
        super().write_file(path, limited())


def test_a_save_that_fills_the_disk_gives_its_space_back(local: Where) -> None:
    """A save that failed with ENOSPC left its partial files in its temporary directory, and only a
    later *successful* save removes temporary directories: a disk that was full once stayed full,
    and every later save failed too."""
    model, opt = _trained(0)
    big = torch.zeros(1 << 20, dtype=torch.uint8)  # 1 MiB of state, so the quota is about whole saves
    with local.manager(keep=1, run_id="abc") as ckpt:
        ckpt.save(1, model, opt, extra={"big": big})
        ckpt.wait()
        one = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(local.directory) for f in fs)
        ckpt.store = _QuotaStore(local.directory, quota_bytes=int(2.5 * one))
        ballast = Path(local.path("ballast"))
        ballast.write_bytes(bytes(one))  # somebody else's file: no room for a second checkpoint
        ckpt.save(2, model, opt, extra={"big": big})
        with pytest.raises(OSError) as failed:
            ckpt.wait()
        assert failed.value.errno == errno.ENOSPC
        left = [n for n in local.listdir() if n.startswith(".step-")]
        assert not left or not local.listdir(left[0]), f"the failed save left {left} behind"
        ballast.unlink()  # the other tenant frees its space: the next save fits beside step 1
        ckpt.save(3, model, opt, extra={"big": big})
        ckpt.wait()
    assert [n for n in local.listdir() if not n.startswith(".")] == ["step-00000003"]
    with local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 3


# -- record shards ---------------------------------------------------------------------------------

class _StaleStat(LocalFileSystem):
    """The size a ``stat`` saw before the file was truncated under the reader (another writer)."""

    def __init__(self, sizes: dict[str, int]) -> None:
        self.sizes = sizes

    def stat(self, path: str) -> os.stat_result:
        real = os.stat(path)
        fields = list(real)
        fields[6] = self.sizes.get(path, real.st_size)
        return os.stat_result(fields)


def test_a_shard_truncated_after_its_stat_is_a_format_error(tmp_path: Path) -> None:
    """A shard cut short between the reader's ``stat`` and its first read raised ``struct.error``
    (no file name, not a RecordFormatError) from the header's unpacking."""
    fs = LocalFileSystem()
    (path,) = write_shards(fs, str(tmp_path), [b"x" * 100] * 3, records_per_file=3)
    size = os.path.getsize(path)
    os.truncate(path, 10)
    with pytest.raises(RecordFormatError, match=f"{path}.*truncated"):
        read_index(_StaleStat({path: size}), path)


# -- the sampler ---------------------------------------------------------------------------------------

def test_a_finished_padded_epoch_resumes_on_fewer_ranks() -> None:
    """With ``drop_last=False`` an epoch of 10 samples on 4 ranks is padded to 12; a state saved once
    it finished said position 12, and a job resumed on 1 rank refused it as 'outside an epoch'
    (anything past ``length + num_replicas`` of the *new* sampler), although resuming on another
    number of ranks is what the position is kept globally for."""
    ranks = [DistributedRecordSampler(10, num_replicas=4, rank=r, drop_last=False) for r in range(4)]
    for sampler in ranks:
        list(sampler)
    state = ranks[0].state_dict()
    one = DistributedRecordSampler(10, num_replicas=1, rank=0, drop_last=False)
    one.load_state_dict(state)
    assert list(one) == []  # the epoch is done: nothing of it is read again
    one.set_epoch(1)
    assert sorted(one) == list(range(10))
    bad = dict(state, position=10 + 4 * 10)
    with pytest.raises(ValueError, match="outside an epoch"):
        DistributedRecordSampler(10, num_replicas=1, rank=0, drop_last=False).load_state_dict(bad)
    for broken in ({"version": 1}, dict(state, position="x"), dict(state, epoch=None), [("version", 1)],
                   dict(state, position=None)):
        with pytest.raises(ValueError, match="sampler state"):
            DistributedRecordSampler(10, num_replicas=1, rank=0, drop_last=False).load_state_dict(broken)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_replicas"):
        DistributedRecordSampler(10, num_replicas=1, rank=0, drop_last=False).load_state_dict(
            dict(state, num_replicas=0))
