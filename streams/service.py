"""One routing window, end to end, independent of Faust (DESIGN.md "the service").

``RouterService.handle`` takes the raw messages of one window and:

1. validates each with ``schemas.parse_query`` — a bad one goes to ``dead-letters`` with
   its raw bytes, the reason, topic, partition and offset; the window goes on;
2. dedupes by query id in Redis (body SHA-256, TTL): a conflicting body is dead-lettered;
   a duplicate already routed is dropped; a duplicate not yet routed is a redelivery
   (the previous router died before finishing). If that router had recorded its route
   intent (step 5), the same decision is sent again to the same instance, whose worker
   drops a second copy; otherwise the query is decided again — the Redis reservations
   are idempotent per query id, so it is never paid or slotted twice;
3. reads every instance's snapshot in one pipelined call and builds the views (with the
   router's model of each instance's prefix cache, ``state.prefix``); this read, each
   tenant's budget status and the ledger check go beside the dedupe call of step 2, so
   the window's reads cost one round trip;
4. calls ``Router.decide`` once for the window (the service has no routing logic);
5. reserves budget (per tenant) and capacity (per instance) atomically in Redis — a
   reservation lost to another router sends the query to the next window — and records
   each routed query's intent (instance and decision) in its dedupe entry;
6. produces ``RoutedQuery`` to ``route.<instance>`` and a ``Decision`` to ``decisions``,
   and waits until Kafka acknowledged all of them; then marks them routed and touches
   their whole prefix blocks in their instances' prefix-cache models (one round trip:
   a touch Redis refuses is logged, not retried — the worker touches them again when
   the query finishes). Only then does it return, and only then does the Faust adapter
   acknowledge the input offsets, so a crash at any point re-delivers rather than
   loses.

A query that cannot be placed now (budget paced out, every instance full, no live
instance) is *held*: its input offset stays unacknowledged and it joins the next window,
until ``max_hold_s`` has passed; then it gets a final ``Decision`` and an error
``Result`` so whoever waits for it is answered. A Kafka error makes the whole window retry
later (nothing is acknowledged). A Redis error makes the window route *blind* from what
this process last read (``streams.blind.BlindLedger``: LPS views, a conservative share of
the budget, in-process dedupe; decisions flagged ``BUDGET_BLIND``); what was done blind is
written to Redis before the next normal window. So does a Redis that answers without its
budget ledger (restarted empty), until ``streams.ledger_rebuild.LedgerGuard`` has rebuilt
it from Kafka.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, TypeVar

import numpy as np

from routing.prefix import routed_hit_tokens
from routing.types import Budget, InstanceView, Router
from routing.window import (
    BUDGET_HOLD_S,
    MAX_BATCH,
    MAX_HOLD_S,
    SHED_AFTER_SLO,
    SHED_BACKLOG,
    Admission,
    HoldReason,
    Lost,
    WindowPlan,
    WindowSettings,
    admit,
    carried,
    settle,
    shed,
)
from schemas import (
    BadMessage,
    ClusterConfig,
    DeadLetter,
    Decision,
    DecisionFlag,
    DecisionStatus,
    Limits,
    ModelSpec,
    Query,
    Result,
    ResultCode,
    decision_bytes,
    decision_with,
    parse_query,
    routed_query_bytes,
)
from schemas.messages import decision_stamped_bytes
from state.prefix import PrefixTouch, touch_of
from state.protocols import RouterState
from state.store import RouteIntent, StateUnavailable
from streams.blind import BlindLedger
from streams.ledger_rebuild import LedgerGuard, LedgerRebuilding
from streams.metrics import RouterMetrics, observe_many
from streams.views import (
    TenantWindow,
    instance_views,
    live_dispatch_ms,
    live_step_models,
    window_budget,
)
from wiring import topics

log = logging.getLogger("switchyard.router")

_PLACED = (DecisionStatus.ROUTED, DecisionStatus.OVER_BUDGET)
# a window that fails for a reason of its own (not Redis or Kafka being away) is retried this
# many times in all; then each of its inputs is tried alone, and one that fails alone too is
# dead-lettered with the stage that failed (and answered): never a crash loop at one offset
WINDOW_TRIES = 3


class Sink(Protocol):
    """Where produced messages go: ``await send(...)`` returns a future resolved on ack."""

    async def send(self, topic: str, key: bytes, value: bytes) -> Awaitable[Any]: ...


@dataclass
class Inbound:
    """One message off the ``queries`` topic. ``handle`` is the adapter's (a Faust event)."""

    raw: bytes | None
    topic: str
    partition: int
    offset: int
    timestamp_s: float | None = None
    handle: Any = None
    undecodable: str | None = None  # a record batch the consumer could not decode (why)


@dataclass(slots=True)
class Pending:
    """A valid, deduplicated query waiting for a decision."""

    query: Query
    raw: bytes
    inbound: Inbound
    first_seen_s: float
    announced: bool = False  # a DEFERRED decision was already published for it
    sha: str = ""  # SHA-256 of the raw body (dedupe)
    rerouted_from: str | None = None  # adopted from this silent instance (``adopt``)


@dataclass(frozen=True)
class Adopted:
    """``Inbound.handle`` of a query handed over by ``RouterService.adopt`` (not read from
    ``queries``): its ``on_done`` is called instead of the adapter's once the query is
    finished (its re-routed copy, or its final error, acknowledged by Kafka). ``wanted`` is
    asked under the service's lock, so a query finished meanwhile is not adopted again.
    ``routed`` is told, before ``on_done``, where the acknowledged copy went: an instance
    id, or ``"-"`` when the query was answered with an error instead."""

    on_done: Callable[[Inbound], None]
    wanted: Callable[[], bool] = lambda: True
    routed: Callable[[str], None] = lambda _instance_id: None


@dataclass(frozen=True)
class RouterConfig:
    """Knobs of the routing window (CLI: ``switchyard router``)."""

    window_s: float = 0.05
    max_batch: int = MAX_BATCH  # most queries the router is asked about per window
    stale_after_s: float = 2.0
    dedupe_ttl_s: float = 3600.0
    max_hold_s: float = MAX_HOLD_S  # a query waiting for capacity (or a live instance) gives up
    budget_hold_s: float = BUDGET_HOLD_S  # a query deferred for budget gives up after this
    max_held: int = 20_000  # past this many held queries the agent stops reading new ones
    # the router's fetches of ``queries`` (streams.feed): the broker answers once this many
    # bytes wait or fetch_wait_s passed (None: half the window); patient fetches spare the
    # broker and the router a request per few records, and the wait counts toward the
    # window (its records are timed from when they were produced)
    fetch_min_bytes: int = 64 * 1024
    fetch_wait_s: float | None = None
    # load shedding (routing.window.shed): past this many queries waiting in the router (held
    # + read, not yet decided) the excess is shed, earliest deadline first; 0: off
    shed_backlog: int = SHED_BACKLOG
    # a query that waited this many times its TTFT SLO since it was sent (its Kafka
    # timestamp) is shed: a Decision and an error Result with code ``shed``; 0: off
    shed_after_slo: float = SHED_AFTER_SLO
    pacing_factor: float = 0.0
    slot_lease_s: float | None = (
        600.0  # a slot never touched by a worker for this long is reclaimed
    )
    limits: Limits = field(default_factory=Limits)
    # while Redis is unreachable a tenant may spend this share of its last known remaining
    # budget (each router its own share: keep it <= 1 / number of routers)
    blind_budget_fraction: float = 0.5
    # the router's consumer-group session (Faust ``broker_session_timeout``): a window attempt
    # that outlasted it (the process was paused) no longer knows which inputs are its own
    group_session_s: float = 10.0
    # SFS prices steps with the Eq. 9 coefficients the workers refit online (read with the
    # snapshot, same round trip) while their record is at most step_time_max_age_s old;
    # False: always the configured ones
    online_step_time: bool = True
    step_time_max_age_s: float = 600.0

    @property
    def fetch_wait(self) -> float:
        """The fetch wait in force (s): ``fetch_wait_s``, else half the window."""
        return self.window_s / 2 if self.fetch_wait_s is None else self.fetch_wait_s

    @property
    def window(self) -> WindowSettings:
        """The window rules' settings (``routing.window``, shared with the simulator)."""
        return WindowSettings.of(self)


