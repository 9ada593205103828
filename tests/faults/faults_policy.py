"""A test-only routing policy for the fault scenarios (``--policy faults_policy:factory``).

The scenarios test the service's guarantees (nothing lost, nothing twice, hard limits), not
routing quality, so they use this cheap, deterministic policy unless the product's own
policies (``routing.policies``) are installed. It is the service tests' ``SpreadRouter``
(one decision per query, in order; most free slots first; LPS/stale flags when an instance
has no live state) with two differences: ties go to the lowest instance id, and a query is
charged for its own ``max_tokens`` (the worst case, so a reservation always covers what a
worker may spend).
"""

from __future__ import annotations

from routing.types import InstanceView
from schemas import ClusterConfig, Query
from tests.streams.fake_router import SpreadRouter

DEFAULT_OUTPUT_TOKENS = 64


class LeastLoaded(SpreadRouter):
    name = "faults-least-loaded"

    def _rank(self, v: InstanceView, free: dict[str, int]) -> tuple[int | str, ...]:
        return (-free[v.instance_id], v.instance_id)

    def _output_tokens(self, q: Query) -> int:
        return q.output_cap_tokens() or DEFAULT_OUTPUT_TOKENS


def factory(cluster: ClusterConfig) -> LeastLoaded:
    return LeastLoaded(cluster)
