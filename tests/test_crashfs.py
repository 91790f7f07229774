"""CrashFS, the disk that loses what was never synced, checked against writers known to be wrong.

A checker that never fails proves nothing, so each way of skipping a sync — the file's, its
directory's, the parent directory's — must lose data on it, and the careful writer must lose
nothing. The model (``CrashFS`` without FUSE) is also checked against a plain reference under
random writes, truncates, syncs and power cuts.
"""

from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fs3.testing.crashfs import ROOT_INODE, CrashFS

# -- through the mount -------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes, sync_file: bool, sync_dir: bool, offset: int | None = None) -> None:
    flags = os.O_WRONLY | os.O_CREAT | (0 if offset is not None else os.O_TRUNC)
    fd = os.open(path, flags, 0o644)
    try:
        os.pwrite(fd, data, offset or 0)
        if sync_file:
            os.fsync(fd)
    finally:
        os.close(fd)
    if sync_dir:
        _fsync_dir(path.parent)


def _careful(path: Path, data: bytes) -> None:
    """The writer that does it right: the file, then its directory."""
    _write(path, data, sync_file=True, sync_dir=True)


def test_unsynced_files_and_names_are_lost_synced_ones_survive(crash_disk: Any) -> None:
    root: Path = crash_disk.path
    (root / "d").mkdir()
    _careful(root / "careful", b"kept")  # (its directory sync makes "d" durable too)
    _write(root / "no-sync-at-all", b"x", sync_file=False, sync_dir=False)
    _write(root / "file-only", b"x", sync_file=True, sync_dir=False)  # the name never became durable
    _write(root / "d" / "dir-only", b"x", sync_file=False, sync_dir=True)  # the name did, the bytes not
    assert sorted(os.listdir(root)) == ["careful", "d", "file-only", "no-sync-at-all"]
    report = crash_disk.power_cut()
    assert report["power_cuts"] == 1
    assert sorted(os.listdir(root)) == ["careful", "d"]
    assert (root / "careful").read_bytes() == b"kept"
    assert (root / "d" / "dir-only").read_bytes() == b""


def test_unsynced_writes_and_truncates_are_undone(crash_disk: Any) -> None:
    root: Path = crash_disk.path
    original = bytes(range(256)) * 64
    _careful(root / "f", original)
    _write(root / "f", b"X" * 100, sync_file=False, sync_dir=False, offset=1000)  # overwrite
    with open(root / "f", "ab") as f:
        f.write(b"appended")  # append
    os.truncate(root / "f", 10)  # shrink
    os.truncate(root / "f", 50_000)  # and grow again, over the old bytes
    _careful(root / "g", b"first")
    _write(root / "g", b"second", sync_file=True, sync_dir=False)  # a synced overwrite is durable
    crash_disk.power_cut()
    assert (root / "f").read_bytes() == original
    assert (root / "g").read_bytes() == b"second"


def test_renames_and_unlinks_need_the_directory_synced(crash_disk: Any) -> None:
    root: Path = crash_disk.path
    for name in ("renamed", "renamed-synced", "unlinked", "unlinked-synced", "replaced"):
        _careful(root / name, name.encode())
    os.rename(root / "renamed", root / "renamed-new")
    os.unlink(root / "unlinked")
    # The atomic-replace pattern: write a temporary, sync it, rename it over, but skip the
    # directory: the old contents come back.
    _write(root / "replaced.tmp", b"new contents", sync_file=True, sync_dir=False)
    os.rename(root / "replaced.tmp", root / "replaced")
    assert (root / "replaced").read_bytes() == b"new contents"
    crash_disk.power_cut()
    names = sorted(os.listdir(root))
    assert names == ["renamed", "renamed-synced", "replaced", "unlinked", "unlinked-synced"]
    assert (root / "unlinked").read_bytes() == b"unlinked"
    assert (root / "replaced").read_bytes() == b"replaced"
    # Now with the directory synced after each change: they stick.
    os.rename(root / "renamed-synced", root / "renamed-synced-new")
    os.unlink(root / "unlinked-synced")
    _write(root / "replaced.tmp", b"new contents", sync_file=True, sync_dir=False)
    os.rename(root / "replaced.tmp", root / "replaced")
    _fsync_dir(root)
    crash_disk.power_cut()
    assert sorted(os.listdir(root)) == ["renamed", "renamed-synced-new", "replaced", "unlinked"]
    assert (root / "replaced").read_bytes() == b"new contents"


