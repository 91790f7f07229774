"""mgmtd's cluster gauges: capacity, target states, chain health and node liveness, from its state.

mgmtd is the one process that sees the whole cluster (every node's heartbeat, every target's
states and space, every chain), so the cluster-wide gauges an operator alerts on come from here,
not from summing what each storage node says about itself. :func:`cluster_families` is a plain
function of :class:`MgmtdState` and a time; the service publishes its result through a
:class:`~fs3.common.metrics.SnapshotCollector`.

State gauges follow the Prometheus way of exporting an enum: one series per possible state, 1 for
the state the target is in and 0 for the others, so ``fs3_target_public_state{state="offline"} == 1``
selects the offline targets and ``sum by (state)`` counts them.
"""

from __future__ import annotations

from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from fs3.common.metrics import service_label
from fs3.common.target_state import LocalState, PublicState
from fs3.mgmtd.state import MgmtdState

__all__ = ["cluster_families"]

def cluster_families(state: MgmtdState, now_ms: int) -> list[Metric]:
    """Every cluster gauge for the state as it is at ``now_ms`` (mgmtd's clock)."""
    node_alive = GaugeMetricFamily("fs3_node_alive", "1 while the node heartbeats within the timeout, else 0",
                                   labels=["node_id", "service"])
    heartbeat_age = GaugeMetricFamily("fs3_node_heartbeat_age_seconds",
                                      "Seconds since mgmtd last heard the node's heartbeat",
                                      labels=["node_id", "service"])
    for node_id in sorted(state.nodes):
        record = state.nodes[node_id]
        labels = [str(node_id), service_label(record.info.node_type)]
        node_alive.add_metric(labels, 1.0 if record.alive else 0.0)
        heartbeat_age.add_metric(labels, max(0, now_ms - record.last_heartbeat_ms) / 1000)

    target_capacity = GaugeMetricFamily("fs3_target_capacity_bytes", "Size of the file system the target is on",
                                        labels=["target_id", "node_id"])
    target_used = GaugeMetricFamily("fs3_target_used_bytes", "Bytes of chunk data stored on the target",
                                    labels=["target_id", "node_id"])
    target_free = GaugeMetricFamily("fs3_target_free_bytes", "Bytes free on the file system the target is on",
                                    labels=["target_id", "node_id"])
    target_chunks = GaugeMetricFamily("fs3_target_chunks", "Chunks stored on the target",
                                      labels=["target_id", "node_id"])
    public = GaugeMetricFamily("fs3_target_public_state",
                               "1 for the target's public state (serving, syncing, waiting, lastsrv, offline)",
                               labels=["target_id", "node_id", "chain_id", "state"])
    local = GaugeMetricFamily("fs3_target_local_state",
                              "1 for the target's local state as its node reports it (up_to_date, online, offline)",
                              labels=["target_id", "node_id", "state"])
    node_capacity: dict[int, int] = {}
    node_used: dict[int, int] = {}
    node_free: dict[int, int] = {}
    for target_id in sorted(state.targets):
        target = state.targets[target_id]
        info = target.info
        labels = [str(target_id), str(info.node_id)]
        target_capacity.add_metric(labels, info.capacity_bytes)
        target_used.add_metric(labels, info.used_bytes)
        target_free.add_metric(labels, info.free_bytes)
        target_chunks.add_metric(labels, info.chunk_count)
        current = target.public_state
        for ps in PublicState:
            public.add_metric([*labels, str(info.chain_id), ps.name.lower()], 1.0 if ps is current else 0.0)
        for ls in LocalState:
            local.add_metric([*labels, ls.name.lower()], 1.0 if ls is target.local_state else 0.0)
        node_capacity[info.node_id] = node_capacity.get(info.node_id, 0) + info.capacity_bytes
        node_used[info.node_id] = node_used.get(info.node_id, 0) + info.used_bytes
        node_free[info.node_id] = node_free.get(info.node_id, 0) + info.free_bytes

    # Sums over the node's targets (targets sharing one file system count its size once each).
    capacity = GaugeMetricFamily("fs3_node_capacity_bytes", "Size of the node's targets' file systems together",
                                 labels=["node_id"])
    used = GaugeMetricFamily("fs3_node_used_bytes", "Bytes of chunk data on the node's targets together",
                             labels=["node_id"])
    free = GaugeMetricFamily("fs3_node_free_bytes", "Bytes free on the node's targets' file systems together",
                             labels=["node_id"])
    for node_id in sorted(node_capacity):
        capacity.add_metric([str(node_id)], node_capacity[node_id])
        used.add_metric([str(node_id)], node_used[node_id])
        free.add_metric([str(node_id)], node_free[node_id])

    chain_targets = GaugeMetricFamily("fs3_chain_targets", "Targets in the chain", labels=["chain_id"])
    chain_serving = GaugeMetricFamily("fs3_chain_serving_targets", "Targets of the chain serving reads and writes",
                                      labels=["chain_id"])
    chain_syncing = GaugeMetricFamily("fs3_chain_syncing_targets",
                                      "Targets of the chain being resynced from their predecessor",
                                      labels=["chain_id"])
    degraded = unavailable = syncing_total = 0
    for chain_id in sorted(state.chains):
        ids = list(state.chains[chain_id].target_ids)
        states = [state.targets[t].public_state for t in ids if t in state.targets]
        serving = sum(1 for s in states if s is PublicState.SERVING)
        syncing = sum(1 for s in states if s is PublicState.SYNCING)
        chain_targets.add_metric([str(chain_id)], len(ids))
        chain_serving.add_metric([str(chain_id)], serving)
        chain_syncing.add_metric([str(chain_id)], syncing)
        degraded += serving < len(ids)
        unavailable += serving == 0
        syncing_total += syncing

    return [
        node_alive, heartbeat_age, target_capacity, target_used, target_free, target_chunks, public, local,
        capacity, used, free, chain_targets, chain_serving, chain_syncing,
        GaugeMetricFamily("fs3_chains", "Chains in every chain table", value=len(state.chains)),
        GaugeMetricFamily("fs3_chains_degraded", "Chains with a target that is not serving", value=degraded),
        GaugeMetricFamily("fs3_chains_unavailable", "Chains with no serving target: their files cannot be read",
                          value=unavailable),
        GaugeMetricFamily("fs3_targets_syncing", "Targets being resynced (recovery in progress)",
                          value=syncing_total),
        GaugeMetricFamily("fs3_cluster_capacity_bytes", "Size of every target's file system together",
                          value=sum(node_capacity.values())),
        GaugeMetricFamily("fs3_cluster_used_bytes", "Bytes of chunk data on every target together",
                          value=sum(node_used.values())),
        GaugeMetricFamily("fs3_cluster_free_bytes", "Bytes free on every target's file system together",
                          value=sum(node_free.values())),
    ]
