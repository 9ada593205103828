"""Dedupe entries and route intents in Redis: a router asks whether a query id is new, a
duplicate or a conflict, records where it is sending each query before producing it,
and marks it routed after Kafka acknowledged it. See ``state.protocols.Dedupe``."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from redis.asyncio.client import Pipeline

from state.keys import dedupe_bucket
from state.records import DedupeEntry, RouteIntent, Verdict
from state.redis_core import RedisCore, _seconds_ms


class RedisDedupe(RedisCore):
    """Dedupe verdicts, route intents and routed marks, a window per round trip.

    Each of the three is one script over many dedupe entries: on a Redis Cluster one call
    per dedupe bucket (a script's keys must share a hash slot, and a bucket is one hash
    tag), on a single Redis one call for the whole window (each call of a pipeline costs
    the client ~20 µs of Python; 64 buckets made ~190 calls a window).
    """

    def _cluster_calls(
        self, groups: list[tuple[list[str], list[Any]]]
    ) -> list[tuple[Sequence[str], Sequence[Any]]]:
        """A Redis Cluster's script calls: one per dedupe bucket, its query ids' dedupe keys
        as the script's KEYS (one hash slot). A single Redis takes a window in one call
        with the keys joined in an argument instead (each ``*_many`` returns before this)."""
        return [([self.keys.dedupe(q) for q in qids], args) for qids, args in groups]

    def _joined_keys(self, query_ids: Iterable[str]) -> str:
        """A single Redis's one call: the query ids' dedupe keys as one argument, joined by
        '\n' (no key holds one: ``state.keys``; read by ``lua/_window_keys.lua``)."""
        return "\n".join(self.keys.dedupes(query_ids))

    async def dedupe(self, query_id: str, body_sha256: str, ttl_s: float) -> Verdict:
        """``new`` the first time an id is seen, then ``duplicate`` (same body) or ``conflict``."""
        return (await self.dedupe_ex(query_id, body_sha256, ttl_s))[0]

    async def dedupe_ex(
        self, query_id: str, body_sha256: str, ttl_s: float
    ) -> tuple[Verdict, str | None]:
        """``dedupe`` plus the instance a previous copy was routed to (None: not routed yet).

        A ``duplicate`` that was never marked routed is what a router crash between dedupe
        and produce leaves behind: route it again (reservations are idempotent per id).
        """
        return (await self.dedupe_many([(query_id, body_sha256)], ttl_s))[0]

    async def dedupe_many(
        self, items: Sequence[tuple[str, str]], ttl_s: float
    ) -> list[tuple[Verdict, str | None]]:
        """``dedupe_ex`` for a whole window: (query id, body sha256) each, answers in order.

        One pipelined round trip (one script call, or one per dedupe
        bucket on a Redis Cluster). An id given twice is
        ``new`` then ``duplicate`` (or ``conflict``), as if the two arrived one after the other.
        """
        if not items:
            return []
        ttl_ms = _seconds_ms(ttl_s, "dedupe ttl_s")
        for qid, sha in items:
            if not isinstance(sha, str) or not sha or len(sha) > 128 or "\n" in sha:
                raise ValueError(f"query {qid}: body_sha256 must be a hex digest, got {sha!r}")
        if not self._cluster:  # one call, no grouping: the keys and hashes as two arguments
            keys = self._joined_keys(q for q, _ in items)
            (reply,) = await self._script_many(
                "dedupe", [((), [ttl_ms, "\n".join([sha for _, sha in items]), keys])]
            )
            it = iter(reply)
            return [(cast(Verdict, str(v)), str(r) or None) for v, r in zip(it, it, strict=True)]
        groups: dict[int, list[int]] = {}
        for n, (qid, _) in enumerate(items):
            groups.setdefault(dedupe_bucket(qid), []).append(n)
        # the hashes in one argument (dedupe.lua): redis-py packs each argument in Python
        calls = self._cluster_calls(
            [
                ([items[n][0] for n in rows], [ttl_ms, "\n".join([items[n][1] for n in rows])])
                for rows in groups.values()
            ]
        )
        replies = await self._script_many("dedupe", calls)
        out: list[tuple[Verdict, str | None]] = [("new", None)] * len(items)
        for rows, reply in zip(groups.values(), replies, strict=True):
            for j, n in enumerate(rows):
                out[n] = (cast(Verdict, str(reply[2 * j])), str(reply[2 * j + 1]) or None)
        return out

    async def mark_routed_many(self, routed: Mapping[str, str]) -> int:
        """``mark_routed`` for many queries ({query id: instance id}); returns how many were marked."""
        if not routed:
            return 0
        for iid in set(routed.values()):
            self.keys.check_instance_id(iid)  # once per instance, not once per query
        if not self._cluster:  # one call, no grouping
            args = ["\n".join(routed.values()), self._joined_keys(routed)]
            return sum(int(r) for r in await self._script_many("mark_routed", [((), args)]))
        groups: dict[int, list[tuple[str, str]]] = {}
        for qid, iid in routed.items():
            groups.setdefault(dedupe_bucket(qid), []).append((qid, iid))
        calls = self._cluster_calls(
            [([q for q, _ in rows], ["\n".join([i for _, i in rows])]) for rows in groups.values()]
        )
        return sum(int(r) for r in await self._script_many("mark_routed", calls))

    async def mark_intent_many(self, intents: Mapping[str, RouteIntent]) -> dict[str, str]:
        """Record each query's route intent before producing it; returns the ids *taken*,
        each with the instance that holds it: already marked routed, or with another intent
        recorded first (another router routed them while this one was paused mid-window).
        Those must not be produced.

        A router killed between producing and ``mark_routed_many`` leaves the intent behind;
        its successor re-sends that decision to that instance (``intents``) rather than
        deciding again, so a query is never routed to two instances. A query with no dedupe
        entry (expired) is neither recorded nor taken.

        An intent with ``rerouted_from`` (a rescuer's claim made the query this router's) is
        recorded over the original routing to that instance; it is taken only when the query
        was marked routed to a third instance meanwhile (another rescuer re-routed it).
        """
        if not intents:
            return {}
        for iid in {i.instance_id for i in intents.values()}:
            self.keys.check_instance_id(iid)  # once per instance, not once per query
        if not self._cluster:
            return await self._mark_intents_one_call(intents)
        groups: dict[int, list[tuple[str, str, str]]] = {}
        for qid, intent in intents.items():
            if _SEP in intent.decision_json:  # never in JSON (a control character is escaped)
                raise ValueError(f"query {qid}: decision JSON holds a raw 0x1e byte")
            payload = f"{intent.instance_id}\n{intent.decision_json}"
            row = (qid, payload, intent.rerouted_from or "")
            if row[2]:
                self.keys.check_instance_id(row[2])
            groups.setdefault(dedupe_bucket(qid), []).append(row)
        rows = list(groups.values())
        # one argument of intents (and one of re-routed-from instances, when any): mark_intent.lua
        per_bucket: list[tuple[list[str], list[Any]]] = []
        for group in rows:
            args = [_SEP.join([p for _, p, _ in group])]
            if any(f for _, _, f in group):
                args.append("\n".join([f for _, _, f in group]))
            per_bucket.append(([q for q, _, _ in group], args))
        calls = self._cluster_calls(per_bucket)
        replies = await self._script_many("mark_intent", calls)
        qids = [qid for group in rows for qid, _, _ in group]
        return _holders(qids, [holder for got in replies for holder in got])

    async def _mark_intents_one_call(self, intents: Mapping[str, RouteIntent]) -> dict[str, str]:
        """``mark_intent_many`` on a single Redis: the window's intents, re-routed-from
        instances and keys as three arguments of one call, each joined once."""
        joined = _SEP.join([f"{i.instance_id}\n{i.decision_json}" for i in intents.values()])
        if joined.count(_SEP) != len(intents) - 1:  # never in JSON (control characters escaped)
            bad = next(q for q, i in intents.items() if _SEP in i.decision_json)
            raise ValueError(f"query {bad}: decision JSON holds a raw 0x1e byte")
        froms = [i.rerouted_from or "" for i in intents.values()]
        for f in set(froms) - {""}:
            self.keys.check_instance_id(f)
        args = [joined, "\n".join(froms) if any(froms) else "", self._joined_keys(intents)]
        (reply,) = await self._script_many("mark_intent", [((), args)])
        return _holders(list(intents), reply)

    async def intents(self, query_ids: Sequence[str]) -> dict[str, RouteIntent]:
        """The recorded route intent of each query that has one (one pipelined round trip)."""
        if not query_ids:
            return {}
        pipe: Pipeline = self._r.pipeline(transaction=False)
        for qid in query_ids:
            pipe.hget(self.keys.dedupe(qid), "intent")
        replies = cast(list[Any], await self._call("intents", pipe.execute()))
        out: dict[str, RouteIntent] = {}
        for qid, raw in zip(query_ids, replies, strict=True):
            intent = _route_intent(raw)
            if intent is not None:
                out[qid] = intent
        return out

    async def mark_routed(self, query_id: str, instance_id: str) -> bool:
        """Record where a deduped query went (after its routed message was acknowledged)."""
        return await self.mark_routed_many({query_id: instance_id}) == 1

    async def dedupe_entry(self, query_id: str) -> DedupeEntry | None:
        raw = cast(
            dict[str, str],
            await self._call("dedupe_entry", self._r.hgetall(self.keys.dedupe(query_id))),
        )
        if not raw or "sha" not in raw:
            return None
        return DedupeEntry(raw["sha"], raw.get("routed") or None, _route_intent(raw.get("intent")))

    async def forget(self, query_id: str) -> None:
        """Drop a query's dedupe entry (its routing failed and it will be retried as new)."""
        await self._call("forget", self._r.delete(self.keys.dedupe(query_id)))

    # ------------------------------------------------------------------ budget ledger


_SEP = "\x1e"  # between the intents of one mark_intent.lua call


def _route_intent(raw: str | None) -> RouteIntent | None:
    """Parse a dedupe entry's ``intent`` field ("<instance id>\\n<decision json>")."""
    if not raw or "\n" not in raw:
        return None
    instance_id, decision_json = raw.split("\n", 1)
    return RouteIntent(instance_id, decision_json) if instance_id and decision_json else None


def _holders(query_ids: Sequence[str], replies: Sequence[Any]) -> dict[str, str]:
    """The queries another router took, from ``mark_intent.lua``'s answers (one per query
    id, in order): the instance each is taken by; an integer (recorded, or no entry) is
    left out."""
    return {
        qid: holder.decode() if isinstance(holder, bytes) else str(holder)
        for qid, holder in zip(query_ids, replies, strict=True)
        if not isinstance(holder, int)
    }