@dataclass(frozen=True)
class Sight:
    """Stage ``_see``: the live instances' views, and the instances left out (no heartbeat)."""

    views: list[InstanceView]
    excluded: list[str]


@dataclass(frozen=True)
class Reads:
    """The window's state reads taken beside its dedupe call (``RouterService._read``)."""

    now: float  # when they were taken: the window's decision time
    sight: Sight
    spent: dict[str, float]  # tenant -> reserved + settled in its period at ``now``


@dataclass(frozen=True)
class Money:
    """Stage ``_price``: the window's ``Budget`` and each tenant's ledger position."""

    budget: Budget
    tenant_windows: dict[str, TenantWindow]
    period_ids: dict[str, str]  # tenant -> ledger period (tenants with a budget)
    spent: dict[str, float]  # tenant -> reserved + settled in that period


@dataclass
class WindowOutcome:
    """What one window did (for tests and the benchmark)."""

    routed: int = 0
    held: int = 0
    dead_letters: int = 0
    final_errors: int = 0  # answered with a final Decision and an error Result (shed included)
    shed: int = 0  # of those, shed under overload (routing.window.shed)
    dropped_duplicates: int = 0
    resent: int = 0  # redelivered queries whose crashed router's decision was sent again

    def add(self, other: WindowOutcome) -> None:
        """Count ``other`` in as well (the windows ``_isolate`` runs one input at a time)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class WindowOutput:
    """What one window produces and records, filled stage by stage, sent at its end."""

    outcome: WindowOutcome = field(default_factory=WindowOutcome)
    outs: list[tuple[str, bytes, bytes]] = field(default_factory=list)  # (topic, key, value)
    # query id -> instance it went to ("-": answered without routing), marked after the produce
    routed_marks: dict[str, str] = field(default_factory=dict)
    routed_inputs: list[Inbound] = field(default_factory=list)  # for the added-latency metric
    # the routed queries' prefix blocks, touched in the prefix-cache model after the produce
    prefix_touches: list[PrefixTouch] = field(default_factory=list)
    held: list[Pending] = field(default_factory=list)  # wait for the next window, oldest first


class RouterService:
    """The imperative shell around one ``Router``: Redis in, Kafka out."""

    def __init__(
        self,
        cluster: ClusterConfig,
        router: Router,
        state: RouterState,
        sink: Sink,
        config: RouterConfig = RouterConfig(),
        metrics: RouterMetrics | None = None,
        on_done: Callable[[Inbound], None] | None = None,
        period_id: Callable[[float, float], str] | None = None,
        keep: Callable[[Inbound], bool] | None = None,
        ledger_guard: LedgerGuard | None = None,
    ) -> None:
        self.cluster = cluster
        self.router = router
        self.state = state
        self.sink = sink
        self.config = config
        self.metrics = metrics or RouterMetrics()
        done, kept = on_done or (lambda _inbound: None), keep or (lambda _inbound: True)
        # adopted queries (``adopt``) are not the adapter's: they report to their adopter
        self._on_done: Callable[[Inbound], None] = lambda it: (
            it.handle.on_done(it) if isinstance(it.handle, Adopted) else done(it)
        )
        self._keep: Callable[[Inbound], bool] = lambda it: (
            isinstance(it.handle, Adopted) or kept(it)
        )
        self._period_id = period_id or _default_period_id
        self._budgets = {t.tenant: t for t in cluster.tenants}
        self._instance_ids = [i.id for i in cluster.instances]
        self._models = list(dict.fromkeys(i.model for i in cluster.instances))
        self._held: list[Pending] = []
        self._retry: list[Inbound] = []  # whole windows that failed on a Redis/Kafka error
        self._lock = asyncio.Lock()
        self._last_window_s = time.time()
        self._arrivals: dict[str, float] = {}
        self._blind = BlindLedger(config.blind_budget_fraction)
        self._blind_logged = False
        self._ledger_guard = ledger_guard  # None: trust the ledger in Redis as it is
        self._stage = "validate"  # the window's stage now (named when it fails)
        self._tries: dict[tuple[str, int, int], int] = {}  # input -> failed windows it was in

    # ------------------------------------------------------------------ entry points

    @property
    def held_count(self) -> int:
        return len(self._held) + len(self._retry)

    async def handle(self, items: Sequence[Inbound]) -> tuple[WindowOutcome, list[Inbound]]:
        """Route one window. Returns what it did and the inputs it did *not* finish.

        The caller must keep the returned inputs unacknowledged; this service reports
        each of them through ``on_done`` once it is finished in a later window.
        """
        async with self._lock:
            return await self._window(list(items))

    def drop_held(self) -> int:
        """Forget held and retried queries (their partition is being given up); returns how many."""
        n = len(self._held) + len(self._retry)
        self._held, self._retry = [], []
        self.metrics.held.set(0)
        return n

    async def adopt(self, pendings: Sequence[Pending]) -> int:
        """Take queries re-routed from a silent instance (``streams.rescue``) as held queries.

        They are decided in the next window among the live instances like any held query
        (their budget and slots are reserved then), and their routed ``Decision`` carries
        ``REROUTED``. Each must have an ``Adopted`` handle and ``rerouted_from`` set; one
        already held here is skipped (adopting again is harmless). Returns how many were taken.
        """
        for p in pendings:
            if not isinstance(p.inbound.handle, Adopted) or not p.rerouted_from:
                raise ValueError(
                    f"query {p.query.id}: adopt() takes re-routed queries only (an Adopted "
                    f"handle and rerouted_from), got handle {type(p.inbound.handle).__name__} "
                    f"from {p.rerouted_from!r}"
                )
        async with self._lock:
            held = {p.query.id for p in self._held}
            new = [p for p in pendings if p.query.id not in held and p.inbound.handle.wanted()]
            self._held = new + self._held  # waited longest: first in the next window
            self.metrics.held.set(self.held_count)
            return len(new)

    async def retry_held(self) -> WindowOutcome | None:
        """Run a window for held queries only (called on a timer when traffic stops)."""
        if not self._held and not self._retry:
            return None
        async with self._lock:
            if not self._held and not self._retry:
                return None
            outcome, _ = await self._window([])
            return outcome

    # ------------------------------------------------------------------ one window

    async def _window(self, items: list[Inbound]) -> tuple[WindowOutcome, list[Inbound]]:
        """One window: decide (``_decide_window``), produce and commit (``_commit``), then
        release what is finished (``_finish``); a failure is contained (``_failed``)."""
        t_start = time.perf_counter()
        retry = [it for it in self._retry if self._keep(it)]
        held = [p for p in self._held if self._keep(p.inbound)]
        self._retry, self._held = [], []
        batch_items = retry + items
        self._stage = "validate"
        try:
            out, candidates, blind = await self._decide_window(batch_items, held)
            await self._commit(out, candidates, blind)
        except Exception as exc:
            return await self._failed(exc, items, batch_items, held)
        if self._tries:
            for it in batch_items + [p.inbound for p in held]:
                self._tries.pop(_input_key(it), None)
        return self._finish(out, items, retry + [p.inbound for p in held], t_start)

    async def _decide_window(
        self, batch_items: list[Inbound], held: list[Pending]
    ) -> tuple[WindowOutput, list[Pending], bool]:
        """Validate, dedupe and route with Redis; when Redis is away (or its ledger is being
        rebuilt), the same blind. Returns what to produce, the candidates, and blind or not."""
        attempt_t0 = time.monotonic()
        try:
            await self._blind.flush(
                self.state, self.cluster, self.config.slot_lease_s, self.config.dedupe_ttl_s
            )
            out = WindowOutput()
            now = time.time()
            valid = self._validate(batch_items, out, now)
            # the window's reads go at once, in one round trip: the ledger check (a Redis
            # back without its ledger routes blind until it is rebuilt from Kafka), the
            # dedupe call, and the instances' snapshots with the budget status of every
            # tenant present (a duplicate's tenant too: reading it costs nothing more). The
            # dedupe entries of a window that then goes blind only keep its routed marks later
            guard = self._ledger_guard
            tenants = list(dict.fromkeys(p.query.tenant for p in (*held, *valid)))
            ready, kept, reads = await asyncio.gather(
                guard.ready(self.state) if guard is not None else _answer(True),
                self._dedupe_valid(valid, out, now),
                self._read(now, tenants) if tenants else _answer(None),
            )
            if not ready:
                raise LedgerRebuilding("the budget ledger is being rebuilt from Kafka")
            candidates = held + kept
            if candidates:
                await self._route(candidates, out, reads=reads)
            return out, candidates, False
        except Exception as exc:
            if not _state_error(exc):
                raise
            if time.monotonic() - attempt_t0 > self.config.group_session_s:
                # not an outage: this router was paused mid-call past its group session (a
                # zombie; the timeout ran out while it was stopped). Its inputs are likely
                # another router's by now, and blind routing has no cross-router check
                # (scenario 9: routed twice); retry the window once the group settled
                raise
            # Redis is away: nothing was produced yet; route this window blind instead
            self.metrics.errors.labels(type(exc).__name__).inc()
            if not self._blind_logged:  # once per outage, not once per window
                log.warning("Redis unreachable, routing blind until it answers: %s", exc)
            self._blind_logged = True
        out = WindowOutput()
        candidates = held + await self._validate_and_dedupe(batch_items, out, blind=True)
        if candidates:
            await self._route(candidates, out, True)
        return out, candidates, True

    async def _commit(self, out: WindowOutput, candidates: list[Pending], blind: bool) -> None:
        """Produce the window's messages (acknowledged by Kafka), then mark its queries
        routed in Redis (owed to Redis by the blind ledger while it is away)."""
        self._stage = "produce"
        await self._produce(out.outs)
        self._stage = "commit"
        marks = out.routed_marks
        shas: dict[str, str] = {}
        for p in candidates:
            qid = p.query.id
            if qid in marks:
                shas[qid] = p.sha
                if isinstance(p.inbound.handle, Adopted):  # acknowledged: tell its rescuer
                    p.inbound.handle.routed(marks[qid])
        if blind:
            self._blind.routed(marks, shas)
        elif marks or out.prefix_touches:
            # the marks and the prefix touches at once (one round trip, not two)
            marked, touched = await asyncio.gather(
                self._mark_routed(marks) if marks else _answer(None),
                self._touch_prefixes(out.prefix_touches),
                return_exceptions=True,
            )
            if isinstance(marked, BaseException):
                if not _state_error(marked):
                    raise marked
                log.warning("routed marks owed to Redis until it answers: %s", marked)
                self._blind.routed(marks, shas)
            else:
                self._blind.remember(shas)
            if isinstance(touched, BaseException):
                if not _state_error(touched):
                    raise touched
                # a model of the engine's cache, reconciled with its own counters: these
                # blocks only count as less recent until the queries' results touch them
                log.warning("prefix-cache model not updated (Redis away): %s", touched)
        if not blind:
            self._blind_logged = False

    async def _failed(
        self, exc: Exception, items: list[Inbound], batch_items: list[Inbound], held: list[Pending]
    ) -> tuple[WindowOutcome, list[Inbound]]:
        """A window that failed: retried later (Redis or Kafka away: nothing acknowledged);
        one failing of its own is retried ``WINDOW_TRIES`` times, then input by input."""
        kind = type(exc).__name__
        stage = self._stage
        self.metrics.errors.labels(kind).inc()
        if not _transient(exc):
            # this window's own failure (a bug, an input some stage chokes on): retried a
            # bounded number of times, then its inputs one by one (``_isolate``)
            failed = batch_items + [p.inbound for p in held]
            tries = 0
            for it in failed:
                key = _input_key(it)
                self._tries[key] = self._tries.get(key, 0) + 1
                tries = max(tries, self._tries[key])
            log.error(
                "window of %d queries failed at stage %s (try %d of %d): %s",
                len(failed), stage, tries, WINDOW_TRIES, exc, exc_info=exc,
            )  # fmt: skip
            if tries >= WINDOW_TRIES:
                return await self._isolate(failed, items, stage, f"{kind}: {exc}")
        log.warning(
            "window of %d queries will be retried: %s: %s", len(batch_items) + len(held), kind, exc
        )
        self._retry = batch_items
        self._held = held
        self.metrics.held.set(self.held_count)
        await asyncio.sleep(min(1.0, self.config.window_s * 4))
        return WindowOutcome(held=len(batch_items) + len(held)), list(items)

    def _finish(
        self, out: WindowOutput, items: list[Inbound], earlier: list[Inbound], t_start: float
    ) -> tuple[WindowOutcome, list[Inbound]]:
        """After the commit: keep the held queries, release the inputs finished now.

        Inputs of this call that are not finished stay unacknowledged by the caller; inputs
        of earlier calls (``earlier``: retried or held) that are finished now are released
        here."""
        now = time.time()
        observe_many(
            self.metrics.added_latency_seconds,
            [max(0.0, now - it.timestamp_s) for it in out.routed_inputs if it.timestamp_s],
        )
        self._held = out.held
        pending_ids = {id(p.inbound) for p in out.held}
        unfinished = [it for it in items if id(it) in pending_ids]
        for it in earlier:
            if id(it) not in pending_ids:
                self._on_done(it)
        out.outcome.held = len(out.held)
        self.metrics.held.set(self.held_count)
        self.metrics.window_seconds.observe(time.perf_counter() - t_start)
        return out.outcome, unfinished

    async def _isolate(
        self, failed: list[Inbound], items: list[Inbound], stage: str, why: str
    ) -> tuple[WindowOutcome, list[Inbound]]:
        """After ``WINDOW_TRIES`` failed windows: each input alone in a window of its own. One
        that fails alone as well is the poison: dead-lettered with the stage, and answered
        with an error Result (``_fail``); the others are routed (or held) as usual.

        Returns, like ``_window``, the outcome and the inputs of ``items`` left unfinished;
        inputs of earlier calls are reported through ``on_done`` once finished.
        """
        mine = {id(it) for it in items}
        total = WindowOutcome()
        unfinished: list[Inbound] = []
        held: list[Pending] = []
        retry: list[Inbound] = []
        for it in failed:
            self._held, self._retry = [], []
            if len(failed) == 1 or self._tries.get(_input_key(it), 0) > WINDOW_TRIES:
                reason = (
                    f"router stage {stage} failed {WINDOW_TRIES} times on a window holding "
                    f"this message, and again on it alone: {why}"
                )
                try:
                    await self._fail([it], reason[:4000], stage)
                except Exception as exc:  # noqa: BLE001 - cannot even answer: retry it later
                    log.warning("could not dead-letter a failing message: %s", exc)
                    retry.append(it)
                    if id(it) in mine:
                        unfinished.append(it)
                    continue
                self._tries.pop(_input_key(it), None)
                total.dead_letters += 1
                if id(it) not in mine:
                    self._on_done(it)
                continue
            self._tries[_input_key(it)] = WINDOW_TRIES  # alone now: one more failure ends it
            outcome, left = await self._window([it])
            held += self._held
            retry += self._retry
            total.add(outcome)
            if left and id(it) in mine:
                unfinished.append(it)
            elif not left and id(it) not in mine:
                self._on_done(it)
        self._held, self._retry = held, retry
        self.metrics.held.set(self.held_count)
        return total, unfinished

    async def _validate_and_dedupe(
        self, items: list[Inbound], out: WindowOutput, blind: bool = False
    ) -> list[Pending]:
        """The window's valid queries (``_validate``) that are not already routed
        (``_dedupe_valid``)."""
        now = time.time()
        return await self._dedupe_valid(self._validate(items, out, now), out, now, blind)

    async def _dedupe_valid(
        self, valid: list[Pending], out: WindowOutput, now: float, blind: bool = False
    ) -> list[Pending]:
        """Those of the ``valid`` queries that are not already routed: a redelivery whose
        crashed router recorded its intent is re-sent as recorded."""
        if not valid:
            return []
        self._stage = "dedupe"
        outs, outcome = out.outs, out.outcome
        if blind:  # only what this process finished itself (BlindLedger docstring)
            verdicts = [(self._blind.verdict(p.query.id, p.sha), "-") for p in valid]
        else:
            verdicts = await self._dedupe(valid)
        # a duplicate never marked routed: its router died after deciding it; if that router
        # recorded its intent, the same decision goes to the same instance again (no re-decide)
        unmarked = [
            p.query.id
            for p, (verdict, routed_to) in zip(valid, verdicts, strict=True)
            if verdict == "duplicate" and not routed_to
        ]
        intents = await self.state.intents(unmarked) if unmarked and not blind else {}
        kept: list[Pending] = []
        for p, (verdict, routed_to) in zip(valid, verdicts, strict=True):
            intent = intents.get(p.query.id)
            if intent is not None:
                self._resend(p, intent, out)
                outcome.resent += 1
                continue
            if verdict == "conflict":
                self._dead_letter(
                    outs,
                    p.inbound,
                    f"query {p.query.id}: id already used by a different query body",
                    "dedupe",
                    now,
                )
                outcome.dead_letters += 1
            elif verdict == "duplicate" and routed_to:
                # already routed (by us before a crash, or by another router): drop it
                outcome.dropped_duplicates += 1
                self.metrics.decisions.labels("duplicate").inc()
            else:
                kept.append(p)
        return kept

    def _validate(self, items: list[Inbound], out: WindowOutput, now: float) -> list[Pending]:
        """Parse and check each input; a bad one, or an id twice in the window, is
        dead-lettered with its stage (``decode``, ``validate``, ``dedupe``)."""
        outs, outcome = out.outs, out.outcome
        valid: list[Pending] = []
        seen: set[str] = set()
        limits, budgets, sha256 = self.config.limits, self._budgets, hashlib.sha256
        for it in items:
            if it.undecodable is not None:  # wiring.kafka_records: never a crash loop
                self._dead_letter(outs, it, it.undecodable, "decode", now)
                outcome.dead_letters += 1
                continue
            try:
                query = parse_query(it.raw, limits)
                if budgets and query.tenant not in budgets:
                    raise BadMessage(
                        f"query {query.id}: unknown tenant {query.tenant!r}; "
                        f"known tenants: {sorted(self._budgets)}"
                    )
                if query.model is not None:
                    try:
                        self.cluster.models_named(query.model)
                    except KeyError as exc:
                        raise BadMessage(f"query {query.id}: {exc.args[0]}") from None
            except BadMessage as exc:
                self._dead_letter(outs, it, exc.reason, "validate", now)
                outcome.dead_letters += 1
                continue
            if query.id in seen:  # the same id twice in one window: keep the first
                self._dead_letter(
                    outs, it, f"query {query.id}: duplicate id in the same window", "dedupe", now
                )
                outcome.dead_letters += 1
                continue
            seen.add(query.id)
            raw = bytes(it.raw or b"")
            valid.append(Pending(query, raw, it, now, sha=sha256(raw).hexdigest()))
        return valid

    def _resend(self, p: Pending, intent: RouteIntent, out: WindowOutput) -> None:
        """Produce again exactly what a crashed router produced (or was producing) for ``p``.

        Its budget and slot were reserved before the intent was recorded, so nothing is
        reserved again. If the first copy did reach ``route.<instance>``, the worker there
        drops the second by query id (``workers.worker``: running or answered).
        """
        dec_json = intent.decision_json.encode()
        routed = routed_query_bytes(p.raw, dec_json)
        key = p.query.id.encode()
        out.outs.append((topics.route(intent.instance_id), key, routed))
        out.outs.append((topics.DECISIONS, key, dec_json))
        out.routed_marks[p.query.id] = intent.instance_id
        self.metrics.decisions.labels("resent").inc()

    async def _dedupe(self, pending: list[Pending]) -> list[tuple[str, str]]:
        """(verdict, routed-to or '') per query, one pipelined round trip for the window."""
        items = [(p.query.id, p.sha) for p in pending]
        got = await self.state.dedupe_many(items, self.config.dedupe_ttl_s)
        return [(str(verdict), str(routed or "")) for verdict, routed in got]

    async def _route(
        self,
        candidates: list[Pending],
        out: WindowOutput,
        blind: bool = False,
        reads: Reads | None = None,
    ) -> None:
        """Decide and place one window's candidates (oldest first), in stages: see the
        instances, price the window, admit and cut (``routing.window.admit``), decide,
        reserve, hold or give up (``routing.window.settle``), emit. Before all, load
        shedding (``routing.window.shed``) answers the queries it sheds. ``reads``: the
        snapshots and budget status already read beside the dedupe call (``_read``)."""
        now = time.time() if reads is None else reads.now
        self._stage = "decide"
        rules = self.config.window
        shedding = shed(
            candidates,
            [p.inbound.timestamp_s or p.first_seen_s for p in candidates],
            [p.query.ttft_slo_ms / 1000.0 for p in candidates],
            now,
            rules,
        )
        for g in shedding.shed:
            self._give_up(g.item, None, g.status, g.text, now, None, out, g.reason)
        candidates = shedding.kept
        if reads is None:  # two reads at once (one round trip, not two)
            sight, money = await asyncio.gather(
                self._see(now, blind), self._price(candidates, now, blind)
            )
        else:
            sight, money = reads.sight, await self._price(candidates, now, blind, reads.spent)
        admission = admit(
            candidates,
            [p.first_seen_s for p in candidates],
            [v.free_slots for v in sight.views],
            now,
            rules,
            sight.excluded,
        )
        asked = admission.asked
        decisions = self._decide(asked, sight.views, money.budget, now) if asked else []
        self._stage = "reserve"
        lost = await self._reserve(asked, decisions, money, blind)
        plan = settle(asked, [p.first_seen_s for p in asked], decisions, now, rules, lost, blind)
        cached = self._predicted_cached(plan.routed, sight.views) if not blind else {}
        intents = self._emit_routed(plan.routed, money.period_ids, now, blind, out, cached)
        self._emit_unplaced(admission, plan, money.period_ids, now, out)
        out.held.extend(carried(admission, plan))
        if intents and not blind:
            # before anything is produced: a successor re-sends these rather than re-deciding
            taken = await self.state.mark_intent_many(intents)
            if taken:
                await self._drop_taken(taken, intents, out, candidates)
            out.prefix_touches = self._prefix_touches(plan.routed, taken)

    def _predicted_cached(
        self, routed: Sequence[tuple[Pending, Decision]], views: Sequence[InstanceView]
    ) -> dict[str, int]:
        """Query id -> prompt tokens the prefix model of its local instance holds for it
        (``routing.prefix.routed_hit_tokens`` on this window's snapshot; an instance without
        a model yet holds nothing). Cloud instances are left out."""
        held: dict[str, Any] = {}
        for v in views:
            if self.cluster.model_of(v.instance_id).kind == "local":
                h = v.prefix_hashes
                held[v.instance_id] = np.zeros(0, dtype=np.uint64) if h is None else h
        local = [(p, d) for p, d in routed if str(d.instance_id) in held]
        hits = routed_hit_tokens(
            [p.query for p, _ in local], [str(d.instance_id) for _, d in local], held
        )
        return {p.query.id: h for (p, _), h in zip(local, hits, strict=True) if h is not None}

    def _prefix_touches(
        self, routed: Sequence[tuple[Pending, Decision]], taken: Mapping[str, str]
    ) -> list[PrefixTouch]:
        """The routed queries' whole prefix blocks, to become the most recent in their local
        instance's prefix-cache model (``state.prefix``: an LRU of the instance's KV-cache
        tokens) once produced (``_commit``); the next window's snapshot reads them back
        (``InstanceView.prefix_hashes``). A query another router had taken is skipped."""
        touches: list[PrefixTouch] = []
        local: dict[str, ModelSpec | None] = {}  # instance id -> its model when local, once
        for p, d in routed:
            iid = str(d.instance_id)
            spec = local.get(iid, _UNSEEN)
            if spec is _UNSEEN:
                model = self.cluster.model_of(iid)
                spec = local[iid] = model if model.kind == "local" else None
            if spec is None or p.query.id in taken:  # a cloud model: no cache of ours
                continue
            touch = touch_of(iid, p.query, spec)
            if touch is not None:
                touches.append(touch)
        return touches

    async def _see(self, now: float, blind: bool) -> Sight:
        """Stage 1: the live instances' views (from Redis, or the blind ledger's memory)."""
        if blind:
            views, excluded = self._blind.views(self.cluster, now), list[str]()
        else:
            if self.config.online_step_time:
                live, records = await self.state.snapshots_and_step_times(
                    self._instance_ids, self._models, now
                )
                steps = live_step_models(records, now, self.config.step_time_max_age_s)
                dispatch: dict[str, float] = live_dispatch_ms(
                    records, now, self.config.step_time_max_age_s
                )
                self.metrics.observe_step_times(records, steps)
            else:
                live, steps = await self.state.snapshots(self._instance_ids, now), {}
                dispatch = {}
            self._blind.observe_instances(live, self.cluster, now)
            views, excluded = instance_views(
                self.cluster, live, now, self.config.stale_after_s, self._arrivals, steps, dispatch
            )
            for spec in self.cluster.instances:
                info = live.get(spec.id)
                if info is not None:
                    self.metrics.instance_slots_used.labels(spec.id).set(int(info.slots_used))
        for v in views:
            self.metrics.instance_stale.labels(v.instance_id).set(1 if v.stale else 0)
        return Sight(views, excluded)

    async def _read(self, now: float, tenants: Sequence[str]) -> Reads:
        """Stages 1 and 2's reads at once: the snapshots (``_see``) and what each of
        ``tenants`` has spent in its period at ``now``."""
        sight, spent = await asyncio.gather(
            self._see(now, False), self._spent(self._period_ids(tenants, now))
        )
        return Reads(now, sight, spent)

    def _period_ids(self, tenants: Sequence[str], now: float) -> dict[str, str]:
        """Tenant -> its ledger period at ``now`` (tenants with a budget)."""
        return {
            t: self._period_id(now, self._budgets[t].period_s)
            for t in tenants
            if t in self._budgets
        }

    async def _price(
        self,
        candidates: Sequence[Pending],
        now: float,
        blind: bool,
        read: Mapping[str, float] | None = None,
    ) -> Money:
        """Stage 2: what the window may spend (``streams.views.window_budget``: pacing).
        ``read``: what each tenant has spent, read already (``_read``) at the same ``now``."""
        tenants = list(dict.fromkeys(p.query.tenant for p in candidates))
        period_ids = self._period_ids(tenants, now)
        if blind:  # what the router may spend is the blind allowance
            spent = {
                t: self._budgets[t].budget_usd - self._blind.allowance(t, pid)
                for t, pid in period_ids.items()
            }
        else:
            spent = await self._spent(period_ids) if read is None else dict(read)
            self.metrics.observe_budgets(
                {t: b.budget_usd for t, b in self._budgets.items()}, spent
            )
        elapsed = max(self.config.window_s, now - self._last_window_s)
        self._last_window_s = now
        budget, tenant_windows = window_budget(
            tenants, self._budgets, spent, period_ids, now, elapsed, self.config.pacing_factor
        )
        return Money(budget, tenant_windows, period_ids, spent)

    def _decide(
        self, asked: Sequence[Pending], views: Sequence[InstanceView], budget: Budget, now: float
    ) -> list[Decision]:
        """Stage 3: the router's decisions for the admitted queries (checked)."""
        queries = [p.query for p in asked]
        self.metrics.batch_size.observe(len(queries))
        t0 = time.perf_counter()
        decisions = self.router.decide(queries, views, budget, now)
        self.metrics.decide_seconds.observe(time.perf_counter() - t0)
        _check_decisions(queries, decisions, {v.instance_id for v in views})
        return decisions

    async def _reserve(
        self, asked: Sequence[Pending], decisions: Sequence[Decision], money: Money, blind: bool
    ) -> dict[int, Lost]:
        """Stage 4: reserve budget per tenant, then capacity per instance, each one atomic
        call (blind: from the blind ledger, owed to Redis). Returns the positions (in
        ``asked``) whose reservation failed, and why."""
        placed = [
            (k, p, d)
            for k, (p, d) in enumerate(zip(asked, decisions, strict=True))
            if d.status in _PLACED and d.instance_id
        ]
        if blind:
            return self._reserve_blind(placed, money)
        # budget and slots are reserved at once (one round trip, not two); a query that
        # lost either gives the other back. Budget first among the reasons, as it is the
        # one a later window cannot fix by itself.
        budget_lost, slot_lost = await asyncio.gather(
            self._reserve_budget(placed, money), self._reserve_slots(placed)
        )
        give_back_budget: dict[tuple[str, str], list[str]] = {}
        give_back_slots: dict[str, list[str]] = {}
        for k, p, d in placed:
            if k in slot_lost and k not in budget_lost:
                tw = money.tenant_windows.get(p.query.tenant)
                if tw is not None:
                    give_back_budget.setdefault((tw.tenant, tw.period_id), []).append(p.query.id)
            elif k in budget_lost and k not in slot_lost:
                give_back_slots.setdefault(str(d.instance_id), []).append(p.query.id)
        if give_back_budget or give_back_slots:
            await asyncio.gather(
                *(self.state.release_budget(t, pid, q) for (t, pid), q in give_back_budget.items()),
                *(self.state.release_slots(i, q) for i, q in give_back_slots.items()),
            )
        for instance_id, qids in give_back_slots.items():
            self._blind.reserved_slots(instance_id, -len(qids))
        return slot_lost | budget_lost

    def _reserve_blind(self, placed: Sequence[_Placed], money: Money) -> dict[int, Lost]:
        lost: dict[int, Lost] = {}
        for k, p, d in placed:
            tw = money.tenant_windows.get(p.query.tenant)
            short = self._blind.take(
                tw.tenant if tw else None,
                tw.period_id if tw else None,
                str(d.instance_id),
                p.query.id,
                self.cluster.model_of(str(d.instance_id)).max_cost_usd(p.query),
            )
            if short:
                lost[k] = Lost(HoldReason.BLIND_SHORT, short)
        return lost

    async def _reserve_budget(self, placed: Sequence[_Placed], money: Money) -> dict[int, Lost]:
        """Each tenant's worst-case spend, one atomic call per tenant with a budget (the
        tenants' calls at once)."""
        by_tenant: dict[str, list[_Placed]] = {}
        for t in placed:
            by_tenant.setdefault(t[1].query.tenant, []).append(t)
        calls = [
            (money.tenant_windows[tenant], group)
            for tenant, group in by_tenant.items()
            if tenant in money.tenant_windows
        ]
        # the worst case, not the prediction: settling the real cost never overspends
        amounts = [self._worst_costs(group) for _, group in calls]
        oks = await asyncio.gather(
            *(
                self.state.reserve_budget(tw.tenant, tw.period_id, tw.limit_usd, a)
                for (tw, _), a in zip(calls, amounts, strict=True)
            )
        )
        lost: dict[int, Lost] = {}
        for (tw, group), a, ok in zip(calls, amounts, oks, strict=True):
            spent_now = f"tenant {tw.tenant} budget for period {tw.period_id} is spent"
            for k, p, _ in group:
                if not ok.get(p.query.id, True):
                    lost[k] = Lost(HoldReason.BUDGET, spent_now)
            # what a blind window would start from: the read less what was just reserved
            taken = sum(a[q] for q, accepted in ok.items() if accepted)
            self._blind.observe_budget(
                tw.tenant, tw.period_id, tw.limit_usd, money.spent[tw.tenant] + taken
            )
        return lost

    def _worst_costs(self, group: Sequence[_Placed]) -> dict[str, float]:
        """Query id -> ``ModelSpec.max_cost_usd`` of the query on its instance's model, in
        ``group``'s order: one ``max_costs_usd`` array per model (the same floats)."""
        by_model: dict[str, list[int]] = {}
        model_name: dict[str, str] = {}  # instance id -> its model's name, once
        for j, (_, _, d) in enumerate(group):
            iid = str(d.instance_id)
            name = model_name.get(iid)
            if name is None:
                name = model_name[iid] = self.cluster.model_of(iid).name
            by_model.setdefault(name, []).append(j)
        costs = [0.0] * len(group)
        for name, rows in by_model.items():
            worst = self.cluster.model(name).max_costs_usd([group[j][1].query for j in rows])
            for j, usd in zip(rows, worst.tolist(), strict=True):
                costs[j] = usd
        return {t[1].query.id: usd for t, usd in zip(group, costs, strict=True)}

    async def _reserve_slots(self, placed: Sequence[_Placed]) -> dict[int, Lost]:
        """One atomic call per instance (the instances' calls at once)."""
        by_instance: dict[str, list[int]] = {}
        qids: dict[str, list[str]] = {}
        for k, p, d in placed:
            iid = str(d.instance_id)
            rows = by_instance.get(iid)
            if rows is None:
                rows = by_instance[iid] = []
                qids[iid] = []
            rows.append(k)
            qids[iid].append(p.query.id)
        limits = {i: self.cluster.model_of(i).max_concurrency for i in by_instance}
        oks = await asyncio.gather(
            *(
                self.state.reserve_slots(i, limits[i], qids[i], lease_s=self.config.slot_lease_s)
                for i in by_instance
            )
        )
        lost: dict[int, Lost] = {}
        for (instance_id, ks), accepted in zip(by_instance.items(), oks, strict=True):
            self._blind.reserved_slots(instance_id, sum(accepted))
            full = f"instance {instance_id} is at its capacity of {limits[instance_id]}"
            for k, ok in zip(ks, accepted, strict=True):
                if not ok:
                    lost[k] = Lost(HoldReason.SLOT_LOST, full)
        return lost

    def _emit_routed(
        self,
        routed: Sequence[tuple[Pending, Decision]],
        period_ids: Mapping[str, str],
        now: float,
        blind: bool,
        out: WindowOutput,
        cached: Mapping[str, int] | None = None,
    ) -> dict[str, RouteIntent]:
        """Stage 5: the route message and the Decision of each routed query; its intent.
        ``cached``: query id -> prompt tokens the prefix model predicts cached there
        (``Decision.predicted_cached_tokens``, which the worker reconciles with the engine)."""
        intents: dict[str, RouteIntent] = {}
        counted: list[tuple[Decision, Query]] = []
        windows: dict[Any, bytes] = {}  # what the window's decisions share, serialised once
        route_topics: dict[str, str] = {}  # instance id -> its checked topic name, once
        outs, marks, inputs = out.outs, out.routed_marks, out.routed_inputs
        decisions_topic = topics.DECISIONS
        for p, d in routed:
            q = p.query
            qid = q.id
            pid = period_ids.get(q.tenant)
            tokens = cached.get(qid) if cached else None
            if p.rerouted_from is None and not (blind and DecisionFlag.BUDGET_BLIND not in d.flags):
                # the usual case: stamped while written, no copy (the same bytes, tested)
                dec_json = decision_stamped_bytes(d, now, pid, tokens, windows)
            else:
                update: dict[str, Any] = {"budget_period": pid, "decided_at": now}
                if tokens is not None:
                    update["predicted_cached_tokens"] = tokens
                if blind and DecisionFlag.BUDGET_BLIND not in d.flags:
                    update["flags"] = [*d.flags, DecisionFlag.BUDGET_BLIND]
                if p.rerouted_from is not None:
                    update["flags"] = [*update.get("flags", d.flags), DecisionFlag.REROUTED]
                    why = f"re-routed from silent instance {p.rerouted_from}"
                    update["reason"] = f"{why}; {d.reason}" if d.reason else why
                d = decision_with(d, update)
                dec_json = decision_bytes(d, windows)
            instance_id = str(d.instance_id)
            topic = route_topics.get(instance_id)
            if topic is None:
                topic = route_topics[instance_id] = topics.route(instance_id)
            key = qid.encode()
            outs.append((topic, key, routed_query_bytes(p.raw, dec_json)))
            outs.append((decisions_topic, key, dec_json))
            marks[qid] = instance_id
            intents[qid] = RouteIntent(instance_id, dec_json.decode(), p.rerouted_from)
            inputs.append(p.inbound)
            counted.append((d, q))
        out.outcome.routed += len(counted)
        self._count_routed(counted)
        return intents

    def _emit_unplaced(
        self,
        admission: Admission[Pending],
        plan: WindowPlan[Pending],
        period_ids: Mapping[str, str],
        now: float,
        out: WindowOutput,
    ) -> None:
        """Stage 5 for the rest: one DEFERRED decision when a query is first held (not for
        the batch cut's overflow, which was not decided), a final answer when given up.
        Held or given up at admission, the router was not asked: no ledger period."""
        for h in admission.held:
            if h.reason != HoldReason.OVERFLOW:
                self._hold_quietly(h.item, out, now, h.text)
        for g in admission.given_up:
            self._give_up(g.item, None, g.status, g.text, now, None, out, g.reason)
        for h in plan.held:
            pid = period_ids.get(h.item.query.tenant)
            self._hold_quietly(h.item, out, now, h.text, h.decision, pid)
        for g in plan.given_up:
            pid = period_ids.get(g.item.query.tenant)
            self._give_up(g.item, g.decision, g.status, g.text, now, pid, out, g.reason)

    async def _drop_taken(
        self,
        taken: Mapping[str, str],
        intents: Mapping[str, RouteIntent],
        out: WindowOutput,
        candidates: Sequence[Pending],
    ) -> None:
        """Queries another router routed while this one was away mid-window (a zombie woken
        from a pause longer than its group session): theirs stands, these are not produced.

        One whose recorded intent is not marked routed yet is sent again as recorded instead:
        it may be this router's own, from an attempt whose produce failed (a held query in a
        window retried after a broker outage: dropping it acknowledged a query nobody had
        produced), or another router's still producing; an identical copy is harmless (its
        worker drops the second by query id)."""
        recorded = await self.state.intents(list(taken))
        keys = {q.encode() for q in taken}
        out.outs[:] = [
            o for o in out.outs
            if not (o[1] in keys and (o[0] == topics.DECISIONS or topics.instance_of(o[0])))
        ]  # fmt: skip
        out.routed_inputs[:] = [it for it in out.routed_inputs if not _query_key_in(it, keys)]
        by_instance: dict[str, list[str]] = {}
        for qid, holder in taken.items():
            out.routed_marks.pop(qid, None)
            mine = intents[qid].instance_id
            if holder != mine:  # a slot is per (instance, query): the same one is theirs too
                by_instance.setdefault(mine, []).append(qid)
        for instance_id, qids in by_instance.items():  # the slot this router took for nothing
            await self.state.release_slots(instance_id, qids)
        for p in candidates:
            if p.query.id in recorded:
                self._resend(p, recorded[p.query.id], out)
                out.outcome.resent += 1
        out.outcome.routed -= len(taken)
        self.metrics.decisions.labels("taken_by_another_router").inc(len(taken))
        log.warning(
            "%d queries of this window were routed by another router meanwhile (this router "
            "was paused past its group session?); their routing stands, this one is dropped",
            len(taken),
        )

    def _give_up(
        self,
        p: Pending,
        d: Decision | None,
        status: DecisionStatus,
        reason: str,
        now: float,
        pid: str | None,
        out: WindowOutput,
        why: HoldReason,
    ) -> None:
        """Final answer for a query that will not be routed: a Decision and an error Result
        (``code`` ``insufficient_quota`` when its budget was short, ``shed`` when load
        shedding gave it up, else ``not_routed``)."""
        q = p.query
        final = (d or _deferred(q, reason, now)).model_copy(
            update={
                "status": status,
                "reason": reason,
                "instance_id": None,
                "decided_at": now,
                "budget_period": pid,
            }
        )
        out.outs.append(
            (topics.DECISIONS, q.id.encode(), final.model_dump_json(exclude_none=True).encode())
        )
        result = Result(
            query_id=q.id,
            tenant=q.tenant,
            instance_id="",
            model="",
            error=f"not routed ({status.value}): {reason}",
            code=_RESULT_CODES.get(why, ResultCode.NOT_ROUTED),
            finished_at=now,
        )
        out.outs.append(
            (topics.RESULTS, q.id.encode(), result.model_dump_json(exclude_none=True).encode())
        )
        out.routed_marks[q.id] = "-"
        out.outcome.final_errors += 1
        if why == HoldReason.SHED:
            out.outcome.shed += 1
            self.metrics.decisions.labels("shed").inc()
        else:
            self.metrics.decisions.labels(status.value).inc()

    def _hold_quietly(
        self,
        p: Pending,
        out: WindowOutput,
        now: float,
        reason: str,
        d: Decision | None = None,
        pid: str | None = None,
    ) -> None:
        """Publish one DEFERRED decision the first time a query is held; later holds are silent."""
        if p.announced:
            return
        base = d or _deferred(p.query, reason, now)
        held = base.model_copy(
            update={
                "status": DecisionStatus.DEFERRED,
                "reason": f"held for a later window: {reason}",
                "instance_id": None,
                "decided_at": now,
                "budget_period": pid,
            }
        )
        out.outs.append(
            (
                topics.DECISIONS,
                p.query.id.encode(),
                held.model_dump_json(exclude_none=True).encode(),
            )
        )
        p.announced = True

    async def _spent(self, period_ids: Mapping[str, str]) -> dict[str, float]:
        """Each tenant's reserved + settled spend in its period (every tenant at once)."""
        statuses = await asyncio.gather(
            *(self.state.budget_status(t, pid) for t, pid in period_ids.items())
        )
        return {t: _spent_usd(s) for t, s in zip(period_ids, statuses, strict=True)}

    async def _mark_routed(self, marks: Mapping[str, str]) -> None:
        await self.state.mark_routed_many(dict(marks))

    async def _touch_prefixes(self, touches: Sequence[PrefixTouch]) -> None:
        """The produced queries' prefix blocks become the most recent (one pipelined call)."""
        if touches:
            await self.state.prefix_touch_many(list(touches))

    async def _produce(self, outs: list[tuple[str, bytes, bytes]]) -> None:
        if not outs:
            return
        send_all = getattr(self.sink, "send_all", None)
        if send_all is not None:
            await send_all(outs)
            return
        futures = [await self.sink.send(topic, key, value) for topic, key, value in outs]
        await asyncio.gather(*futures)

    async def _fail(self, failed: list[Inbound], reason: str, stage: str = "route") -> None:
        """Dead-letter inputs that cannot be routed (naming the stage), and answer each query
        with an error Result, except after the ``commit`` stage: its route message is out
        already and its worker answers it."""
        now = time.time()
        outs: list[tuple[str, bytes, bytes]] = []
        for it in failed:
            self._dead_letter(outs, it, reason, stage, now)
            if stage == "commit":
                continue
            try:
                q = parse_query(it.raw, self.config.limits)
            except Exception:  # noqa: BLE001 - no query to answer (or parsing is the poison)
                continue
            result = Result(
                query_id=q.id,
                tenant=q.tenant,
                instance_id="",
                model="",
                error=reason[:2000],
                code=ResultCode.NOT_ROUTED,
                finished_at=now,
            )
            outs.append(
                (topics.RESULTS, q.id.encode(), result.model_dump_json(exclude_none=True).encode())
            )
        await self._produce(outs)

    # ------------------------------------------------------------------ helpers

    def _dead_letter(
        self, outs: list[tuple[str, bytes, bytes]], it: Inbound, reason: str, stage: str, now: float
    ) -> None:
        letter = DeadLetter.of(
            raw=bytes(it.raw or b""),
            reason=reason,
            topic=it.topic,
            partition=it.partition,
            offset=it.offset,
            received_at=now,
            stage=stage,
        )
        outs.append(
            (
                topics.DEAD_LETTERS,
                f"{it.topic}/{it.partition}/{it.offset}".encode(),
                letter.model_dump_json().encode(),
            )
        )
        self.metrics.dead_letters.labels(stage).inc()

    def _count_routed(self, routed: Sequence[tuple[Decision, Query]]) -> None:
        """The window's routed queries in the metrics: one ``inc`` per label, not per query
        (a labelled child's lookup and lock cost microseconds each)."""
        m = self.metrics
        # counted in C (an enum's hash is Python code: once per decision, not twice)
        statuses = Counter([d.status for d, _ in routed])
        instances = Counter([str(d.instance_id) for d, _ in routed])
        flags = Counter([flag for d, _ in routed for flag in d.flags])
        spend: dict[str, float] = {}
        predicted = met = 0
        for d, q in routed:
            cost = d.predicted_cost_usd
            if cost:
                spend[q.tenant] = spend.get(q.tenant, 0.0) + cost
            ttft = d.predicted_ttft_ms
            if ttft is not None:
                predicted += 1
                met += ttft <= q.ttft_slo_ms
        # the arrival-rate average, one step per routed query (as the views read it): each
        # instance's average is its own, so stepping it its count of times in a row is exact
        rate = 0.1 / max(self.config.window_s, 1e-3)
        arrivals = self._arrivals
        for inst, c in instances.items():
            avg = arrivals.get(inst, 0.0)
            for _ in range(c):
                avg = avg * 0.9 + rate
            arrivals[inst] = avg
        for status, c in statuses.items():
            m.decisions.labels(status.value).inc(c)
        for inst, c in instances.items():
            m.routed.labels(inst).inc(c)
        for flag, c in flags.items():
            m.flags.labels(flag.value).inc(c)
        for tenant, usd in spend.items():
            m.spend_usd.labels(tenant).inc(usd)
        if predicted:
            m.slo_predicted_total.inc(predicted)
        if met:
            m.slo_predicted_met.inc(met)


