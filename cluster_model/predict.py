"""Predictions of the paper's figures the reference file does not give: inputs only, no paper values.

The reference file holds the paper's inputs and a few calibration points; :mod:`reproduce` checks the
model against those. The figures here are the paper's other results, predicted from their setups (GPU
counts, models, batch sizes, topologies) with the same mechanisms and no constant chosen per figure.
Each :class:`Prediction` names the mechanism that sets its value, so a reader can see *why* a point
is where it is and which assumption (``cluster_model/README.md``) it rests on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cluster_model.collectives import AllreduceResult
from cluster_model.reproduce import FIG7A_MESSAGE_BYTES

if TYPE_CHECKING:
    from cluster_model.cluster import Cluster

__all__ = ["FIG7A_GPUS", "FIG7B_ONE_ZONE_GPUS", "FIG7B_TWO_ZONE_GPUS", "Prediction", "allreduce_predictions",
           "predictions"]


@dataclass(frozen=True)
class Prediction:
    """One predicted point of one of the paper's figures."""

    section: str          # "Table III", "Fig. 7a", ...
    setup: str            # the point's inputs: "1,024 GPUs, one zone", "design (b)"
    quantity: str         # what is predicted: "HFReduce allreduce bandwidth, 186 MiB"
    value: float
    unit: str
    mechanism: str        # what sets the value: "NIC: 2 bytes per byte through one 25 GB/s NIC"


#: Fig. 7a continued: the allreduce of 186 MiB at these GPU counts, inside one zone.
FIG7A_GPUS = (128, 256, 512, 1024, 1440)
#: Fig. 7b: HFReduce with NVLink inside one zone, and with the job spread over the two zones.
FIG7B_ONE_ZONE_GPUS = (16, 32, 64, 128, 256, 512, 1024)
FIG7B_TWO_ZONE_GPUS = (128, 256, 512, 1024)


def _allreduce_mechanism(result: AllreduceResult) -> str:
    """What set one allreduce's bandwidth: the bound, and where its tree lay on the fabric."""
    text = f"{result.bound} sets {result.bound_gbs:.2f} GB/s"
    traffic = result.traffic
    if traffic is None:
        return text + "; one node, no network"
    where = f"{traffic.leaves} leaf switch{'es' if traffic.leaves > 1 else ''}"
    if traffic.zones > 1:
        where += f" in {traffic.zones} zones"
    shared = (f"busiest shared link {traffic.network_load:g} B/B (NIC {traffic.nic_load:g})"
              if traffic.network_load else "no switch-to-switch link")
    return (f"{text}; tree depth {traffic.depth} over {where}, {traffic.deepest_path_switches} switches on the "
            f"deepest path; {shared}; pipeline fill {result.fill_s * 1e3:.2f} of {result.time_s * 1e3:.1f} ms")


def allreduce_predictions(cluster: Cluster) -> list[Prediction]:
    """Fig. 7a continued (HFReduce and NCCL, one zone) and Fig. 7b (HFReduce with NVLink, one zone and two)."""
    collective = cluster.collective
    size = FIG7A_MESSAGE_BYTES
    rows: list[Prediction] = []
    for gpus in FIG7A_GPUS:
        for name, result in (("HFReduce", collective.hfreduce(gpus, size)), ("NCCL", collective.nccl(gpus, size))):
            rows.append(Prediction("Fig. 7a", f"{gpus:,} GPUs, one zone", f"{name} allreduce bandwidth, 186 MiB",
                                   result.algbw_gbs, "GB/s", _allreduce_mechanism(result)))
    # The second panel spreads the job over two zones; a fabric of one zone has no such points (they
    # would repeat the one-zone rows under the same label).
    for zones, counts in ((1, FIG7B_ONE_ZONE_GPUS), (2, FIG7B_TWO_ZONE_GPUS)):
        if zones > cluster.fabric.zones:
            continue
        for gpus in counts:
            result = collective.hfreduce(gpus, size, nvlink=True, zones=zones)
            setup = f"{gpus:,} GPUs, " + ("one zone" if zones == 1 else f"spread over {zones} zones")
            rows.append(Prediction("Fig. 7b", setup, "HFReduce with NVLink allreduce bandwidth, 186 MiB",
                                   result.algbw_gbs, "GB/s", _allreduce_mechanism(result)))
    return rows


def predictions(cluster: Cluster) -> list[Prediction]:
    """Every predicted point, in the paper's order: Table III, Fig. 7a and 7b, Fig. 8 and 9, power."""
    from cluster_model.designs import power_predictions, table_iii_predictions
    from cluster_model.scaling import training_predictions

    return [*table_iii_predictions(cluster), *allreduce_predictions(cluster),
            *training_predictions(cluster, cluster.collective), *power_predictions(cluster)]
