"""Prometheus metrics: one registry and one ``/metrics`` HTTP port per service process.

Metrics objects are created per service instance against its own registry so that several
services (the simulator, tests) can live in one process without name clashes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["ServiceMetrics", "serve_metrics"]

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass
class ServiceMetrics:
    """RPC-level metrics every service exports, plus a registry for service-specific ones."""

    service: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
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
        self.rpc_bytes_in = Counter("fs3_rpc_payload_bytes_in", "Bulk payload bytes received", ["service"],
                                    registry=self.registry)
        self.rpc_bytes_out = Counter("fs3_rpc_payload_bytes_out", "Bulk payload bytes sent", ["service"],
                                     registry=self.registry)

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name, doc, list(labels), registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=self.registry)


def serve_metrics(metrics: ServiceMetrics, host: str, port: int) -> int:
    """Start the ``/metrics`` endpoint; returns the bound port (``port=0`` picks a free one)."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return int(server.server_address[1])
