"""``make rolling-upgrade``: a running cluster upgraded one node at a time, from the previous
release to this code, under a client workload. Needs root (network namespaces) and git history.

Usage: ``python -m tests.chaos.rolling_upgrade [--from COMMIT] [--seconds S] [--out DIR] [--sabotage]``.

1. The previous release's tree: ``git archive PREVIOUS_RELEASE`` into a temporary directory, its
   protobuf modules generated from its own ``proto/`` (grpc_tools, this venv). Both trees run on
   this venv; ``PYTHONPATH`` chooses the tree for each process.
2. The compose topology (mgmtd, meta, three storage nodes, chains of three replicas) on network
   namespace hosts (tests/chaos/cluster.py), every server on the OLD code; files written (and
   their digests recorded at acknowledgement) by an old client; then the chaos workload (writers
   and readers of slots, metadata creates and removes) keeps running on an old client.
3. One node at a time: SIGTERM, start on the NEW code, wait until mgmtd lists it alive with the
   new protocol and every chain is serving again (a storage node's replicas resynced) before the
   next. Order: mgmtd, storage nodes, meta (UPGRADE_ORDER says why). Clients come last: the
   workload's old client talks to new servers throughout.
4. Checks (tests/chaos/upgrade_check.py): the workload ran through every restart, no client
   operation failed beyond its retries, no acknowledged write lost, every byte of the files reads
   back (with the new client), fsck clean, every node listed alive on the new protocol and
   release, every store on the new format.

Without the history (a shallow clone, an unpacked archive) it says so and exits 0, skipped.
``--sabotage`` flips one byte of one file before the read-back: the run must then FAIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fs3.common.errors import FS3Error
from fs3.rpc.versions import PROTOCOL_VERSION, RELEASE
from tests.chaos.cluster import LabCluster, check_history, check_namespace
from tests.chaos.netns import NetnsLab
from tests.chaos.topology import ROOT
from tests.chaos.upgrade_check import compare_files, format_problems, upgrade_verdict, version_problems

# The release this code upgrades from (docs/operations.md, "Rolling upgrade").
PREVIOUS_RELEASE = "02e3b42"
# mgmtd first: it is the registry, and only a new one records the versions each node reports
# (an old mgmtd drops the fields it does not know), so the operator watches the rest of the
# upgrade in ``fs3 admin nodes``; it still speaks protocol 1 to the old nodes. Then the storage
# nodes, one replica of each chain at a time, each resynced before the next; then meta.
UPGRADE_ORDER = ["mgmtd", "storage1", "storage2", "storage3", "meta"]
FAST = {"FS3_MGMTD_HEARTBEAT_TIMEOUT_MS": "3000", "FS3_STORAGE_HEARTBEAT_INTERVAL_MS": "200",
        "FS3_META_HEARTBEAT_INTERVAL_MS": "200"}
FILES = 40


def previous_tree(commit: str, into: Path) -> Path | None:
    """The tree of ``commit`` with its generated protobuf modules under ``into``; None (and why,
    printed) when this repository lacks that commit."""
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True)
    if known.returncode != 0:
        shallow = (ROOT / ".git" / "shallow").exists()
        print(f"rolling-upgrade: SKIPPED: commit {commit} (the previous release) is not in this repository's "
              f"history{' (a shallow clone: git fetch --unshallow)' if shallow else ''}; nothing to upgrade from")
        return None
    tree = into / "previous"
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    protos = sorted(str(p.relative_to(tree)) for p in (tree / "proto" / "fs3").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-Iproto", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", *protos], cwd=tree, check=True, capture_output=True)
    shipped = tree / "fs3" / "proto" / "fs3"
    shipped.mkdir(parents=True, exist_ok=True)
    for proto in protos:
        shutil.copy(tree / proto, shipped)
    return tree


class UpgradeRun:
    def __init__(self, cluster: LabCluster, old: Path, root: Path) -> None:
        self.cluster = cluster
        self.old = old
        self.root = root
        self.code: dict[str, Path] = {}  # server -> the tree it runs
        self.steps: list[dict[str, Any]] = []
        self.marks: list[tuple[str, float]] = []  # (node, seconds after the workload started) per restart

    def use(self, tree: Path) -> None:
        """Programs started from now on (servers, clients, admin commands) run ``tree``'s code."""
        self.cluster.base_env = {**self.cluster.base_env, "PYTHONPATH": str(tree)}

    def client_script(self, tree: Path, *args: str, timeout_s: float = 300) -> None:
        self.use(tree)
        done = self.cluster.client_run([sys.executable, "-P", str(ROOT / "tests" / "chaos" / "upgrade_files.py"),
                                        *args], timeout_s=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"upgrade_files {args[0]} failed:\n{done.stdout}{done.stderr}"[-3000:])

    def nodes(self) -> list[dict[str, Any]]:
        """``fs3 admin --json nodes`` (the new code's admin command), each entry named by its host."""
        self.use(ROOT)
        done = self.cluster.admin("--json", "nodes")
        if done.returncode != 0:
            raise RuntimeError(f"admin nodes failed: {done.stderr[-2000:]}")
        entries: list[dict[str, Any]] = json.loads(done.stdout)
        by_address = {self.cluster.lab.address(name): name for name in self.cluster.servers}
        for entry in entries:
            # The one mgmtd of this topology lists itself under the address it was told to
            # advertise, which may be its compose name.
            entry["host"] = "mgmtd" if entry.get("node_type") == "mgmtd" else \
                by_address.get(str(entry.get("framed_address", "")).rsplit(":", 1)[0], "?")
        return entries

    def versions(self) -> dict[str, str]:
        return {e["host"]: f"{e.get('release') or '-'}/p{e.get('protocol_version') or '?'}"
                for e in self.nodes() if e.get("alive")}

    def wait_rejoined(self, name: str, timeout_s: float = 120) -> None:
        """Until mgmtd lists ``name`` alive on the new protocol, and every chain serves again."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            mine = [e for e in self.nodes() if e["host"] == name]
            if mine and all(e.get("alive") and e.get("protocol_version") == PROTOCOL_VERSION for e in mine):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError(f"{name} did not rejoin on protocol {PROTOCOL_VERSION} within {timeout_s}s")
        self.use(ROOT)
        self.cluster.wait_all_serving(max(1.0, deadline - time.monotonic()))

    def upgrade(self, name: str) -> None:
        started = time.monotonic()
        self.cluster.procs[name].kill(signal.SIGTERM)
        self.use(ROOT)
        self.cluster.start(name)
        self.code[name] = ROOT
        self.wait_rejoined(name)
        step = {"node": name, "seconds": round(time.monotonic() - started, 1), "versions": self.versions()}
        self.steps.append(step)
        print(f"rolling-upgrade: {name} on the new code after {step['seconds']}s; versions {step['versions']}",
              flush=True)


def run(commit: str, seconds: float, out: Path, sabotage: bool) -> int:
    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="fs3-rolling-"))
    report: dict[str, Any] = {"from": commit, "to_protocol": PROTOCOL_VERSION, "to_release": RELEASE,
                              "sabotage": sabotage}
    try:
        old = previous_tree(commit, work)
        if old is None:
            return 0
        root = work / "cluster"
        with NetnsLab() as lab:
            cluster = LabCluster(lab, root, FAST)
            upgrade = UpgradeRun(cluster, old, root)
            try:
                upgrade.use(old)
                cluster.start_all()
                report["versions_before"] = upgrade.versions()
                report["formats_before"] = {store: f["found"] for store, f in store_formats(cluster).items()}
                print(f"rolling-upgrade: cluster up on {commit}; versions {report['versions_before']}", flush=True)
                upgrade.client_script(old, "write", cluster.mgmtd, cluster.token, str(FILES),
                                      str(root / "files.json"))
                upgrade.use(old)
                workload = cluster.client_spawn([sys.executable, "-P", "-m", "tests.chaos.workload", cluster.mgmtd,
                                                 cluster.token, str(seconds), str(root / "workload.json"),
                                                 "namespace"], root / "workload.log")
                time.sleep(3)  # the workload's files exist and it is running before the first restart
                report["workload_started"] = time.monotonic()
                for name in UPGRADE_ORDER:
                    upgrade.marks.append((name, time.monotonic() - report["workload_started"]))
                    if workload.poll() is not None:
                        print(f"rolling-upgrade: the workload ended before {name} was upgraded: give more --seconds")
                        report["workload_covered_upgrade"] = False
                    upgrade.upgrade(name)
                report.setdefault("workload_covered_upgrade", workload.poll() is None)
                report["steps"] = upgrade.steps
                report["restarts_at_s"] = [(name, round(at, 1)) for name, at in upgrade.marks]
                if workload.wait(timeout=seconds + 300) != 0:
                    raise RuntimeError(f"workload failed:\n{(root / 'workload.log').read_text()[-3000:]}")
                result = json.loads((root / "workload.json").read_text())
                report.update(check_history(result))
                report.update(check_namespace(result))
                # What failed, and when (seconds since the workload started): the first few of each kind.
                failed = [op for op in result["ops"] + result["namespace"]["ops"] if not op["ok"]]
                first = min((op["invoke"] for op in result["ops"]), default=0.0)
                report["failures"] = [{"kind": op["kind"], "at_s": round(op["invoke"] - first, 2),
                                       "error": op.get("error"), "errno": op.get("errno")} for op in failed[:10]]
                upgrade.client_script(ROOT, "read", cluster.mgmtd, cluster.token, str(root / "files.json"),
                                      str(root / "read.json"), *(["--corrupt"] if sabotage else []))
                expected = json.loads((root / "files.json").read_text())
                report["files_checked"] = len(expected)
                report["file_problems"] = compare_files(expected, json.loads((root / "read.json").read_text()))
                upgrade.use(ROOT)
                cluster.wait_all_serving()
                fsck = cluster.admin("fsck")
                for _ in range(9):  # GC of the workload's removals may still be in flight a moment
                    if fsck.returncode == 0:
                        break
                    time.sleep(1)
                    fsck = cluster.admin("fsck")
                report["fsck_clean"] = fsck.returncode == 0
                report["fsck"] = fsck.stdout.strip().splitlines()[-1:] if fsck.returncode == 0 else \
                    fsck.stdout.strip().splitlines()[-20:]
                nodes = upgrade.nodes()
                report["versions_after"] = upgrade.versions()
                report["version_problems"] = version_problems([e for e in nodes if e.get("alive")], PROTOCOL_VERSION,
                                                              RELEASE, expected_hosts=tuple(UPGRADE_ORDER))
                report["formats_after"] = store_formats(cluster)
                report["format_problems"] = format_problems(report["formats_after"])
            finally:
                cluster.close()
        report["wall_s"] = round(time.monotonic() - began, 1)
        report["problems"] = upgrade_verdict(report)
        report["ok"] = not report["problems"]
    except Exception as exc:
        report.update({"ok": False, "error": f"{type(exc).__name__}: {exc}"[-4000:],
                       "wall_s": round(time.monotonic() - began, 1)})
        report["problems"] = [report["error"]]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rolling-upgrade.json").write_text(json.dumps(report, indent=2, default=str))
    print(summary(report))
    return 0 if report["ok"] else 1


def store_formats(cluster: LabCluster) -> dict[str, dict[str, Any]]:
    """Every store's format as this code reads it (read-only views, beside the running servers):
    store -> {"found", "current", "pending"}; ``found`` None for a store without a record and
    data, "unreadable: ..." for one this code refuses."""
    from fs3.kv.store import RocksKVStore
    from fs3.kv.txn import OptimisticTxnEngine
    from fs3.meta.formats import open_meta_format
    from fs3.mgmtd.formats import open_mgmtd_format
    from fs3.storage.formats import open_target_format

    stores: dict[str, Path] = {"mgmtd": Path(cluster.env_for("mgmtd")["FS3_MGMTD_DATA_DIR"]) / "kv",
                               "meta": Path(cluster.env_for("meta")["FS3_META_DATA_DIR"]) / "kv"}
    for name in UPGRADE_ORDER:
        if name.startswith("storage"):
            for path in cluster._target_paths(name):
                stores[f"{name}/{path.name}"] = path / "meta"
    found: dict[str, dict[str, Any]] = {}
    for store, path in stores.items():
        view = RocksKVStore.open_view(path)
        try:
            if store == "mgmtd":
                report = open_mgmtd_format(view, store, check=True)
            elif store == "meta":
                report = asyncio.run(open_meta_format(OptimisticTxnEngine(view), store, check=True))
            else:
                report = open_target_format(view, store, check=True)
            found[store] = {"found": report.found, "current": report.current, "pending": list(report.pending)}
        except FS3Error as exc:
            found[store] = {"found": f"unreadable: {exc.message}", "current": None, "pending": []}
        finally:
            view.close()
    return found


def summary(report: dict[str, Any]) -> str:
    lines = [f"rolling-upgrade {'PASSED' if report.get('ok') else 'FAILED'} in {report.get('wall_s')}s: "
             f"{report.get('from')} -> protocol {report.get('to_protocol')} release {report.get('to_release')}",
             f"  client operations {report.get('operations', '?')} ({report.get('acknowledged', '?')} acknowledged, "
             f"{report.get('failed', '?')} failed), metadata operations {report.get('namespace_operations', '?')} "
             f"({report.get('namespace_failed', '?')} failed), worst stall {report.get('worst_stall_s', '?')}s",
             f"  files read back {report.get('files_checked', '?')} ({len(report.get('file_problems') or [])} bad), "
             f"fsck {'clean' if report.get('fsck_clean') else 'NOT clean'}",
             f"  versions before {report.get('versions_before')}", f"  versions after {report.get('versions_after')}",
             f"  store formats before {report.get('formats_before')}",
             f"  store formats after {({s: f['found'] for s, f in (report.get('formats_after') or {}).items()})}"]
    lines += [f"  PROBLEM: {problem}" for problem in report.get("problems", [])]
    lines += [f"  failed op: {failure}" for failure in report.get("failures", [])]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--from", dest="commit", default=PREVIOUS_RELEASE, help="the release to upgrade from")
    parser.add_argument("--seconds", type=float, default=60, help="how long the client workload runs")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results", help="where the JSON report goes")
    parser.add_argument("--sabotage", action="store_true", help="flip one byte of one file: the run must fail")
    args = parser.parse_args()
    return run(args.commit, args.seconds, args.out, args.sabotage)


if __name__ == "__main__":
    sys.exit(main())
