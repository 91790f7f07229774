"""What ``make rolling-upgrade`` checks at the end, as pure functions (unit-tested in
tests/test_rolling_upgrade_check.py, so a checker that cannot fail is caught there).

* :func:`compare_files`: every file whose write was acknowledged before the upgrade reads back
  whole, byte for byte (its SHA-256 and size as recorded at the acknowledgement).
* :func:`version_problems`: every node and mgmtd is listed alive and reports the new protocol and
  release.
* :func:`format_problems`: every store is on this code's format, no migration pending.
* :func:`upgrade_verdict`: the whole run: the client workload ran through every restart, its
  ledger and linearizability (from :func:`tests.chaos.cluster.check_history`), no client
  operation failed beyond its retries, the files, fsck, the versions, the stores' formats.
"""

from __future__ import annotations

from typing import Any

__all__ = ["compare_files", "format_problems", "upgrade_verdict", "version_problems"]


def compare_files(expected: dict[str, dict[str, Any]], observed: dict[str, dict[str, Any]]) -> list[str]:
    """``expected``: path -> {"sha256", "size"} recorded when each write was acknowledged;
    ``observed``: path -> {"sha256", "size"} or {"error"} as read back. One line per file that is
    missing, unreadable, of another size or other bytes; nothing when every byte reads back."""
    problems = []
    for path, want in sorted(expected.items()):
        got = observed.get(path)
        if got is None:
            problems.append(f"{path}: never read back")
        elif "error" in got:
            problems.append(f"{path}: {got['error']}")
        elif got.get("size") != want["size"]:
            problems.append(f"{path}: {got.get('size')} bytes, {want['size']} were written")
        elif got.get("sha256") != want["sha256"]:
            problems.append(f"{path}: its bytes differ from those written (sha256 {got.get('sha256', '')[:12]}, "
                            f"written {want['sha256'][:12]})")
    return problems


def version_problems(entries: list[dict[str, Any]], protocol: int, release: str,
                     expected_hosts: tuple[str, ...] = ()) -> list[str]:
    """``entries``: ``fs3 admin --json nodes``; one line per node not on ``protocol``/``release``,
    and one per host of ``expected_hosts`` (matched against each entry's ``host``) not listed alive:
    a node that died after its upgrade is left out of a listing of the living, which must not
    make it pass."""
    problems = []
    alive = {entry.get("host") for entry in entries if entry.get("alive")}
    problems += [f"{host}: not listed alive after the upgrade" for host in expected_hosts if host not in alive]
    for entry in entries:
        name = entry.get("name") or f"{entry.get('node_type')} {entry.get('node_id')} {entry.get('framed_address')}"
        seen = (entry.get("protocol_version") or 0, entry.get("release") or "")
        if seen != (protocol, release):
            problems.append(f"{name}: protocol {seen[0] or '?'} release {seen[1] or '?'}, "
                            f"expected protocol {protocol} release {release}")
    if not entries:
        problems.append("no node listed")
    return problems


def upgrade_verdict(report: dict[str, Any]) -> list[str]:
    """Why a finished run failed, in words (nothing: it passed). Every check is required: a key
    the run never filled in is a failure, not a pass."""
    broken = []
    if report.get("workload_covered_upgrade") is not True:
        # A workload that ended before the first restart (or never ran) proves nothing about
        # serving through the upgrade, however clean its history.
        broken.append("the client workload did not run through every restart (give more --seconds)")
    if report.get("failed", 1):
        broken.append(f"{report.get('failed', '?')} client operations failed beyond their retries")
    if report.get("lost", [None]):
        broken.append(f"{len(report.get('lost') or [None])} acknowledged slot writes lost")
    if report.get("violations", [None]):
        broken.append("linearizability violations")
    if report.get("namespace_lost", [None]):
        broken.append("acknowledged metadata operations lost")
    if report.get("namespace_failed", 1):
        broken.append(f"{report.get('namespace_failed', '?')} metadata operations failed beyond their retries")
    if report.get("file_problems", [None]):
        broken.append(f"files written before the upgrade do not read back: {report.get('file_problems')}")
    if not report.get("files_checked"):
        broken.append("no file was checked")
    if not report.get("fsck_clean"):
        broken.append("fsck found problems")
    if report.get("version_problems", [None]):
        broken.append(f"nodes not on the new versions: {report.get('version_problems')}")
    if report.get("format_problems", [None]):
        broken.append(f"stores not on the new formats: {report.get('format_problems')}")
    return broken


def format_problems(formats: dict[str, dict[str, Any]]) -> list[str]:
    """One line per store not on this code's format (migrations pending, or unreadable)."""
    return [f"{store}: format {f['found']}, current {f['current']}, pending {f['pending']}"
            for store, f in sorted(formats.items()) if f["found"] != f["current"] or f["pending"]] or \
        ([] if formats else ["no store checked"])
