"""Per-query robust routing: paper A's latency-aware rule on paper B's lower bounds."""

from __future__ import annotations

from routing.policies.latency_aware import LatencyAwareRouter


class PerQueryRobustRouter(LatencyAwareRouter):
    """Like ``latency-aware`` but maximises the robust lower bound of quality."""

    name = "per-query-robust"
    robust = True
