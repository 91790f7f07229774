"""``make chaos``: every scenario on a fresh namespace cluster; a Markdown + JSON report and a PNG timeline.

Usage: ``python -m tests.chaos.run [--scenarios a,b] [--out DIR]``. Needs root (network namespaces).
A scenario that cannot finish (a service that does not come back, a workload that dies) is recorded
as failed, with its error and what it measured, and the next one runs; the report is always
written. Exit status 1 when any scenario failed: it could not finish, lost data, broke
linearizability, or left replicas different.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from tests.chaos.cluster import LabCluster, check_history, check_namespace, stalled_after
from tests.chaos.netns import NetnsLab
from tests.chaos.scenarios import SCENARIOS, Scenario
from tests.chaos.topology import ROOT

FAST = {"FS3_MGMTD_HEARTBEAT_TIMEOUT_MS": "3000", "FS3_STORAGE_HEARTBEAT_INTERVAL_MS": "200",
        "FS3_META_HEARTBEAT_INTERVAL_MS": "200"}
# Several mgmtd: a takeover (a lease and a renewal) must fit in half the heartbeat timeout.
HA_FAST = {**FAST, "FS3_MGMTD_LEASE_MS": "1000", "FS3_MGMTD_LEASE_RENEW_INTERVAL_MS": "250",
           "FS3_MGMTD_LEASE_DRIFT_MARGIN_MS": "100"}


def run_scenario(scenario: Scenario, root: Path, report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one scenario on a fresh cluster and return its report; raises when it cannot finish.

    ``report`` (optional) is filled in as the run goes, so that a caller that catches the error
    still has whatever was measured before it (see :func:`run_recorded`).
    """
    report = {} if report is None else report
    report.update({"scenario": scenario.name, "faults": []})
    with NetnsLab() as lab:
        report["run_id"] = lab.run_id  # its namespaces are fs3-<run_id>-<host>, its switch fs3sw-<run_id>
        cluster = LabCluster(lab, root, HA_FAST if scenario.profile == "ha" else FAST, scenario.small_disks,
                             scenario.ext4_disks, profile=scenario.profile)
        try:
            return _run(scenario, cluster, root, report)
        finally:
            cluster.close()


def run_recorded(scenario: Scenario, root: Path) -> dict[str, Any]:
    """Run one scenario and never raise: a scenario that could not finish is a report with
    ``status: "failed"``, its error, and what it measured until then."""
    report: dict[str, Any] = {}
    try:
        run_scenario(scenario, root, report)
    except Exception as exc:
        report.update({"scenario": scenario.name, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-4000:]})
        for name in ("filler.log", "workload.log", "meta_probe.log"):
            log = root / name
            if log.exists() and name.split(".")[0] not in report:
                report[name.split(".")[0]] = log.read_text(errors="replace")[-1000:]
    report["status"] = "ok" if report.get("ok") else "failed"
    if report["status"] == "failed" and "error" not in report:
        report["error"] = "; ".join(_broken_promises(report))
    return report


def _broken_promises(report: dict[str, Any]) -> list[str]:
    """Why a scenario that ran to the end failed, in words."""
    broken = []
    if report.get("violations"):
        broken.append(f"{len(report['violations'])} linearizability violations")
    if report.get("lost"):
        broken.append(f"{len(report['lost'])} acknowledged writes lost")
    if report.get("replicas_identical") is False:
        broken.append("replicas differ")
    if report.get("fsck_clean") is False:
        broken.append("fsck found problems")
    if report.get("lease") and not report["lease"].get("ok"):
        broken.append("the node cut from mgmtd kept serving past its lease")
    if report.get("namespace_lost"):
        broken.append(f"{len(report['namespace_lost'])} acknowledged metadata operations lost")
    if report.get("takeover") and not report["takeover"].get("ok"):
        broken.append("no standby mgmtd took over within lease + heartbeat timeout")
    if report.get("meta_probe") and not report["meta_probe"].get("ok"):
        broken.append("the meta server cut from its database answered (or never answered again)")
    if report.get("continued") is False:
        broken.append(f"acknowledged nothing after the last fault: {', '.join(report.get('stalled') or [])}")
    return broken or ["failed"]