def test_a_new_directory_needs_its_parent_synced(crash_disk: Any) -> None:
    root: Path = crash_disk.path
    (root / "kept").mkdir()
    _fsync_dir(root)
    (root / "orphaned").mkdir()
    _careful(root / "orphaned" / "f", b"synced, in a directory that is not")
    _careful(root / "kept" / "f", b"all synced")
    (root / "kept" / "sub").mkdir()  # its parent is not synced again
    _careful(root / "kept" / "sub" / "f", b"lost with sub")
    crash_disk.power_cut()
    assert sorted(os.listdir(root)) == ["kept"]
    assert sorted(os.listdir(root / "kept")) == ["f"]
    assert (root / "kept" / "f").read_bytes() == b"all synced"


def test_a_handle_from_before_the_power_cut_fails_and_a_second_cut_keeps_the_same_state(crash_disk: Any) -> None:
    root: Path = crash_disk.path
    _careful(root / "f", b"durable")
    fd = os.open(root / "f", os.O_RDWR)
    try:
        crash_disk.power_cut()
        with pytest.raises(OSError) as raised:
            os.pwrite(fd, b"after the cut", 0)
        assert raised.value.errno == errno.EIO
    finally:
        os.close(fd)
    crash_disk.power_cut()
    assert (root / "f").read_bytes() == b"durable"
    assert crash_disk.stats()["unsynced_files"] == 0


_CHILD_WRITER = r"""
import os, sys
path, mode = sys.argv[1], sys.argv[2]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
os.write(fd, b"acknowledged")
if mode == "careful":
    os.fsync(fd)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    os.fsync(dfd)
print("written", flush=True)
sys.stdin.read()  # killed here, its files still open
"""


@pytest.mark.parametrize("mode", ["careful", "careless"])
def test_sigkill_alone_loses_nothing_the_power_cut_does(crash_disk: Any, mode: str) -> None:
    """What the layer is for: the killed writer's data is still there after the kill (the page
    cache survives a SIGKILL) and is gone after the power cut unless it was synced."""
    path = crash_disk.path / "f"
    child = subprocess.Popen([sys.executable, "-c", _CHILD_WRITER, str(path), mode], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"written\n"
    child.kill()
    child.wait()
    assert path.read_bytes() == b"acknowledged"
    crash_disk.power_cut()
    assert path.exists() == (mode == "careful")


# -- the model against a reference ---------------------------------------------------------------------


def test_file_contents_match_a_reference_under_random_writes_truncates_syncs_and_cuts(tmp_path: Path) -> None:
    """A plain reference keeps two byte strings per file (now, durable); CrashFS must agree with it
    after every step and every power cut (seeded: a failure names its seed)."""
    for seed in range(40):
        rng = random.Random(seed)
        fs = CrashFS(tmp_path / f"backing-{seed}")
        node = fs.make(ROOT_INODE, b"f", 0o100644, 0, 0)
        fs.sync_dir(ROOT_INODE)
        handle = fs.open(node.ino)
        now, durable = b"", b""
        for step in range(60):
            action = rng.choice(["write", "write", "write", "truncate", "sync", "cut"])
            if action == "write":
                offset = rng.randrange(0, len(now) + 3000)
                data = rng.randbytes(rng.randrange(1, 2000))
                fs.write(handle, offset, data)
                now = now.ljust(offset, b"\0")
                now = now[:offset] + data + now[offset + len(data):]
            elif action == "truncate":
                size = rng.randrange(0, len(now) + 3000)
                fs.truncate(node.ino, size)
                now = now[:size].ljust(size, b"\0")
            elif action == "sync":
                fs.sync_file(handle)
                durable = now
            else:
                fs.power_cut()
                now = durable
                handle = fs.open(node.ino)
            assert fs.read(handle, 0, len(now) + 10) == now, f"seed {seed}, step {step} ({action})"
