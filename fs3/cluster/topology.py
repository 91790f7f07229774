"""What a cluster is made of, and what each of its parts is called.

Pure data: no transport, clock or event loop, so that the simulator (which draws a cluster's
shape from its seed), the in-process test cluster and the process launchers describe the same
cluster the same way. A target's id carries its node's (``node_id * 100 + index``), so a target
id alone says which node holds it, in logs and in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from fs3.common.errors import InvalidArgument

__all__ = ["CHAIN_TABLE_ID", "INSTANCES_MAX", "META", "META_NODE_ID", "MGMTD", "POSTGRES", "TARGETS_PER_NODE_MAX",
           "Topology"]

#: The name (and, in the simulator, the address) of mgmtd and of meta.
MGMTD = "mgmtd"
META = "meta"
#: The name of a cluster's own PostgreSQL server (``fs3 local up --meta-engine postgres``).
POSTGRES = "postgres"
#: The node id meta registers under with mgmtd (storage node ids count up from 1, far below it).
META_NODE_ID = 1001
#: The chain table files are striped over.
CHAIN_TABLE_ID = 1
#: A target's id is ``node_id * 100 + index``: a node has at most 99 targets.
TARGETS_PER_NODE_MAX = 99
#: At most this many mgmtd instances, and meta servers, in one cluster.
INSTANCES_MAX = 9


@dataclass(frozen=True)
class Topology:
    """mgmtd (``mgmtd_replicas`` instances), ``storage_nodes`` storage nodes of ``targets_per_node``
    targets each, one chain table of ``replicas``-target chains, and (``with_meta``) ``meta_servers``
    meta servers. The first mgmtd and the first meta keep the names of a cluster of one of each
    (``mgmtd``, ``meta``: existing clusters' directories and configs are named so); the others
    are ``mgmtd-1``, ``mgmtd-2``, ... and ``meta-1``, ``meta-2``, ...; meta node ids count up from
    :data:`META_NODE_ID`."""

    storage_nodes: int = 3
    targets_per_node: int = 1
    replicas: int = 3
    with_meta: bool = True
    chain_table_id: int = CHAIN_TABLE_ID
    meta_servers: int = 1
    mgmtd_replicas: int = 1

    def __post_init__(self) -> None:
        if self.storage_nodes < 1 or self.targets_per_node < 1:
            raise InvalidArgument("a cluster needs at least one storage node with one target")
        if self.targets_per_node > TARGETS_PER_NODE_MAX:
            raise InvalidArgument(f"at most {TARGETS_PER_NODE_MAX} targets per node (a target id holds its node's)")
        if self.replicas < 1:
            raise InvalidArgument("a chain needs at least one replica")
        if not 1 <= self.meta_servers <= INSTANCES_MAX:
            raise InvalidArgument(f"meta servers: {self.meta_servers}, expected 1..{INSTANCES_MAX}")
        if not 1 <= self.mgmtd_replicas <= INSTANCES_MAX:
            raise InvalidArgument(f"mgmtd replicas: {self.mgmtd_replicas}, expected 1..{INSTANCES_MAX}")

    @property
    def node_ids(self) -> range:
        return range(1, self.storage_nodes + 1)

    def target_ids(self, node_id: int) -> list[int]:
        """The node's targets, in the order their directories are numbered (``index`` from 1)."""
        return [self.target_id(node_id, index) for index in range(1, self.targets_per_node + 1)]

    @staticmethod
    def target_id(node_id: int, index: int) -> int:
        return node_id * 100 + index

    @staticmethod
    def node_of(target_id: int) -> int:
        return target_id // 100

    @property
    def target_count(self) -> int:
        return self.storage_nodes * self.targets_per_node

    @staticmethod
    def storage_name(node_id: int) -> str:
        """The storage node's process name (its address in the simulator)."""
        return f"storage-{node_id}"

    @property
    def mgmtd_names(self) -> list[str]:
        """Every mgmtd instance's process name: ``mgmtd``, ``mgmtd-1``, ..."""
        return [MGMTD, *(f"{MGMTD}-{i}" for i in range(1, self.mgmtd_replicas))]

    @property
    def meta_names(self) -> list[str]:
        """Every meta server's process name (none without meta): ``meta``, ``meta-1``, ..."""
        if not self.with_meta:
            return []
        return [META, *(f"{META}-{i}" for i in range(1, self.meta_servers))]

    @staticmethod
    def meta_node_id(index: int) -> int:
        """The node id of the ``index``-th meta server (from 0), as it registers with mgmtd."""
        return META_NODE_ID + index

    @property
    def service_names(self) -> list[str]:
        """Every server process, in the order a cluster starts them."""
        return [*self.mgmtd_names, *(self.storage_name(n) for n in self.node_ids), *self.meta_names]
