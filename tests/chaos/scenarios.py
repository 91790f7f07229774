"""Fault scenarios: each a timeline of faults applied to a LabCluster while a workload runs."""

from __future__ import annotations

import signal
import sys
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
}