# the code of a given-up query's error Result, by why it was given up (else ``not_routed``)
_RESULT_CODES = {HoldReason.BUDGET: ResultCode.INSUFFICIENT_QUOTA, HoldReason.SHED: ResultCode.SHED}

_UNSEEN: Any = object()  # a per-window memo's miss (its values may be None)

_Placed = tuple[int, Pending, Decision]  # a query the router placed: position in asked, it, how


def _input_key(it: Inbound) -> tuple[str, int, int]:
    return (it.topic, it.partition, it.offset)


def _query_key_in(it: Inbound, keys: set[bytes]) -> bool:
    key = getattr(getattr(it.handle, "message", None), "key", None)
    return isinstance(key, bytes) and key in keys


# Kafka errors about one record, which no retry fixes (every other Kafka error, a timeout
# or an unknown producer id after a broker restart included, is the broker being away)
_RECORD_ERRORS = frozenset(
    {"MessageSizeTooLargeError", "RecordTooLargeError", "CorruptRecordException",
     "InvalidTopicError", "RecordListTooLargeError"}
)  # fmt: skip


def _transient(exc: BaseException) -> bool:
    """Errors that go away by themselves (Redis or Kafka unreachable, timeouts); not an
    error of this window's own, such as a record Kafka will never take."""
    if isinstance(exc, (OSError, TimeoutError, asyncio.TimeoutError, ConnectionError)):
        return True
    name = type(exc).__name__
    module = type(exc).__module__
    if name == "StateUnavailable" or module.startswith("redis"):
        return True
    if module.startswith(("aiokafka", "kafka")):
        return name not in _RECORD_ERRORS
    return False


