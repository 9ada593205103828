"""Capacity slots and re-routing claims in Redis: a router holds one slot per routed query
on an instance; a worker claims its copy of a query right before running it, a rescuer
claims copies stranded on a silent instance, so a query runs on one instance only.
See ``state.protocols.Slots`` and ``Claims``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from state.records import ClaimOutcome
from state.redis_core import RedisCore, _count, _seconds_ms

CLAIM_TTL_S = 7 * 86_400.0  # as long as a result mark: a copy can wait that long in Kafka


class RedisClaims(RedisCore):
    """Capacity slots (router) and per-copy claims (worker, rescuer)."""

    async def reserve_slots(
        self,
        instance_id: str,
        max_slots: int,
        query_ids: Sequence[str],
        *,
        lease_s: float | None = None,
    ) -> list[bool]:
        """Hold one slot per query id while fewer than ``max_slots`` are held. Atomic; idempotent per id.

        ``lease_s``: slots not touched for that long (no resident progress, no heartbeat
        while resident) are reclaimed first, so a query lost before reaching its worker
        cannot leak capacity forever. None keeps slots until released.
        """
        _count(max_slots, "max_slots")
        if not query_ids:
            return []
        lease = 0.0 if lease_s is None else float(lease_s)
        if not math.isfinite(lease) or lease < 0:
            raise ValueError(f"lease_s must be a finite number >= 0, got {lease_s}")
        ids = self.keys.check_query_ids(query_ids)
        reply = await self._script(  # the ids in one argument (reserve_slots.lua)
            "reserve_slots", [self.keys.slots(instance_id)], [max_slots, repr(lease), "\n".join(ids)]
        )
        return [bool(x) for x in reply]

    async def release_slots(self, instance_id: str, query_ids: Sequence[str]) -> None:
        if not query_ids:
            return
        ids = [self.keys.check_query_id(q) for q in query_ids]
        await self._call("release_slots", self._r.zrem(self.keys.slots(instance_id), *ids))

    async def slots_held(self, instance_id: str) -> list[str]:
        return cast(
            list[str],
            await self._call("slots_held", self._r.zrange(self.keys.slots(instance_id), 0, -1)),
        )

    # ------------------------------------------------------------------ results

    async def claim_run(
        self, instance_id: str, query_id: str, *, ttl_s: float = CLAIM_TTL_S
    ) -> ClaimOutcome:
        """The worker of ``instance_id`` claims its copy of ``query_id`` right before running it.

        ``won``: run it (also when this instance claimed it before: a re-delivery, or a
        rescuer's lease that ran out without a re-route). ``lost``: a rescuer re-routed it
        elsewhere, skip the copy. ``wait``: a rescuer holds a live lease and has not
        re-routed it yet; ask again later.
        """
        reply = await self._claims(instance_id, [query_id], "run", "", 1.0, ttl_s)
        return reply[0]

    async def claim_rescue(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        rescuer_id: str,
        *,
        lease_s: float,
        ttl_s: float = CLAIM_TTL_S,
    ) -> list[ClaimOutcome]:
        """A rescuer claims (or renews its lease on) copies waiting in a silent instance's topic.

        Per id: ``won`` (re-route it; the lease must be renewed before ``lease_s`` passes),
        ``lost`` (its worker started it, or it was re-routed already) or ``busy`` (another
        rescuer's lease is live). One script call.
        """
        return await self._claims(instance_id, query_ids, "rescue", rescuer_id, lease_s, ttl_s)

    async def claim_rerouted(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        rescuer_id: str,
        *,
        ttl_s: float = CLAIM_TTL_S,
    ) -> list[ClaimOutcome]:
        """Mark claims final once the re-routed copies were acknowledged by Kafka.

        ``won``: marked (the instance's worker will skip its copy for good). ``lost``: the
        rescuer no longer held the claim (its lease lapsed and the worker started the query).
        """
        return await self._claims(instance_id, query_ids, "rerouted", rescuer_id, 1.0, ttl_s)

    async def claim_returned(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        rescuer_id: str,
        *,
        ttl_s: float = CLAIM_TTL_S,
    ) -> list[ClaimOutcome]:
        """Drop claims whose re-routed copy went back to ``instance_id`` itself (it came back
        before the window that re-routed it): its worker runs one of its copies.

        A ``rerouted`` mark there would make that worker skip every copy of the query on it,
        the re-routed one included (the claim is per instance and query). ``won``: dropped.
        ``lost``: the rescuer no longer held the claim (its lease lapsed, the worker took it).
        """
        return await self._claims(instance_id, query_ids, "returned", rescuer_id, 1.0, ttl_s)

    async def claim_state(self, instance_id: str, query_id: str) -> str | None:
        """The raw claim value (``run``, ``rescue <id> <ms>``, ``rerouted <id>``) or None."""
        raw = await self._call("claim_state", self._r.get(self.keys.claim(instance_id, query_id)))
        return None if raw is None else str(raw)

    async def _claims(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        mode: str,
        rescuer_id: str,
        lease_s: float,
        ttl_s: float,
    ) -> list[ClaimOutcome]:
        if mode != "run" and (not rescuer_id or any(c.isspace() for c in rescuer_id)):
            raise ValueError(f"rescuer id must be a non-empty word, got {rescuer_id!r}")
        if not query_ids:
            return []
        keys = [self.keys.claim(instance_id, q) for q in query_ids]
        args = [
            mode,
            rescuer_id,
            _seconds_ms(lease_s, "claim lease_s"),
            _seconds_ms(ttl_s, "claim ttl_s"),
        ]
        reply = await self._script("claim", keys, args)
        return [cast(ClaimOutcome, str(v)) for v in reply]
