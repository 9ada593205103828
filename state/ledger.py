"""The budget ledger in Redis: routers reserve each query's predicted cost and release it
when the query will not run; workers settle the actual cost; a router rebuilds the ledger
from Kafka after Redis lost it (``ledger_mark``/``ledger_lease``). Integer nano-USD, so a
budget comparison is exact. See ``state.protocols.Ledger`` and ``LedgerRebuild``."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

from redis.asyncio.client import Pipeline

from state.records import BudgetStatus, LeaseOutcome
from state.redis_core import (
    NANO_PER_USD,
    RedisCore,
    _seconds_ms,
    is_cluster_client,
    period_bounds,
    usd_to_nano,
    usd_to_nanos,
)

LEDGER_KEEP_S = 86_400.0  # a ledger period stays readable this long after it ends
LEDGER_REBUILD_CHUNK = 1000  # query ids per ledger_rebuild call: Redis never blocks long


def ledger_expire_at(period: str) -> int:
    """Unix second at which a period's ledger keys may expire (0: a free-form period)."""
    bounds = period_bounds(period)
    if bounds is None:
        return 0
    start, end = bounds
    keep = max(LEDGER_KEEP_S, end - start)
    # never in the past: a late settle of an old period must not delete its ledger
    return int(math.ceil(max(end, time.time()) + keep))


class RedisLedger(RedisCore):
    """Reservations, settlements, status and the rebuild of a lost ledger."""

    async def reserve_budget(
        self, tenant: str, period_id: str, limit_usd: float, amounts_usd: Mapping[str, float]
    ) -> dict[str, bool]:
        """Reserve each query's predicted cost, in order; accept iff reserved+spent+amount <= limit.

        Atomic (one script). Idempotent per query id: re-reserving a held id returns True and
        adds nothing; an id already settled returns False (its spend is booked; do not run it again).
        """
        keys = self.keys.ledger(tenant, period_id)
        if not amounts_usd:
            return {}
        args: list[Any] = [
            usd_to_nano(limit_usd, "limit_usd", round_up=False),
            ledger_expire_at(period_id),
        ]
        qids = "\n".join(self.keys.check_query_ids(amounts_usd))
        nanos = usd_to_nanos(list(amounts_usd.values()), "amount", list(amounts_usd))
        # the ids in one argument, their amounts in another (reserve_budget.lua)
        reply = await self._script("reserve_budget", keys, [*args, qids, "\n".join(map(str, nanos))])
        return {qid: bool(ok) for qid, ok in zip(amounts_usd, reply, strict=True)}

    async def release_budget(self, tenant: str, period_id: str, query_ids: Sequence[str]) -> None:
        """Give back reservations of queries that will not run. Unknown or settled ids: no-op."""
        if not query_ids:
            return
        ledger, res, _ = self.keys.ledger(tenant, period_id)
        await self._script(
            "release_budget", [ledger, res], [self.keys.check_query_id(q) for q in query_ids]
        )

    async def settle(
        self, tenant: str, period_id: str, query_id: str, actual_cost_usd: float
    ) -> bool:
        """Reserved → spent at the actual cost. Idempotent: a second settle returns False."""
        keys = self.keys.ledger(tenant, period_id)
        reply = await self._script(
            "settle",
            keys,
            [
                self.keys.check_query_id(query_id),
                usd_to_nano(actual_cost_usd, f"query {query_id}: actual_cost_usd"),
                ledger_expire_at(period_id),
            ],
        )
        return bool(reply)

    async def budget_status(self, tenant: str, period_id: str) -> BudgetStatus:
        ledger, res, settled = self.keys.ledger(tenant, period_id)
        # MULTI/EXEC only on a single node: redis-py's cluster transaction runs a pending
        # re-discovery in a thread of its own, whose event loop trips over the client's lock
        # ("bound to a different event loop") after a failover. The one HGETALL that holds
        # the money is atomic without it; the two counts are informative
        pipe: Pipeline = self._r.pipeline(transaction=not is_cluster_client(self._r))
        pipe.hgetall(ledger)
        pipe.hlen(res)
        pipe.hlen(settled)
        raw, n_res, n_set = await self._call("budget_status", pipe.execute())
        raw = cast(dict[str, str], raw)
        limit = raw.get("limit")
        return BudgetStatus(
            tenant=tenant,
            period_id=period_id,
            limit_usd=int(limit) / NANO_PER_USD if limit is not None else None,
            reserved_usd=int(raw.get("reserved", 0)) / NANO_PER_USD,
            spent_usd=int(raw.get("spent", 0)) / NANO_PER_USD,
            n_reserved=int(n_res),
            n_settled=int(n_set),
        )

    # ------------------------------------------------------------------ ledger completeness

    async def ledger_mark(self) -> str | None:
        """The ledger's completeness mark (None: Redis lost its data, or never held a ledger)."""
        mark, _ = self.keys.ledger_epoch()
        raw = await self._call("ledger_mark", self._r.get(mark))
        return None if raw is None else str(raw)

    async def ledger_lease(
        self, token: str, lease_s: float, *, renew: bool = False
    ) -> LeaseOutcome:
        """Take (or ``renew``) the lease on rebuilding the ledger: ``marked`` (nothing to
        rebuild), ``ours``, ``held`` (another router has it) or ``lost`` (a renew found it
        gone: it expired or Redis restarted empty). See ``state/lua/ledger_lease.lua``."""
        if not isinstance(token, str) or not token or len(token) > 128:
            raise ValueError(f"ledger lease token must be a non-empty string, got {token!r}")
        reply = await self._script(
            "ledger_lease",
            list(self.keys.ledger_epoch()),
            [token, _seconds_ms(lease_s, "ledger lease_s"), "renew" if renew else "take"],
        )
        return cast(LeaseOutcome, str(reply))

    async def ledger_set_mark(self, token: str, value: str) -> bool:
        """Mark the ledger complete iff ``token`` still holds the rebuild lease."""
        return bool(
            await self._script("ledger_mark", list(self.keys.ledger_epoch()), [token, value])
        )

    async def ledger_rebuild(
        self,
        tenant: str,
        period_id: str,
        limit_usd: float,
        settled_usd: Mapping[str, float],
        reserved_usd: Mapping[str, float],
    ) -> tuple[int, int]:
        """Book settled spend and worst-case reservations read back from Kafka, idempotently.

        Returns (settlements booked now, reservations booked now): ids already settled or
        reserved in Redis (by a worker or router meanwhile, or an earlier rebuild) count 0.
        """
        keys = self.keys.ledger(tenant, period_id)
        limit = usd_to_nano(limit_usd, "limit_usd", round_up=False)
        expire = ledger_expire_at(period_id)
        settled = [
            (self.keys.check_query_id(q), usd_to_nano(usd, f"query {q}: settled cost"))
            for q, usd in settled_usd.items()
        ]
        reserved = [
            (self.keys.check_query_id(q), usd_to_nano(usd, f"query {q}: worst-case cost"))
            for q, usd in reserved_usd.items()
            if q not in settled_usd
        ]
        booked = held = 0
        step = LEDGER_REBUILD_CHUNK
        for i in range(0, max(len(settled), len(reserved), 1), step):
            s_part, r_part = settled[i : i + step], reserved[i : i + step]
            args: list[Any] = [limit, expire, len(s_part)]
            for qid, nano in (*s_part, *r_part):
                args += [qid, nano]
            b, h = await self._script("ledger_rebuild", keys, args)
            booked, held = booked + int(b), held + int(h)
        return booked, held

    # ------------------------------------------------------------------ capacity slots
