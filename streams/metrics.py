"""Prometheus metrics of the router (issue 7, item 7).

One registry per ``RouterMetrics`` so tests and several apps in one process do not
collide; ``serve(port)`` exposes it over HTTP (``/metrics``).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter as Tally
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


class RouterMetrics:
    """Counters, gauges and histograms the router updates once per window."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.batch_size = Histogram(
            "switchyard_router_batch_size",
            "Queries per routing window",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.decide_seconds = Histogram(
            "switchyard_router_decide_seconds",
            "Router.decide time per window",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.window_seconds = Histogram(
            "switchyard_router_window_seconds",
            "Whole window handling time (validate → produce acknowledged)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.added_latency_seconds = Histogram(
            "switchyard_router_added_latency_seconds",
            "Kafka timestamp of the query → its routed message acknowledged",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_lag = Gauge(
            "switchyard_router_queue_lag_messages",
            "queries not yet read, per partition",
            ["partition"],
            registry=r,
        )
        self.decisions = Counter(
            "switchyard_router_decisions_total", "Final decisions by status", ["status"], registry=r
        )
        self.flags = Counter(
            "switchyard_router_decision_flags_total", "Decision flags", ["flag"], registry=r
        )
        self.routed = Counter(
            "switchyard_router_routed_total",
            "Queries sent to each instance",
            ["instance"],
            registry=r,
        )
        self.spend_usd = Counter(
            "switchyard_router_reserved_usd_total",
            "Predicted cost reserved in the ledger",
            ["tenant"],
            registry=r,
        )
        self.budget_usd = Gauge(
            "switchyard_router_budget_usd",
            "Each tenant's budget for its current period",
            ["tenant"],
            registry=r,
        )
        self.committed_usd = Gauge(
            "switchyard_router_committed_usd",
            "Reserved + spent in each tenant's current period (Redis ledger, read per window)",
            ["tenant"],
            registry=r,
        )
        self.slo_predicted_met = Counter(
            "switchyard_router_slo_predicted_met_total",
            "Routed queries whose predicted TTFT meets their SLO",
            registry=r,
        )
        self.slo_predicted_total = Counter(
            "switchyard_router_slo_predicted_total",
            "Routed queries with a TTFT prediction",
            registry=r,
        )
        self.instance_slots_used = Gauge(
            "switchyard_router_instance_slots_used",
            "Capacity slots held per instance",
            ["instance"],
            registry=r,
        )
        self.instance_stale = Gauge(
            "switchyard_router_instance_stale",
            "1 when the instance's snapshot is stale or missing",
            ["instance"],
            registry=r,
        )
        self.dead_letters = Counter(
            "switchyard_router_dead_letters_total",
            "Messages sent to dead-letters",
            ["stage"],
            registry=r,
        )
        self.held = Gauge(
            "switchyard_router_held_queries", "Queries held for a later window", registry=r
        )
        self.errors = Counter(
            "switchyard_router_window_errors_total",
            "Windows retried after a Redis or Kafka error",
            ["kind"],
            registry=r,
        )

        self.step_time_coefficient = Gauge(
            "switchyard_router_step_time_coefficient",
            "Eq. 9 coefficients of each model as its workers refit them online (ms per unit; "
            "c0 per step, c1 per token, c2 per decode ctx token, c3 per attention unit)",
            ["model", "coefficient"],
            registry=r,
        )
        self.step_time_version = Gauge(
            "switchyard_router_step_time_version",
            "Version of the online coefficients read (0: none)",
            ["model"],
            registry=r,
        )
        self.step_time_in_use = Gauge(
            "switchyard_router_step_time_online",
            "1 while SFS uses the online coefficients of the model, 0: the configured ones",
            ["model"],
            registry=r,
        )
        self.step_time_ttft_error = Gauge(
            "switchyard_router_live_ttft_error",
            "Mean |predicted - measured| / measured TTFT of the model's recent requests, as "
            "its worker reports it with the coefficients",
            ["model"],
            registry=r,
        )
        self.dispatch_ms = Gauge(
            "switchyard_router_dispatch_ms",
            "Median delay from a decision to the engine receiving the query, as the model's "
            "workers measure it; added to every TTFT the router predicts there",
            ["model"],
            registry=r,
        )

    def observe_step_times(self, records: Mapping[str, Any], in_use: Mapping[str, Any]) -> None:
        """The online step-time records read this window (``state.LiveStepTime``)."""
        for model, rec in records.items():
            c = rec.coefficients
            for name, value in (
                ("c0_ms", c.c0_ms),
                ("c1_ms_per_token", c.c1_ms_per_token),
                ("c2_ms_per_ctx_token", c.c2_ms_per_ctx_token),
                ("c3_ms_per_attn_unit", c.c3_ms_per_attn_unit),
            ):
                self.step_time_coefficient.labels(model, name).set(value)
            self.step_time_version.labels(model).set(rec.version)
            if rec.ttft_error is not None:
                self.step_time_ttft_error.labels(model).set(rec.ttft_error)
            if rec.dispatch_ms is not None:
                self.dispatch_ms.labels(model).set(rec.dispatch_ms)
        for model in set(records) | set(in_use):
            self.step_time_in_use.labels(model).set(1 if model in in_use else 0)

    def observe_budgets(self, budgets: dict[str, float], committed: dict[str, float]) -> None:
        for tenant, usd in committed.items():
            self.committed_usd.labels(tenant).set(usd)
            if tenant in budgets:
                self.budget_usd.labels(tenant).set(budgets[tenant])

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)


def observe_many(histogram: Histogram, amounts: Iterable[float]) -> None:
    """``histogram.observe(a)`` for each amount, with one increment per bucket and one of the
    sum (``observe`` walks the bucket bounds in Python and takes a lock per increment: ~1.3
    µs an amount, once per routed query). An unlabelled histogram of prometheus_client's
    layout only; any other is observed one amount at a time."""
    values = [float(a) for a in amounts]
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for v in values:
            histogram.observe(v)
        return
    if not values:
        return
    histogram._raise_if_not_observable()  # type: ignore[no-untyped-call]
    # the first bound >= the amount, as observe's loop finds it; NaN fits no bucket
    counts = Tally(bisect_left(bounds, v) for v in values if v == v)
    total.inc(sum(values))
    for i, n in counts.items():
        buckets[i].inc(n)
