"""Published-result marks and start counts in Redis: a worker marks each result once
(with its cost), closes a query in one round trip (``finish``), and skips ids already
answered; a rescuer skips stranded copies that were answered. See
``state.protocols.Results``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio.client import Pipeline
from redis.exceptions import NoScriptError

from schemas import FinishedRequest
from state.ledger import ledger_expire_at
from state.liveness import FINISHED_KEEP, FINISHED_KEEP_S, TOMBSTONE_KEEP_S, encode_finished
from state.records import ResultMark, Starts
from state.redis_core import NANO_PER_USD, RedisCore, _seconds_ms, usd_to_nano


class RedisResults(RedisCore):
    """Result marks, ``finish`` and attempt counts."""

    async def mark_result(
        self, query_id: str, ttl_s: float, *, cost_usd: float | None = None
    ) -> bool:
        """True the first time a result for this id is marked published; False for a duplicate.

        ``cost_usd`` is kept with the mark, so a worker that skips a re-delivered copy can
        still settle the ledger (idempotently) if a crash cut that short.
        """
        value = (
            "-" if cost_usd is None else str(usd_to_nano(cost_usd, f"query {query_id}: cost_usd"))
        )
        ok = await self._call(
            "mark_result",
            self._r.set(
                self.keys.result(query_id), value, nx=True, px=_seconds_ms(ttl_s, "result ttl_s")
            ),
        )
        return bool(ok)

    async def finish(
        self,
        instance_id: str,
        query_id: str,
        *,
        result_ttl_s: float,
        cost_usd: float,
        tenant: str | None = None,
        period_id: str | None = None,
        finished: FinishedRequest | None = None,
    ) -> tuple[bool, bool]:
        """A worker's three closing writes in one round trip, in this order: ``mark_result``
        (with the cost), ``settle`` (when ``tenant`` and ``period_id`` are given) and
        ``resident_done``. Each is idempotent on its own; returns (first result, settled now).
        ``finished``: what the engine ran (arrival at the engine, last token, prompt and
        output tokens), kept in the instance's recently-finished list (``FINISHED_KEEP``
        newest) for the routers' catch-up; recorded once per query.
        """
        k = self.keys
        cost_nano = usd_to_nano(cost_usd, f"query {query_id}: cost_usd")
        ttl_ms = _seconds_ms(result_ttl_s, "result ttl_s")
        now = repr(time.time())
        calls: list[tuple[str, list[str], list[Any]]] = []
        if tenant is not None and period_id is not None:
            calls.append(
                (
                    "settle",
                    list(k.ledger(tenant, period_id)),
                    [query_id, cost_nano, ledger_expire_at(period_id)],
                )
            )
        done_keys = [
            k.heartbeat(instance_id),
            k.residents(instance_id),
            k.slots(instance_id),
            k.gone(instance_id),
        ]
        done_args: list[Any] = [query_id, now, repr(TOMBSTONE_KEEP_S)]
        if finished is not None:
            done_keys.append(k.finished(instance_id))
            done_args += [encode_finished(finished), FINISHED_KEEP, int(FINISHED_KEEP_S * 1000)]
        calls.append(("resident_done", done_keys, done_args))
        pipe: Pipeline = self._r.pipeline(transaction=False)
        pipe.set(k.result(query_id), str(cost_nano), nx=True, px=ttl_ms)
        for name, keys, args in calls:
            pipe.execute_command("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)
        replies = await self._call("finish", pipe.execute(raise_on_error=False))
        for n, (name, keys, args) in enumerate(calls, start=1):
            if isinstance(replies[n], NoScriptError):  # Redis restarted: load and run just this one
                replies[n] = await self._script(name, keys, args)
            elif isinstance(replies[n], Exception):
                self._raise_reply("finish", replies[n])
        if isinstance(replies[0], Exception):
            self._raise_reply("finish", replies[0])
        settled = bool(replies[1]) if len(calls) == 2 else False
        return bool(replies[0]), settled

    async def result_mark(self, query_id: str) -> ResultMark | None:
        """The published-result mark of a query (None: no result published yet)."""
        raw = await self._call("result_mark", self._r.get(self.keys.result(query_id)))
        if raw is None:
            return None
        text = str(raw)
        return ResultMark(cost_usd=int(text) / NANO_PER_USD if text.isdigit() else None)

    async def mark_start(self, query_id: str, process: str, ttl_s: float) -> Starts:
        """Record one start of this query by the worker process ``process`` (a token unique to
        the process); returns this start's number and how many processes have started it.

        A start number above 1 is repeated inference. Only a second *process* means the first
        one died running it (or a rescuer moved the query while it ran): a stage retried in one
        process, or this call re-sent after its reply was lost, adds no process.
        """
        key = self.keys.start(query_id)
        if not process or len(process) > 64:
            raise ValueError(f"mark_start: process token must be 1-64 characters, got {process!r}")
        n, processes = await self._script(
            "start", [key], [_seconds_ms(ttl_s, "start ttl_s"), process]
        )
        return Starts(number=int(n), processes=int(processes))

    # ------------------------------------------------------------------ claims (re-routing)

    async def has_results(self, query_ids: Sequence[str]) -> list[bool]:
        """``has_result`` for many ids in one pipelined round trip."""
        if not query_ids:
            return []
        pipe: Pipeline = self._r.pipeline(transaction=False)
        for q in query_ids:
            pipe.exists(self.keys.result(q))
        return [bool(n) for n in await self._call("has_results", pipe.execute())]

    async def has_result(self, query_id: str) -> bool:
        return bool(await self._call("has_result", self._r.exists(self.keys.result(query_id))))

    # ------------------------------------------------------------------ maintenance
