"""The model checked at the small end: HFReduce and HaiScale as measured on this machine.

The paper-scale model predicts Fire-Flyer 2 from mechanisms. Here the same mechanisms
(:meth:`Collective.hfreduce`: a chunk's copy-in, reduce and copy-out back to back, the host-memory
traffic bound, the NIC bound, the tree's fill) predict what HFReduce and HaiScale's DDP did on the
machine the benchmarks ran on, from that machine's measured figures alone (cores, all-core memory and
copy bandwidth, in ``inputs/measured-v2.json``), and the predictions are set beside the measurements.

This machine is a :class:`Node` built by :meth:`Node.host_ranks`: its "GPUs" are rank processes whose
buffers are host memory (so every copy reads and writes host memory and runs on the cores), every
network-namespace node of a job shares its memory and its cores, and its "NIC" is a socket whose bytes
are copied through memory.

DDP step: the measured step with no communication (``local_step_s``, every rank computing at once) is
the compute; the model adds its predicted allreduce of ``parameters x 4`` bytes (float32 gradients),
exposed by the paper model's overlap rule with one change. On Fire-Flyer 2 the allreduce runs on the
CPU and NIC while the GPUs compute, so it hides behind the backward pass (what exceeds it and the last
bucket stay exposed). Here the cores that compute are the cores that reduce: the backward pass leaves
``max(0, 1 - ranks / cores)`` of them idle, the window the allreduce can hide in shrinks by that share,
and with at least as many ranks as cores (every run here) nothing hides: the whole allreduce adds to
the step.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster_model.cluster import Cluster
from cluster_model.collectives import AllreduceResult, Collective, host_memory_bytes_per_byte
from cluster_model.config import ConfigError
from cluster_model.measured import AllreduceCell, DdpCell, Machine, Measured
from cluster_model.node import Node

__all__ = ["BACKWARD_SHARE", "GRADIENT_BYTES_PER_PARAMETER", "CalibrationRow", "calibration_rows",
           "calibration_section", "ddp_step_s", "exposed_allreduce_s", "machine_node", "predicted_allreduce"]

GRADIENT_BYTES_PER_PARAMETER = 4  # the DDP benchmark trains in float32
BACKWARD_SHARE = 2 / 3            # as the paper model: backward costs two forwards of three
_MIB = 1 << 20


@dataclass(frozen=True)
class CalibrationRow:
    """One measured quantity on this machine beside the model's prediction of it."""

    quantity: str
    setup: str
    measured: float
    model: float
    unit: str
    mechanism: str

    @property
    def model_over_measured(self) -> float:
        return self.model / self.measured


def machine_node(machine: Machine, ranks_per_node: int) -> Node:
    """This machine as the model's node for ``ranks_per_node`` ranks per (namespace) node."""
    return Node.host_ranks("this machine", ranks_per_node, machine.cores, machine.memory_bw_gbs, machine.copy_bw_gbs)


def predicted_allreduce(cluster: Cluster, machine: Machine, nodes: int, ranks_per_node: int,
                        message_bytes: int) -> AllreduceResult:
    """HFReduce on ``nodes`` x ``ranks_per_node`` ranks of this machine, with the cluster's pipeline chunk
    and hop latency (the same assumptions as at paper scale)."""
    reference = cluster.collective
    collective = Collective(machine_node(machine, ranks_per_node), pipeline_chunk_bytes=reference.pipeline_chunk_bytes,
                            hop_latency_s=reference.hop_latency_s)
    return collective.hfreduce(nodes * ranks_per_node, message_bytes, gpus_per_node=ranks_per_node)


def exposed_allreduce_s(allreduce_s: float, last_bucket_s: float, backward_s: float, idle_core_share: float) -> float:
    """The allreduce time a DDP step does not hide: the paper's rule with the backward window scaled by
    the share of the reducing cores the computation leaves idle (1 on a GPU node, 0 here)."""
    if not 0 <= idle_core_share <= 1:
        raise ConfigError("idle_core_share", f"must lie in [0, 1], not {idle_core_share!r}")
    if idle_core_share == 0:
        return allreduce_s
    return max(0.0, allreduce_s - backward_s * idle_core_share) + last_bucket_s


def ddp_step_s(cluster: Cluster, machine: Machine, cell: DdpCell, bucket_bytes: int = 25 * _MIB) -> float:
    """HaiScale's DDP step on this machine: measured compute plus the exposed predicted allreduce."""
    grads = cell.parameters * GRADIENT_BYTES_PER_PARAMETER
    allreduce = predicted_allreduce(cluster, machine, cell.nodes, cell.ranks_per_node, grads).time_s
    last = predicted_allreduce(cluster, machine, cell.nodes, cell.ranks_per_node, min(bucket_bytes, grads)).time_s
    idle = max(0.0, 1 - cell.nodes * cell.ranks_per_node / machine.cores)
    return cell.local_step_s + exposed_allreduce_s(allreduce, last, cell.local_step_s * BACKWARD_SHARE, idle)


def _size(size_bytes: int) -> str:
    return f"{size_bytes / _MIB:g} MiB"


