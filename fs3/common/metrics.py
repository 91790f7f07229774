"""Prometheus metrics: one registry and one ``/metrics`` HTTP port per service process, mount or client.

Metrics objects are created per service instance against its own registry so that several
services (the simulator, tests) can live in one process without name clashes.

Every name follows the Prometheus conventions: base units (seconds, bytes) as the last word of
the name, before the ``_total`` a counter gets; no ``_created`` series (they double the series
count of every counter and no query here uses them). The names a dashboard or a tool reads are
listed in this module, one catalogue for the services, the mount and the client library
(docs/operations.md says what each means).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

from fs3 import common_pb2 as cpb

__all__ = ["ClientMetrics", "MetricsEndpoint", "MountMetrics", "ServiceMetrics", "SnapshotCollector",
           "add_process_collectors", "file_sd_groups", "serve_metrics", "service_label", "start_metrics_endpoint"]

# No ``_created`` series anywhere in the process (a module-level switch of prometheus_client).
disable_created_metrics()  # type: ignore[no-untyped-call]

_SERVICE_OF_NODE_TYPE: dict[int, str] = {cpb.NODE_MGMTD: "mgmtd", cpb.NODE_META: "meta",
                                          cpb.NODE_STORAGE: "storage", cpb.NODE_CLIENT: "client"}

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def add_process_collectors(registry: CollectorRegistry) -> None:
    """``process_*`` (CPU seconds, resident memory, open fds, start time), ``python_info`` and
    ``python_gc_*`` in ``registry``: every fs3 process exports them, so a dashboard shows each
    process's resources next to its requests."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


