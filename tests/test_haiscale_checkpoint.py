"""haiscale.checkpoint: saves that never tear, loads that verify and fall back, resharding, RNG.

Most tests run on a local directory and on fs3 (the shared in-process cluster); rank processes are
started only where a fresh process is the point (a resumed run, a crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from haiscale.checkpoint import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointManager,
    ShardedModule,
    capture_rng_state,
    restore_rng_state,
)
from haiscale.checkpoint import format as fmt
from haiscale.checkpoint.format import RankIndex
from haiscale.sharding import Shard, shard_range
from tests.haiscale import ckpt_job
from tests.harness import ProcessCluster

ROOT = Path(__file__).resolve().parents[1]
JOB = [sys.executable, "-m", "tests.haiscale.ckpt_job"]
Factory = Callable[..., CheckpointManager]


class Where:
    """One checkpoint directory, local or on fs3: makes managers on it and pokes at its files."""

    def __init__(self, fs: Any, directory: str) -> None:
        self.fs = fs
        self.directory = directory

    def manager(self, **options: Any) -> CheckpointManager:
        if self.fs is None:
            return CheckpointManager(self.directory, **options)
        return CheckpointManager(fs=self.fs, directory=self.directory, **options)

    def path(self, *parts: str) -> str:
        return "/".join([self.directory, *parts])

    def listdir(self, *parts: str) -> list[str]:
        return sorted(self.fs.listdir(self.path(*parts)) if self.fs else os.listdir(self.path(*parts)))

    def read(self, *parts: str) -> bytes:
        if self.fs is None:
            return Path(self.path(*parts)).read_bytes()
        return bytes(self.fs.read_bytes(self.path(*parts)))

    def write(self, data: bytes, *parts: str) -> None:
        if self.fs is None:
            Path(self.path(*parts)).write_bytes(data)
        else:
            self.fs.write_bytes(self.path(*parts), data)

    def remove(self, *parts: str) -> None:
        if self.fs is None:
            os.remove(self.path(*parts))
        else:
            self.fs.remove(self.path(*parts))


@pytest.fixture(scope="module")
def fs3_fs(shared_cluster: Any) -> Iterator[Any]:
    import fs3

    cluster = shared_cluster.cluster
    fs = fs3.connect(cluster.mgmtd_address, token=cluster.token)
    yield fs
    fs.close()


@pytest.fixture(params=["local", "fs3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    if request.param == "local":
        return Where(None, str(tmp_path / "ckpt"))
    return Where(request.getfixturevalue("fs3_fs"), f"/ckpt-tests/{uuid.uuid4().hex}")


@pytest.fixture
def local(tmp_path: Path) -> Where:
    return Where(None, str(tmp_path / "ckpt"))


def _trained(seed: int, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16)).square().sum().backward()
        opt.step()
    return model, opt


def _assert_same(a: nn.Module, b: nn.Module, oa: torch.optim.Optimizer | None = None,
                 ob: torch.optim.Optimizer | None = None) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name
    if oa is not None and ob is not None:
        sa, sb = oa.state_dict(), ob.state_dict()
        assert sa["param_groups"] == sb["param_groups"]
        assert sa["state"].keys() == sb["state"].keys()
        for key, state in sa["state"].items():
            for name, value in state.items():
                assert torch.equal(value, sb["state"][key][name]), (key, name)


def _differs(a: nn.Module, b: nn.Module) -> bool:
    return any(not torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


# -- round trips ----------------------------------------------------------------------------------

def test_round_trip_with_adam_state(where: Where) -> None:
    model, opt = _trained(0)
    extra = {"sampler": {"epoch": 3, "order": (4, 1, 2)}, "ids": {7: "seven"}, "pending": torch.arange(6)}
    with where.manager() as ckpt:
        ckpt.save(3, model, opt, extra)
        ckpt.wait()
    assert where.listdir() == ["step-00000003"]
    assert where.listdir("step-00000003") == ["manifest.json", "rank-00000.bin", "rank-00000.done",
                                              "rank-00000.json"]
    fresh, fresh_opt = _trained(1, steps=1)
    assert _differs(model, fresh)
    with where.manager() as ckpt:
        loaded = ckpt.load_latest(fresh, fresh_opt)
    assert loaded is not None and loaded.step == 3
    _assert_same(model, fresh, opt, fresh_opt)
    assert loaded.extra["sampler"] == {"epoch": 3, "order": (4, 1, 2)}
    assert loaded.extra["ids"] == {7: "seven"}  # an int key stays an int
    assert torch.equal(loaded.extra["pending"], torch.arange(6))


def test_empty_directory_loads_nothing(where: Where) -> None:
    model, opt = _trained(0)
    with where.manager() as ckpt:
        assert ckpt.load_latest(model, opt) is None


def test_an_unsaveable_extra_is_refused_before_anything_is_written(local: Where) -> None:
    model, opt = _trained(0)
    with local.manager() as ckpt:
        with pytest.raises(TypeError, match=r"extra/when: a object is neither a tensor nor JSON-able"):
            ckpt.save(1, model, opt, extra={"when": object()})
        with pytest.raises(TypeError, match="not a str or an int"):
            ckpt.save(1, model, opt, extra={(1, 2): 3})
        ckpt.wait()
    assert local.listdir() == []


def test_the_writer_keeps_its_host_buffers(local: Where) -> None:
    model, opt = _trained(0)
    with local.manager() as ckpt:
        ckpt.save(1, model, opt)
        first = [b.data_ptr() for b in ckpt._buffers]
        ckpt.save(2, model, opt)
        assert [b.data_ptr() for b in ckpt._buffers] == first  # the same memory, no new allocation
        ckpt.wait()


# -- bit-identical resume ---------------------------------------------------------------------------

@pytest.mark.slow
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path: Path) -> None:
    """2k steps in one go against k steps, a checkpoint, and k more in a fresh process (both in
    this process's generators first, which are put back afterwards)."""
    steps = 40
    saved = capture_rng_state()
    try:
        ckpt_job.train(str(tmp_path / "a"), 2 * steps, 2 * steps, str(tmp_path / "full.pt"))
        ckpt_job.train(str(tmp_path / "b"), 2 * steps, steps, "-")
    finally:
        restore_rng_state(saved)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    second = subprocess.run([*JOB, "train", str(tmp_path / "b"), str(2 * steps), str(2 * steps),
                             str(tmp_path / "resumed.pt")], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0, second.stderr
    a = torch.load(tmp_path / "full.pt")
    b = torch.load(tmp_path / "resumed.pt")
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for key, state in a["optim"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["optim"]["state"][key][name]), (key, name)
    assert a["optim"]["state"][0]["step"] == b["optim"]["state"][0]["step"] == 2 * steps


def test_without_its_rng_state_a_resume_would_differ(tmp_path: Path) -> None:
    """The check above can fail: the same resume, with the generators re-seeded after the load,
    ends elsewhere."""
    saved = capture_rng_state()
    try:
        ckpt_job.train(str(tmp_path / "a"), 20, 20, str(tmp_path / "full.pt"))
        ckpt_job.train(str(tmp_path / "b"), 20, 10, "-")
        ckpt_job.train(str(tmp_path / "b"), 20, 20, str(tmp_path / "resumed.pt"), reseed_after_load=True)
    finally:
        restore_rng_state(saved)
    a = torch.load(tmp_path / "full.pt")
    b = torch.load(tmp_path / "resumed.pt")
    assert any(not torch.equal(a["model"][n], b["model"][n]) for n in a["model"])


# -- crashes mid-save -----------------------------------------------------------------------------

def _two_ranks(where: Where, run_id: str, **options: Any) -> list[CheckpointManager]:
    return [where.manager(rank=rank, world_size=2, run_id=run_id, **options) for rank in range(2)]


def _save_two(managers: list[CheckpointManager], step: int, extra: Any) -> None:
    for manager in reversed(managers):  # rank 1 first: rank 0 then finds every marker at once
        manager.save(step, extra=extra)
    for manager in managers:
        manager.wait()


CRASH_CASES = ("mid_write", "no_markers", "some_markers", "before_rename")


@pytest.mark.slow
def test_a_crash_mid_save_leaves_the_previous_checkpoint(where: Where) -> None:
    """A child saving a few MiB as two ranks is killed at each point of a save (one child per case,
    all at once): the previous step stays the latest, and the next save clears the leftovers."""
    cases = {case: Where(where.fs, f"{where.directory}/{case}") for case in CRASH_CASES}
    for case_where in cases.values():
        managers = _two_ranks(case_where, "aaaa")
        _save_two(managers, 1, {"step": 1})
        for manager in managers:
            manager.close()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if where.fs is not None:
        env.update(FS3_MGMTD=",".join(where.fs.settings.mgmtd), FS3_TOKEN=where.fs.settings.token)
    base = f"fs3://{where.directory}" if where.fs is not None else where.directory
    child = subprocess.Popen([*JOB, "crash", base, *CRASH_CASES], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    paused: dict[str, int] = {}
    try:
        assert child.stdout is not None
        while len(paused) < len(CRASH_CASES):
            line = child.stdout.readline()
            assert line.startswith("PAUSED "), (line, child.stderr.read() if child.stderr else "")
            _, case, pid_text = line.split()
            if case == "mid_write":
                time.sleep(0.05)
            os.kill(int(pid_text), signal.SIGKILL)  # a process of this test's own child
            paused[case] = int(pid_text)
    finally:
        for grandchild in paused.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.communicate(timeout=30)
    for case, case_where in cases.items():
        tmp = fmt.tmp_dir_name(2, ckpt_job.CRASH_RUN_ID)
        names = case_where.listdir()
        if case != "mid_write":
            assert "step-00000002" not in names
            markers = [n for n in case_where.listdir(tmp) if n.endswith(".done")]
            assert markers == {"no_markers": [], "some_markers": ["rank-00001.done"],
                               "before_rename": ["rank-00000.done", "rank-00001.done"]}[case]
        managers = _two_ranks(case_where, "bbbb")
        for manager in managers:
            loaded = manager.load_latest()
            assert loaded is not None and loaded.step == 1 and loaded.extra == {"step": 1}, case
        _save_two(managers, 3, {"step": 3})
        for manager in managers:
            manager.close()
        assert case_where.listdir() == ["step-00000001", "step-00000003"], case  # the crashed tmp dir is gone


@pytest.mark.slow
def test_a_storage_node_killed_mid_save_never_tears_latest(process_cluster: ProcessCluster) -> None:
    """A storage node SIGKILLed while a save streams to its chains: the save completes (the chains
    fail over) or fails cleanly; either way what loads is a whole checkpoint, verified."""
    import fs3

    asyncio.run(process_cluster.ensure_chains(3))
    fs = fs3.connect(process_cluster.mgmtd_address, token_file=str(process_cluster.token_file))
    try:
        gen = torch.Generator().manual_seed(3)
        weights = {step: torch.randn(4 << 20, generator=gen) for step in (1, 2)}
        states = {step: {"w": weights[step], "step": step} for step in (1, 2)}
        phases: list[tuple[str, int]] = []
        ckpt = CheckpointManager(fs=fs, directory="/ckpt", files_per_rank=2,
                                 observer=lambda phase, step: phases.append((phase, step)))
        ckpt.save(1, extra=states[1])
        ckpt.wait()
        ckpt.save(2, extra=states[2])
        process_cluster.kill("storage-2")
        assert ("rank_files_written", 2) not in phases  # killed while the data files were written
        try:
            ckpt.wait()
            saved = 2
        except Exception as exc:  # a clean failure: the previous checkpoint must still be whole
            saved = 1
            print(f"the save failed cleanly: {exc!r}")
        ckpt.close()
        with CheckpointManager(fs=fs, directory="/ckpt") as reader:
            loaded = reader.load_latest()
        assert loaded is not None and loaded.step == saved
        assert torch.equal(loaded.extra["w"], weights[saved])
    finally:
        fs.close()


# -- keep, periodic saves, suspend, other runs ------------------------------------------------------

def test_keep_k_removes_older_checkpoints(where: Where) -> None:
    model, opt = _trained(0)
    with where.manager(keep=2) as ckpt:
        for step in (10, 20, 30, 40):
            ckpt.save(step, model, opt)
        ckpt.wait()
    assert where.listdir() == ["step-00000030", "step-00000040"]


def test_keep_must_keep_something(local: Where) -> None:
    with pytest.raises(ValueError, match="keep at least one"):
        local.manager(keep=0)


def test_periodic_saves(local: Where) -> None:
    model, opt = _trained(0)
    with local.manager(every_steps=5, keep=None) as ckpt:
        saved = [step for step in range(1, 13) if ckpt.maybe_save(step, model, opt)]
        ckpt.wait()
    assert saved == [5, 10]
    assert local.listdir() == ["step-00000005", "step-00000010"]
    with local.manager(every_s=0.2, keep=None) as ckpt:
        assert not ckpt.maybe_save(11, model, opt)  # the clock starts at construction
        time.sleep(0.25)
        assert ckpt.maybe_save(12, model, opt)
        assert not ckpt.maybe_save(13, model, opt)
        ckpt.wait()
    assert local.listdir()[-1] == "step-00000012"


def test_on_suspend_returns_once_published(where: Where) -> None:
    rank0, rank1 = _two_ranks(where, "cccc")
    done = threading.Event()

    def suspend_rank1() -> None:
        rank1.on_suspend(7, extra={"r": 1})
        done.set()

    thread = threading.Thread(target=suspend_rank1)
    thread.start()
    # Rank 1's files are written, but rank 0 has not saved: nothing is published, rank 1 waits.
    assert not done.wait(0.8)
    assert "step-00000007" not in where.listdir()
    rank0.on_suspend(7, extra={"r": 0})
    assert "step-00000007" in where.listdir()  # rank 0 returned: published
    assert done.wait(30)
    thread.join()
    # A suspend right after a periodic save of the same step waits for that save, without another.
    rank1.save(8, extra={"r": 1})
    rank0.save(8, extra={"r": 0})
    rank0.on_suspend(8)
    rank1.on_suspend(8)
    assert "step-00000008" in where.listdir()
    for manager in (rank0, rank1):
        manager.close()


def test_a_failed_background_write_surfaces_on_the_next_call(local: Where) -> None:
    model, opt = _trained(0)
    with local.manager(run_id="dead") as ckpt:
        Path(local.path(fmt.tmp_dir_name(5, "dead"))).write_bytes(b"in the way")  # not a directory
        ckpt.save(5, model, opt)  # the snapshot is taken; the write fails in the background
        with pytest.raises(OSError):
            ckpt.wait()
        ckpt.wait()  # reported once
        ckpt.save(6, model, opt)
        Path(local.path(fmt.tmp_dir_name(7, "dead"))).write_bytes(b"in the way")
        ckpt.save(7, model, opt)
        with pytest.raises(OSError):
            ckpt.save(8, model, opt)  # step 7's error, raised by the next save
    assert "step-00000006" in local.listdir() and "step-00000008" not in local.listdir()


def test_a_second_run_finds_another_runs_bigger_steps(where: Where) -> None:
    model, opt = _trained(0)
    with where.manager(run_id="0a") as other:
        other.save(50, model, opt, extra={"run": "other"})
    mine, mine_opt = _trained(1)
    with where.manager(keep=1) as ckpt:
        ckpt.save(10, mine, mine_opt, extra={"run": "mine"})
        ckpt.save(20, mine, mine_opt, extra={"run": "mine"})
        ckpt.wait()
        assert where.listdir() == ["step-00000020", "step-00000050"]  # keep never removes a bigger step
        loaded = ckpt.load_latest(mine, mine_opt)
    assert loaded is not None and loaded.step == 50 and loaded.extra == {"run": "other"}
    _assert_same(model, mine, opt, mine_opt)


def test_replicas_write_once_and_load_from_their_writer(where: Where) -> None:
    model, opt = _trained(0)
    rank0 = where.manager(rank=0, world_size=2, run_id="dd")
    rank1 = where.manager(rank=1, world_size=2, run_id="dd", replica_of=0)
    rank1.save(4, model, opt, extra={"rank": 1})
    rank0.save(4, model, opt, extra={"rank": 0})
    rank1.wait()
    rank0.wait()
    index1 = json.loads(where.read("step-00000004", "rank-00001.json"))
    assert not [t["name"] for t in index1["tensors"] if t["name"].startswith(("model/", "optim/"))]
    fresh, fresh_opt = _trained(2)
    loaded = rank1.load_latest(fresh, fresh_opt)
    assert loaded is not None and loaded.extra == {"rank": 1}
    _assert_same(model, fresh, opt, fresh_opt)
    rank0.close()
    rank1.close()


def test_a_model_that_does_not_match_is_an_error_not_a_fallback(local: Where) -> None:
    model, opt = _trained(0)
    with local.manager() as ckpt:
        ckpt.save(1, model, opt)
        ckpt.wait()
        other = nn.Sequential(nn.Linear(16, 33), nn.ReLU(), nn.Linear(33, 4))
        with pytest.raises(RuntimeError, match="size mismatch"):
            ckpt.load_latest(other)


# -- damage ---------------------------------------------------------------------------------------

def _flip(where: Where, *parts: str, at: int = 100) -> None:
    data = bytearray(where.read(*parts))
    data[at] ^= 0x40
    where.write(bytes(data), *parts)


DAMAGE: dict[str, Callable[[Where], None]] = {
    "missing data file": lambda w: w.remove("step-00000002", "rank-00001.bin"),
    "short data file": lambda w: w.write(w.read("step-00000002", "rank-00001.bin")[:-10],
                                         "step-00000002", "rank-00001.bin"),
    "flipped data byte": lambda w: _flip(w, "step-00000002", "rank-00000.bin"),
    "missing rank": lambda w: w.remove("step-00000002", "rank-00001.json"),
    "flipped index byte": lambda w: _flip(w, "step-00000002", "rank-00000.json", at=30),
    "corrupt manifest": lambda w: _flip(w, "step-00000002", "manifest.json", at=20),
    "no manifest": lambda w: w.remove("step-00000002", "manifest.json"),
}
REASONS = {"missing data file": "FileNotFoundError", "short data file": "holds", "flipped data byte": "CRC32C",
           "missing rank": "FileNotFoundError", "flipped index byte": "does not match the manifest",
           "corrupt manifest": "manifest", "no manifest": "FileNotFoundError"}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_is_logged_and_the_previous_one_used(
        damage: str, where: Where, caplog: pytest.LogCaptureFixture) -> None:
    managers = _two_ranks(where, "ee")
    model1, opt1 = _trained(0)
    model2, opt2 = _trained(1)
    for step, (m, o) in ((1, (model1, opt1)), (2, (model2, opt2))):
        managers[1].save(step, extra={"step": step, "t": torch.full((300,), float(step))})
        managers[0].save(step, m, o, extra={"step": step})
        managers[1].wait()
        managers[0].wait()
    DAMAGE[damage](where)
    fresh, fresh_opt = _trained(2)
    with caplog.at_level(logging.WARNING, logger="haiscale.checkpoint.manager"):
        loaded = managers[0].load_latest(fresh, fresh_opt)
    assert loaded is not None and loaded.step == 1
    _assert_same(model1, fresh, opt1, fresh_opt)
    assert "step-00000002 cannot be loaded" in caplog.text and REASONS[damage] in caplog.text
    for manager in managers:
        manager.close()


def test_no_loadable_checkpoint_is_a_clear_error(local: Where) -> None:
    model, opt = _trained(0)
    with local.manager() as ckpt:
        ckpt.save(1, model, opt)
        ckpt.wait()
    _flip(local, "step-00000001", "rank-00000.bin", at=5)
    fresh, fresh_opt = _trained(1)
    with local.manager() as ckpt, pytest.raises(CheckpointError, match=r"no loadable checkpoint.*step-00000001.*CRC"):
        ckpt.load_latest(fresh, fresh_opt)
    assert _differs(model, fresh)  # a failed load changed nothing


def _rewrite_index(where: Where, step: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Replace rank 0's index with a changed one and make the manifest vouch for it (a hostile writer)."""
    body = json.loads(where.read(step, "rank-00000.json"))
    change(body)
    data = json.dumps(body).encode()
    where.write(data, step, "rank-00000.json")
    manifest = fmt.parse_manifest(where.read(step, "manifest.json"), "manifest", int(step.split("-")[1]))
    marker = fmt.Marker(0, manifest.run_id, len(data), fmt.crc32c(data))
    where.write(fmt.render_manifest(fmt.Manifest(manifest.step, 1, manifest.run_id, (marker,))), step, "manifest.json")


def test_a_hostile_index_claiming_huge_sizes_is_refused(local: Where, caplog: pytest.LogCaptureFixture) -> None:
    model, opt = _trained(0)
    with local.manager(keep=None) as ckpt:
        ckpt.save(1, model, opt)
        ckpt.save(2, model, opt)
        ckpt.wait()

    def huge(body: dict[str, Any]) -> None:
        entry = body["tensors"][0]
        entry["shape"] = [1 << 40]
        entry["nbytes"] = 4 << 40
        entry["crcs"] = [0] * 3  # whatever the count, the claim is refused first

    _rewrite_index(local, "step-00000002", huge)
    with caplog.at_level(logging.WARNING), local.manager() as ckpt:
        loaded = ckpt.load_latest(model, opt)
    assert loaded is not None and loaded.step == 1
    assert "claims bytes" in caplog.text


def test_index_checks_refuse_bad_claims() -> None:
    good = RankIndex(0, 1, 5, "ab", {"rank-00000.bin": 8192},
                     {"w": fmt.Entry("w", "rank-00000.bin", 0, 16, "float32", (4,), (1,))},
                     {"model": {"__dict__": [["w", {"__tensor__": "w"}]]}})
    assert fmt.parse_index(fmt.render_index(good), "i", rank=0, step=5).entries["w"].nbytes == 16

    def bad(change: Callable[[dict[str, Any]], None], match: str) -> None:
        body = json.loads(fmt.render_index(good))
        change(body)
        with pytest.raises(CheckpointCorrupt, match=match):
            fmt.parse_index(json.dumps(body).encode(), "i", rank=0, step=5)

    bad(lambda b: b["tensors"][0].update(nbytes=20), "claims 20 bytes")
    bad(lambda b: b["tensors"][0].update(offset=8190), "claims bytes")
    bad(lambda b: b["tensors"][0].update(dtype="object"), "dtype")
    bad(lambda b: b["tensors"][0].update(file="../../etc/passwd"), "not one of the rank's data files")
    bad(lambda b: b["files"][0].update(name="../x.bin"), "not one of rank 0's")
    bad(lambda b: b["tensors"][0].update(shape=[-4]), "shape")
    bad(lambda b: b["tensors"][0].update(crcs=[]), "CRC32C")
    bad(lambda b: b["tensors"][0].update(global_shape=[3], flat_offset=0), "lies outside")
    bad(lambda b: b["tensors"].append(b["tensors"][0]), "twice")
    bad(lambda b: b.update(rank=1), "not of rank 0")
    bad(lambda b: b["trees"].update(model={"__shard__": "w"}), "referenced as a shard")
    with pytest.raises(CheckpointCorrupt, match="not valid JSON"):
        fmt.parse_index(b"{" * 100_000, "i", rank=0, step=5)
    nested: Any = 1
    for _ in range(100):
        nested = [nested]
    with pytest.raises(CheckpointCorrupt, match="deeper"):
        fmt.decode_tree(nested, lambda ref: None)


def test_manifest_checks() -> None:
    manifest = fmt.Manifest(3, 2, "ab", (fmt.Marker(0, "ab", 10, 1), fmt.Marker(1, "ab", 10, 2)))
    data = fmt.render_manifest(manifest)
    assert fmt.parse_manifest(data, "m", 3) == manifest
    with pytest.raises(CheckpointCorrupt, match="step 3, not of step 4"):
        fmt.parse_manifest(data, "m", 4)
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        outer = json.loads(data)
        outer["body"]["world_size"] = 3
        fmt.parse_manifest(json.dumps(outer).encode(), "m", 3)
    with pytest.raises(CheckpointCorrupt, match="more than"):
        fmt.parse_manifest(b" " * (fmt.MAX_MANIFEST_BYTES + 1), "m", 3)


# -- resharding -----------------------------------------------------------------------------------

class ShardedState:
    """A rank's piece of some flattened tensors (what FSDP holds), through the ShardedModule protocol."""

    def __init__(self, full: Mapping[str, torch.Tensor], rank: int, world_size: int) -> None:
        self.shards: dict[str, Shard] = {}
        self.plain = {"scale": torch.tensor([2.0, 3.0])}
        self.lr: dict[str, Any] | None = {"lr": 0.5, "betas": (0.9, 0.99)}
        for name, tensor in full.items():
            start, end = shard_range(tensor.numel(), rank, world_size)
            self.shards[name] = Shard(tensor.reshape(-1)[start:end].clone(), tuple(tensor.shape), start)

    def sharded_state_dict(self) -> dict[str, Any]:
        return {**self.shards, **self.plain, **({"lr": self.lr} if self.lr is not None else {})}

    def load_sharded_state_dict(self, state: Mapping[str, Any]) -> None:
        for name, value in state.items():
            if isinstance(value, Shard):
                assert value.flat_offset == self.shards[name].flat_offset
                self.shards[name] = value
            elif isinstance(value, torch.Tensor):
                self.plain[name] = value
            else:
                self.lr = value

    def zero(self) -> None:
        for name, shard in self.shards.items():
            self.shards[name] = Shard(torch.zeros_like(shard.local), shard.global_shape, shard.flat_offset)
        self.plain = {"scale": torch.zeros(2)}
        self.lr = {}


FULL = {"w": torch.arange(3 * 1000 * 700, dtype=torch.float32).reshape(3000, 700) / 7,
        "b": torch.arange(11, dtype=torch.float64), "e": torch.zeros(0)}


@pytest.mark.parametrize(("saved_by", "loaded_by"), [(2, 3), (4, 1)])
def test_shards_saved_by_n_ranks_load_on_m(saved_by: int, loaded_by: int, where: Where) -> None:
    assert isinstance(ShardedState(FULL, 0, 1), ShardedModule)
    writers = [where.manager(rank=r, world_size=saved_by, run_id="5a") for r in range(saved_by)]
    for rank in reversed(range(saved_by)):
        writers[rank].save(9, ShardedState(FULL, rank, saved_by))
    for writer in writers:
        writer.wait()
        writer.close()
    for rank in range(loaded_by):
        state = ShardedState(FULL, rank, loaded_by)
        state.zero()
        with where.manager(rank=rank, world_size=loaded_by, run_id="5c") as reader:
            loaded = reader.load_latest(state)
        assert loaded is not None and loaded.step == 9
        for name, tensor in FULL.items():
            start, end = shard_range(tensor.numel(), rank, loaded_by)
            assert torch.equal(state.shards[name].local, tensor.reshape(-1)[start:end]), name
        assert torch.equal(state.plain["scale"], torch.tensor([2.0, 3.0]))
        assert state.lr == {"lr": 0.5, "betas": (0.9, 0.99)}


def test_shards_load_into_a_plain_model(local: Where) -> None:
    """Shards saved by 2 ranks (FSDP) load whole into an unsharded module of the same names."""
    model = nn.Linear(40, 30)
    full = {"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone()}
    writers = [local.manager(rank=r, world_size=2, run_id="5b") for r in range(2)]
    for rank in (1, 0):
        state = ShardedState(full, rank, 2)
        state.plain = {}
        state.lr = None  # what a plain module's state_dict holds: the tensors alone
        writers[rank].save(1, state)
    for writer in writers:
        writer.close()
    fresh = nn.Linear(40, 30)
    with local.manager() as reader:
        assert reader.load_latest(fresh) is not None
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_a_reshard_reads_only_the_blocks_it_needs(local: Where) -> None:
    big = {"w": torch.arange(4 << 20, dtype=torch.float32)}  # 16 MiB: 16 CRC blocks
    with local.manager() as writer:
        writer.save(1, ShardedState(big, 0, 1))
    reads: list[int] = []
    with local.manager(rank=3, world_size=4, run_id="5d") as reader:
        original = reader.store.read_into

        def counting(path: str, offset: int, buffer: memoryview) -> None:
            reads.append(len(buffer))
            original(path, offset, buffer)

        reader.store.read_into = counting  # type: ignore[method-assign]
        state = ShardedState(big, 3, 4)
        state.zero()
        reader.load_latest(state)
    assert torch.equal(state.shards["w"].local, big["w"][3 << 20:])
    assert sum(reads) < 5 << 20  # a quarter of the tensor (and the small plain tensor), not all of it


def test_pieces_cover_the_file_and_checksum_every_entry() -> None:
    from haiscale.checkpoint.manager import _WRITE_PIECE_BYTES, _checksummed_pieces

    sizes = [("a", 10), ("b", _WRITE_PIECE_BYTES + 5000), ("c", 0), ("d", 3 << 20)]
    places, (total,) = fmt.plan_layout(0, sizes, 1)
    data = memoryview(bytes(range(256)) * (total // 256 + 1))[:total]
    entries = [fmt.Entry(name, file, offset, n, "uint8", (n,), ()) for (name, n), (file, offset) in zip(
        sizes, places, strict=True)]
    crcs: dict[str, tuple[int, ...]] = {}
    pieces = list(_checksummed_pieces(data, entries, crcs))
    assert b"".join(pieces) == bytes(data)
    assert max(len(p) for p in pieces) < 2 * _WRITE_PIECE_BYTES
    for entry in entries:
        assert crcs[entry.name] == tuple(fmt.block_crcs(data[entry.offset:entry.offset + entry.nbytes]))