def _allreduce_row(cluster: Cluster, machine: Machine, cell: AllreduceCell) -> CalibrationRow:
    result = predicted_allreduce(cluster, machine, cell.nodes, cell.ranks_per_node, cell.size_bytes)
    traffic = host_memory_bytes_per_byte(cell.ranks_per_node, cell.nodes, ranks_in_host_memory=True,
                                         nodes_share_memory=True, socket_network=True)
    mechanism = (f"{result.bound}: copy-in, reduce{', socket copies' if cell.nodes > 1 else ''} and copy-out back "
                 f"to back on {machine.cores} shared cores ({traffic:g} B of memory traffic per byte)")
    if cell.nodes > 1:
        mechanism += f"; tree fill over {cell.nodes} namespace nodes"
    return CalibrationRow("HFReduce allreduce bandwidth", f"{cell.layout}, {_size(cell.size_bytes)}",
                          cell.hfreduce_algbw_gbs, result.algbw_gbs, "GB/s", mechanism)


def _ddp_row(cluster: Cluster, machine: Machine, cell: DdpCell) -> CalibrationRow:
    grads = cell.parameters * GRADIENT_BYTES_PER_PARAMETER
    ranks = cell.nodes * cell.ranks_per_node
    hidden = ("all exposed" if ranks >= machine.cores else
              f"hidden in {1 - ranks / machine.cores:.0%} of the backward pass")
    mechanism = (f"measured compute {cell.local_step_s:.3f} s + allreduce of {grads / 1e6:.1f} MB, {hidden} "
                 f"({ranks} ranks on {machine.cores} cores)")
    return CalibrationRow("HaiScale DDP step", f"{cell.layout}, {cell.model} ({cell.parameters / 1e6:.2f} M params)",
                          cell.haiscale_step_s, ddp_step_s(cluster, machine, cell), "s", mechanism)


def calibration_rows(cluster: Cluster, measured: Measured) -> list[CalibrationRow]:
    """Every HFReduce and DDP cell of the measured input, the model's prediction beside it."""
    machine = measured.machine
    if machine is None:
        return []
    return ([_allreduce_row(cluster, machine, cell) for cell in measured.allreduce]
            + [_ddp_row(cluster, machine, cell) for cell in measured.ddp])


def calibration_section(cluster: Cluster, measured: Measured | None) -> list[str]:
    """The report's "Calibration on this machine" section (Markdown lines); nothing without a measured input."""
    if measured is None:
        return []
    rows = calibration_rows(cluster, measured)
    machine = measured.machine
    lines = ["## Calibration on this machine", ""]
    if machine is None or not rows:
        return [*lines, "The measured input holds no HFReduce or DDP results: nothing to calibrate against.", ""]
    sources = sorted({cell.source for cell in measured.allreduce} | {cell.source for cell in measured.ddp})
    lines += [f"The same mechanisms, on the machine the benchmarks ran on: {machine.cores} cores, "
              f"{machine.memory_bw_gbs:.1f} GB/s memory and {machine.copy_bw_gbs:.1f} GB/s copy bandwidth "
              "(read plus written, all cores). Ranks are processes in host memory, namespace nodes share its "
              "memory and cores, and the network is a socket copied through memory. The DDP step is the "
              "measured step without communication plus the predicted allreduce, none of it hidden (the cores "
              f"that compute also reduce). From `{machine.source}` and " + ", ".join(f"`{s}`" for s in sources
                                                                                     if s != machine.source)
              + " via `cluster_model/inputs/measured-v2.json`.", "",
              "| quantity | setup | measured | model | model / measured | mechanism |", "|---|---|---|---|---|---|"]
    for row in rows:
        digits = 3 if row.unit == "s" else 2
        lines.append(f"| {row.quantity} | {row.setup} | {row.measured:.{digits}f} {row.unit} | "
                     f"{row.model:.{digits}f} {row.unit} | {row.model_over_measured:.2f} | {row.mechanism} |")
    lines += ["", _where_they_differ(measured, rows), ""]
    return lines


def _where_they_differ(measured: Measured, rows: list[CalibrationRow]) -> str:
    ratios = list(zip((row.model_over_measured for row in rows), measured.allreduce, strict=False))
    piped = [r for r, cell in ratios if cell.size_bytes >= 16 * _MIB]
    single = [r for r, cell in ratios if cell.size_bytes < 16 * _MIB]
    ddp = [row.model_over_measured for row in rows[len(measured.allreduce):]]
    spans = [f"{name} {min(values):.2f}-{max(values):.2f}" for name, values in
             (("allreduce of 16 MiB and more", piped), ("1 MiB (one chunk)", single), ("DDP steps", ddp)) if values]
    return ("Where they differ (model / measured: " + ", ".join(spans) + "): the model runs each stage at the "
            "measured all-core bandwidth and knows nothing of more processes than cores taking turns, Python, "
            "futex wake-ups or TCP's per-segment work, nor of other load on this shared machine, so its "
            "bandwidths sit above the measurement (and its steps below) as ranks and namespace nodes are added; "
            "a 1 MiB message is one chunk, with no pipeline to spread those per-operation costs over.")
