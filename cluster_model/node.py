"""Compute nodes: the PCIe A100 node of Fire-Flyer 2 and the DGX-A100 it is compared with.

What matters to the collectives is where bytes can flow and how fast: each GPU's PCIe path to
host memory (and the root port that GPU5 and GPU6 share on the PCIe node), host memory
bandwidth (HFReduce reduces on the CPU), NVLink (bridged pairs on the PCIe node, NVSwitch on
the DGX), and the NICs — including the GPU↔NIC peer-to-peer ceiling of the PCIe node, whose
EPYC Rome root complex lacks chained writes, which is what holds NCCL back there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cluster_model.config import ConfigError, require_int, require_number

__all__ = ["GIB", "Node"]

GIB = 1024**3 / 1e9  # GB per GiB


@dataclass(frozen=True)
class Node:
    """One server. Bandwidths in GB/s (10^9 bytes), power in W, prices in the paper's relative unit."""

    name: str
    gpus: int
    compute_nics: int
    storage_nics: int
    nic_gbps: float
    memory_bw_gbs: float
    pcie_gpu_to_cpu_gbs: float
    root_port_limit_gbs: float
    shared_root_port_gpus: tuple[int, ...]
    nvlink_pairs: tuple[tuple[int, int], ...]
    nvlink_gbs: float
    nvswitch: bool
    gpu_nic_p2p_gbs: float | None
    power_w: float
    tf32_tflops: float
    fp16_tflops: float

    @property
    def nic_gbs(self) -> float:
        """One NIC's line rate in GB/s."""
        return self.nic_gbps / 8

    @property
    def gpu_nic_gbs(self) -> float:
        """What one NIC can move to or from GPU memory directly (GPUDirect RDMA)."""
        if self.gpu_nic_p2p_gbs is None:
            return self.nic_gbs
        return min(self.nic_gbs, self.gpu_nic_p2p_gbs)

    def d2h_gbs(self, gpu: int) -> float:
        """GPU ``gpu``'s copy bandwidth to host memory while every GPU copies at once.

        GPUs behind one root port share its limit; the others get their own x16 link.
        """
        if gpu in self.shared_root_port_gpus:
            return min(self.pcie_gpu_to_cpu_gbs, self.root_port_limit_gbs / len(self.shared_root_port_gpus))
        return min(self.pcie_gpu_to_cpu_gbs, self.root_port_limit_gbs)

    @property
    def slowest_d2h_gbs(self) -> float:
        """The slowest GPU's share when all copy at once: a node-wide copy finishes with it."""
        return min(self.d2h_gbs(gpu) for gpu in range(self.gpus))

    @property
    def has_nvlink(self) -> bool:
        return self.nvswitch or bool(self.nvlink_pairs)

    @classmethod
    def from_table(cls, name: str, table: dict[str, Any], gemm: dict[str, Any] | None = None,
                   field: str | None = None) -> Node:
        """Build from a ``[node.NAME]`` table; ``gemm`` is ``[gemm_tflops_per_gpu]``.

        Assumptions for what a table leaves out are stated inline: a node with more NICs than
        GPUs uses one NIC per GPU for compute and the rest for storage (the DGX's 8 + 1); a node
        with fewer NICs than GPUs has no NVSwitch unless it says so.
        """
        field = field or f"node.{name}"
        gpus = require_int(table, "gpus", field)
        nics = require_int(table, "nics", field)
        compute_nics = min(nics, gpus)
        storage_nics = nics - compute_nics
        shared = tuple(int(g) for g in table.get("shared_root_port_gpus", []))
        for gpu in shared:
            if not 0 <= gpu < gpus:
                raise ConfigError(f"{field}.shared_root_port_gpus", f"GPU {gpu} is not one of the node's {gpus} GPUs")
        pairs_raw = table.get("nvlink_bridge_pairs", [])
        pairs: list[tuple[int, int]] = []
        for pair in pairs_raw:
            if len(pair) != 2 or not all(0 <= int(g) < gpus for g in pair):
                raise ConfigError(f"{field}.nvlink_bridge_pairs", f"{pair!r} is not a pair of the node's GPUs")
            pairs.append((int(pair[0]), int(pair[1])))
        nvswitch = bool(table.get("nvswitch", "sxm" in str(table.get("gpu", "")).lower()))
        prefix = "dgx" if nvswitch else "pcie"
        gemm = gemm or {}
        p2p_gib = table.get("gpu_nic_p2p_gibs")
        p2p = None if p2p_gib is None else require_number(table, "gpu_nic_p2p_gibs", field) * GIB
        return cls(
            name=name,
            gpus=gpus,
            compute_nics=compute_nics,
            storage_nics=storage_nics,
            nic_gbps=require_number(table, "nic_gbps", field),
            # Unstated for the DGX: its two EPYC 7742 have the same 16 DDR4-3200 channels.
            memory_bw_gbs=require_number(table, "memory_bw_practical_gbs", field, default=320),
            pcie_gpu_to_cpu_gbs=require_number(table, "pcie_gpu_to_cpu_gbs", field, default=27),
            root_port_limit_gbs=require_number(table, "root_port_limit_gbs", field, default=37.5),
            shared_root_port_gpus=shared,
            nvlink_pairs=tuple(pairs),
            nvlink_gbs=require_number(table, "nvlink_pair_gbs", field, default=600),
            nvswitch=nvswitch,
            gpu_nic_p2p_gbs=p2p,
            power_w=require_number(table, "power_w", field),
            tf32_tflops=require_number(gemm, f"{prefix}_tf32", "gemm_tflops_per_gpu", default=table.get("tf32_tflops")),
            fp16_tflops=require_number(gemm, f"{prefix}_fp16", "gemm_tflops_per_gpu", default=table.get("fp16_tflops")),
        )
