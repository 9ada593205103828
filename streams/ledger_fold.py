"""Rebuild a budget ledger from what Kafka recorded — the pure part (no I/O).

Redis holds the ledger (``state/keys.py``: per tenant and period, reservations and
settlements keyed by query id). When Redis comes back without it, Kafka still has
everything it was made of:

- ``route.<instance>`` (``RoutedQuery``): every query a router placed, with the decision's
  ``budget_period`` — the ledger period its worst case was reserved in — and the query, so
  the worst case ``ModelSpec.max_cost_usd(query)`` of its instance's model is known again;
- ``results`` (``Result``): what each query cost. A worker settles a result it produced
  (``instance_id`` set, error or not) at ``cost_usd``; the router's own error results
  (``instance_id == ""``) were never routed and never reserved.

Folding both gives, per tenant and period being rebuilt:

    settled[q]  = max cost_usd of q's worker results                (q routed in the period)
    reserved[q] = max over q's route messages of max_cost_usd(q)    (routed, no result yet)

exactly what the live ledger would hold if no write had been lost (a worst case where the
live ledger had a released reservation: only for queries that were never routed, which
have no route message). Records may come in any order and any number of times (a
re-delivery, a re-routed query, a duplicated inference): the fold is order-independent and
idempotent. A result whose route message is not in the scan belongs to an earlier period
(scans start at the period's first second) and is skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from schemas import ClusterConfig, Result, RoutedQuery


@dataclass(frozen=True)
class RebuiltLedger:
    """One tenant's ledger for one period, as Kafka shows it (USD per query id)."""

    tenant: str
    period_id: str
    limit_usd: float
    settled_usd: dict[str, float]
    reserved_usd: dict[str, float]

    @property
    def spent_usd(self) -> float:
        return sum(self.settled_usd.values())

    @property
    def outstanding_usd(self) -> float:
        return sum(self.reserved_usd.values())

    @property
    def committed_usd(self) -> float:
        return self.spent_usd + self.outstanding_usd


@dataclass
class FoldCounts:
    """What the fold saw, for the rebuild's report."""

    routed: int = 0  # route messages of a period being rebuilt
    results: int = 0  # worker results read (any period)
    skipped: int = 0  # route messages of other periods or tenants without a budget


@dataclass
class LedgerFold:
    """Folds ``RoutedQuery`` and ``Result`` records into the ledgers of ``periods``.

    ``periods``: tenant -> the ledger period to rebuild for it (its current one).
    """

    cluster: ClusterConfig
    periods: Mapping[str, str]
    counts: FoldCounts = field(default_factory=FoldCounts)
    _worst: dict[str, tuple[str, float]] = field(default_factory=dict)  # qid -> (tenant, usd)
    _cost: dict[str, float] = field(default_factory=dict)  # qid -> max worker-result cost

    def __post_init__(self) -> None:
        budgets = {t.tenant for t in self.cluster.tenants}
        unknown = sorted(set(self.periods) - budgets)
        if unknown:
            raise ValueError(
                f"ledger rebuild: tenants {unknown} have no budget in the cluster config "
                f"(tenants with a budget: {sorted(budgets)})"
            )

    def routed(self, rq: RoutedQuery, instance_id: str) -> bool:
        """One message off ``route.<instance_id>``; True if it belongs to a rebuilt ledger."""
        tenant = rq.query.tenant
        period = rq.decision.budget_period
        if period is None or self.periods.get(tenant) != period:
            self.counts.skipped += 1
            return False
        worst = self.cluster.model_of(instance_id).max_cost_usd(rq.query)
        prev = self._worst.get(rq.query.id)
        if prev is not None and prev[0] != tenant:
            raise ValueError(
                f"query {rq.query.id}: routed for tenant {tenant!r} and for {prev[0]!r}"
            )
        self._worst[rq.query.id] = (tenant, max(worst, prev[1] if prev else 0.0))
        self.counts.routed += 1
        return True

    def result(self, r: Result) -> bool:
        """One message off ``results``; True if a worker settled it (a router's error: False)."""
        if not r.instance_id:
            return False
        self._cost[r.query_id] = max(r.cost_usd, self._cost.get(r.query_id, 0.0))
        self.counts.results += 1
        return True

    def ledgers(self) -> list[RebuiltLedger]:
        """Every tenant of ``periods``, with what it spent and what is still outstanding."""
        limits = {t.tenant: t.budget_usd for t in self.cluster.tenants}
        out = {
            tenant: RebuiltLedger(tenant, period, limits[tenant], {}, {})
            for tenant, period in self.periods.items()
        }
        for qid, (tenant, worst) in self._worst.items():
            ledger = out[tenant]
            cost = self._cost.get(qid)
            if cost is None:
                ledger.reserved_usd[qid] = worst
            else:
                ledger.settled_usd[qid] = cost
        return list(out.values())
