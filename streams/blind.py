"""Blind mode: what the router keeps in process so routing goes on while Redis is away.

DESIGN.md: "when Redis is unreachable ... routing goes on with LPS estimates" and "budgets
and capacities are hard limits". While a Redis call fails, ``RouterService`` routes from
this ledger instead of Redis:

- views: every instance alive at the last successful read, with ``state=None`` and
  ``stale=True`` (routers then use LPS and flag the decision); free slots = the free
  slots last read minus what this process routed blind since, never above the model's
  ``max_concurrency``. There is no replenishment: slots freed while blind are only seen
  once Redis answers;
- budget: per tenant and period, ``fraction`` (default 0.5) of the remaining budget last
  read (limit - reserved - spent; zero if never read this period), less the worst-case
  cost (``ModelSpec.max_cost_usd``) of every query routed blind;
- dedupe: the ids this process finished (routed or answered) recently, with their body
  hash: a redelivery within the process is dropped, a different body is a conflict.

Everything routed blind is recorded and written to Redis before normal routing resumes
(``flush``): the dedupe entries and routed marks, the budget reservations (same worst-case
amounts; idempotent per id) and the capacity slots of the blind queries the instance's
worker reports as residents (running or queued there; it frees their slots when they
finish). Blind queries that finished while Redis was away (their worker could not write
that) get no slot, or it would be held until its lease ran out, and blind queries still
in Kafka get none either: capacity is undercounted by those for a while after an outage.
Allowances and slot estimates are only ever lowered until Redis is read again, so an
outage that comes and goes never hands out the same remaining budget twice.

Guaranteed while blind, within this process: no query routed twice (among the last
``remember`` ids it finished, plus all it routed blind), blind spend per
tenant never above ``fraction`` of the remaining budget last read, no instance given more
than the free slots last read. NOT guaranteed across processes: each router spends its own
fraction of the same remaining budget (``fraction <= 1 / routers`` keeps the sum within
the budget), routers share no slot counts, and a query redelivered to *another* router
while Redis is away may be routed by both. When the flushed reservations no longer fit
(another router spent meanwhile) the overspend is logged. A Redis restarted empty has
forgotten the period's earlier spend: ``streams.ledger_rebuild`` keeps the router blind
until that ledger is rebuilt from Kafka.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from routing.types import InstanceView
from schemas import ClusterConfig
from state.protocols import RouterState

log = logging.getLogger("switchyard.router")


@dataclass
class _Tenant:
    tenant: str
    period_id: str
    limit_usd: float
    allowance_usd: float
    pending: dict[str, float] = field(default_factory=dict)  # query id -> reserved usd


class BlindLedger:
    """Last known Redis state, local allowances, and the writes owed to Redis."""

    def __init__(self, fraction: float = 0.5, remember: int = 200_000) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"blind budget fraction must be in [0, 1], got {fraction}")
        self.fraction = fraction
        self._remember = remember
        self._free: dict[str, int] = {}  # instance -> free slots (last read, less blind use)
        self._seen_at: dict[str, float] = {}  # instance -> when it was last read alive
        self._remaining: dict[str, tuple[str, float, float]] = {}  # tenant -> (period, limit, left)
        # blind allowances, made on first blind use; kept after a flush until Redis is read
        # again, so an outage that flaps never hands out a fresh allowance of the same read
        self._tenants: dict[str, _Tenant] = {}
        self._old: list[_Tenant] = []  # allowances of periods that ended while blind
        self._finished: OrderedDict[str, str] = OrderedDict()  # query id -> body sha256
        # query id -> (instance id or "-" for answered but not routed, body sha256)
        self._marks: dict[str, tuple[str, str]] = {}
        self._slots: dict[str, list[str]] = {}  # instance -> query ids routed blind

    # ------------------------------------------------------------ what Redis said last

    def observe_instances(
        self, live: Mapping[str, Any], cluster: ClusterConfig, now: float
    ) -> None:
        """Remember every alive instance's free slots (from ``StateStore.snapshots``)."""
        self._free, self._seen_at = {}, {}
        for spec in cluster.instances:
            info = live.get(spec.id)
            if info is not None and info.alive:
                cap = cluster.model(spec.model).max_concurrency
                self._free[spec.id] = max(0, cap - int(info.slots_used))
                self._seen_at[spec.id] = now

    def reserved_slots(self, instance_id: str, n: int) -> None:
        """Slots this process just reserved in Redis after the last read (negative: gave back)."""
        if instance_id in self._free:
            self._free[instance_id] = max(0, self._free[instance_id] - n)

    def observe_budget(
        self, tenant: str, period_id: str, limit_usd: float, spent_usd: float
    ) -> None:
        """Remember a tenant's remaining budget (``spent_usd``: reserved + settled)."""
        self._remaining[tenant] = (period_id, limit_usd, max(0.0, limit_usd - spent_usd))
        t = self._tenants.get(tenant)
        if t is not None and not t.pending:
            del self._tenants[tenant]  # this read includes what was spent blind: start from it

    def remember(self, finished: Mapping[str, str]) -> None:
        """Ids finished in a normal window ({id: body sha256}), for dedupe while blind."""
        for qid, sha in finished.items():
            self._finished[qid] = sha
            self._finished.move_to_end(qid)
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)

    # ------------------------------------------------------------ routing blind

    def verdict(self, query_id: str, body_sha256: str) -> str:
        """``new``, ``duplicate`` (finished by this process) or ``conflict`` (other body)."""
        sha = self._finished.get(query_id)
        if sha is None:
            return "new"
        return "duplicate" if sha == body_sha256 else "conflict"

    def views(self, cluster: ClusterConfig, now: float) -> list[InstanceView]:
        """Every instance alive at the last read: no live state, local free-slot estimate."""
        out = []
        for spec in cluster.instances:
            if spec.id not in self._free:
                continue
            cap = cluster.model(spec.model).max_concurrency
            out.append(
                InstanceView(
                    instance_id=spec.id,
                    model=spec.model,
                    state=None,
                    free_slots=max(0, min(cap, self._free[spec.id])),
                    age_s=max(0.0, now - self._seen_at[spec.id]),
                    stale=True,
                )
            )
        return out

    def allowance(self, tenant: str, period_id: str) -> float:
        """What ``tenant`` may still spend blind in ``period_id`` (0 if never read for it)."""
        return self._tenant(tenant, period_id).allowance_usd

    def take(
        self, tenant: str | None, period_id: str | None, instance_id: str, query_id: str, usd: float
    ) -> str | None:
        """Reserve one blind query locally; None if it fits, else why not (nothing taken).

        ``tenant`` None: a tenant without a configured budget (only slots are counted).
        """
        if self._free.get(instance_id, 0) <= 0:
            return f"instance {instance_id} has no free slot left while Redis is unreachable"
        if tenant is not None and period_id is not None:
            t = self._tenant(tenant, period_id)
            if not math.isfinite(usd) or usd > t.allowance_usd + 1e-12:
                return (
                    f"tenant {tenant} blind budget is spent (Redis unreachable: "
                    f"${t.allowance_usd:.6f} left of its blind allowance)"
                )
            t.allowance_usd = max(0.0, t.allowance_usd - usd)
            t.pending[query_id] = usd
        self._free[instance_id] -= 1
        self._slots.setdefault(instance_id, []).append(query_id)
        return None

    def routed(self, marks: Mapping[str, str], shas: Mapping[str, str]) -> None:
        """Queries answered blind and acknowledged by Kafka: owe their marks to Redis."""
        self._marks.update({q: (iid, shas[q]) for q, iid in marks.items() if q in shas})
        self.remember({q: shas[q] for q in marks if q in shas})

    # ------------------------------------------------------------ back to Redis

    @property
    def pending(self) -> bool:
        return bool(self._marks or self._slots or any(t.pending for t in self._all()))

    async def flush(
        self, state: RouterState, cluster: ClusterConfig, lease_s: float | None, dedupe_ttl_s: float
    ) -> int:
        """Write what was done blind to Redis; raises (keeping it all) if Redis fails again.

        Every write is idempotent per query id, so a flush cut short is simply redone.
        Returns how many blind reservations no longer fitted the budget (overspend).
        """
        if not self.pending:
            return 0
        over = 0
        for t in self._all():
            if t.pending:
                ok = await state.reserve_budget(t.tenant, t.period_id, t.limit_usd, t.pending)
                lost = [q for q, accepted in ok.items() if not accepted]
                if lost:
                    over += len(lost)
                    log.error(
                        "tenant %s: %d queries routed blind no longer fit its budget for "
                        "period %s (another router spent meanwhile, or they were settled)",
                        t.tenant,
                        len(lost),
                        t.period_id,
                    )
        for instance_id, qids in self._slots.items():
            resident = {r.query_id for r in await state.residents(instance_id)}
            running = [q for q in qids if q in resident]
            cap = cluster.model_of(instance_id).max_concurrency
            if running:
                await state.reserve_slots(instance_id, cap, running, lease_s=lease_s)
        if self._marks:  # a mark needs its dedupe entry, which a blind window never made
            await state.dedupe_many([(q, sha) for q, (_, sha) in self._marks.items()], dedupe_ttl_s)
            await state.mark_routed_many({q: iid for q, (iid, _) in self._marks.items()})
        n = sum(len(t.pending) for t in self._all())
        log.warning(
            "Redis answers again: wrote %d blind reservations, %d slots, %d marks",
            n,
            sum(len(q) for q in self._slots.values()),
            len(self._marks),
        )
        for t in self._all():
            t.pending = {}
        self._old, self._slots, self._marks = [], {}, {}
        return over

    def _all(self) -> list[_Tenant]:
        return [*self._tenants.values(), *self._old]

    def _tenant(self, tenant: str, period_id: str) -> _Tenant:
        t = self._tenants.get(tenant)
        if t is None or t.period_id != period_id:
            last = self._remaining.get(tenant)
            limit, left = (last[1], last[2]) if last and last[0] == period_id else (0.0, 0.0)
            if t is not None and t.pending:  # a new period while blind: keep the owed writes
                self._old.append(t)
            t = _Tenant(tenant, period_id, limit, self.fraction * left)
            self._tenants[tenant] = t
        return t
