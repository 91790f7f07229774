"""fs3's public API for tools that run fs3 and their own services on one machine.

``fs3 local`` starts a cluster as processes in a directory; a tool that starts more next to it
(``hai local``: a scheduler and its node agents) needs the same pieces — the local cluster, the
process handling (pid files with start times, logs, ready files, process groups), network
namespaces as hosts, private token files — and should not copy them or reach into fs3's modules.
This module names that surface, so fs3 can move code behind it without breaking its users
(``tests/test_layering.py`` holds the packages beside fs3 to the public modules in
``pyproject.toml``'s ``[tool.fs3.layering]``).
"""

from __future__ import annotations

from fs3.cli.local import LocalCluster, cluster_lock
from fs3.cluster import netns
from fs3.cluster.processes import ServiceProcess, pid_alive, read_pid_file, spawn_logged, stop_group
from fs3.common.errors import FS3Error, InvalidArgument
from fs3.common.secret_files import make_private_dir, read_token_file, write_secret_file
from fs3.rpc.auth import parse_user_token

__all__ = [
    "FS3Error",
    "InvalidArgument",
    "LocalCluster",
    "ServiceProcess",
    "cluster_lock",
    "is_user_token",
    "make_private_dir",
    "netns",
    "pid_alive",
    "read_pid_file",
    "read_token_file",
    "spawn_logged",
    "stop_group",
    "write_secret_file",
]


def is_user_token(token: str) -> bool:
    """Whether ``token`` is an fs3 user token (``fs3u.<id>.<secret>``, made by ``fs3 admin user
    add``: it acts as one uid), as opposed to a cluster token (which acts as the cluster itself)."""
    return parse_user_token(token) is not None