def _state_error(exc: BaseException) -> bool:
    """Redis unreachable (the window can be routed blind instead of retried)."""
    return isinstance(exc, StateUnavailable) or type(exc).__module__.startswith("redis")


_T = TypeVar("_T")


async def _answer(value: _T) -> _T:
    """``value`` as an awaitable (a read a window does not need, in a ``gather``)."""
    return value


def _spent_usd(status: Any) -> float:
    """Reserved + settled spend from ``StateStore.budget_status`` (object or mapping)."""
    if isinstance(status, Mapping):
        return float(status.get("reserved_usd", 0.0)) + float(status.get("spent_usd", 0.0))
    return float(getattr(status, "reserved_usd", 0.0)) + float(getattr(status, "spent_usd", 0.0))


def _default_period_id(now_s: float, period_s: float) -> str:
    from state import period_id

    return str(period_id(now_s, period_s))


def _deferred(q: Query, reason: str, now: float) -> Decision:
    return Decision(
        query_id=q.id,
        tenant=q.tenant,
        status=DecisionStatus.DEFERRED,
        policy="service",
        decided_at=now,
        reason=reason,
    )


class RouterContractError(RuntimeError):
    """The router broke the ``Router.decide`` contract; the message says how."""


def _check_decisions(
    queries: Sequence[Query], decisions: Sequence[Decision], live: Iterable[str]
) -> None:
    if len(decisions) != len(queries):
        raise RouterContractError(
            f"router returned {len(decisions)} decisions for {len(queries)} queries"
        )
    known = set(live)
    for q, d in zip(queries, decisions, strict=True):
        if d.query_id != q.id:
            raise RouterContractError(
                f"decision for {d.query_id!r} where query {q.id!r} was expected (order)"
            )
        if d.status in _PLACED and d.instance_id not in known:
            raise RouterContractError(
                f"query {q.id}: routed to {d.instance_id!r}, not a live instance"
            )
