"""3FS throughput from its parts: storage nodes x SSDs x NICs, replication, and flow control.

Reads are served by one replica (CRAQ reads any clean copy), so the cluster's read ceiling is
the smaller of the storage NICs and the SSDs. Writes go down the chain: a byte enters the
cluster once per replica, so writes get the ingress ceiling over the replication factor.

What is left between the line rate and what is achieved is flow control. Many storage nodes
answering one client at once overflow its switch port (incast); 3FS has a client grant each
transfer with a request-to-send, so a transfer's bytes follow one round trip of control
messages. A link then carries data for ``t_data / (t_data + t_rts)`` of the time, with
``t_data`` one transfer (a chunk) at the line rate. Checkpoints are written at the smaller of what
the job's nodes can send and what the cluster can take.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster_model.config import ConfigError, require_int, require_number

__all__ = ["CHECKPOINT_BYTES_PER_PARAM", "StorageSystem"]

#: A mixed-precision Adam checkpoint: fp16 weights 2 + fp32 master copy 4 + two Adam moments 4 + 4.
CHECKPOINT_BYTES_PER_PARAM = 14


@dataclass(frozen=True)
class StorageSystem:
    """A 3FS deployment: storage nodes, their SSDs and NICs, and the replica count."""

    storage_nodes: int
    ssds_per_node: int
    ssd_tb: float
    nics_per_node: int
    nic_gbps: float
    replicas: int = 3
    ssd_read_gbs: float = 6.8           # assumption: PCIe 4.0 NVMe of the period, sequential read
    ssd_write_gbs: float = 4.0          # assumption: the same drives, sequential write
    transfer_bytes: int = 512 * 1024    # assumption: one transfer = one chunk read
    rts_round_trip_s: float = 2.5e-6    # assumption: one IB round trip of a small control message

    def __post_init__(self) -> None:
        for name in ("storage_nodes", "ssds_per_node", "nics_per_node", "replicas"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"storage_3fs.{name}", f"must be a positive whole number, not {value!r}")
        for name in ("ssd_tb", "nic_gbps", "ssd_read_gbs", "ssd_write_gbs", "rts_round_trip_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"storage_3fs.{name}", f"must be positive, not {getattr(self, name)}")

    @classmethod
    def from_table(cls, table: dict[str, Any], replicas: int = 3) -> StorageSystem:
        field = "storage_3fs"
        return cls(require_int(table, "storage_nodes", field), require_int(table, "ssds_per_node", field),
                   require_number(table, "ssd_tb", field), require_int(table, "nics_per_node", field),
                   require_number(table, "nic_gbps", field),
                   replicas=require_int(table, "replicas", field, default=replicas),
                   ssd_read_gbs=require_number(table, "ssd_read_gbs", field, default=cls.ssd_read_gbs),
                   ssd_write_gbs=require_number(table, "ssd_write_gbs", field, default=cls.ssd_write_gbs))

    @property
    def raw_capacity_pb(self) -> float:
        return self.storage_nodes * self.ssds_per_node * self.ssd_tb / 1000

    @property
    def usable_capacity_pb(self) -> float:
        return self.raw_capacity_pb / self.replicas

    @property
    def network_gbs(self) -> float:
        return self.storage_nodes * self.nics_per_node * self.nic_gbps / 8

    @property
    def ssd_read_total_gbs(self) -> float:
        return self.storage_nodes * self.ssds_per_node * self.ssd_read_gbs

    @property
    def flow_control_efficiency(self) -> float:
        data_s = self.transfer_bytes / (self.nic_gbps / 8 * 1e9)
        return data_s / (data_s + self.rts_round_trip_s)

    def read_theoretical_gbs(self) -> float:
        return min(self.network_gbs, self.ssd_read_total_gbs)

    def read_gbs(self) -> float:
        """Aggregate read throughput with request-to-send flow control."""
        return self.read_theoretical_gbs() * self.flow_control_efficiency

    def write_gbs(self) -> float:
        ingress = self.network_gbs * self.flow_control_efficiency
        ssd = self.storage_nodes * self.ssds_per_node * self.ssd_write_gbs
        return min(ingress, ssd) / self.replicas

    def checkpoint_s(self, state_bytes: float, job_nodes: int, per_node_write_gbs: float) -> float:
        """Time to write ``state_bytes`` from ``job_nodes`` nodes writing ``per_node_write_gbs`` each."""
        if state_bytes < 0 or job_nodes <= 0 or per_node_write_gbs <= 0:
            raise ConfigError("checkpoint", "state size must be non-negative, nodes and per-node rate positive")
        rate = min(job_nodes * per_node_write_gbs, self.write_gbs())
        return state_bytes / (rate * 1e9)

    def checkpoint_load_s(self, state_bytes: float, job_nodes: int, node_nic_gbs: float) -> float:
        """Time to read ``state_bytes`` back into ``job_nodes`` nodes, each receiving at ``node_nic_gbs``.

        Every rank reads its own shard, so a load is bounded by the job's NICs and the cluster's reads.
        """
        if state_bytes < 0 or job_nodes <= 0 or node_nic_gbs <= 0:
            raise ConfigError("checkpoint", "state size must be non-negative, nodes and NIC rate positive")
        rate = min(job_nodes * node_nic_gbs, self.read_gbs())
        return state_bytes / (rate * 1e9)
