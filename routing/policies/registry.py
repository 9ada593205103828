"""Every policy by name: ``make_router(name, ctx, **options)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from routing.policies.batch_ilp import BatchIlpRouter
from routing.policies.batch_ilp_sfs import BatchIlpSfsRouter
from routing.policies.constrained import ModelConstrained
from routing.policies.context import RouterContext
from routing.policies.latency_agnostic import LatencyAgnosticRouter
from routing.policies.latency_aware import LatencyAwareRouter
from routing.policies.per_query_robust import PerQueryRobustRouter
from routing.policies.prefix_affinity import PrefixAffinityRouter
from routing.policies.round_robin import RoundRobinRouter
from routing.policies.shortest_queue import ShortestQueueRouter
from routing.types import Router

DEFAULT_POLICY = "batch-ilp-sfs"

ROUTERS: dict[str, Callable[..., Any]] = {
    "round-robin": RoundRobinRouter,
    "shortest-queue": ShortestQueueRouter,
    "prefix-affinity": PrefixAffinityRouter,
    "latency-agnostic": LatencyAgnosticRouter,
    "latency-aware": LatencyAwareRouter,
    "per-query-robust": PerQueryRobustRouter,
    "batch-ilp": BatchIlpRouter,
    "batch-ilp-sfs": BatchIlpSfsRouter,
}


def make_router(name: str, ctx: RouterContext, **options: Any) -> Router:
    """Build the policy ``name``; ``options`` go to its constructor (e.g. ``delta``,
    ``method``, ``gap_tol``, ``deadline_ms``, ``max_ttft_rounds``). Every policy honours a
    query's ``model`` (``ModelConstrained``)."""
    factory = ROUTERS.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(ROUTERS)}")
    try:
        router: Router = factory(ctx, **options)
    except TypeError as exc:
        raise ValueError(f"policy {name!r}: bad options {sorted(options)}: {exc}") from None
    return ModelConstrained(router, ctx.cluster)
