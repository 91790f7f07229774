"""fs3 against a local directory: the same random operations must give the same results and trees.

A Hypothesis state machine applies mkdir / create / write / truncate / rename / link / unlink /
rmdir / setxattr / chmod / symlink to fs3 (through the blocking client library) and to a local
directory, compares every outcome (success, or the errno), and after each step compares the
whole trees: types, sizes, contents, link counts, permission bits, symlink targets and xattrs.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import fs3
from fs3.client.sync_api import FileSystem
from tests.inproc import ClusterThread

pytestmark = pytest.mark.slow  # an in-process cluster driven against a local directory

NAMES = ["a", "b", "c"]
PATHS = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join)


@pytest.fixture(scope="module")
def cluster_fs(shared_cluster: ClusterThread) -> Iterator[FileSystem]:
    fs = fs3.connect(shared_cluster.cluster.mgmtd_address, token=shared_cluster.cluster.token)
    try:
        yield fs
    finally:
        fs.close()


def _xattrs_work(path: Path) -> bool:
    probe = path / ".xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def outcome(fn: Callable[[], Any]) -> Any:
    try:
        result = fn()
        return ("ok", result)
    except OSError as exc:
        return ("error", exc.errno)


@pytest.mark.timeout(600)
def test_fs3_behaves_like_a_local_directory(cluster_fs: FileSystem, tmp_path: Path) -> None:
    xattrs = _xattrs_work(tmp_path)
    counter = iter(range(1_000_000))

    class Model(RuleBasedStateMachine):
        @initialize()
        def setup(self) -> None:
            n = next(counter)
            self.local = tmp_path / f"run{n}"
            self.local.mkdir()
            self.remote = f"/run{n}"
            cluster_fs.mkdir(self.remote)

        def both(self, local: Callable[[Path], Any], remote: Callable[[str], Any], path: str) -> None:
            expected = outcome(lambda: local(self.local / path))
            got = outcome(lambda: remote(f"{self.remote}/{path}"))
            assert got == expected, f"{path}: fs3 {got} vs local {expected}"

        def both2(self, local: Callable[[Path, Path], Any], remote: Callable[[str, str], Any], src: str,
                  dst: str) -> None:
            expected = outcome(lambda: local(self.local / src, self.local / dst))
            got = outcome(lambda: remote(f"{self.remote}/{src}", f"{self.remote}/{dst}"))
            assert got == expected, f"{src} -> {dst}: fs3 {got} vs local {expected}"

        @rule(path=PATHS)
        def mkdir(self, path: str) -> None:
            self.both(lambda p: os.mkdir(p, 0o755), lambda p: cluster_fs.mkdir(p, 0o755), path)

        @rule(path=PATHS, data=st.binary(max_size=300), offset=st.integers(0, 200))
        def write(self, path: str, data: bytes, offset: int) -> None:
            def local(p: Path) -> None:
                with open(p, "r+b" if p.exists() and p.is_file() else "wb") as f:
                    f.seek(offset)
                    f.write(data)

            def remote(p: str) -> None:
                with cluster_fs.open(p, "r+b" if cluster_fs.isfile(p) else "wb") as f:
                    f.seek(offset)
                    f.write(data)

            self.both(local, remote, path)

        @rule(path=PATHS, data=st.binary(max_size=100))
        def create(self, path: str, data: bytes) -> None:
            def local(p: Path) -> None:
                with open(p, "xb") as f:
                    f.write(data)

            def remote(p: str) -> None:
                with cluster_fs.open(p, "xb") as f:
                    f.write(data)

            self.both(local, remote, path)

        @rule(path=PATHS, size=st.integers(0, 400))
        def truncate(self, path: str, size: int) -> None:
            self.both(lambda p: os.truncate(p, size), lambda p: cluster_fs.truncate(p, size), path)

        @rule(src=PATHS, dst=PATHS)
        def rename(self, src: str, dst: str) -> None:
            self.both2(os.rename, cluster_fs.rename, src, dst)

        @rule(src=PATHS, dst=PATHS)
        def link(self, src: str, dst: str) -> None:
            self.both2(os.link, cluster_fs.link, src, dst)

        @rule(path=PATHS, link_target=st.sampled_from(["a", "c/a", "b/../c"]))
        def symlink(self, path: str, link_target: str) -> None:
            self.both(lambda p: os.symlink(link_target, p), lambda p: cluster_fs.symlink(link_target, p), path)

        @rule(path=PATHS)
        def unlink(self, path: str) -> None:
            self.both(os.unlink, cluster_fs.remove, path)

        @rule(path=PATHS)
        def rmdir(self, path: str) -> None:
            self.both(os.rmdir, cluster_fs.rmdir, path)

        @rule(path=PATHS, mode=st.sampled_from([0o700, 0o755, 0o711, 0o777, 0o750]))
        def chmod(self, path: str, mode: int) -> None:
            self.both(lambda p: os.chmod(p, mode), lambda p: cluster_fs.chmod(p, mode), path)

        @rule(path=PATHS, name=st.sampled_from(["user.x", "user.y"]), value=st.binary(max_size=20))
        def setxattr(self, path: str, name: str, value: bytes) -> None:
            if xattrs:
                self.both(lambda p: os.setxattr(p, name, value), lambda p: cluster_fs.setxattr(p, name, value), path)

        @rule(path=PATHS)
        def read(self, path: str) -> None:
            self.both(lambda p: p.read_bytes(), cluster_fs.read_bytes, path)

        @invariant()
        def trees_match(self) -> None:
            if not hasattr(self, "local"):
                return
            assert _tree_local(self.local, xattrs) == _tree_remote(cluster_fs, self.remote, xattrs)

    examples = int(os.environ.get("FS3_MODEL_EXAMPLES", "40"))
    Model.TestCase.settings = settings(max_examples=examples, stateful_step_count=30, deadline=None,
                                       suppress_health_check=list(HealthCheck))
    Model.TestCase().runTest()


def _tree_local(root: Path, xattrs: bool) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st_ = path.lstat()
            rel = str(path.relative_to(root))
            entry: dict[str, Any] = {"mode": stat.S_IMODE(st_.st_mode), "nlink": st_.st_nlink}
            if stat.S_ISLNK(st_.st_mode):
                entry = {"link": os.readlink(path)}
            elif stat.S_ISREG(st_.st_mode):
                entry["data"] = path.read_bytes()
            else:
                entry["dir"] = True
            if xattrs and not stat.S_ISLNK(st_.st_mode):
                entry["xattrs"] = {n: os.getxattr(path, n) for n in sorted(os.listxattr(path))}
            tree[rel] = entry
    return tree


def _tree_remote(fs: FileSystem, root: str, xattrs: bool) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for dirpath, dirnames, filenames in fs.walk(root):
        for name in dirnames + filenames:
            path = f"{dirpath}/{name}"
            st_ = fs.lstat(path)
            rel = path[len(root) + 1:]
            entry: dict[str, Any] = {"mode": stat.S_IMODE(st_.st_mode), "nlink": st_.st_nlink}
            if stat.S_ISLNK(st_.st_mode):
                entry = {"link": fs.readlink(path)}
            elif stat.S_ISREG(st_.st_mode):
                entry["data"] = fs.read_bytes(path)
                assert len(entry["data"]) == st_.st_size
            else:
                entry["dir"] = True
            if xattrs and not stat.S_ISLNK(st_.st_mode):
                entry["xattrs"] = {n: fs.getxattr(path, n) for n in sorted(fs.listxattr(path))}
            tree[rel] = entry
    return tree
