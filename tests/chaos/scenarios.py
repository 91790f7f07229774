"""Fault scenarios: each a timeline of faults applied to a LabCluster while a workload runs."""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tests.chaos.cluster import LabCluster

__all__ = ["SCENARIOS", "Scenario"]


@dataclass
class Scenario:
    name: str
    seconds: float
    # (at seconds into the run, description, action)
    steps: list[tuple[float, str, Callable[[LabCluster], None]]] = field(default_factory=list)
    small_disks: dict[str, int] = field(default_factory=dict)  # service -> bytes of tmpfs per target
    ext4_disks: dict[str, int] = field(default_factory=dict)  # service -> bytes of ext4 image per target
    profile: str = "default"  # the compose topology: default, or ha (PostgreSQL, 3 mgmtd, 3 meta)
    namespace: bool = False  # the workload also creates and removes files (the meta servers' ledger)

    def run_faults(self, cluster: LabCluster, started: float, log: list[dict[str, object]]) -> None:
        for at, what, action in sorted(self.steps, key=lambda s: s[0]):
            delay = started + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            action(cluster)
            log.append({"at": round(time.monotonic() - started, 3), "fault": what})


def _kill(name: str) -> Callable[[LabCluster], None]:
    return lambda c: c.signal(name, signal.SIGKILL)


def _start(name: str) -> Callable[[LabCluster], None]:
    return lambda c: c.start(name)


def _stop(name: str) -> Callable[[LabCluster], None]:
    return lambda c: c.signal(name, signal.SIGSTOP)


def _cont(name: str) -> Callable[[LabCluster], None]:
    return lambda c: c.signal(name, signal.SIGCONT)


def _cut(a: str, b: str) -> Callable[[LabCluster], None]:
    return lambda c: c.lab.partition(a, b)


def _cut_and_probe(node: str) -> Callable[[LabCluster], None]:
    """Partition a storage node from mgmtd and start timing how long it keeps serving."""

    def act(c: LabCluster) -> None:
        c.lab.partition(node, "mgmtd")
        address = f"{c.lab.address(node)}:{c.env_for(node)['FS3_STORAGE_FRAMED_PORT']}"
        c.client_spawn([sys.executable, "-P", "-m", "tests.chaos.probe", address, c.token, "8",
                        str(c.root / "probe.json")], c.root / "probe.log")

    return act


def _heal(a: str, b: str) -> Callable[[LabCluster], None]:
    return lambda c: c.lab.heal(a, b)


_TOOK_LEASE = re.compile(r"mgmtd \S+ took the primary lease: epoch (\d+)")
TAKEOVER_WAIT_S = 60.0


def primary_mgmtd(c: LabCluster) -> tuple[str, int]:
    """The mgmtd that last took the primary lease (the highest epoch in the logs) and that epoch."""
    epochs = {name: max(map(int, _TOOK_LEASE.findall(c.log(name))), default=0) for name in c.servers
              if c.kind(name) == "mgmtd"}
    name = max(epochs, key=lambda n: epochs[n])
    if epochs[name] == 0:
        raise RuntimeError("no mgmtd took the primary lease")
    return name, epochs[name]


def _kill_primary_mgmtd(c: LabCluster) -> None:
    """SIGKILL the primary mgmtd, then time (in the background, from the logs) until another one
    takes the lease with a newer epoch: ``notes["takeover"]``."""
    name, epoch = primary_mgmtd(c)
    c.signal(name, signal.SIGKILL)
    killed_at = time.monotonic()
    takeover: dict[str, object] = {"killed": name, "epoch": epoch, "new_primary": None, "after_s": None}
    c.notes["takeover"] = takeover

    def watch() -> None:
        while time.monotonic() - killed_at < TAKEOVER_WAIT_S:
            for other in c.servers:
                if c.kind(other) == "mgmtd" and other != name:
                    newer = [int(e) for e in _TOOK_LEASE.findall(c.log(other)) if int(e) > epoch]
                    if newer:
                        takeover.update(new_primary=other, new_epoch=max(newer),
                                        after_s=round(time.monotonic() - killed_at, 3))
                        return
            time.sleep(0.05)

    threading.Thread(target=watch, name="takeover-watch", daemon=True).start()


