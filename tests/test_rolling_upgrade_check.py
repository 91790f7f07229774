"""The checks ``make rolling-upgrade`` ends with (tests/chaos/upgrade_check.py) can fail: a lost
acknowledged write, one flipped byte, a node left on the old protocol, a check that never ran."""

from __future__ import annotations

import hashlib
from typing import Any

from fs3.rpc.versions import PROTOCOL_VERSION, RELEASE
from tests.chaos.cluster import check_history
from tests.chaos.upgrade_check import compare_files, format_problems, upgrade_verdict, version_problems


def _digest(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


FILES = {f"/upgrade/f{i}": bytes([i]) * (100 + i) for i in range(4)}
EXPECTED = {path: _digest(data) for path, data in FILES.items()}


def _passing_report() -> dict[str, Any]:
    return {"failed": 0, "lost": [], "violations": [], "namespace_lost": [], "namespace_failed": 0,
            "file_problems": [], "files_checked": len(FILES), "fsck_clean": True, "version_problems": [],
            "format_problems": [], "workload_covered_upgrade": True}


def test_every_byte_read_back_passes() -> None:
    assert compare_files(EXPECTED, {path: _digest(data) for path, data in FILES.items()}) == []
    assert upgrade_verdict(_passing_report()) == []


def test_a_flipped_byte_a_short_file_and_a_missing_one_are_each_caught() -> None:
    observed = {path: _digest(data) for path, data in FILES.items()}
    flipped = bytearray(FILES["/upgrade/f0"])
    flipped[7] ^= 0x01
    observed["/upgrade/f0"] = _digest(bytes(flipped))
    observed["/upgrade/f1"] = _digest(FILES["/upgrade/f1"][:-1])
    observed["/upgrade/f2"] = {"error": "[Errno 2] No such file"}
    del observed["/upgrade/f3"]
    problems = compare_files(EXPECTED, observed)
    assert [p.split(":")[0] for p in problems] == sorted(FILES)
    assert "bytes differ" in problems[0] and "100 bytes, 101 were written" in problems[1]
    report = {**_passing_report(), "file_problems": problems}
    assert any("do not read back" in p for p in upgrade_verdict(report))


def _ops(final_value: int) -> dict[str, Any]:
    """Two acknowledged writes to one slot, then the slot as read at the end."""
    return {"ops": [
        {"kind": "write", "file": 0, "slot": 0, "value": 1, "invoke": 1.0, "complete": 2.0, "ok": True},
        {"kind": "write", "file": 0, "slot": 0, "value": 2, "invoke": 3.0, "complete": 4.0, "ok": True},
        {"kind": "read", "file": 0, "slot": 0, "invoke": 5.0, "complete": 6.0, "ok": True, "observed": 2},
    ], "final": {"0": [final_value]}}


def test_a_lost_acknowledged_write_fails_the_run() -> None:
    kept = check_history(_ops(2))
    assert kept["lost"] == [] and kept["failed"] == 0
    lost = check_history(_ops(1))  # the last acknowledged write (2) was dropped
    assert lost["lost"] and "last acknowledged write was 2" in lost["lost"][0]
    assert any("slot writes lost" in p for p in upgrade_verdict({**_passing_report(), **lost}))


def test_a_node_left_on_the_old_protocol_fails_the_run() -> None:
    new = {"name": "", "node_type": "storage", "node_id": 1, "framed_address": "a:1",
           "protocol_version": PROTOCOL_VERSION, "release": RELEASE}
    old = {**new, "node_id": 2, "protocol_version": 1, "release": ""}
    assert version_problems([new], PROTOCOL_VERSION, RELEASE) == []
    (problem,) = version_problems([new, old], PROTOCOL_VERSION, RELEASE)
    assert "storage 2" in problem and "protocol 1" in problem
    assert version_problems([], PROTOCOL_VERSION, RELEASE) == ["no node listed"]


def test_a_check_that_never_ran_is_a_failure_not_a_pass() -> None:
    report = _passing_report()
    for key in ("failed", "lost", "fsck_clean", "files_checked", "version_problems", "format_problems",
                "workload_covered_upgrade"):
        partial = {k: v for k, v in report.items() if k != key}
        assert upgrade_verdict(partial), f"a report without {key} passed"
    assert upgrade_verdict({**report, "failed": 3}) == ["3 client operations failed beyond their retries"]


def test_a_store_left_on_an_old_format_fails_the_run() -> None:
    current = {"found": 3, "current": 3, "pending": []}
    assert format_problems({"storage1/target-1": current, "mgmtd": {"found": 1, "current": 1, "pending": []}}) == []
    (problem,) = format_problems({"storage1/target-1": current,
                                  "storage2/target-1": {"found": 2, "current": 3, "pending": ["2->3: crc"]}})
    assert problem.startswith("storage2/target-1: format 2, current 3")
    assert format_problems({"meta": {"found": "unreadable: newer", "current": None, "pending": []}})
    assert format_problems({}) == ["no store checked"]


def test_a_workload_that_ended_before_the_restarts_fails_the_run() -> None:
    """A clean history of a workload that stopped before the first restart proves nothing about
    serving through the upgrade."""
    (problem,) = upgrade_verdict({**_passing_report(), "workload_covered_upgrade": False})
    assert "did not run through every restart" in problem


def test_a_node_missing_from_the_listing_after_the_upgrade_fails_the_run() -> None:
    """Only the living are listed alive: a node that died after its upgrade must not pass by absence."""
    entry = {"name": "", "node_type": "storage", "node_id": 1, "framed_address": "a:1", "alive": True,
             "protocol_version": PROTOCOL_VERSION, "release": RELEASE}
    listed = [{**entry, "host": "storage1"}, {**entry, "node_id": 2, "host": "storage2"}]
    assert version_problems(listed, PROTOCOL_VERSION, RELEASE, expected_hosts=("storage1", "storage2")) == []
    (problem,) = version_problems(listed, PROTOCOL_VERSION, RELEASE,
                                  expected_hosts=("storage1", "storage2", "storage3"))
    assert problem == "storage3: not listed alive after the upgrade"
