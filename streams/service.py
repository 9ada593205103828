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
3. reads every instance's snapshot in one pipelined call and builds the views;
4. calls ``Router.decide`` once for the window (the service has no routing logic);
5. reserves budget (per tenant) and capacity (per instance) atomically in Redis — a
   reservation lost to another router sends the query to the next window — and records
   each routed query's intent (instance and decision) in its dedupe entry;
6. produces ``RoutedQuery`` to ``route.<instance>`` and a ``Decision`` to ``decisions``,
   and waits until Kafka acknowledged all of them. Only then does it return, and only
   then does the Faust adapter acknowledge the input offsets, so a crash at any point
   re-delivers rather than loses.

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
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol

from routing.types import Router
from schemas import (
    BadMessage,
    ClusterConfig,
    DeadLetter,
    Decision,
    DecisionFlag,
    DecisionStatus,
    Limits,
    Query,
    Result,
    parse_query,
)
from state.store import RouteIntent, StateUnavailable
from streams.blind import BlindLedger
from streams.ledger_rebuild import LedgerGuard, LedgerRebuilding
from streams.metrics import RouterMetrics
from streams.views import instance_views, window_budget
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


@dataclass
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
    asked under the service's lock, so a query finished meanwhile is not adopted again."""

    on_done: Callable[[Inbound], None]
    wanted: Callable[[], bool] = lambda: True


@dataclass(frozen=True)
class RouterConfig:
    """Knobs of the routing window (CLI: ``switchyard router``)."""

    window_s: float = 0.05
    max_batch: int = 1000
    stale_after_s: float = 2.0
    dedupe_ttl_s: float = 3600.0
    max_hold_s: float = (
        60.0  # a query waiting for capacity (or a live instance) gives up after this
    )
    budget_hold_s: float = 2.0  # a query deferred for budget gives up after this
    max_held: int = 20_000  # past this many held queries the agent stops reading new ones
    pacing_factor: float = 0.0
    slot_lease_s: float | None = (
        600.0  # a slot never touched by a worker for this long is reclaimed
    )
    limits: Limits = field(default_factory=Limits)
    # while Redis is unreachable a tenant may spend this share of its last known remaining
    # budget (each router its own share: keep it <= 1 / number of routers)
    blind_budget_fraction: float = 0.5