_SCRAPE = """
import sys, urllib.request
total = 0.0
for line in urllib.request.urlopen(sys.argv[1], timeout=5).read().decode().splitlines():
    if line.startswith("fs3_rpc_requests_total{"):
        total += float(line.rsplit(" ", 1)[1])
print(total)
"""


def _served(c: LabCluster, name: str) -> float:
    """Requests a server answered so far (its /metrics, scraped from the client host)."""
    env = c.env_for(name)
    port = next(v for k, v in env.items() if k.endswith("_METRICS_PORT"))
    done = c.client_run([sys.executable, "-c", _SCRAPE, f"http://{c.lab.address(name)}:{port}/metrics"],
                        timeout_s=30)
    if done.returncode != 0:
        raise RuntimeError(f"scraping {name}'s metrics failed: {done.stderr[-500:]}")
    return float(done.stdout.strip())


def _kill_busiest_meta(c: LabCluster) -> None:
    """SIGKILL the meta server that answered the most requests: the one the workload's clients use."""
    served = {name: _served(c, name) for name in c.servers if c.kind(name) == "meta"}
    name = max(served, key=lambda n: served[n])
    c.signal(name, signal.SIGKILL)
    c.notes["meta_killed"] = {"meta": name, "requests_served": served}


def _probe_meta(meta: str, path: str, seconds: float) -> Callable[[LabCluster], None]:
    """Look ``path`` up on one meta server, directly, every 100 ms for ``seconds``."""

    def act(c: LabCluster) -> None:
        address = f"{c.lab.address(meta)}:{c.env_for(meta)['FS3_META_FRAMED_PORT']}"
        c.notes["meta_probe"] = {"meta": meta}
        c.client_spawn([sys.executable, "-P", "-m", "tests.chaos.meta_probe", address, c.token, path, str(seconds),
                        str(c.root / "meta_probe.json")], c.root / "meta_probe.log")

    return act


def _cut_noted(a: str, b: str) -> Callable[[LabCluster], None]:
    def act(c: LabCluster) -> None:
        c.lab.partition(a, b)
        c.notes.setdefault("meta_probe", {})["cut_at"] = time.monotonic()

    return act


def _heal_noted(a: str, b: str) -> Callable[[LabCluster], None]:
    def act(c: LabCluster) -> None:
        c.notes.setdefault("meta_probe", {})["heal_at"] = time.monotonic()
        c.lab.heal(a, b)

    return act


def _each(*actions: Callable[[LabCluster], None]) -> Callable[[LabCluster], None]:
    """Several faults applied as one step, in order."""

    def act(c: LabCluster) -> None:
        for action in actions:
            action(c)

    return act


def _fill(c: LabCluster) -> None:
    done = c.client_run([sys.executable, "-P", "-m", "tests.chaos.filler", c.mgmtd, c.token, "fill", "64"],
                        timeout_s=120)
    if done.returncode != 0:
        raise RuntimeError(f"filler failed: {done.stdout}{done.stderr}")
    (c.root / "filler.log").write_text(done.stdout + done.stderr)


def _unfill(c: LabCluster) -> None:
    c.client_run([sys.executable, "-P", "-m", "tests.chaos.filler", c.mgmtd, c.token, "remove"], timeout_s=120)


def _replace_disks(name: str) -> Callable[[LabCluster], None]:
    def act(c: LabCluster) -> None:
        c.signal(name, signal.SIGKILL)
        c.repair_disks(name)
        c.start(name)

    return act