def _run(scenario: Scenario, cluster: LabCluster, root: Path, report: dict[str, Any]) -> dict[str, Any]:
    cluster.start_all()
    out = root / "workload.json"
    started = time.monotonic()
    report["started"] = started
    workload = cluster.client_spawn([sys.executable, "-P", "-m", "tests.chaos.workload", cluster.mgmtd,
                                     cluster.token, str(scenario.seconds), str(out),
                                     *(["namespace"] if scenario.namespace else [])], root / "workload.log")
    scenario.run_faults(cluster, started, report["faults"])
    if workload.wait(timeout=scenario.seconds + 300) != 0:
        raise RuntimeError(f"workload failed:\n{(root / 'workload.log').read_text()[-3000:]}")
    result = json.loads(out.read_text())
    report.update(check_history(result))
    if scenario.namespace:
        report.update(check_namespace(result))
    report["timeline"] = _timeline(result, started)
    if report["faults"]:
        # Clients carry on: operations acknowledged that were invoked after the last fault.
        last = started + max(float(str(f["at"])) for f in report["faults"])
        report["stalled"] = stalled_after(result, last)
        report["continued"] = not report["stalled"]
    filler = root / "filler.log"
    if filler.exists():
        report["filler"] = filler.read_text()[-500:]
    cluster.wait_all_serving()
    verify = _settled(cluster, "verify")
    fsck = _settled(cluster, "fsck")
    # The last line says it; when something is wrong, the lines before it say what.
    report.update({"replicas_identical": verify.returncode == 0, "fsck_clean": fsck.returncode == 0,
                   "verify": verify.stdout.strip().splitlines()[-1 if verify.returncode == 0 else -40:],
                   "fsck": fsck.stdout.strip().splitlines()[-1 if fsck.returncode == 0 else -40:]})
    probe = root / "probe.json"
    lease_s = int(FAST["FS3_MGMTD_HEARTBEAT_TIMEOUT_MS"]) / 2000
    if probe.exists():
        # Split brain: the node cut from mgmtd must refuse service within half the heartbeat timeout
        # (plus one heartbeat interval of slack: the lease started at the last heartbeat it sent).
        report["lease"] = json.loads(probe.read_text())
        refused = report["lease"]["refused_after_s"]
        report["lease"]["ok"] = refused is not None and refused <= lease_s + 0.5
    else:
        report["lease"] = None
    report["meta_killed"] = cluster.notes.get("meta_killed")
    report["takeover"] = _takeover(cluster)
    report["meta_probe"] = _meta_probe(cluster, result)
    report["ok"] = (not report["violations"] and not report["lost"] and report["replicas_identical"]
                    and report["fsck_clean"] and (report["lease"] is None or report["lease"]["ok"])
                    and not report.get("namespace_lost") and report.get("continued", True) is not False
                    and (report["takeover"] is None or report["takeover"]["ok"])
                    and (report["meta_probe"] is None or report["meta_probe"]["ok"]))
    return report


def _takeover(cluster: LabCluster) -> dict[str, Any] | None:
    """A killed primary mgmtd: a standby must take the lease within lease + heartbeat timeout of the
    kill (the bound storage nodes ride through), plus the log watcher's 50 ms poll."""
    takeover = cluster.notes.get("takeover")
    if takeover is None:
        return None
    env = cluster.env_for(str(takeover["killed"]))
    bound_s = (int(env["FS3_MGMTD_LEASE_MS"]) + int(env["FS3_MGMTD_HEARTBEAT_TIMEOUT_MS"])) / 1000
    after = takeover["after_s"]
    return {**takeover, "bound_s": bound_s, "ok": after is not None and after <= bound_s + 0.1}


