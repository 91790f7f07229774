"""Predictions of the paper's figures the reference file does not give: inputs only, no paper values.

The reference file holds the paper's inputs and a few calibration points; :mod:`reproduce` checks the
model against those. The figures here are the paper's other results, predicted from their setups (GPU
counts, models, batch sizes, topologies) with the same mechanisms and no constant chosen per figure.
Each :class:`Prediction` names the mechanism that sets its value, so a reader can see *why* a point
is where it is and which assumption (``cluster_model/README.md``) it rests on.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Prediction"]


@dataclass(frozen=True)
class Prediction:
    """One predicted point of one of the paper's figures."""

    section: str          # "Table III", "Fig. 7a", ...
    setup: str            # the point's inputs: "1,024 GPUs, one zone", "design (b)"
    quantity: str         # what is predicted: "HFReduce allreduce bandwidth, 186 MiB"
    value: float
    unit: str
    mechanism: str        # what sets the value: "NIC: 2 bytes per byte through one 25 GB/s NIC"
