"""Re-route the queue of an instance that stopped heart-beating (issue 8, scenario 5).

The router leaves a silent instance out of new windows (``streams.views``), but what was
routed to it before it went silent waits in ``route.<id>``: not yet read by its worker,
or read but not started (queued for one of its slots). The ``Rescuer`` runs in each
router process, on a timer:

1. an instance without a live heartbeat for longer than ``grace_s`` is *silent*
   (``SilenceTracker``, pure); nothing is rescued while no instance at all is alive (there
   is nowhere to re-route to, and the copies are better off waiting for their worker);
2. its ``route.<id>`` is read from the worker group's committed offset (the earliest
   offset if none) to the end, with a plain consumer outside any group
   (``KafkaRouteReader``);
3. each copy without a published result is *claimed* for re-routing
   (``StateStore.claim_rescue``: one Lua script per instance). The instance's worker claims
   each copy right before running it (``claim_run``), so exactly one of them owns it: a copy
   that already started stays with its worker (re-running it elsewhere would duplicate
   inference); a claimed one is skipped by the worker when it comes back;
4. for a claimed copy the old budget reservation (made at the old instance's worst case)
   and the old capacity slot are released, and the query is handed to the
   ``RouterService`` (``adopt``) as a held query of the next window: it is decided among
   the live instances, with what is left of its SLO (``created_at``, or the old decision's
   time when the producer did not set it), reserved at the new instance's worst case, and
   its ``Decision`` is flagged ``REROUTED``;
5. once Kafka acknowledged the re-routed copy (or the query's final error), the claim is
   marked ``rerouted`` in Redis: final, the old instance's worker skips its copy for good.
   Unless the copy went back to the old instance itself (it came back, e.g. a worker
   restarted after ``kill -9``, before the window that re-routed it, and the policy chose
   it again): then the claim is dropped instead (``StateStore.claim_returned``) and that
   instance's worker runs one of its two copies and skips the other as a duplicate. A
   ``rerouted`` mark there would have it skip both: the claim is per instance and query
   (bug 21 in docs/reliability.md).

Crash safety: a rescuer holds its claims on a lease (``lease_s``) it renews every tick
while the query waits in the service. A router that dies before the re-routed copy is
acknowledged leaves a lapsing lease: a successor rescuer (any router) claims the copy
again from ``route.<id>``, or, if the instance came back, its worker runs it. Nothing is
lost. The one window for a duplicate is a crash between Kafka's acknowledgement and the
``rerouted`` mark (one Redis round trip), as for the router's own dedupe marks.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from schemas import ClusterConfig, Query, RoutedQuery
from schemas import routed_query_raw as query_bytes  # the router's splice, undone
from schemas.parse import BadMessage, Limits, parse_model
from state.protocols import RescuerState
from streams.service import Adopted, Inbound, Pending
from wiring import topics

log = logging.getLogger("switchyard.router.rescue")


@dataclass(frozen=True)
class RescueConfig:
    """Knobs of the rescuer (CLI: ``switchyard router --rescue-grace-s``)."""

    grace_s: float = 6.0  # silent this long (after its heartbeat expired): re-route its queue
    lease_s: float = 15.0  # a claim not renewed for this long may be taken over
    interval_s: float = 0.5  # how often the rescuer looks
    read_timeout_s: float = 10.0  # reading one route topic to its end gives up after this

    def __post_init__(self) -> None:
        for name in ("grace_s", "lease_s", "interval_s", "read_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"rescue {name} must be a finite number of seconds > 0, got {value!r}"
                )
        if self.lease_s <= 2 * self.interval_s:
            raise ValueError(
                f"rescue lease_s ({self.lease_s:g} s) must be more than two intervals "
                f"({self.interval_s:g} s each): the lease is renewed once per interval"
            )


# ---------------------------------------------------------------------- pure parts


class _LiveLike(Protocol):
    @property
    def alive(self) -> bool: ...


class SilenceTracker:
    """Which instances have been without a live heartbeat for at least ``grace_s``.

    Silence is counted from the first look that found the heartbeat gone (the heartbeat
    key's TTL already ran out by then), so an instance is rescued ``TTL + grace_s`` after
    its last heartbeat at the earliest. One live look resets it.
    """

    def __init__(self, grace_s: float) -> None:
        if not math.isfinite(grace_s) or grace_s <= 0:
            raise ValueError(f"grace_s must be a finite number of seconds > 0, got {grace_s}")
        self.grace_s = grace_s
        self.silent_since: dict[str, float] = {}

    def update(
        self, instance_ids: Iterable[str], live: Mapping[str, _LiveLike], now: float
    ) -> list[str]:
        """Record one look at every instance; return the silent ones, in ``instance_ids`` order."""
        out: list[str] = []
        for iid in instance_ids:
            info = live.get(iid)
            if info is not None and info.alive:
                self.silent_since.pop(iid, None)
                continue
            since = self.silent_since.setdefault(iid, now)
            if now - since >= self.grace_s:
                out.append(iid)
        return out


@dataclass(frozen=True)
class Copy:
    """One message of a ``route.<id>`` topic."""

    partition: int
    offset: int
    value: bytes | None


@dataclass(frozen=True)
class Stranded:
    """A valid routed copy waiting on a silent instance."""

    instance_id: str
    copy: Copy
    routed: RoutedQuery
    raw_query: bytes  # the query's body as the router received it (``Pending.raw``)


def parse_copies(
    instance_id: str, copies: Iterable[Copy], limits: Limits
) -> tuple[list[Stranded], list[str]]:
    """Valid copies meant for ``instance_id`` (first copy of each query id), and why the others
    were left (their worker dead-letters them when it comes back)."""
    out: list[Stranded] = []
    skipped: list[str] = []
    seen: set[str] = set()
    for c in copies:
        where = f"{topics.route(instance_id)}[{c.partition}]@{c.offset}"
        try:
            rq = parse_model(RoutedQuery, c.value, limits, "routed query")
        except BadMessage as exc:
            skipped.append(f"{where}: {exc.reason}")
            continue
        if rq.decision.instance_id not in (None, instance_id):
            skipped.append(f"{where}: decision names instance {rq.decision.instance_id!r}")
            continue
        if rq.query.id in seen:
            continue
        seen.add(rq.query.id)
        out.append(Stranded(instance_id, c, rq, query_bytes(bytes(c.value or b""), rq)))
    return out, skipped


def ledger_of(rq: RoutedQuery, cluster: ClusterConfig) -> tuple[str, str] | None:
    """(tenant, period) the old decision reserved the query's cost in (as the worker settles)."""
    from state import period_id

    if rq.decision.budget_period is not None:
        return rq.query.tenant, rq.decision.budget_period
    budget = next((t for t in cluster.tenants if t.tenant == rq.query.tenant), None)
    if budget is None:
        return None
    return rq.query.tenant, period_id(rq.decision.decided_at, budget.period_s)


def to_pending(
    s: Stranded,
    now: float,
    on_done: Callable[[Inbound], None],
    wanted: Callable[[], bool] = lambda: True,
    routed: Callable[[str], None] = lambda _instance_id: None,
) -> Pending:
    """The ``Pending`` that ``RouterService.adopt`` takes for a claimed copy.

    The policy sees what is left of the SLO (``routing.policies.common.remaining_slo_ms``
    counts from ``created_at``): a query without ``created_at`` counts from its first
    decision, the moment it started waiting on the silent instance. The routed body keeps
    the query exactly as it was sent.
    """
    q: Query = s.routed.query
    if q.created_at is None:
        q = q.model_copy(update={"created_at": s.routed.decision.decided_at})
    inbound = Inbound(
        raw=s.raw_query,
        topic=topics.route(s.instance_id),
        partition=s.copy.partition,
        offset=s.copy.offset,
        timestamp_s=None,
        handle=Adopted(on_done, wanted, routed),
    )
    return Pending(
        q,
        s.raw_query,
        inbound,
        now,
        sha=hashlib.sha256(s.raw_query).hexdigest(),
        rerouted_from=s.instance_id,
    )


# ---------------------------------------------------------------------- I/O


class RouteReader(Protocol):
    async def read(
        self, instance_id: str, start: Mapping[int, int]
    ) -> tuple[list[Copy], dict[int, int]]:
        """Copies of ``route.<instance_id>`` from the worker group's committed offset (or
        ``start[partition]`` when further) to the end; and the end offset per partition."""
        ...

    async def close(self) -> None: ...


class KafkaRouteReader:
    """``RouteReader`` on Kafka: an admin client for the worker group's committed offsets and
    one plain consumer (no group: it never commits, never joins) assigned per read."""

    def __init__(self, kafka_kwargs: Mapping[str, Any], timeout_s: float = 10.0) -> None:
        self.kafka_kwargs = dict(kafka_kwargs)
        self.timeout_s = timeout_s
        self._admin: Any = None
        self._consumer: Any = None

    async def _start(self) -> None:
        from aiokafka import AIOKafkaConsumer
        from aiokafka.admin import AIOKafkaAdminClient

        if self._admin is None:
            admin = AIOKafkaAdminClient(**self.kafka_kwargs)
            await admin.start()
            self._admin = admin
        if self._consumer is None:
            consumer = AIOKafkaConsumer(
                **self.kafka_kwargs,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                isolation_level="read_committed",
            )
            await consumer.start()
            self._consumer = consumer

    async def read(
        self, instance_id: str, start: Mapping[int, int]
    ) -> tuple[list[Copy], dict[int, int]]:
        from aiokafka import TopicPartition

        await self._start()
        topic = topics.route(instance_id)
        committed = await self._committed(topics.worker_group(instance_id))
        described = await self._admin.describe_topics([topic])
        tps = [TopicPartition(topic, p["partition"]) for t in described for p in t["partitions"]]
        if not tps:
            return [], {}
        consumer = self._consumer
        consumer.assign(tps)
        consumer.resume(*tps)
        begins = await consumer.beginning_offsets(tps)
        ends = await consumer.end_offsets(tps)
        todo: dict[Any, int] = {}
        for tp in tps:
            meta = committed.get(tp)
            first = meta.offset if meta is not None and meta.offset >= 0 else begins[tp]
            first = max(first, begins[tp], start.get(tp.partition, 0))
            if first < ends[tp]:
                consumer.seek(tp, first)
                todo[tp] = ends[tp]
        out: list[Copy] = []
        if todo:
            consumer.pause(*[tp for tp in tps if tp not in todo])
            async with asyncio.timeout(self.timeout_s):
                while todo:
                    batch = await consumer.getmany(*todo, timeout_ms=200)
                    for tp, recs in batch.items():
                        out.extend(
                            Copy(tp.partition, r.offset, r.value)
                            for r in recs
                            if r.offset < todo.get(tp, -1)
                        )
                    for tp in list(todo):
                        if await consumer.position(tp) >= todo[tp]:
                            del todo[tp]
        return out, {tp.partition: ends[tp] for tp in tps}

    async def _committed(self, group: str) -> dict[Any, Any]:
        """The group's committed offsets; a coordinator still starting (a fresh broker creates
        ``__consumer_offsets`` on the first look-up) is asked again a few times."""
        from aiokafka.errors import (
            CoordinatorLoadInProgressError,
            GroupCoordinatorNotAvailableError,
        )

        for attempt in range(10):
            try:
                return dict(await self._admin.list_consumer_group_offsets(group))
            except (GroupCoordinatorNotAvailableError, CoordinatorLoadInProgressError):
                if attempt == 9:
                    raise
                await asyncio.sleep(0.5)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        for client in (self._consumer, self._admin):
            if client is not None:
                try:
                    await client.stop() if client is self._consumer else await client.close()
                except Exception as exc:  # noqa: BLE001 - closing at shutdown: log and go on
                    log.debug("rescuer: closing a Kafka client failed: %s", exc)
        self._admin = self._consumer = None


class _Service(Protocol):
    async def adopt(self, pendings: Sequence[Pending]) -> int: ...


@dataclass
class _InFlight:
    instance_id: str
    pending: Pending


@dataclass
class Rescuer:
    """Finds silent instances and hands their unstarted copies to the service (module doc)."""

    cluster: ClusterConfig
    state: RescuerState
    service: _Service
    reader: RouteReader
    config: RescueConfig = field(default_factory=RescueConfig)
    limits: Limits = field(default_factory=Limits)
    rescuer_id: str = field(default_factory=lambda: "r" + uuid.uuid4().hex[:12])
    counts: dict[str, int] = field(
        default_factory=lambda: {
            "claimed": 0,  # copies this rescuer took (re-routed or being re-routed)
            "rerouted": 0,  # re-routed copies acknowledged and marked final
            "taken": 0,  # claim lost: its worker started it, or it was re-routed before
            "answered": 0,  # a result was already out: left alone
            "busy": 0,  # another rescuer's lease
            "unreadable": 0,  # not a valid routed query: left for the worker to dead-letter
            "lease_lost": 0,  # lease lapsed while held: the worker took the copy back
            "returned": 0,  # re-routed back to the same instance (it came back): claim dropped
        }
    )

    def __post_init__(self) -> None:
        self.tracker = SilenceTracker(self.config.grace_s)
        self._ids = [i.id for i in self.cluster.instances]
        self._inflight: dict[str, _InFlight] = {}  # query id -> adopted, not finished
        self._owed: dict[str, list[str]] = {}  # instance -> query ids to mark rerouted
        self._returned: dict[str, list[str]] = {}  # instance -> ids re-routed back to it
        self._went: dict[str, str] = {}  # query id -> where its acknowledged copy went
        self._start: dict[str, dict[int, int]] = {}  # instance -> partition -> next offset
        self._lock = asyncio.Lock()
        self._failing = False

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    async def tick(self, now: float | None = None) -> None:
        """One look: mark what finished, renew leases, scan silent instances, hand over.

        Never raises for Redis or Kafka being away (it tries again next tick).
        """
        async with self._lock:
            try:
                await self._tick(time.time() if now is None else now)
            except Exception as exc:
                if not _transient(exc):
                    raise
                # once per outage, not once per tick
                (log.debug if self._failing else log.warning)(
                    "rescuer: will try again: %s: %s", type(exc).__name__, exc
                )
                self._failing = True
            else:
                self._failing = False

    async def _tick(self, now: float) -> None:
        await self._mark_owed()
        await self._renew()
        live = await self.state.snapshots(self._ids, now)
        silent = self.tracker.update(self._ids, live, now)
        for iid in list(self._start):
            if iid not in silent:
                self._start.pop(iid)  # back (or not yet silent long enough): rescan from its commit
        # with no live instance there is nowhere to re-route to: the copies wait where they are
        # (for their worker, or for the first instance that comes back)
        if any(info.alive for info in live.values()):
            for iid in silent:
                await self._scan(iid, now)
        if self._inflight:
            await self.service.adopt([f.pending for f in self._inflight.values()])

    async def _scan(self, iid: str, now: float) -> None:
        copies, ends = await self.reader.read(iid, self._start.get(iid, {}))
        stranded, skipped = parse_copies(iid, copies, self.limits)
        self.counts["unreadable"] += len(skipped)
        for why in skipped[:3]:
            log.warning("rescuer: left in %s: %s", topics.route(iid), why)
        stranded = [s for s in stranded if s.routed.query.id not in self._inflight]
        first_open: dict[int, int] = {}  # partition -> lowest offset to look at again
        if stranded:
            answered = await self.state.has_results([s.routed.query.id for s in stranded])
            self.counts["answered"] += sum(answered)
            stranded = [s for s, done in zip(stranded, answered, strict=True) if not done]
        if stranded:
            outcomes = await self.state.claim_rescue(
                iid,
                [s.routed.query.id for s in stranded],
                self.rescuer_id,
                lease_s=self.config.lease_s,
            )
            won = [s for s, o in zip(stranded, outcomes, strict=True) if o == "won"]
            self.counts["taken"] += outcomes.count("lost")
            self.counts["busy"] += outcomes.count("busy")
            for s, o in zip(stranded, outcomes, strict=True):
                if o == "busy":  # another rescuer may die: look at it again
                    p = s.copy.partition
                    first_open[p] = min(first_open.get(p, s.copy.offset), s.copy.offset)
            if won:
                await self._release(iid, won)
                for s in won:
                    qid = s.routed.query.id
                    self._inflight[qid] = _InFlight(
                        iid,
                        to_pending(
                            s, now, self._finisher(iid, qid), self._wanted(qid), self._router(qid)
                        ),
                    )
                self.counts["claimed"] += len(won)
                log.warning(
                    "rescuer: instance %s silent for %.1f s: re-routing %d queued queries",
                    iid,
                    now - self.tracker.silent_since.get(iid, now),
                    len(won),
                )
        self._start[iid] = {p: min(end, first_open.get(p, end)) for p, end in ends.items()}

    async def _release(self, iid: str, won: Sequence[Stranded]) -> None:
        """Give back the old reservation (old instance's worst case) and the old slot: the
        adopting window reserves again at the new instance's worst case."""
        by_ledger: dict[tuple[str, str], list[str]] = {}
        for s in won:
            ledger = ledger_of(s.routed, self.cluster)
            if ledger is not None:
                by_ledger.setdefault(ledger, []).append(s.routed.query.id)
        for (tenant, period), qids in by_ledger.items():
            await self.state.release_budget(tenant, period, qids)
        await self.state.release_slots(iid, [s.routed.query.id for s in won])

    def _wanted(self, qid: str) -> Callable[[], bool]:
        """Whether the service should still route ``qid`` (False once its claim is gone)."""
        return lambda: qid in self._inflight

    def _router(self, qid: str) -> Callable[[str], None]:
        def routed(instance_id: str) -> None:  # the service, once the copy was acknowledged
            if qid in self._inflight:
                self._went[qid] = instance_id

        return routed

    def _finisher(self, iid: str, qid: str) -> Callable[[Inbound], None]:
        def done(_inbound: Inbound) -> None:  # called by the service once Kafka acknowledged
            went = self._went.pop(qid, None)
            if self._inflight.pop(qid, None) is not None:
                owed = self._returned if went == iid else self._owed
                owed.setdefault(iid, []).append(qid)

        return done

    async def _mark_owed(self) -> None:
        for iid, qids in list(self._returned.items()):
            outcomes = await self.state.claim_returned(iid, qids, self.rescuer_id)
            self._returned.pop(iid, None)
            self.counts["returned"] += outcomes.count("won")
            self.counts["lease_lost"] += len(qids) - outcomes.count("won")
            log.warning(
                "rescuer: %d re-routed queries went back to %s (it came back): its worker "
                "runs them, e.g. %s",
                len(qids),
                iid,
                qids[:3],
            )
        for iid, qids in list(self._owed.items()):
            outcomes = await self.state.claim_rerouted(iid, qids, self.rescuer_id)
            self._owed.pop(iid, None)
            self.counts["rerouted"] += outcomes.count("won")
            lost = [q for q, o in zip(qids, outcomes, strict=True) if o != "won"]
            if lost:
                self.counts["lease_lost"] += len(lost)
                log.warning(
                    "rescuer: %d re-routed queries of %s were taken back by its worker after "
                    "the lease lapsed (duplicated inference), e.g. %s",
                    len(lost),
                    iid,
                    lost[:3],
                )

    async def _renew(self) -> None:
        by_instance: dict[str, list[str]] = {}
        for qid, f in self._inflight.items():
            by_instance.setdefault(f.instance_id, []).append(qid)
        for iid, qids in by_instance.items():
            outcomes = await self.state.claim_rescue(
                iid, qids, self.rescuer_id, lease_s=self.config.lease_s
            )
            for qid, o in zip(qids, outcomes, strict=True):
                if o != "won":  # lapsed and taken: the service may still route it (rare)
                    self._inflight.pop(qid, None)
                    self.counts["lease_lost"] += 1
                    log.warning("rescuer: lost the claim on %s of %s (%s)", qid, iid, o)

    async def flush(self) -> None:
        """Mark what finished since the last tick (before a clean shutdown)."""
        async with self._lock:
            try:
                await self._mark_owed()
            except Exception as exc:
                if not _transient(exc):
                    raise
                log.warning("rescuer: rerouted marks not written: %s", exc)


def _transient(exc: BaseException) -> bool:
    from streams.service import _transient as service_transient

    return service_transient(exc)
