"""Prometheus metrics of the gateway (served on its own ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "switchyard_gateway_requests_total",
            "HTTP requests by endpoint and status code",
            ["endpoint", "code"],
            registry=r,
        )
        self.seconds = Histogram(
            "switchyard_gateway_request_seconds",
            "Request received → response finished",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.first_chunk_seconds = Histogram(
            "switchyard_gateway_first_chunk_seconds",
            "Streaming request received → first text chunk sent",
            buckets=_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "switchyard_gateway_in_flight", "Requests waiting for their answer", registry=r
        )
        self.relay_fallbacks = Counter(
            "switchyard_gateway_relay_fallbacks_total",
            "Streams finished from the Result because relayed chunks did not arrive",
            registry=r,
        )
