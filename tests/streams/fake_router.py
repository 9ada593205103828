"""A deliberately simple Router for the service tests (never shipped in streams/).

Spreads queries over the instances with the most free slots, charges each query its
model's price for the prompt plus ``OUTPUT_TOKENS`` output tokens, and defers what does
not fit in the free slots or the window budget. It obeys the ``Router`` contract
(one decision per query, in order), which is all the service relies on.
"""

from __future__ import annotations

from collections.abc import Sequence

from routing.types import Budget, InstanceView
from schemas import ClusterConfig, Decision, DecisionFlag, DecisionStatus, Query

OUTPUT_TOKENS = 32


class SpreadRouter:
    name = "test-spread"

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
            choices = sorted(instances, key=lambda v: self._rank(v, free))
            chosen = choices[0] if choices and free[choices[0].instance_id] > 0 else None
            if chosen is None:
                out.append(self._deferred(q, now, "no free slot"))
                continue
            model = self.cluster.model(chosen.model)
            output = self._output_tokens(q)
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

    def _rank(self, v: InstanceView, free: dict[str, int]) -> tuple[int | str, ...]:
        return (-free[v.instance_id],)  # most free slots first; ties keep cluster order

    def _output_tokens(self, q: Query) -> int:
        return OUTPUT_TOKENS

    def _deferred(self, q: Query, now: float, reason: str) -> Decision:
        return Decision(
            query_id=q.id,
            tenant=q.tenant,
            status=DecisionStatus.DEFERRED,
            policy=self.name,
            decided_at=now,
            reason=reason,
        )


def factory(cluster: ClusterConfig) -> SpreadRouter:
    return SpreadRouter(cluster)
