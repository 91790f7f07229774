"""``make chaos``'s runner: a scenario that fails is recorded and the others still run; the report
is always written, with each scenario's status; the exit status says whether any failed.

No namespaces here: the scenarios are replaced by stand-ins.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("yaml")

from tests.chaos import run as chaos_run
from tests.chaos.scenarios import Scenario


def _measured(name: str) -> dict[str, Any]:
    return {"scenario": name, "faults": [{"at": 2.0, "fault": "something"}], "operations": 100, "acknowledged": 99,
            "violations": [], "lost": [], "worst_gap_s": 0.1, "worst_stall_s": 0.2, "failed": 1,
            "replicas_identical": True, "fsck_clean": True, "verify": ["all replicas identical"],
            "fsck": ["namespace clean"], "started": 0.0, "timeline": [(0.0, 10, 0), (0.5, 12, 1)], "lease": None,
            "ok": True}


def test_runner_goes_on_after_a_failed_scenario_and_reports_it(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def fake_run(scenario: Scenario, root: Path, report: dict[str, Any] | None = None) -> dict[str, Any]:
        ran.append(scenario.name)
        report = {} if report is None else report
        report.update({"scenario": scenario.name, "faults": [{"at": 2.0, "fault": "fill the disk"}]})
        if scenario.name == "breaks":
            raise RuntimeError("chains did not all return to serving")
        if scenario.name == "differs":
            report.update({**_measured(scenario.name), "replicas_identical": False, "ok": False})
            return report
        report.update(_measured(scenario.name))
        return report

    scenarios = {name: Scenario(name, 1) for name in ("first", "breaks", "differs", "last")}
    monkeypatch.setattr(chaos_run, "SCENARIOS", scenarios)
    monkeypatch.setattr(chaos_run, "run_scenario", fake_run)
    monkeypatch.setattr(sys, "argv", ["run", "--scenarios", "first,breaks,differs,last", "--out", str(tmp_path)])
    status = chaos_run.main()
    assert status == 1
    assert ran == ["first", "breaks", "differs", "last"]  # the failures did not stop the run
    [md] = tmp_path.glob("chaos-*.md")
    [js] = tmp_path.glob("chaos-*.json")
    reports = {r["scenario"]: r for r in json.loads(js.read_text())}
    assert [r["status"] for r in reports.values()] == ["ok", "failed", "failed", "ok"]
    assert "chains did not all return to serving" in reports["breaks"]["error"]
    assert reports["breaks"]["faults"] == [{"at": 2.0, "fault": "fill the disk"}]  # measured before it broke
    assert reports["differs"]["error"] == "replicas differ"
    text = md.read_text()
    assert "2 of 4 scenarios passed; FAILED: breaks, differs." in text
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    assert "**FAILED**" in rows["breaks"] and "**FAILED**" in rows["differs"]
    assert " ok " in rows["first"] and " ok " in rows["last"]
    assert "RuntimeError: chains did not all return to serving" in text


def test_runner_exits_zero_when_every_scenario_passes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fake_run(scenario: Scenario, root: Path, report: dict[str, Any] | None = None) -> dict[str, Any]:
        report = {} if report is None else report
        report.update(_measured(scenario.name))
        return report

    monkeypatch.setattr(chaos_run, "SCENARIOS", {"only": Scenario("only", 1)})
    monkeypatch.setattr(chaos_run, "run_scenario", fake_run)
    monkeypatch.setattr(sys, "argv", ["run", "--out", str(tmp_path)])
    assert chaos_run.main() == 0
    assert "1 of 1 scenarios passed." in next(tmp_path.glob("chaos-*.md")).read_text()


def _ns_op(kind: str, name: str, ok: bool) -> dict[str, Any]:
    return {"kind": kind, "name": name, "ok": ok, "invoke": 1.0, "complete": 2.0 if ok else None}


def test_the_metadata_ledger_catches_lost_and_phantom_operations() -> None:
    """check_namespace: an acknowledged create must be there (with its own contents), an
    acknowledged remove must be gone, a name nobody created must not appear; unacknowledged
    operations may have happened or not."""
    from tests.chaos.cluster import check_namespace

    ops = [_ns_op("create", "w0-1", True), _ns_op("create", "w0-2", True), _ns_op("remove", "w0-1", True),
           _ns_op("create", "w0-4", False), _ns_op("create", "w1-1", True), _ns_op("remove", "w1-1", False)]
    clean = check_namespace({"namespace": {"ops": ops, "final": {"w0-2": "w0-2", "w0-4": "w0-4"}}})
    assert clean["namespace_lost"] == [] and clean["namespace_acknowledged"] == 4 and clean["namespace_failed"] == 2
    lost = check_namespace({"namespace": {"ops": ops, "final": {"w0-1": "w0-1", "w0-2": "", "w9-9": "w9-9"}}})
    assert lost["namespace_lost"] == ["w0-1: its remove was acknowledged, it is still there",
                                      "w0-2: holds '', not its name", "w9-9: there, never created"]
    gone = check_namespace({"namespace": {"ops": ops, "final": {}}})
    assert gone["namespace_lost"] == ["w0-2: its create was acknowledged, it is gone"]
