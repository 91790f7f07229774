"""Hosts as Linux network namespaces on one private bridge — all created, and removed, by this harness.

A `switch` namespace holds the bridge; every host namespace gets one veth (``eth0``) with its own
address on a /24 the harness picks among unused private ranges. Nothing is added to the machine's
own interfaces or namespaces, every name carries this run's id, and :meth:`NetnsLab.destroy` (also
run at exit and on SIGTERM) kills the processes it started and deletes its namespaces.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import signal
import subprocess
from pathlib import Path
from typing import Any

from fs3.cluster.netns import attach_namespace, free_subnet
from fs3.cluster.netns import ip as _ip

__all__ = ["NetnsLab"]


class NetnsLab:
    def __init__(self) -> None:
        self.run_id = secrets.token_hex(3)
        self.subnet = free_subnet("10.213")
        self.switch = f"fs3sw-{self.run_id}"
        self.hosts: dict[str, tuple[str, str]] = {}  # host -> (namespace, address)
        self.procs: list[subprocess.Popen[Any]] = []
        self._blackholes: set[tuple[str, str]] = set()
        self._created = False
        atexit.register(self.destroy)

    # -- topology --------------------------------------------------------------------------------

    def create(self, hosts: list[str]) -> dict[str, str]:
        _ip("netns", "add", self.switch)
        self._created = True
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for index, host in enumerate(hosts):
            namespace = f"fs3-{self.run_id}-{host}"
            address = f"{self.subnet}.{10 + index}"
            self.hosts[host] = (namespace, address)
            attach_namespace(namespace, f"{address}/24", "br0", f"p{index}", bridge_namespace=self.switch)
        return {host: address for host, (_, address) in self.hosts.items()}

    def address(self, host: str) -> str:
        return self.hosts[host][1]

    def namespace(self, host: str) -> str:
        return self.hosts[host][0]

    # -- processes -------------------------------------------------------------------------------

    def spawn(self, host: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[Any]:
        with log.open("ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(host), *args], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    # -- faults ----------------------------------------------------------------------------------

    def partition(self, a: str, b: str) -> None:
        """Cut traffic between two hosts both ways (their other links keep working)."""
        for src, dst in ((a, b), (b, a)):
            _ip("-n", self.namespace(src), "route", "add", "blackhole", f"{self.address(dst)}/32")
            self._blackholes.add((src, dst))

    def heal(self, a: str, b: str) -> None:
        for src, dst in ((a, b), (b, a)):
            if (src, dst) in self._blackholes:
                _ip("-n", self.namespace(src), "route", "del", "blackhole", f"{self.address(dst)}/32", check=False)
                self._blackholes.discard((src, dst))

    def lossy_link(self, a: str, b: str, loss_percent: int) -> None:
        """Drop ``loss_percent`` of the packets between two hosts, both ways (nftables, in ``a``).

        The kernel here has no netem qdisc; nftables' random number generator drops packets the
        same way, and TCP's retransmission timeouts turn the loss into the delays netem would add.
        """
        namespace, peer = self.namespace(a), self.address(b)
        self._nft(namespace, "add", "table", "inet", "fs3chaos")
        for chain, hook, field in (("out", "output", "daddr"), ("in", "input", "saddr")):
            self._nft(namespace, "add", "chain", "inet", "fs3chaos", chain,
                      f"{{ type filter hook {hook} priority 0; }}")
            self._nft(namespace, "add", "rule", "inet", "fs3chaos", chain, "ip", field, peer, "numgen", "random",
                      "mod", "100", "<", str(loss_percent), "drop")

    def slow_link(self, host: str, rate_mbit: int) -> None:
        """Throttle a host's link both ways to ``rate_mbit`` (tbf on its veth and on the switch port)."""
        namespace = self.namespace(host)
        port = f"p{list(self.hosts).index(host)}"
        for ns, dev in ((namespace, "eth0"), (self.switch, port)):
            _ip("-n", ns, "link", "show", dev)
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                            f"{rate_mbit}mbit", "burst", "64kb", "latency", "200ms"], check=True,
                           capture_output=True, text=True)

    def restore_link(self, host: str) -> None:
        """Undo :meth:`lossy_link` (made from this host) and :meth:`slow_link` on this host."""
        namespace = self.namespace(host)
        subprocess.run(["ip", "netns", "exec", namespace, "nft", "delete", "table", "inet", "fs3chaos"],
                       capture_output=True)
        port = f"p{list(self.hosts).index(host)}"
        for ns, dev in ((namespace, "eth0"), (self.switch, port)):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], capture_output=True)

    @staticmethod
    def _nft(namespace: str, *args: str) -> None:
        done = subprocess.run(["ip", "netns", "exec", namespace, "nft", *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nft {' '.join(args)}: {done.stderr.strip()}")

    # -- teardown --------------------------------------------------------------------------------

    def destroy(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
        self.procs.clear()
        if not self._created:
            return
        for namespace, _ in self.hosts.values():
            _ip("netns", "del", namespace, check=False)
        _ip("netns", "del", self.switch, check=False)
        self.hosts.clear()
        self._created = False

    def __enter__(self) -> NetnsLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()
