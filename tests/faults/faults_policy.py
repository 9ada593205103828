"""A test-only routing policy for the fault scenarios (``--policy faults_policy:factory``).

The scenarios test the service's guarantees (nothing lost, nothing twice, hard limits), not
routing quality, so they use this cheap, deterministic policy unless the product's own
policies (``routing.policies``) are installed. It obeys the ``Router`` contract: one
decision per query, in order; least-loaded instance; cost = the model's price for the
prompt plus the query's ``max_tokens`` (the worst case, so a reservation always covers
what a worker may spend); LPS/stale flags when an instance has no live state.
"""

from __future__ import annotations

from collections.abc import Sequence

from routing.types import Budget, InstanceView
from schemas import ClusterConfig, Decision, DecisionFlag, DecisionStatus, Query

DEFAULT_OUTPUT_TOKENS = 64


class LeastLoaded:
    name = "faults-least-loaded"

    def __init__(self, cluster: ClusterConfig) -> None:
        self.cluster = cluster

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        free = {v.instance_id: v.free_slots for v in instances}
        left = dict(budget.tenant_remaining_usd)
        window = budget.window_usd
        out: list[Decision] = []
        for q in queries:
            ranked = sorted(instances, key=lambda v: (-free[v.instance_id], v.instance_id))
            chosen = ranked[0] if ranked and free[ranked[0].instance_id] > 0 else None
            if chosen is None:
                out.append(self._deferred(q, now, "no free slot"))
                continue
            model = self.cluster.model(chosen.model)
            output = q.output_cap_tokens() or DEFAULT_OUTPUT_TOKENS
            cost = model.cost_usd(q.estimated_prompt_tokens(), output)
            if cost > left.get(q.tenant, float("inf")) or cost > window:
                out.append(self._deferred(q, now, "window budget"))
                continue
            free[chosen.instance_id] -= 1
            left[q.tenant] = left.get(q.tenant, float("inf")) - cost
            window -= cost
            flags = (
                [DecisionFlag.LPS_ESTIMATE, DecisionFlag.STALE_STATE]
                if chosen.state is None
                else []
            )
            out.append(
                Decision(
                    query_id=q.id,
                    tenant=q.tenant,
                    status=DecisionStatus.ROUTED,
                    instance_id=chosen.instance_id,
                    model=chosen.model,
                    policy=self.name,
                    flags=flags,
                    predicted_cost_usd=cost,
                    predicted_ttft_ms=10.0,
                    predicted_output_tokens=output,
                    decided_at=now,
                )
            )
        return out

    def _deferred(self, q: Query, now: float, reason: str) -> Decision:
        return Decision(
            query_id=q.id,
            tenant=q.tenant,
            status=DecisionStatus.DEFERRED,
            policy=self.name,
            decided_at=now,
            reason=reason,
        )


def factory(cluster: ClusterConfig) -> LeastLoaded:
    return LeastLoaded(cluster)