@dataclass
class WindowOutcome:
    """What one window did (for tests and the benchmark)."""

    routed: int = 0
    held: int = 0
    dead_letters: int = 0
    final_errors: int = 0
    dropped_duplicates: int = 0
    resent: int = 0  # redelivered queries whose crashed router's decision was sent again

    def add(self, other: WindowOutcome) -> None:
        """Count ``other`` in as well (the windows ``_isolate`` runs one input at a time)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


class RouterService:
    """The imperative shell around one ``Router``: Redis in, Kafka out."""

    def __init__(
        self,
        cluster: ClusterConfig,
        router: Router,
        state: Any,
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
        t_start = time.perf_counter()
        retry = [it for it in self._retry if self._keep(it)]
        held = [p for p in self._held if self._keep(p.inbound)]
        self._retry, self._held = [], []
        batch_items = retry + items
        outcome = WindowOutcome()
        self._stage = "validate"
        try:
            outs: list[tuple[str, bytes, bytes]] = []
            routed_marks: dict[str, str] = {}
            latencies: list[Inbound] = []
            still_held: list[Pending] = []
            blind = False
            try:
                await self._blind.flush(
                    self.state, self.cluster, self.config.slot_lease_s, self.config.dedupe_ttl_s
                )
                # a Redis back without its ledger: blind until it is rebuilt from Kafka
                if self._ledger_guard is not None and not await self._ledger_guard.ready(
                    self.state
                ):
                    raise LedgerRebuilding("the budget ledger is being rebuilt from Kafka")
                candidates = held + await self._validate_and_dedupe(
                    batch_items, outs, outcome, routed_marks=routed_marks
                )
                if candidates:
                    await self._route(
                        candidates, outs, outcome, routed_marks, latencies, still_held
                    )
            except Exception as exc:
                if not _state_error(exc):
                    raise
                # Redis is away: nothing was produced yet; route this window blind instead
                self.metrics.errors.labels(type(exc).__name__).inc()
                if not self._blind_logged:  # once per outage, not once per window
                    log.warning("Redis unreachable, routing blind until it answers: %s", exc)
                self._blind_logged = True
                blind, outcome = True, WindowOutcome()
                outs, routed_marks, latencies, still_held = [], {}, [], []
                candidates = held + await self._validate_and_dedupe(
                    batch_items, outs, outcome, blind=True
                )
                if candidates:
                    await self._route(
                        candidates, outs, outcome, routed_marks, latencies, still_held, blind
                    )
            self._stage = "produce"
            await self._produce(outs)
            self._stage = "commit"
            shas = {p.query.id: p.sha for p in candidates if p.query.id in routed_marks}
            if blind:
                self._blind.routed(routed_marks, shas)
            elif routed_marks:
                try:
                    await self._mark_routed(routed_marks)
                except Exception as exc:
                    if not _state_error(exc):
                        raise
                    log.warning("routed marks owed to Redis until it answers: %s", exc)
                    self._blind.routed(routed_marks, shas)
                else:
                    self._blind.remember(shas)
            if not blind:
                self._blind_logged = False
        except Exception as exc:
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
                log.exception(
                    "window of %d queries failed at stage %s (try %d of %d): %s",
                    len(failed), stage, tries, WINDOW_TRIES, exc,
                )  # fmt: skip
                if tries >= WINDOW_TRIES:
                    return await self._isolate(failed, items, stage, f"{kind}: {exc}")
            log.warning(
                "window of %d queries will be retried: %s: %s",
                len(batch_items) + len(held),
                kind,
                exc,
            )
            self._retry = batch_items
            self._held = held
            self.metrics.held.set(self.held_count)
            await asyncio.sleep(min(1.0, self.config.window_s * 4))
            return WindowOutcome(held=len(batch_items) + len(held)), list(items)

        if self._tries:
            for it in batch_items + [p.inbound for p in held]:
                self._tries.pop(_input_key(it), None)
        now = time.time()
        for inbound in latencies:
            if inbound.timestamp_s:
                self.metrics.added_latency_seconds.observe(max(0.0, now - inbound.timestamp_s))
        self._held = still_held
        # inputs of this call that are not finished stay unacknowledged by the caller;
        # inputs of earlier calls (held or retried) that are finished now are released here
        pending_ids = {id(p.inbound) for p in still_held}
        unfinished = [it for it in items if id(it) in pending_ids]
        for it in retry + [p.inbound for p in held]:
            if id(it) not in pending_ids:
                self._on_done(it)
        outcome.held = len(still_held)
        self.metrics.held.set(self.held_count)
        self.metrics.window_seconds.observe(time.perf_counter() - t_start)
        return outcome, unfinished

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
        self,
        items: list[Inbound],
        outs: list[tuple[str, bytes, bytes]],
        outcome: WindowOutcome,
        blind: bool = False,
        routed_marks: dict[str, str] | None = None,
    ) -> list[Pending]:
        now = time.time()
        valid: list[Pending] = []
        seen: set[str] = set()
        for it in items:
            if it.undecodable is not None:  # wiring.kafka_records: never a crash loop
                self._dead_letter(outs, it, it.undecodable, "decode", now)
                outcome.dead_letters += 1
                continue
            try:
                query = parse_query(it.raw, self.config.limits)
                if self._budgets and query.tenant not in self._budgets:
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
            valid.append(Pending(query, raw, it, now, sha=hashlib.sha256(raw).hexdigest()))
        if not valid:
            return []
        self._stage = "dedupe"
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
            if intent is not None and routed_marks is not None:
                self._resend(p, intent, outs, routed_marks)
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

    def _resend(
        self,
        p: Pending,
        intent: RouteIntent,
        outs: list[tuple[str, bytes, bytes]],
        routed_marks: dict[str, str],
    ) -> None:
        """Produce again exactly what a crashed router produced (or was producing) for ``p``.

        Its budget and slot were reserved before the intent was recorded, so nothing is
        reserved again. If the first copy did reach ``route.<instance>``, the worker there
        drops the second by query id (``workers.worker``: running or answered).
        """
        dec_json = intent.decision_json.encode()
        routed = b'{"query":' + p.raw.strip() + b',"decision":' + dec_json + b"}"
        key = p.query.id.encode()
        outs.append((topics.route(intent.instance_id), key, routed))
        outs.append((topics.DECISIONS, key, dec_json))
        routed_marks[p.query.id] = intent.instance_id
        self.metrics.decisions.labels("resent").inc()

    async def _dedupe(self, pending: list[Pending]) -> list[tuple[str, str]]:
        """(verdict, routed-to or '') per query, one pipelined round trip for the window."""
        items = [(p.query.id, p.sha) for p in pending]
        got = await self.state.dedupe_many(items, self.config.dedupe_ttl_s)
        return [(str(verdict), str(routed or "")) for verdict, routed in got]

    async def _route(
        self,
        candidates: list[Pending],
        outs: list[tuple[str, bytes, bytes]],
        outcome: WindowOutcome,
        routed_marks: dict[str, str],
        latencies: list[Inbound],
        still_held: list[Pending],
        blind: bool = False,
    ) -> None:
        now = time.time()
        self._stage = "decide"
        if blind:
            views, excluded = self._blind.views(self.cluster, now), list[str]()
        else:
            live = await self.state.snapshots(self._instance_ids, now)
            self._blind.observe_instances(live, self.cluster, now)
            views, excluded = instance_views(
                self.cluster, live, now, self.config.stale_after_s, self._arrivals
            )
            for spec in self.cluster.instances:
                info = live.get(spec.id)
                if info is not None:
                    self.metrics.instance_slots_used.labels(spec.id).set(int(info.slots_used))
        for v in views:
            self.metrics.instance_stale.labels(v.instance_id).set(1 if v.stale else 0)

        tenants = list(dict.fromkeys(p.query.tenant for p in candidates))
        period_ids = {
            t: self._period_id(now, self._budgets[t].period_s)
            for t in tenants
            if t in self._budgets
        }
        if blind:  # what the router may spend is the blind allowance
            spent = {
                t: self._budgets[t].budget_usd - self._blind.allowance(t, pid)
                for t, pid in period_ids.items()
            }
        else:
            spent = await self._spent(period_ids)
            self.metrics.observe_budgets(
                {t: b.budget_usd for t, b in self._budgets.items()}, spent
            )
        elapsed = max(self.config.window_s, now - self._last_window_s)
        self._last_window_s = now
        budget, tenant_windows = window_budget(
            tenants, self._budgets, spent, period_ids, now, elapsed, self.config.pacing_factor
        )

        # admission: with no free slot anywhere nothing can be placed, so the router is not
        # asked; and it is asked about at most max_batch queries (the oldest first)
        total_free = sum(v.free_slots for v in views)
        if views and total_free == 0:
            reason = "every live instance is at its capacity"
            for p in candidates:
                if now - p.first_seen_s < self.config.max_hold_s:
                    self._hold_quietly(p, outs, now, reason)
                    still_held.append(p)
                else:
                    why = f"gave up after {self.config.max_hold_s:g} s: {reason}"
                    self._give_up(
                        p, None, DecisionStatus.DEFERRED, why, now, None, outs, routed_marks
                    )
                    outcome.final_errors += 1
            return
        if len(candidates) > self.config.max_batch:
            still_held.extend(candidates[self.config.max_batch :])
            candidates = candidates[: self.config.max_batch]
        queries = [p.query for p in candidates]
        self.metrics.batch_size.observe(len(queries))
        if views:
            t0 = time.perf_counter()
            decisions = self.router.decide(queries, views, budget, now)
            self.metrics.decide_seconds.observe(time.perf_counter() - t0)
            _check_decisions(queries, decisions, {v.instance_id for v in views})
        else:
            reason = f"no live instance (no heartbeat from {', '.join(excluded) or 'any instance'})"
            decisions = [_deferred(q, reason, now) for q in queries]

        # reserve budget per tenant, then capacity per instance, each one atomic call
        self._stage = "reserve"
        placed = [
            (p, d)
            for p, d in zip(candidates, decisions, strict=True)
            if d.status in _PLACED and d.instance_id
        ]
        lost: dict[str, str] = {}  # query id -> why its reservation failed
        if blind:
            for p, d in placed:
                tw = tenant_windows.get(p.query.tenant)
                short = self._blind.take(
                    tw.tenant if tw else None,
                    tw.period_id if tw else None,
                    str(d.instance_id),
                    p.query.id,
                    self.cluster.model_of(str(d.instance_id)).max_cost_usd(p.query),
                )
                if short:
                    lost[p.query.id] = short
            placed = []  # nothing to reserve in Redis now: the ledger owes it
        by_tenant: dict[str, list[tuple[Pending, Decision]]] = {}
        for p, d in placed:
            by_tenant.setdefault(p.query.tenant, []).append((p, d))
        for tenant, group in by_tenant.items():
            tw = tenant_windows.get(tenant)
            if tw is None:
                continue
            # the worst case, not the prediction: settling the real cost never overspends
            amounts = {
                p.query.id: self.cluster.model_of(str(d.instance_id)).max_cost_usd(p.query)
                for p, d in group
            }
            ok = await self.state.reserve_budget(tenant, tw.period_id, tw.limit_usd, amounts)
            for qid, accepted in ok.items():
                if not accepted:
                    lost[qid] = f"tenant {tenant} budget for period {tw.period_id} is spent"
            # what a blind window would start from: the read less what was just reserved
            taken = sum(amounts[q] for q, accepted in ok.items() if accepted)
            self._blind.observe_budget(tenant, tw.period_id, tw.limit_usd, spent[tenant] + taken)
        by_instance: dict[str, list[tuple[Pending, Decision]]] = {}
        for p, d in placed:
            if p.query.id not in lost:
                by_instance.setdefault(str(d.instance_id), []).append((p, d))
        released: dict[tuple[str, str], list[str]] = {}
        for instance_id, group in by_instance.items():
            max_slots = self.cluster.model_of(instance_id).max_concurrency
            qids = [p.query.id for p, _ in group]
            oks = await self.state.reserve_slots(
                instance_id, max_slots, qids, lease_s=self.config.slot_lease_s
            )
            self._blind.reserved_slots(instance_id, sum(oks))
            for (p, _), accepted in zip(group, oks, strict=True):
                if not accepted:
                    lost[p.query.id] = f"instance {instance_id} is at its capacity of {max_slots}"
                    tw = tenant_windows.get(p.query.tenant)
                    if tw is not None:
                        released.setdefault((p.query.tenant, tw.period_id), []).append(p.query.id)
        for (tenant, period), qids in released.items():
            await self.state.release_budget(tenant, period, qids)

        intents: dict[str, RouteIntent] = {}
        for p, d in zip(candidates, decisions, strict=True):
            q = p.query
            pid = period_ids.get(q.tenant)
            if d.status in _PLACED and d.instance_id and q.id not in lost:
                instance_id = d.instance_id
                update: dict[str, Any] = {"budget_period": pid, "decided_at": now}
                if blind and DecisionFlag.BUDGET_BLIND not in d.flags:
                    update["flags"] = [*d.flags, DecisionFlag.BUDGET_BLIND]
                if p.rerouted_from is not None:
                    update["flags"] = [*update.get("flags", d.flags), DecisionFlag.REROUTED]
                    why = f"re-routed from silent instance {p.rerouted_from}"
                    update["reason"] = f"{why}; {d.reason}" if d.reason else why
                d = d.model_copy(update=update)
                dec_json = d.model_dump_json(exclude_none=True).encode()
                routed = b'{"query":' + p.raw.strip() + b',"decision":' + dec_json + b"}"
                key = q.id.encode()
                outs.append((topics.route(instance_id), key, routed))
                outs.append((topics.DECISIONS, key, dec_json))
                routed_marks[q.id] = instance_id
                intents[q.id] = RouteIntent(instance_id, dec_json.decode(), p.rerouted_from)
                latencies.append(p.inbound)
                outcome.routed += 1
                self._count_routed(d, q)
                continue
            reason = lost.get(q.id) or d.reason or f"router decided {d.status.value}"
            status = DecisionStatus.DEFERRED if q.id in lost else d.status
            # while blind a short budget is the blind allowance's: wait for Redis like for slots
            paced = "budget" in reason.lower() and not blind
            limit_s = self.config.budget_hold_s if paced else self.config.max_hold_s
            final = status == DecisionStatus.REJECTED  # e.g. longer than every model's context
            if not final and now - p.first_seen_s < limit_s:
                self._hold_quietly(p, outs, now, reason, d, pid)
                still_held.append(p)
                continue
            why = reason if final else f"gave up after {limit_s:g} s: {reason}"
            self._give_up(p, d, status, why, now, pid, outs, routed_marks)
            outcome.final_errors += 1
        if intents and not blind:
            # before anything is produced: a successor re-sends these rather than re-deciding
            taken = await self.state.mark_intent_many(intents)
            if taken:
                await self._drop_taken(taken, intents, outs, routed_marks, latencies, outcome)

    async def _drop_taken(
        self,
        taken: Mapping[str, str],
        intents: Mapping[str, RouteIntent],
        outs: list[tuple[str, bytes, bytes]],
        routed_marks: dict[str, str],
        latencies: list[Inbound],
        outcome: WindowOutcome,
    ) -> None:
        """Queries another router routed while this one was away mid-window (a zombie woken
        from a pause longer than its group session): theirs stands, these are not produced."""
        keys = {q.encode() for q in taken}
        outs[:] = [
            o for o in outs
            if not (o[1] in keys and (o[0] == topics.DECISIONS or topics.instance_of(o[0])))
        ]  # fmt: skip
        latencies[:] = [it for it in latencies if not _query_key_in(it, keys)]
        by_instance: dict[str, list[str]] = {}
        for qid, holder in taken.items():
            routed_marks.pop(qid, None)
            mine = intents[qid].instance_id
            if holder != mine:  # a slot is per (instance, query): the same one is theirs too
                by_instance.setdefault(mine, []).append(qid)
        for instance_id, qids in by_instance.items():  # the slot this router took for nothing
            await self.state.release_slots(instance_id, qids)
        outcome.routed -= len(taken)
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
        outs: list[tuple[str, bytes, bytes]],
        routed_marks: dict[str, str],
    ) -> None:
        """Final answer for a query that will not be routed: a Decision and an error Result."""
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
        outs.append(
            (topics.DECISIONS, q.id.encode(), final.model_dump_json(exclude_none=True).encode())
        )
        result = Result(
            query_id=q.id,
            tenant=q.tenant,
            instance_id="",
            model="",
            error=f"not routed ({status.value}): {reason}",
            finished_at=now,
        )
        outs.append(
            (topics.RESULTS, q.id.encode(), result.model_dump_json(exclude_none=True).encode())
        )
        routed_marks[q.id] = "-"
        self.metrics.decisions.labels(status.value).inc()

    def _hold_quietly(
        self,
        p: Pending,
        outs: list[tuple[str, bytes, bytes]],
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
        outs.append(
            (
                topics.DECISIONS,
                p.query.id.encode(),
                held.model_dump_json(exclude_none=True).encode(),
            )
        )
        p.announced = True

    async def _spent(self, period_ids: Mapping[str, str]) -> dict[str, float]:
        out: dict[str, float] = {}
        for tenant, pid in period_ids.items():
            status = await self.state.budget_status(tenant, pid)
            out[tenant] = _spent_usd(status)
        return out

    async def _mark_routed(self, marks: Mapping[str, str]) -> None:
        await self.state.mark_routed_many(dict(marks))

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

    def _count_routed(self, d: Decision, q: Query) -> None:
        m = self.metrics
        m.decisions.labels(d.status.value).inc()
        m.routed.labels(str(d.instance_id)).inc()
        for flag in d.flags:
            m.flags.labels(flag.value).inc()
        if d.predicted_cost_usd:
            m.spend_usd.labels(q.tenant).inc(d.predicted_cost_usd)
        if d.predicted_ttft_ms is not None:
            m.slo_predicted_total.inc()
            if d.predicted_ttft_ms <= q.ttft_slo_ms:
                m.slo_predicted_met.inc()
        inst = str(d.instance_id)
        self._arrivals[inst] = self._arrivals.get(inst, 0.0) * 0.9 + 0.1 / max(
            self.config.window_s, 1e-3
        )


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
