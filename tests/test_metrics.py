"""Metrics as an operator sees them: names, cluster gauges, scrape discovery, the dashboard and alert rules.

The in-process cluster serves every /metrics endpoint for real; the checks scrape them over HTTP,
as Prometheus would, and compare what the shipped dashboard and alert rules query with what fs3
exports, so a renamed metric cannot leave a dashboard panel or an alert silently empty.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

import fs3.aio
from fs3 import common_pb2 as cpb
from fs3 import mgmtd_pb2 as mgpb
from fs3.cluster.topology import META_NODE_ID
from fs3.common.metrics import file_sd_groups
from fs3.kv.store import MemKVStore
from fs3.mgmtd.metrics import cluster_families
from fs3.mgmtd.state import MgmtdState
from tests.conftest import wait_until
from tests.inproc import InProcessCluster

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "fs3.json"
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
# Series Prometheus itself makes for every scrape target (not exported by any process).
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
_UNITS = ("bytes", "seconds")


# -- helpers --------------------------------------------------------------------------------------

def scrape(address: str) -> list[Metric]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as rsp:
        return list(text_string_to_metric_families(rsp.read().decode()))


def series_names(families: list[Metric]) -> set[str]:
    """Every series name a query may use: samples seen, and those each family's type implies
    (a labelled counter or histogram nobody touched yet has no samples, but its name exists)."""
    names = {s.name for f in families for s in f.samples}
    for family in families:
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(family.name)
    return names


def value(families: list[Metric], name: str, **labels: str) -> float:
    """The one sample ``name`` with (at least) ``labels``."""
    found = [s.value for f in families for s in f.samples
             if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


def query_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label values and selectors' strings dropped)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\[[^\]]*\]", "", bare)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", bare))
    return {n for n in names if n.startswith(("fs3_", "process_", "python_")) or n in SCRAPE_SERIES}


def unknown_names(exprs: list[str], exported: set[str]) -> dict[str, set[str]]:
    """Each expression reading a name fs3 does not export, with those names."""
    bad = {e: query_metric_names(e) - exported - SCRAPE_SERIES for e in exprs}
    return {e: names for e, names in bad.items() if names}


def naming_problems(families: list[Metric]) -> list[str]:
    """Prometheus conventions: counters end in ``_total``, a unit is the name's last word (before
    ``_total``), no ``_created`` series."""
    problems = []
    for family in families:
        for sample in family.samples:
            if sample.name.endswith("_created"):
                problems.append(f"{sample.name}: a _created series")
            if family.type == "counter" and not sample.name.endswith("_total"):
                problems.append(f"{sample.name}: a counter not ending in _total")
        if family.name.startswith("fs3_"):
            words = family.name.split("_")
            for unit in _UNITS:
                if unit in words[:-1]:
                    problems.append(f"{family.name}: unit {unit!r} is not the last word")
    return problems


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


class _Ctx(SimpleNamespace):
    """What pyfuse3 hands a handler as the request context."""


# -- the checkers reject what they must -------------------------------------------------------------

def test_the_name_checks_reject_unknown_and_unconventional_names() -> None:
    exported = {"fs3_rpc_requests_total", "fs3_chain_serving_targets"}
    ok = 'sum by (method) (rate(fs3_rpc_requests_total{code!="OK",method="fs3_fake"}[5m]))'
    assert unknown_names([ok, "fs3_chain_serving_targets == 0", "up == 0"], exported) == {}
    typo = "rate(fs3_rpc_request_total[5m])"
    base = "rate(fs3_rpc_requests[5m])"  # a counter's name without its _total suffix is not a series
    assert unknown_names([typo, base], exported) == {typo: {"fs3_rpc_request_total"}, base: {"fs3_rpc_requests"}}
    text = ("# HELP fs3_x_bytes_read x\n# TYPE fs3_x_bytes_read counter\nfs3_x_bytes_read_total 1\n"
            "fs3_x_bytes_read_created 1\n")
    problems = naming_problems(list(text_string_to_metric_families(text)))
    assert any("_created" in p for p in problems) and any("'bytes' is not the last word" in p for p in problems)


def test_file_sd_lists_every_process_with_an_endpoint_and_labels_it() -> None:
    nodes = [cpb.NodeInfo(node_id=2, node_type=cpb.NODE_STORAGE, metrics_address="h2:9102", alive=False),
             cpb.NodeInfo(node_id=1, node_type=cpb.NODE_META, metrics_address="h1:9012"),
             cpb.NodeInfo(node_id=3, node_type=cpb.NODE_STORAGE)]  # serves no metrics: nothing to scrape
    assert file_sd_groups(nodes, "h0:9002") == [
        {"targets": ["h0:9002"], "labels": {"service": "mgmtd", "node_id": "0"}},
        {"targets": ["h1:9012"], "labels": {"service": "meta", "node_id": "1"}},
        {"targets": ["h2:9102"], "labels": {"service": "storage", "node_id": "2"}},
    ]
    assert file_sd_groups([], "") == []


def test_cluster_gauges_follow_node_expiry_and_chain_states() -> None:
    state = MgmtdState(MemKVStore(), heartbeat_timeout_ms=1_000)
    for node_id in (1, 2):
        state.heartbeat(mgpb.HeartbeatReq(
            node_id=node_id, node_type=cpb.NODE_STORAGE, framed_address=f"h{node_id}:1",
            targets=[mgpb.TargetHeartbeat(target_id=100 + node_id, local_state=cpb.UP_TO_DATE,
                                          capacity_bytes=1000, used_bytes=100 * node_id,
                                          free_bytes=500)]), now_ms=0)
    state.create_chain_table(mgpb.CreateChainTableReq(table_id=1, replicas=2))
    before = cluster_families(state, now_ms=500)
    assert value(before, "fs3_chains_degraded") == 0 and value(before, "fs3_chains_unavailable") == 0
    assert value(before, "fs3_target_public_state", target_id="101", state="serving") == 1
    assert value(before, "fs3_target_public_state", target_id="101", state="offline") == 0
    assert value(before, "fs3_node_used_bytes", node_id="2") == 200
    assert value(before, "fs3_cluster_capacity_bytes") == 2000 and value(before, "fs3_cluster_used_bytes") == 300
    assert value(before, "fs3_cluster_free_bytes") == 1000 and value(before, "fs3_node_free_bytes", node_id="1") == 500
    assert value(before, "fs3_node_heartbeat_age_seconds", node_id="1") == 0.5
    # Node 1 goes silent: past the timeout it is dead, its target offline, the chain degraded.
    state.heartbeat(mgpb.HeartbeatReq(node_id=2, node_type=cpb.NODE_STORAGE, framed_address="h2:1",
                                      targets=[mgpb.TargetHeartbeat(target_id=102, local_state=cpb.UP_TO_DATE,
                                                                    capacity_bytes=1000, used_bytes=200)]), 1_500)
    state.scan(1_500)
    after = cluster_families(state, now_ms=1_500)
    assert value(after, "fs3_node_alive", node_id="1", service="storage") == 0
    assert value(after, "fs3_node_alive", node_id="2") == 1
    assert value(after, "fs3_target_public_state", target_id="101", state="offline") == 1
    assert value(after, "fs3_target_public_state", target_id="101", state="serving") == 0
    assert value(after, "fs3_target_local_state", target_id="101", state="offline") == 1
    assert value(after, "fs3_chains_degraded") == 1 and value(after, "fs3_chains_unavailable") == 0
    chain = str(state.targets[101].info.chain_id)
    assert value(after, "fs3_chain_serving_targets", chain_id=chain) == 1
    assert value(after, "fs3_chain_targets", chain_id=chain) == 2


# -- a running cluster, scraped ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_running_cluster_exports_what_the_dashboard_and_alerts_query(tmp_path: Path) -> None:
    from fs3.common.metrics import MountMetrics
    from fs3.fuse.ops import FS3Operations
    from fs3.vfs import Vfs

    async def main() -> None:
        async with InProcessCluster(tmp_path, with_meta=True, serve_metrics=True) as cluster:
            admin = cluster.admin()
            groups = await admin.metrics_targets()
            by_service = sorted((g["labels"]["service"], g["labels"]["node_id"]) for g in groups)  # type: ignore[index]
            assert by_service == [("meta", str(META_NODE_ID)), ("mgmtd", "0"), ("storage", "1"), ("storage", "2"),
                                  ("storage", "3")], by_service
            fs = await fs3.aio.connect(cluster.mgmtd_address, token=cluster.token, metrics_port=0)
            try:
                assert fs.metrics_address is not None
                data = os.urandom(3 * 1024 * 1024 + 5)
                async with await fs.open("/f.bin", "wb") as out:
                    await out.write(data)
                async with await fs.open("/f.bin", "rb") as src:
                    while await src.read(256 * 1024):
                        pass
                # The mount's handlers, over the same client (what pyfuse3 would call).
                ops = FS3Operations(Vfs(fs), metrics=MountMetrics(fs.metrics.registry))
                ctx = _Ctx(pid=os.getpid(), uid=0, gid=0)
                await ops.getattr(1, ctx)
                await ops.getattr(1, ctx)  # from the attribute cache
                with pytest.raises(Exception) as missing:
                    await ops.lookup(1, b"no-such-name", ctx)
                assert getattr(missing.value, "errno", None) == 2
                client = await asyncio.to_thread(scrape, fs.metrics_address)
            finally:
                await fs.close()
            mgmtd_address = next(g["targets"][0] for g in groups  # type: ignore[index]
                                 if g["labels"]["service"] == "mgmtd")  # type: ignore[index]

            async def all_serving() -> list[Metric] | None:
                fams = await asyncio.to_thread(scrape, mgmtd_address)
                ok = any(f.name == "fs3_chain_serving_targets" and f.samples
                         and all(s.value == 3 for s in f.samples) for f in fams)
                return fams if ok and value(fams, "fs3_cluster_used_bytes") >= 3 * len(data) else None

            mgmtd = await wait_until(all_serving, timeout_s=10, what="cluster gauges")
            services = [await asyncio.to_thread(scrape, g["targets"][0]) for g in groups]  # type: ignore[index]

            # Every process: conventional names and process metrics.
            for families in [*services, client]:
                assert naming_problems(families) == []
                assert "process_cpu_seconds_total" in series_names(families)
                assert "process_resident_memory_bytes" in series_names(families)
            # Cluster gauges.
            assert value(mgmtd, "fs3_chains_unavailable") == 0 and value(mgmtd, "fs3_chains_degraded") == 0
            assert value(mgmtd, "fs3_cluster_capacity_bytes") > value(mgmtd, "fs3_cluster_free_bytes") > 0
            assert sum(s.value for f in mgmtd if f.name == "fs3_target_public_state" for s in f.samples
                       if s.labels["state"] == "serving") == 3
            # The client and its mount.
            assert value(client, "fs3_client_written_bytes_total") == len(data)
            assert value(client, "fs3_client_read_bytes_total") == len(data)
            assert value(client, "fs3_client_cache_hits_total", cache="readahead") \
                + value(client, "fs3_client_cache_misses_total", cache="readahead") > 1
            assert value(client, "fs3_fuse_ops_total", op="getattr") == 2
            assert value(client, "fs3_client_cache_hits_total", cache="attr") >= 1
            assert value(client, "fs3_fuse_op_errors_total", op="lookup", errno="ENOENT") == 1
            assert value(client, "fs3_fuse_op_duration_seconds_count", op="lookup") == 1
            # Meta's job queues (exported by its maintenance pass).
            meta = services[[g["labels"]["service"] for g in groups].index("meta")]  # type: ignore[index]
            assert "fs3_meta_gc_queue_files" in series_names(meta)

            # Every name the dashboard and the alert rules read exists.
            exported = set().union(*(series_names(f) for f in [*services, client]))
            assert unknown_names(dashboard_exprs(), exported) == {}
            assert unknown_names(alert_exprs(), exported) == {}

            # A storage node that stops heartbeating shows in the gauges the alerts read.
            await cluster.nodes[3].stop()
            target_id = next(iter(cluster.nodes[3].engines))

            async def node_dead() -> list[Metric] | None:
                fams = await asyncio.to_thread(scrape, mgmtd_address)
                return fams if value(fams, "fs3_node_alive", node_id="3") == 0 else None

            after = await wait_until(node_dead, timeout_s=10, what="a dead node in the gauges")
            assert value(after, "fs3_target_public_state", target_id=str(target_id), state="offline") == 1
            assert value(after, "fs3_chains_degraded") == 1 and value(after, "fs3_chains_unavailable") == 0
            assert value(after, "fs3_node_heartbeat_age_seconds", node_id="3") >= 2

    asyncio.run(main())


# -- the shipped rules and dashboard ---------------------------------------------------------------

def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian package prometheus; scripts/bootstrap.sh installs it "
                    "when run as root): the alert rules are not checked")
    return path


def test_alert_rules_pass_promtool_and_their_unit_tests(tmp_path: Path) -> None:
    promtool = _promtool()
    for args in (["check", "rules", "alerts.yml"], ["check", "config", "prometheus.yml"],
                 ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run([promtool, *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    names = {r["alert"] for g in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]
             for r in g["rules"]}
    assert {"FS3ChainNotServing", "FS3TargetOffline", "FS3NodeMissingHeartbeats", "FS3TargetSpaceLow"} <= names
    # promtool is no rubber stamp: a rule with a broken expression is refused.
    broken = tmp_path / "broken.yml"
    broken.write_text("groups:\n  - name: x\n    rules:\n      - alert: X\n        expr: fs3_chains_degraded >\n")
    done = subprocess.run([promtool, "check", "rules", str(broken)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_dashboard_is_grafana_json_with_a_query_in_every_panel() -> None:
    dashboard: dict[str, Any] = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "fs3" and dashboard["uid"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 20 and all(p.get("targets") and all(t["expr"] for t in p["targets"]) for p in panels)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