def _meta_probe(cluster: LabCluster, result: dict[str, Any]) -> dict[str, Any] | None:
    """A meta server cut from its database: it answered before the cut, answers nothing invoked
    while cut (an answer could only come from what it read before: stale), and answers again after
    the partition healed; meanwhile the others serve (metadata operations invoked while it was cut
    were acknowledged)."""
    notes = cluster.notes.get("meta_probe")
    path = cluster.root / "meta_probe.json"
    if notes is None:
        return None
    deadline = time.monotonic() + 30
    while not path.exists() and time.monotonic() < deadline:  # the probe may still be finishing
        time.sleep(0.2)
    if not path.exists():
        return {**notes, "ok": False, "error": "the probe wrote no result"}
    attempts = json.loads(path.read_text())["attempts"]
    cut, heal = notes["cut_at"], notes["heal_at"]
    before = [a for a in attempts if a["complete"] < cut]
    during = [a for a in attempts if cut <= a["invoke"] and a["complete"] < heal]
    after = [a for a in attempts if a["invoke"] > heal]
    stale = [a for a in during if a["answered"]]
    summary = {"meta": notes["meta"], "answered_before_cut": sum(a["answered"] for a in before),
               "attempts_while_cut": len(during), "answered_while_cut": len(stale),
               "answered_after_heal": sum(a["answered"] for a in after),
               "outcomes_while_cut": sorted({a["outcome"] for a in during}),
               "others_served_while_cut": sum(1 for op in result.get("namespace", {}).get("ops", [])
                                              if op["ok"] and cut <= op["invoke"] < heal)}
    summary["ok"] = (summary["answered_before_cut"] > 0 and len(during) > 0 and not stale
                     and summary["answered_after_heal"] > 0 and summary["others_served_while_cut"] > 0)
    return summary


def _settled(cluster: LabCluster, command: str, attempts: int = 10) -> subprocess.CompletedProcess[str]:
    """An after-run check, repeated (a second apart) while it fails: right after the run, removals
    the meta service's GC still has in flight leave a chunk on some replicas of its chain for a
    moment. A real difference stays through every attempt."""
    done = cluster.admin(command)
    for _ in range(attempts - 1):
        if done.returncode == 0:
            break
        time.sleep(1)
        done = cluster.admin(command)
    return done


def _timeline(result: dict[str, Any], started: float) -> list[tuple[float, int, int]]:
    """Per half second: acknowledged operations and failed ones."""
    buckets: dict[int, list[int]] = {}
    for op in result["ops"]:
        at = (op["complete"] if op["ok"] else op["invoke"]) - started
        bucket = buckets.setdefault(int(at * 2), [0, 0])
        bucket[0 if op["ok"] else 1] += 1
    last = max(buckets, default=0)
    rows: list[tuple[float, int, int]] = []
    for k in range(last + 1):
        ok, failed = buckets.get(k, [0, 0])  # empty half-seconds are zeros
        rows.append((k / 2, ok, failed))
    return rows


def _png(reports: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(reports), 1, figsize=(10, 2.2 * len(reports)), squeeze=False)
    for ax, report in zip(axes[:, 0], reports, strict=True):
        timeline = report.get("timeline") or []
        times = [t for t, _, _ in timeline]
        ax.plot(times, [2 * ok for _, ok, _ in timeline], label="acknowledged ops/s")
        ax.plot(times, [2 * bad for _, _, bad in timeline], label="failed ops/s", color="red")
        for fault in report.get("faults", []):
            ax.axvline(float(fault["at"]), color="gray", linestyle="--")
            ax.text(float(fault["at"]), ax.get_ylim()[1] * 0.8, str(fault["fault"]), fontsize=6, rotation=90)
        title = report["scenario"]
        if report.get("status") != "ok":
            title += f" — FAILED: {str(report.get('error', ''))[:100]}"
        ax.set_title(title, fontsize=9, color="black" if report.get("status") == "ok" else "red")
        ax.set_xlabel("seconds")
    axes[0, 0].legend(fontsize=7)
    fig.subplots_adjust(hspace=0.9)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def _cell(report: dict[str, Any], key: str, fmt: str = "{}") -> str:
    value = report.get(key)
    return "—" if value is None else fmt.format(value)


