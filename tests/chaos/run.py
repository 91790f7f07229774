"""``make chaos``: every scenario on a fresh namespace cluster; a Markdown + JSON report and a PNG timeline.

Usage: ``python -m tests.chaos.run [--scenarios a,b] [--out DIR]``. Needs root (network namespaces).
Exit status 1 when any scenario loses data, breaks linearizability, or leaves replicas different.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.chaos.cluster import LabCluster, check_history
from tests.chaos.netns import NetnsLab
from tests.chaos.scenarios import SCENARIOS, Scenario
from tests.chaos.topology import ROOT

FAST = {"FS3_MGMTD_HEARTBEAT_TIMEOUT_MS": "3000", "FS3_STORAGE_HEARTBEAT_INTERVAL_MS": "200",
        "FS3_META_HEARTBEAT_INTERVAL_MS": "200"}


def run_scenario(scenario: Scenario, root: Path) -> dict[str, Any]:
    faults: list[dict[str, object]] = []
    with NetnsLab() as lab:
        cluster = LabCluster(lab, root, FAST, scenario.small_disks, scenario.ext4_disks)
        try:
            return _run(scenario, cluster, root, faults)
        finally:
            cluster.close()


def _run(scenario: Scenario, cluster: LabCluster, root: Path, faults: list[dict[str, object]]) -> dict[str, Any]:
    cluster.start_all()
    out = root / "workload.json"
    started = time.monotonic()
    workload = cluster.client_spawn([sys.executable, "-P", "-m", "tests.chaos.workload", cluster.mgmtd,
                                     cluster.token, str(scenario.seconds), str(out)], root / "workload.log")
    scenario.run_faults(cluster, started, faults)
    if workload.wait(timeout=scenario.seconds + 300) != 0:
        raise RuntimeError(f"workload failed:\n{(root / 'workload.log').read_text()[-3000:]}")
    result = json.loads(out.read_text())
    checks = check_history(result)
    cluster.wait_all_serving()
    verify = cluster.admin("verify")
    fsck = cluster.admin("fsck")
    report = {"scenario": scenario.name, "faults": faults, **checks,
              "replicas_identical": verify.returncode == 0, "fsck_clean": fsck.returncode == 0,
              "verify": verify.stdout.strip().splitlines()[-1:], "fsck": fsck.stdout.strip().splitlines()[-1:],
              "started": started, "timeline": _timeline(result, started)}
    filler = root / "filler.log"
    if filler.exists():
        report["filler"] = filler.read_text()[-500:]
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
    report["ok"] = (not checks["violations"] and not checks["lost"] and report["replicas_identical"]
                    and report["fsck_clean"] and (report["lease"] is None or report["lease"]["ok"]))
    return report


def _timeline(result: dict[str, Any], started: float) -> list[tuple[float, int, int]]:
    """Per half second: acknowledged operations and failed ones."""
    buckets: dict[int, list[int]] = {}
    for op in result["ops"]:
        at = (op["complete"] if op["ok"] else op["invoke"]) - started
        bucket = buckets.setdefault(int(at * 2), [0, 0])
        bucket[0 if op["ok"] else 1] += 1
    last = max(buckets, default=0)
    return [(k / 2, *buckets.get(k, [0, 0])) for k in range(last + 1)]  # empty half-seconds are zeros


def _png(reports: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(len(reports), 1, figsize=(10, 2.2 * len(reports)), squeeze=False)
    for ax, report in zip(axes[:, 0], reports, strict=True):
        times = [t for t, _, _ in report["timeline"]]
        ax.plot(times, [2 * ok for _, ok, _ in report["timeline"]], label="acknowledged ops/s")
        ax.plot(times, [2 * bad for _, _, bad in report["timeline"]], label="failed ops/s", color="red")
        for fault in report["faults"]:
            ax.axvline(float(fault["at"]), color="gray", linestyle="--")  # type: ignore[arg-type]
            ax.text(float(fault["at"]), ax.get_ylim()[1] * 0.8, str(fault["fault"]), fontsize=6, rotation=90)  # type: ignore[arg-type]
        ax.set_title(report["scenario"], fontsize=9)
        ax.set_xlabel("seconds")
    axes[0, 0].legend(fontsize=7)
    fig.subplots_adjust(hspace=0.9)
    fig.savefig(path, dpi=90)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    parser.add_argument("--keep", metavar="DIR", help="run each scenario under DIR/<scenario> and keep its logs")
    args = parser.parse_args()
    reports = []
    for name in args.scenarios.split(","):
        print(f"chaos: {name} ...", flush=True)
        if args.keep:
            work = Path(args.keep) / name
            shutil.rmtree(work, ignore_errors=True)
            report = run_scenario(SCENARIOS[name], work)
        else:
            with tempfile.TemporaryDirectory(prefix=f"fs3-chaos-{name}-") as tmp:
                report = run_scenario(SCENARIOS[name], Path(tmp))
        reports.append(report)
        print(f"  {'ok' if report['ok'] else 'FAILED'}: {report['operations']} ops, "
              f"{len(report['violations'])} linearizability violations, {len(report['lost'])} lost, "
              f"longest client stall {report['worst_stall_s']:.2f} s", flush=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"chaos-{stamp}.json").write_text(json.dumps(reports, indent=2))
    lines = [f"# fs3 chaos report {stamp}", "",
             "| scenario | faults | operations | linearizability violations | bytes lost | replicas identical | "
             "fsck | longest client stall (s) | longest time with no op completing (s) | node cut from mgmtd refused "
             "after (s) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in reports:
        lines.append(f"| {r['scenario']} | {'; '.join(str(f['fault']) for f in r['faults'])} | {r['operations']} | "
                     f"{len(r['violations'])} | {4096 * len(r['lost'])} | {r['replicas_identical']} | "
                     f"{'clean' if r['fsck_clean'] else 'PROBLEMS'} | {r['worst_stall_s']:.2f} | "
                     f"{r['worst_gap_s']:.2f} | "
                     f"{'' if not r['lease'] else format(r['lease']['refused_after_s'] or -1, '.2f')} |")
    if _png(reports, out / f"chaos-{stamp}.png"):
        lines += ["", f"![timeline](chaos-{stamp}.png)"]
    (out / f"chaos-{stamp}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / f'chaos-{stamp}.md'}")
    return 0 if all(r["ok"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
