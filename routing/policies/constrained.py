"""A query's ``model`` as a routing constraint, around any policy.

OpenAI requests name a model. A query whose ``model`` is a model of the cluster, or a
group of them (``ClusterConfig.model_groups``), may only go to instances of those models;
``auto`` (``schemas.cluster.ANY_MODEL``, or no ``model``) leaves the choice to the policy. ``ModelConstrained`` splits a
window by constraint and asks the wrapped policy about each part with only the allowed
instances, most constrained first; each part sees the slots and the money the parts
before it left (window budget, tenants' remaining budgets, free slots). A window with no
constrained query goes to the policy unchanged. Decisions of constrained queries carry
``DecisionFlag.MODEL_CONSTRAINED`` and say which models were allowed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from routing.types import Budget, InstanceView, Router
from schemas import ClusterConfig, Decision, DecisionFlag, DecisionStatus, Query

_PLACED = (DecisionStatus.ROUTED, DecisionStatus.OVER_BUDGET)


class ModelConstrained:
    """Routes each query only to instances of the models its ``model`` field allows."""

    def __init__(self, inner: Router, cluster: ClusterConfig) -> None:
        self.inner = inner
        self.cluster = cluster
        self.name = inner.name
        self._all = frozenset(m.name for m in cluster.models)

    def allowed(self, q: Query) -> frozenset[str] | None:
        """The models ``q`` may go to; None: any. ``KeyError`` for a name the cluster lacks."""
        if q.model is None:
            return None
        allowed = frozenset(self.cluster.models_named(q.model))
        return None if allowed == self._all else allowed

    def decide(
        self,
        queries: Sequence[Query],
        instances: Sequence[InstanceView],
        budget: Budget,
        now: float,
    ) -> list[Decision]:
        if all(q.model is None for q in queries):  # the usual window: nothing to split
            return self.inner.decide(queries, instances, budget, now)
        parts: dict[frozenset[str] | None, list[int]] = {}
        unknown: dict[int, str] = {}
        for i, q in enumerate(queries):
            try:
                parts.setdefault(self.allowed(q), []).append(i)
            except KeyError as exc:
                unknown[i] = str(exc.args[0])
        if not unknown and list(parts) in ([None], []):
            return self.inner.decide(queries, instances, budget, now)
        out: list[Decision | None] = [None] * len(queries)
        for i, why in unknown.items():
            out[i] = _not_routed(self.name, queries[i], DecisionStatus.REJECTED, why, now)
        free = {v.instance_id: v.free_slots for v in instances}
        window_left = budget.window_usd
        tenant_left = dict(budget.tenant_remaining_usd)
        # most constrained first: a part with fewer allowed models has fewer choices
        order = sorted(parts, key=lambda k: (k is None, len(k or ()), sorted(k or ())))
        for key in order:
            idx = parts[key]
            part = [queries[i] for i in idx]
            views = [
                dataclasses.replace(v, free_slots=max(0, free[v.instance_id]))
                for v in instances
                if key is None or v.model in key
            ]
            if not views:
                why = f"no live instance of model {sorted(key or ())}"
                ds = [_not_routed(self.name, q, DecisionStatus.DEFERRED, why, now) for q in part]
            else:
                sub = Budget(max(0.0, window_left), _clip(tenant_left), budget.allow_overspend)
                ds = self.inner.decide(part, views, sub, now)
            for i, q, d in zip(idx, part, ds, strict=True):
                if d.status in _PLACED and d.instance_id in free:
                    free[d.instance_id] -= 1
                    cost = d.predicted_cost_usd or 0.0
                    window_left -= cost
                    if q.tenant in tenant_left:
                        tenant_left[q.tenant] -= cost
                out[i] = _flagged(d, key) if key is not None else d
        return [d for d in out if d is not None]


def _clip(left: dict[str, float]) -> dict[str, float]:
    return {t: max(0.0, usd) for t, usd in left.items()}


def _flagged(d: Decision, allowed: frozenset[str]) -> Decision:
    why = f"model constrained to {sorted(allowed)}"
    return d.model_copy(
        update={
            "flags": [*d.flags, DecisionFlag.MODEL_CONSTRAINED],
            "reason": f"{why}; {d.reason}" if d.reason else why,
        }
    )


def _not_routed(
    policy: str, q: Query, status: DecisionStatus, reason: str, now: float
) -> Decision:
    return Decision(
        query_id=q.id,
        tenant=q.tenant,
        status=status,
        policy=policy,
        decided_at=now,
        reason=reason,
    )