@dataclass
class ServiceMetrics:
    """RPC-level metrics every service exports, plus a registry for service-specific ones."""

    service: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        add_process_collectors(self.registry)
        # Exported as fs3_rpc_requests_total{service, method, code}.
        self.rpc_requests = Counter(
            "fs3_rpc_requests", "RPC requests handled", ["service", "method", "code"], registry=self.registry
        )
        self.rpc_latency_seconds = Histogram(
            "fs3_rpc_latency_seconds",
            "RPC handling latency",
            ["service", "method"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        # fs3_rpc_payload_received_bytes_total / fs3_rpc_payload_sent_bytes_total.
        self.rpc_bytes_in = Counter("fs3_rpc_payload_received_bytes", "Bulk payload bytes received", ["service"],
                                    registry=self.registry)
        self.rpc_bytes_out = Counter("fs3_rpc_payload_sent_bytes", "Bulk payload bytes sent", ["service"],
                                     registry=self.registry)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(name, doc, list(labels), buckets=_LATENCY_BUCKETS_S, registry=self.registry)


class ClientMetrics:
    """What the client library counts for one connection: bytes through its files and its caches.

    Always kept (a counter increment per read or write call); served only when the client is given
    a metrics port (``fs3.connect(..., metrics_port=N)``, ``fs3 mount --metrics-port N``).
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, process: bool = True) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        if process:
            add_process_collectors(self.registry)
        self.read_bytes = Counter("fs3_client_read_bytes", "Bytes returned to readers of fs3 files",
                                  registry=self.registry)
        self.written_bytes = Counter("fs3_client_written_bytes", "Bytes accepted from writers of fs3 files",
                                     registry=self.registry)
        # cache: readahead (a sequential read found its piece already fetched), attr (the mount's
        # attribute cache answered a getattr), xattr (a remembered "no security.capability").
        self.cache_hits = Counter("fs3_client_cache_hits", "Lookups a client-side cache answered", ["cache"],
                                  registry=self.registry)
        self.cache_misses = Counter("fs3_client_cache_misses", "Lookups a client-side cache could not answer",
                                    ["cache"], registry=self.registry)
        self._hit = {name: self.cache_hits.labels(name) for name in ("readahead", "attr", "xattr")}
        self._miss = {name: self.cache_misses.labels(name) for name in ("readahead", "attr", "xattr")}

    def cache(self, name: str, hit: bool) -> None:
        """Count one lookup in cache ``name`` (readahead, attr or xattr)."""
        (self._hit if hit else self._miss)[name].inc()


class MountMetrics:
    """The FUSE mount's own families, in its client's registry: per operation, what the kernel asked."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ops = Counter("fs3_fuse_ops", "FUSE requests answered", ["op"], registry=registry)
        self.errors = Counter("fs3_fuse_op_errors", "FUSE requests answered with an error", ["op", "errno"],
                              registry=registry)
        self.latency = Histogram("fs3_fuse_op_duration_seconds", "Time to answer a FUSE request", ["op"],
                                 buckets=_LATENCY_BUCKETS_S, registry=registry)
        self.read_bytes = Counter("fs3_fuse_read_bytes", "Bytes answered to FUSE reads", registry=registry)
        self.written_bytes = Counter("fs3_fuse_written_bytes", "Bytes taken from FUSE writes", registry=registry)
        self._children: dict[str, tuple[Counter, Histogram]] = {}

    def op(self, name: str) -> tuple[Counter, Histogram]:
        """The counter and histogram of one operation (cached: a request costs no label lookup)."""
        children = self._children.get(name)
        if children is None:
            children = (self.ops.labels(name), self.latency.labels(name))
            self._children[name] = children
        return children


class SnapshotCollector(Collector):
    """Serves the metric families last published: computed on the event loop, read by the HTTP thread.

    The scrape runs on prometheus_client's server thread while the state it describes changes on the
    event loop; reading that state from the thread could see it half-changed (or a dict changing
    size). The loop builds the families at its own pace and swaps the list in (one reference
    assignment, atomic); families of targets or nodes that are gone simply stop being published.
    """

    def __init__(self) -> None:
        self._families: tuple[Metric, ...] = ()

    def publish(self, families: Iterable[Metric]) -> None:
        self._families = tuple(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names change with the cluster: nothing to check at registration


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP server; ``close`` stops it (only in the process that started it:
    a forked child has no server thread, and waiting for one would hang)."""

    server: WSGIServer
    thread: threading.Thread
    port: int
    pid: int

    def close(self) -> None:
        if self.pid != os.getpid():
            return
        self.server.shutdown()
        self.server.server_close()


def start_metrics_endpoint(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serve ``registry`` on ``http://host:port/metrics`` from a daemon thread (``port=0``: a free one)."""
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsEndpoint(server, thread, int(server.server_address[1]), os.getpid())


def serve_metrics(metrics: ServiceMetrics, host: str, port: int) -> int:
    """Start the ``/metrics`` endpoint; returns the bound port (``port=0`` picks a free one)."""
    return start_metrics_endpoint(metrics.registry, host, port).port


def service_label(node_type: int) -> str:
    """The ``service`` label of a node type (``mgmtd``, ``meta``, ``storage``, ``client``)."""
    return _SERVICE_OF_NODE_TYPE.get(node_type, "unknown")


def file_sd_groups(nodes: Iterable[cpb.NodeInfo], mgmtd_metrics_address: str = "") -> list[dict[str, object]]:
    """Prometheus ``file_sd_configs`` target groups: one per process with a /metrics endpoint.

    Every registered node is listed, alive or not (a dead node's failed scrape is what ``up == 0``
    alerts on); a node that serves no metrics (its port set to -1) has nothing to scrape and is
    left out. Labels: ``service`` and ``node_id`` (mgmtd, not a registered node, has ``node_id`` 0).
    """
    groups: list[dict[str, object]] = []
    if mgmtd_metrics_address:
        groups.append({"targets": [mgmtd_metrics_address], "labels": {"service": "mgmtd", "node_id": "0"}})
    for node in sorted(nodes, key=lambda n: n.node_id):
        if node.metrics_address:
            groups.append({"targets": [node.metrics_address],
                           "labels": {"service": service_label(node.node_type), "node_id": str(node.node_id)}})
    return groups