def _markdown(reports: list[dict[str, Any]], stamp: str, png: bool) -> str:
    failed = [r["scenario"] for r in reports if r["status"] != "ok"]
    lines = [f"# fs3 chaos report {stamp}", "",
             f"{len(reports) - len(failed)} of {len(reports)} scenarios passed"
             + (f"; FAILED: {', '.join(failed)}" if failed else "") + ".", "",
             "| scenario | status | faults | operations | linearizability violations | bytes lost | "
             "replicas identical | fsck | longest client stall (s) | longest time with no op completing (s) | "
             "node cut from mgmtd refused after (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        status = "ok" if r["status"] == "ok" else "**FAILED**"
        fsck = "—" if r.get("fsck_clean") is None else ("clean" if r["fsck_clean"] else "PROBLEMS")
        lease = r.get("lease")
        lines.append(
            f"| {r['scenario']} | {status} | {'; '.join(str(f['fault']) for f in r.get('faults', []))} | "
            f"{_cell(r, 'operations')} | "
            f"{'—' if r.get('violations') is None else len(r['violations'])} | "
            f"{'—' if r.get('lost') is None else 4096 * len(r['lost'])} | {_cell(r, 'replicas_identical')} | "
            f"{fsck} | {_cell(r, 'worst_stall_s', '{:.2f}')} | {_cell(r, 'worst_gap_s', '{:.2f}')} | "
            f"{'' if not lease else format(lease['refused_after_s'] or -1, '.2f')} |")
    ha = [r for r in reports if any(r.get(k) is not None for k in ("namespace_operations", "takeover", "meta_probe"))]
    if ha:
        lines += ["", "## Metadata and mgmtd (the `ha` profile)", "",
                  "| scenario | metadata ops (acknowledged) | metadata ops lost | longest metadata op (s) | "
                  "mgmtd takeover (s, bound) | meta cut from its database: answered before / while cut / after heal |",
                  "|---|---|---|---|---|---|"]
        for r in ha:
            takeover, probe = r.get("takeover"), r.get("meta_probe")
            lost = r.get("namespace_lost")
            took = "—" if not takeover else f"{takeover.get('after_s')} ({takeover.get('bound_s')})"
            cut = "—" if not probe else (f"{probe.get('answered_before_cut')} / {probe.get('answered_while_cut')} / "
                                         f"{probe.get('answered_after_heal')}")
            lines.append(f"| {r['scenario']} | {_cell(r, 'namespace_operations')} "
                         f"({_cell(r, 'namespace_acknowledged')}) | {'—' if lost is None else len(lost)} | "
                         f"{_cell(r, 'namespace_worst_stall_s', '{:.2f}')} | {took} | {cut} |")
    if failed:
        lines += ["", "## Failures", ""]
        for r in reports:
            if r["status"] != "ok":
                error = str(r.get("error", "")).replace("\n", " ")
                lines.append(f"- **{r['scenario']}**: {error[:1500]}")
    if png:
        lines += ["", f"![timeline](chaos-{stamp}.png)"]
    return "\n".join(lines) + "\n"


def write_report(reports: list[dict[str, Any]], out: Path) -> Path:
    """The Markdown, JSON and PNG report of the scenarios run so far; returns the Markdown's path."""
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"chaos-{stamp}.json").write_text(json.dumps(reports, indent=2, default=str))
    try:
        png = _png(reports, out / f"chaos-{stamp}.png")
    except Exception as exc:  # a plot must not cost the report
        print(f"chaos: no timeline plot: {exc}", flush=True)
        png = False
    md = out / f"chaos-{stamp}.md"
    md.write_text(_markdown(reports, stamp, png))
    return md


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios one after the other; one that fails is recorded and the rest still run.
    The report is always written. Exit status 1 when any scenario failed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--keep", metavar="DIR", help="run each scenario under DIR/<scenario> and keep its logs")
    args = parser.parse_args(argv)
    names = args.scenarios.split(",")
    unknown = [name for name in names if name not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenarios: {', '.join(unknown)} (known: {', '.join(SCENARIOS)})")
    reports: list[dict[str, Any]] = []
    try:
        for name in names:
            print(f"chaos: {name} ...", flush=True)
            if args.keep:
                work = Path(args.keep) / name
                shutil.rmtree(work, ignore_errors=True)
                report = run_recorded(SCENARIOS[name], work)
            else:
                with tempfile.TemporaryDirectory(prefix=f"fs3-chaos-{name}-") as tmp:
                    report = run_recorded(SCENARIOS[name], Path(tmp))
            reports.append(report)
            if report["status"] == "ok":
                print(f"  ok: {report['operations']} ops, {len(report['violations'])} linearizability violations, "
                      f"{len(report['lost'])} lost, longest client stall {report['worst_stall_s']:.2f} s", flush=True)
            else:
                print(f"  FAILED: {report['error']}", flush=True)
    finally:
        md = write_report(reports, Path(args.out))
        print(f"wrote {md}", flush=True)
    return 0 if reports and all(r["status"] == "ok" for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
