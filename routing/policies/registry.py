"""Every policy by name: ``make_router(name, ctx, **options)``."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
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


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["delta=0.1", "robust=true", "method=greedy"]`` → ``{"delta": 0.1, "robust": True,
    "method": "greedy"}`` (``--policy-opt key=value``): true/false/none, an int, a finite
    float, else the text. ``ValueError`` naming the item that is not ``key=value``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key.isidentifier():
            raise ValueError(f"policy option {item!r} is not key=value (e.g. delta=0.1)")
        out[key] = _value(raw.strip())
    return out


def _value(raw: str) -> Any:
    low = raw.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(raw)
    except ValueError:
        pass
    try:
        x = float(raw)
    except ValueError:
        return raw
    if not math.isfinite(x):
        raise ValueError(f"policy option value {raw!r} is not finite")
    return x


def effective_options(name: str, **options: Any) -> dict[str, Any]:
    """Every knob of policy ``name`` with the value it runs with: ``options`` over the
    constructor's defaults (what ``switchyard router`` and ``simulate`` log at start)."""
    factory = ROUTERS.get(name)
    if factory is None:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(ROUTERS)}")
    out: dict[str, Any] = {}
    for pname, param in inspect.signature(factory).parameters.items():
        if pname == "ctx" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if param.default is not param.empty:
            default = param.default
            if default is None:  # resolved by the class itself (e.g. batch-ilp-sfs's delta)
                default = getattr(factory, f"default_{pname}", None)
            out[pname] = default
    unknown = sorted(set(options) - set(out))
    if unknown:
        raise ValueError(
            f"policy {name!r} has no option {', '.join(unknown)}; it has {', '.join(sorted(out))}"
        )
    return {**out, **options}
