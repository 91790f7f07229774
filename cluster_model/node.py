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
    # A machine whose "GPUs" are ranks resident in host memory (the calibration on this machine):
    ranks_in_host_memory: bool = False
    """Each rank's buffer is host memory: its copies read and write host memory and run on the cores."""
    cores: int | None = None
    """CPU cores that copy, reduce and move socket bytes (None: not a limit, the paper's node)."""
    copy_bw_gbs: float | None = None
    """All-core copy bandwidth, read plus written bytes per second (None: copies are DMA over PCIe)."""
    nodes_share_memory: bool = False
    """A job's nodes are network namespaces of one machine: one memory system and one set of cores."""
    socket_network: bool = False
    """The "NIC" is a socket: every byte sent is copied into the kernel and out of it through memory."""

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
    def host_ranks(cls, name: str, ranks_per_node: int, cores: int, memory_bw_gbs: float,
                   copy_bw_gbs: float) -> Node:
        """This machine as a node: ``ranks_per_node`` processes whose buffers are host memory, on ``cores``
        shared by every namespace node of a job, exchanging bytes over sockets.

        Bandwidths are read-plus-written bytes per second of all cores, as the HFReduce benchmark measures
        them. Assumptions: one core copies at ``copy_bw_gbs / cores`` (the measured rate shared evenly; no
        one-core figure is measured), so a rank's "GPU to host" link moves ``copy_bw_gbs / cores / 2``
        message bytes per second; the socket moves ``copy_bw_gbs / 4`` (each byte sent is read and written
        into the kernel and out of it).
        """
        field = f"node.{name}"
        for key, value in (("ranks_per_node", ranks_per_node), ("cores", cores)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{field}.{key}", f"must be a positive whole number, not {value!r}")
        for key, number in (("memory_bw_gbs", memory_bw_gbs), ("copy_bw_gbs", copy_bw_gbs)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not number > 0:
                raise ConfigError(f"{field}.{key}", f"must be a positive number, not {number!r}")
        core_copy_gbs = copy_bw_gbs / cores / 2
        return cls(
            name=name, gpus=ranks_per_node, compute_nics=1, storage_nics=0,
            nic_gbps=copy_bw_gbs / 4 * 8, memory_bw_gbs=float(memory_bw_gbs),
            pcie_gpu_to_cpu_gbs=core_copy_gbs, root_port_limit_gbs=core_copy_gbs, shared_root_port_gpus=(),
            nvlink_pairs=(), nvlink_gbs=0.0, nvswitch=False, gpu_nic_p2p_gbs=None,
            power_w=0.0, tf32_tflops=0.0, fp16_tflops=0.0,   # not modelled: the compute is measured
            ranks_in_host_memory=True, cores=cores, copy_bw_gbs=float(copy_bw_gbs), nodes_share_memory=True,
            socket_network=True)

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
