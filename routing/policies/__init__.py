"""Routing policies behind one ``Router`` protocol, picked by name (``make_router``).

round-robin, shortest-queue, latency-agnostic (paper A baselines); prefix-affinity (the
serving routers' prefix match + load baseline); latency-aware
(paper A, SFS + δ penalty); per-query-robust (paper A on paper B's lower bounds);
batch-ilp (paper B); batch-ilp-sfs (both, the default).
"""

from routing.policies.context import RouterContext, SfsTtft
from routing.policies.registry import (
    DEFAULT_POLICY,
    ROUTERS,
    effective_options,
    make_router,
    parse_options,
)

__all__ = [
    "DEFAULT_POLICY",
    "ROUTERS",
    "RouterContext",
    "SfsTtft",
    "effective_options",
    "make_router",
    "parse_options",
]
