"""Hosts as Linux network namespaces, each with one veth on a bridge, made with ``ip``.

The chaos harness (``tests/chaos/netns.py``: the bridge in a namespace of its own, every host a
namespace) and ``hai local`` (the bridge in this machine's namespace with an address, so that the
namespaces reach the services running here) build their hosts from these. Creating or deleting a
namespace needs root; :func:`netns_usable` says whether this process may.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess

__all__ = ["attach_namespace", "delete_namespace", "free_subnet", "ip", "namespace_pids", "netns_usable",
           "used_subnets"]


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS``; a failure raises :class:`subprocess.CalledProcessError` (with ``check``)."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def used_subnets() -> set[str]:
    """The destinations of every IPv4 route in every table (``10.213.180.0/24``, ...)."""
    out = ip("-4", "route", "show", "table", "all", check=False).stdout
    return {line.split()[0] for line in out.splitlines() if line and line[0].isdigit()}


def free_subnet(prefix: str, first: int = 180, last: int = 250) -> str:
    """The first ``PREFIX.N`` (a /24, ``first <= N < last``) no route uses, as ``"PREFIX.N"``."""
    used = used_subnets()
    for third in range(first, last):
        if f"{prefix}.{third}.0/24" not in used:
            return f"{prefix}.{third}"
    raise RuntimeError(f"every /24 of {prefix}.{first}-{last - 1} is in use")


def netns_usable() -> bool:
    """Whether this process can make network namespaces (root, a kernel with them, ``ip``)."""
    if os.geteuid() != 0:
        return False
    probe = f"fs3probe-{secrets.token_hex(3)}"
    try:
        made = ip("netns", "add", probe, check=False).returncode == 0
    except FileNotFoundError:  # no `ip`
        return False
    ip("netns", "del", probe, check=False)
    return made


def attach_namespace(namespace: str, address_cidr: str, bridge: str, port: str,
                     bridge_namespace: str | None = None) -> None:
    """Make ``namespace`` with ``lo`` up and one veth ``eth0`` holding ``address_cidr``, whose peer
    ``port`` is enslaved to ``bridge`` (in ``bridge_namespace``, or in this machine's own)."""
    ip("netns", "add", namespace)
    if bridge_namespace is None:
        # Made here, in this machine's namespace, with the other end moved into the new one.
        ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", namespace)
    else:
        ip("-n", namespace, "link", "add", "eth0", "type", "veth", "peer", "name", port, "netns", bridge_namespace)
    at_bridge = ["-n", bridge_namespace] if bridge_namespace else []
    ip("-n", namespace, "addr", "add", address_cidr, "dev", "eth0")
    ip("-n", namespace, "link", "set", "eth0", "up")
    ip("-n", namespace, "link", "set", "lo", "up")
    ip(*at_bridge, "link", "set", port, "master", bridge)
    ip(*at_bridge, "link", "set", port, "up")


def namespace_pids(namespace: str) -> list[int]:
    """The processes running in ``namespace`` (none when it does not exist)."""
    out = ip("netns", "pids", namespace, check=False).stdout
    return [int(word) for word in out.split() if word.isdigit()]


def delete_namespace(namespace: str) -> None:
    """SIGKILL whatever still runs in ``namespace``, then delete it (its veth goes with it); a
    namespace that does not exist is no error."""
    for pid in namespace_pids(namespace):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    ip("netns", "del", namespace, check=False)
