"""Rebuild the budget ledger from Kafka when Redis comes back without it (the I/O edge).

Redis should run with AOF (``switchyard services``, docs/reliability.md); this covers the
cases where it comes back empty anyway: no persistence, a failover to a replica that had
not received the writes, a FLUSHALL. Detection is a marker key (``Keys.ledger_epoch``):
set once the ledger is known complete and never expiring, so it vanishes exactly when
Redis loses its data (a fresh Redis has none either: a first start rebuilds from whatever
Kafka holds for the current periods, usually nothing).

While the mark is missing, ``RouterService`` routes blind (``streams.blind``: conservative
allowances, flagged decisions), and one router at a time (a lease in Redis, renewed while
it works) scans ``route.<instance>`` and ``results`` from the start of each tenant's
current period (``offsets_for_times``: the scan is bounded by the period, not by the
topics' history), folds them (``streams.ledger_fold``) and books the result with
``StateStore.ledger_rebuild`` — idempotent per query id beside workers that settle
meanwhile. The mark is set only if the lease survived the whole rebuild (a Redis that
restarted empty again mid-way lost it), with the rebuild's figures as its value.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from pydantic import ValidationError

from schemas import ClusterConfig, Result, RoutedQuery
from state.protocols import LedgerRebuild
from state.store import StateUnavailable, period_bounds
from streams.ledger_fold import LedgerFold
from wiring import topics

log = logging.getLogger("switchyard.router")

# topic -> read from this unix time; calls handle(topic, value) per record; returns the count
Scan = Callable[[Mapping[str, float], Callable[[str, bytes | None], None]], Awaitable[int]]


class LedgerRebuilding(StateUnavailable):
    """The ledger in Redis is not known complete yet: route blind until it is."""


@dataclass(frozen=True)
class RebuildReport:
    """What one rebuild did (stored as the mark's value; logged)."""

    seconds: float
    records: int  # Kafka records read
    routed: int  # route messages of the rebuilt periods
    results: int  # worker results read
    bad: int  # records that did not parse (already dead-lettered by their consumer)
    since_s: float
    periods: dict[str, str]
    ledgers: list[dict[str, Any]]
    finished_at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


class LedgerGuard:
    """Keeps routing blind while the ledger is incomplete, and rebuilds it in the background."""

    def __init__(
        self,
        cluster: ClusterConfig,
        scan: Scan,
        period_id: Callable[[float, float], str],
        *,
        lease_s: float = 30.0,
        clock_margin_s: float = 60.0,
        retry_s: float = 5.0,
    ) -> None:
        if lease_s <= 0 or clock_margin_s < 0 or retry_s < 0:
            raise ValueError(
                f"ledger guard: lease_s must be > 0, clock_margin_s and retry_s >= 0 "
                f"(got {lease_s}, {clock_margin_s}, {retry_s})"
            )
        self.cluster = cluster
        self._scan = scan
        self._period_id = period_id
        self.lease_s = lease_s
        self.clock_margin_s = clock_margin_s
        self.retry_s = retry_s
        self._task: asyncio.Task[RebuildReport | None] | None = None
        self._failed_at = 0.0
        self.last: RebuildReport | None = None

    async def ready(self, state: LedgerRebuild) -> bool:
        """True when Redis holds a complete ledger; else start (or keep) a rebuild, False.

        Raises ``StateUnavailable`` when Redis does not answer (the caller routes blind).
        """
        if await state.ledger_mark() is not None:
            return True
        task = self._task
        if task is not None and task.done():
            self._task = None
            exc = task.exception()
            if exc is not None:
                self._failed_at = time.monotonic()
                log.warning(
                    "budget ledger rebuild failed, retrying in %.0f s: %s", self.retry_s, exc
                )
        if self._task is None and time.monotonic() - self._failed_at >= self.retry_s:
            self._task = asyncio.create_task(self._rebuild(state), name="ledger-rebuild")
        return False

    async def wait_ready(self, state: LedgerRebuild, timeout_s: float) -> bool:
        """``ready`` until True or ``timeout_s``: a router starting on a Redis without the
        mark waits for the rebuild rather than route its first windows blind (a query held
        by a blind window is routed later without a dedupe entry in Redis, so its routed
        mark is not kept; a crash then would route it again)."""
        deadline = time.monotonic() + timeout_s
        while not await self.ready(state):
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _rebuild(self, state: LedgerRebuild) -> RebuildReport | None:
        token = uuid.uuid4().hex
        while True:
            got = await state.ledger_lease(token, self.lease_s)
            if got == "marked":
                return None  # another router finished it
            if got == "ours":
                break
            await asyncio.sleep(min(1.0, self.lease_s / 3))  # another router is rebuilding
        log.warning("budget ledger missing in Redis (restarted empty?): rebuilding it from Kafka")
        renewer = asyncio.create_task(self._renew(state, token))
        try:
            report = await self._fold_and_book(state)
        finally:
            renewer.cancel()
            await asyncio.gather(renewer, return_exceptions=True)
        if renewer.done() and not renewer.cancelled() and renewer.exception() is not None:
            raise RuntimeError(f"ledger rebuild lease lost: {renewer.exception()}")
        if not await state.ledger_set_mark(token, report.to_json()):
            raise RuntimeError("ledger rebuild lease lost before the mark (Redis restarted?)")
        self.last = report
        log.warning(
            "budget ledger rebuilt from Kafka in %.2f s: %d records since %.0f, %s",
            report.seconds,
            report.records,
            report.since_s,
            "; ".join(
                f"{x['tenant']} {x['period_id']}: spent ${x['spent_usd']:.6f} "
                f"+ reserved ${x['reserved_usd']:.6f}"
                for x in report.ledgers
            ),
        )
        return report

    async def _renew(self, state: LedgerRebuild, token: str) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            got = await state.ledger_lease(token, self.lease_s, renew=True)
            if got != "ours":
                raise RuntimeError(f"rebuild lease renew answered {got!r}")

    async def _fold_and_book(self, state: LedgerRebuild) -> RebuildReport:
        t0 = time.monotonic()
        now = time.time()
        periods = {t.tenant: self._period_id(now, t.period_s) for t in self.cluster.tenants}
        starts = [b[0] for p in periods.values() if (b := period_bounds(p)) is not None]
        # a router with a clock behind ours may have stamped this period's first decisions
        # before our period start: read a margin earlier (the fold filters by period anyway)
        since = max(0.0, min(starts, default=0.0) - self.clock_margin_s)
        fold = LedgerFold(self.cluster, periods)
        bad = 0
        route_of = {topics.route(i.id): i.id for i in self.cluster.instances}

        def handle(topic: str, value: bytes | None) -> None:
            nonlocal bad
            if value is None:
                return
            try:
                if topic == topics.RESULTS:
                    fold.result(Result.model_validate_json(value))
                elif topic in route_of:
                    fold.routed(RoutedQuery.model_validate_json(value), route_of[topic])
            except (ValidationError, ValueError):
                bad += 1

        since_by_topic = {t: since for t in [*route_of, topics.RESULTS]}
        records = await self._scan(since_by_topic, handle)
        ledgers = []
        for ledger in fold.ledgers():
            booked, held = await state.ledger_rebuild(
                ledger.tenant,
                ledger.period_id,
                ledger.limit_usd,
                ledger.settled_usd,
                ledger.reserved_usd,
            )
            ledgers.append(
                {
                    "tenant": ledger.tenant,
                    "period_id": ledger.period_id,
                    "spent_usd": round(ledger.spent_usd, 9),
                    "reserved_usd": round(ledger.outstanding_usd, 9),
                    "settled_queries": len(ledger.settled_usd),
                    "reserved_queries": len(ledger.reserved_usd),
                    "settlements_booked": booked,
                    "reservations_booked": held,
                }
            )
        return RebuildReport(
            seconds=round(time.monotonic() - t0, 3),
            records=records,
            routed=fold.counts.routed,
            results=fold.counts.results,
            bad=bad,
            since_s=since,
            periods=periods,
            ledgers=ledgers,
            finished_at=time.time(),
        )


def kafka_scan(kafka_kwargs: Mapping[str, Any], timeout_s: float = 600.0) -> Scan:
    """A ``Scan`` over Kafka: each topic's partitions from the first offset at or after its
    time (``offsets_for_times``) up to the end offsets seen when the scan starts."""

    async def scan(
        since_by_topic: Mapping[str, float], handle: Callable[[str, bytes | None], None]
    ) -> int:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(
            **kafka_kwargs,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=8 * 1024 * 1024,
        )
        await consumer.start()
        n = 0
        try:
            tps = [
                TopicPartition(topic, p)
                for topic, parts in (await _partitions(kafka_kwargs, list(since_by_topic))).items()
                for p in sorted(parts)
            ]
            if not tps:
                return 0
            consumer.assign(tps)
            ends = await consumer.end_offsets(tps)
            starts = await consumer.offsets_for_times(
                {tp: int(since_by_topic[tp.topic] * 1000) for tp in tps}
            )
            todo = set()
            for tp in tps:
                at = starts.get(tp)
                if at is None or at.offset >= ends[tp]:
                    continue  # nothing in this partition since the period started
                consumer.seek(tp, at.offset)
                todo.add(tp)
            deadline = time.monotonic() + timeout_s
            while todo:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"ledger rebuild: Kafka scan not finished after {timeout_s:.0f} s "
                        f"({n} records read, {len(todo)} partitions left)"
                    )
                batch = await consumer.getmany(*todo, timeout_ms=500, max_records=10_000)
                for tp, msgs in batch.items():
                    for m in msgs:
                        if m.offset < ends[tp]:
                            handle(tp.topic, m.value)
                            n += 1
                for tp in list(todo):
                    if await consumer.position(tp) >= ends[tp]:
                        todo.discard(tp)
            return n
        finally:
            await consumer.stop()

    return scan


async def _partitions(kafka_kwargs: Mapping[str, Any], names: list[str]) -> dict[str, set[int]]:
    """Partition ids of each topic that exists (a topic never written to yet is left out)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**dict(kafka_kwargs))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [t for t in names if t in existing]
        described = await admin.describe_topics(wanted) if wanted else []
    finally:
        await admin.close()
    out: dict[str, set[int]] = {}
    for entry in described:
        if entry.get("topic") in existing and not entry.get("error_code"):
            out[str(entry["topic"])] = {int(p["partition"]) for p in entry.get("partitions", [])}
    return out