SCENARIOS = {
    "storage-kill-restart": Scenario("storage-kill-restart", 14, [
        (2, "SIGKILL storage2", _kill("storage2")), (7, "restart storage2", _start("storage2"))]),
    "storage-freeze": Scenario("storage-freeze", 12, [
        (2, "SIGSTOP storage3", _stop("storage3")), (7, "SIGCONT storage3", _cont("storage3"))]),
    "meta-kill-restart": Scenario("meta-kill-restart", 12, [
        (2, "SIGKILL meta", _kill("meta")), (4, "restart meta", _start("meta"))]),
    "mgmtd-kill-restart": Scenario("mgmtd-kill-restart", 12, [
        (2, "SIGKILL mgmtd", _kill("mgmtd")), (5, "restart mgmtd", _start("mgmtd"))]),
    "partition-from-mgmtd": Scenario("partition-from-mgmtd", 14, [
        (2, "partition storage1 from mgmtd", _cut_and_probe("storage1")),
        (8, "heal storage1 and mgmtd", _heal("storage1", "mgmtd"))]),
    "partition-from-chain": Scenario("partition-from-chain", 14, [
        (2, "partition storage2 from storage1, storage3", _each(_cut("storage2", "storage1"),
                                                                _cut("storage2", "storage3"))),
        (8, "heal storage2", _each(_heal("storage2", "storage1"), _heal("storage2", "storage3")))]),
    "partition-from-clients": Scenario("partition-from-clients", 12, [
        (2, "partition storage3 from client", _cut("storage3", "client")),
        (7, "heal storage3 and client", _heal("storage3", "client"))]),
    "two-faults": Scenario("two-faults", 16, [
        (2, "SIGKILL meta", _kill("meta")), (2.5, "SIGSTOP storage1", _stop("storage1")),
        (5, "restart meta", _start("meta")), (9, "SIGCONT storage1", _cont("storage1"))]),
    "disk-full": Scenario("disk-full", 16, [
        (2, "fill the cluster until storage3's 24 MiB disks are full", _fill),
        (8, "remove the filler file (GC frees the chunks)", _unfill)], small_disks={"storage3": 24 << 20}),
    "degraded-links": Scenario("degraded-links", 16, [
        (2, "10% packet loss between storage1 and storage2; storage3's link throttled to 20 Mbit/s",
         _each(lambda c: c.lab.lossy_link("storage1", "storage2", 10), lambda c: c.lab.slow_link("storage3", 20))),
        (10, "links restored", _each(lambda c: c.lab.restore_link("storage1"),
                                     lambda c: c.lab.restore_link("storage3")))]),
    "disk-read-only": Scenario("disk-read-only", 16, [
        (2, "storage2's target disks turn read-only (ext4 error, errors=remount-ro)",
         lambda c: c.fail_disks("storage2")),
        (8, "stop storage2, e2fsck and remount its disks, restart it", _replace_disks("storage2"))],
        ext4_disks={"storage2": 96 << 20}),
    # The `ha` profile: PostgreSQL, three mgmtd (one primary) and three meta servers on it.
    "ha-mgmtd-primary-kill": Scenario("ha-mgmtd-primary-kill", 12, [
        (3, "SIGKILL the primary mgmtd", _kill_primary_mgmtd)], profile="ha", namespace=True),
    "ha-meta-kill": Scenario("ha-meta-kill", 12, [
        (3, "SIGKILL the busiest meta server", _kill_busiest_meta)], profile="ha", namespace=True),
    "ha-postgres-restart": Scenario("ha-postgres-restart", 16, [
        (3, "SIGKILL postgres", _kill("postgres")), (4, "start postgres again", _start("postgres"))],
        profile="ha", namespace=True),
    "ha-meta-cut-from-postgres": Scenario("ha-meta-cut-from-postgres", 16, [
        (1, "probe ha-meta2 directly (lookups of /chaos)", _probe_meta("ha-meta2", "/chaos", 14)),
        (4, "partition ha-meta2 from postgres", _cut_noted("ha-meta2", "postgres")),
        (10, "heal ha-meta2 and postgres", _heal_noted("ha-meta2", "postgres"))], profile="ha", namespace=True),
}
