"""``RouterService`` in-process on real Redis and real Kafka (no Faust): the window's rules.

- a bad message becomes a dead letter naming the problem and its offset; the window goes on;
- a redelivered query already routed is dropped, one never marked routed is routed again,
  and its reservations are not taken twice;
- with every instance full, queries are held (input not finished) and routed once a slot
  frees; the caller is told when a held input is finished;
- the Prometheus registry carries the window's figures.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Callable, Mapping

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas import ClusterConfig, DeadLetter, RoutedQuery
from state import StateStore, StateUnavailable, period_id
from streams.app import BatchSink
from streams.service import Inbound, RouterConfig, RouterService
from wiring import kafka_admin, topics

pytestmark = pytest.mark.integration


def cluster(rid: str, max_concurrency: int = 64) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "m",
                    "input_usd_per_token": 1e-7,
                    "output_usd_per_token": 1e-7,
                    "max_concurrency": max_concurrency,
                }
            ],  # fmt: skip
            "instances": [{"id": f"{rid}-a", "model": "m"}, {"id": f"{rid}-b", "model": "m"}],
            "tenants": [{"tenant": "default", "budget_usd": 10.0, "period_s": 86400}],
        }
    )


def body(qid: str) -> bytes:
    return json.dumps({"id": qid, "prompt": f"what is {qid}?"}).encode()


async def read_topic(
    bootstrap: str,
    topic: str | list[str],
    since_ms: int,
    until: Callable[[list[tuple[bytes, bytes]]], bool],
) -> list[tuple[bytes, bytes]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics([topic] if isinstance(topic, str) else topic)
    finally:
        await admin.close()
    tps = [TopicPartition(t["topic"], p["partition"]) for t in described for p in t["partitions"]]
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    out: list[tuple[bytes, bytes]] = []
    try:
        consumer.assign(tps)
        found = await consumer.offsets_for_times({tp: since_ms for tp in tps})
        for tp in tps:
            if found.get(tp) is None:
                await consumer.seek_to_end(tp)
            else:
                consumer.seek(tp, found[tp].offset)
        deadline = time.monotonic() + 20
        while not until(out) and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            out += [(r.key, r.value) for records in batch.values() for r in records]
    finally:
        await consumer.stop()
    return out


@pytest.fixture
async def env(kafka_bootstrap: str, redis_url: str):  # type: ignore[no-untyped-def]
    rid = "s" + uuid.uuid4().hex[:6]
    store = await StateStore.connect(redis_url, namespace=f"t{rid}")
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
    )
    await producer.start()
    names = [
        topics.DEAD_LETTERS,
        topics.DECISIONS,
        topics.RESULTS,
        topics.route(f"{rid}-a"),
        topics.route(f"{rid}-b"),
    ]
    await kafka_admin.ensure_topics({"bootstrap_servers": kafka_bootstrap}, names, partitions=2)
    try:
        yield rid, store, producer
    finally:
        await producer.stop()
        await store.close()


def make_service(rid: str, store: StateStore, producer: AIOKafkaProducer, max_concurrency: int = 64,
                 done: list[Inbound] | None = None) -> RouterService:  # fmt: skip
    from tests.streams.fake_router import SpreadRouter

    spec = cluster(rid, max_concurrency)
    on_done = done.append if done is not None else None
    return RouterService(spec, SpreadRouter(spec), store, BatchSink(producer),
                         RouterConfig(window_s=0.01), on_done=on_done, period_id=period_id)  # fmt: skip


async def heartbeat(store: StateStore, rid: str, max_concurrency: int = 64) -> None:
    for iid in (f"{rid}-a", f"{rid}-b"):
        await store.heartbeat(iid, "m", 30.0, max_concurrency)


async def test_bad_messages_are_dead_letters_and_the_window_goes_on(
    env, kafka_bootstrap: str
) -> None:  # type: ignore[no-untyped-def]
    rid, store, producer = env
    await heartbeat(store, rid)
    svc = make_service(rid, store, producer)
    since = int(time.time() * 1000)
    items = [
        Inbound(body(f"{rid}-1"), "queries", 0, 10),
        Inbound(
            b'{"id": "' + rid.encode() + b'-x", "prompt": "p", "ttft_slo_ms": 0}', "queries", 1, 11
        ),
        Inbound(b"\xff\xfe", "queries", 1, 12),
        Inbound(body(f"{rid}-2"), "queries", 0, 13),
    ]
    outcome, unfinished = await svc.handle(items)
    assert (outcome.routed, outcome.dead_letters, unfinished) == (2, 2, [])
    letters = [
        DeadLetter.model_validate_json(v)
        for _, v in await read_topic(
            kafka_bootstrap,
            topics.DEAD_LETTERS,
            since,
            lambda got: sum(rid.encode() in v or b"/w==" in v or b"//4=" in v for _, v in got) >= 2,
        )
    ]
    mine = {
        (d.partition, d.offset): d for d in letters if d.topic == "queries" and d.offset in (11, 12)
    }
    assert "ttft_slo_ms must be > 0" in mine[(1, 11)].reason
    assert "not valid UTF-8" in mine[(1, 12)].reason and mine[(1, 12)].raw() == b"\xff\xfe"
    samples = {s.name: s.value for m in svc.metrics.registry.collect() for s in m.samples}
    assert samples["switchyard_router_batch_size_count"] == 1
    assert sum(v for k, v in samples.items() if k == "switchyard_router_dead_letters_total") == 2


async def test_redelivery_is_routed_once_and_paid_once(env, kafka_bootstrap: str) -> None:  # type: ignore[no-untyped-def]
    rid, store, producer = env
    await heartbeat(store, rid)
    svc = make_service(rid, store, producer)
    since = int(time.time() * 1000)
    first, _ = await svc.handle([Inbound(body(f"{rid}-1"), "queries", 0, 1)])
    again, _ = await svc.handle(
        [Inbound(body(f"{rid}-1"), "queries", 0, 1)]
    )  # redelivered after a commit was lost
    assert first.routed == 1 and again.routed == 0 and again.dropped_duplicates == 1
    # a crash after dedupe and before produce leaves an entry that is not marked routed
    raw = body(f"{rid}-2")
    await store.dedupe_many([(f"{rid}-2", hashlib.sha256(raw).hexdigest())], 60.0)
    crashed, _ = await svc.handle([Inbound(raw, "queries", 0, 2)])
    assert crashed.routed == 1
    routed = []
    for iid in (f"{rid}-a", f"{rid}-b"):
        routed += [
            RoutedQuery.model_validate_json(v).query.id
            for _, v in await read_topic(
                kafka_bootstrap, topics.route(iid), since, lambda got: len(got) >= 1
            )
        ]
    assert sorted(routed) == [f"{rid}-1", f"{rid}-2"]
    status = await store.budget_status("default", period_id(time.time(), 86400))
    assert status.n_reserved == 2


class _DiesBeforeMarking(RouterService):
    """A router killed after Kafka acknowledged its window and before the Redis mark."""

    async def _mark_routed(self, marks: Mapping[str, str]) -> None:
        return None


async def test_redelivery_after_a_crash_goes_to_the_same_instance_unchanged(
    env, kafka_bootstrap: str
) -> None:  # type: ignore[no-untyped-def]
    rid, store, producer = env
    await heartbeat(store, rid)
    since = int(time.time() * 1000)
    spec = cluster(rid)
    from tests.streams.fake_router import SpreadRouter

    dead = _DiesBeforeMarking(spec, SpreadRouter(spec), store, BatchSink(producer),
                              RouterConfig(window_s=0.01), period_id=period_id)  # fmt: skip
    raws = [body(f"{rid}-c{k}") for k in range(4)]
    first, _ = await dead.handle([Inbound(r, "queries", 0, k) for k, r in enumerate(raws)])
    assert first.routed == 4
    # the successor (a fresh process) gets the window again; the other instance is now
    # emptier, so deciding again would send some of them there
    successor = make_service(rid, store, producer)
    again, _ = await successor.handle([Inbound(r, "queries", 0, k) for k, r in enumerate(raws)])
    assert (again.resent, again.routed, again.dropped_duplicates) == (4, 0, 0)
    third, _ = await make_service(rid, store, producer).handle([Inbound(raws[0], "queries", 0, 0)])
    assert third.dropped_duplicates == 1 and third.resent == 0  # marked routed by the successor
    where = [await store.dedupe_entry(f"{rid}-c{k}") for k in range(4)]
    copies: dict[str, set[tuple[str, bytes]]] = {}
    for iid in (f"{rid}-a", f"{rid}-b"):
        want = 2 * sum(1 for e in where if e is not None and e.routed_to == iid)
        for _, v in await read_topic(
            kafka_bootstrap, topics.route(iid), since, lambda got, want=want: len(got) >= want
        ):
            rq = RoutedQuery.model_validate_json(v)
            copies.setdefault(rq.query.id, set()).add((iid, rq.decision.model_dump_json().encode()))
    assert sorted(copies) == [f"{rid}-c{k}" for k in range(4)]
    assert all(len(c) == 1 for c in copies.values()), f"a query went two ways: {copies}"
    status = await store.budget_status("default", period_id(time.time(), 86400))
    assert status.n_reserved == 4


class _Spent(RouterService):
    """Another router spends the tenant's budget between this window's read and its
    reservation (what the window read said it could afford, the ledger refuses)."""

    async def _reserve(self, asked, decisions, money, blind):  # type: ignore[no-untyped-def]
        tw = money.tenant_windows["default"]
        await self.state.reserve_budget(
            "default", tw.period_id, tw.limit_usd, {f"other-{uuid.uuid4().hex}": tw.limit_usd}
        )
        return await super()._reserve(asked, decisions, money, blind)


class _SlotsTaken(RouterService):
    """Another router takes every slot between this window's read and its reservation."""

    async def _reserve(self, asked, decisions, money, blind):  # type: ignore[no-untyped-def]
        for iid in {str(d.instance_id) for d in decisions if d.instance_id}:
            await self.state.reserve_slots(iid, 1, [f"other-{uuid.uuid4().hex}"])
        return await super()._reserve(asked, decisions, money, blind)


async def test_a_query_that_lost_its_budget_gives_its_slot_back(env) -> None:  # type: ignore[no-untyped-def]
    # budget and capacity are reserved at once (one round trip): a query that lost its
    # budget gives its slot back
    rid, store, producer = env
    await heartbeat(store, rid)
    spec = cluster(rid)
    from tests.streams.fake_router import SpreadRouter

    spent = _Spent(spec, SpreadRouter(spec), store, BatchSink(producer),
                   RouterConfig(window_s=0.01), period_id=period_id)  # fmt: skip
    outcome, unfinished = await spent.handle(
        [Inbound(body(f"{rid}-b{k}"), "queries", 0, k) for k in range(3)]
    )
    assert outcome.routed == 0 and len(unfinished) == 3  # deferred for budget
    assert await store.slots_held(f"{rid}-a") == [] and await store.slots_held(f"{rid}-b") == []


async def test_a_query_that_lost_its_slot_gives_its_budget_back(env) -> None:  # type: ignore[no-untyped-def]
    # every slot taken by another router after the read, budget ample: no budget is kept
    rid, store, producer = env
    await heartbeat(store, rid, max_concurrency=1)
    spec = cluster(rid, max_concurrency=1)
    from tests.streams.fake_router import SpreadRouter

    taken = _SlotsTaken(spec, SpreadRouter(spec), store, BatchSink(producer),
                        RouterConfig(window_s=0.01), period_id=period_id)  # fmt: skip
    pid = period_id(time.time(), 86400)
    reserved_before = (await store.budget_status("default", pid)).n_reserved
    outcome, unfinished = await taken.handle(
        [Inbound(body(f"{rid}-s{k}"), "queries", 0, k) for k in range(2)]
    )
    assert outcome.routed == 0 and len(unfinished) == 2
    assert (await store.budget_status("default", pid)).n_reserved == reserved_before == 0
    for iid in (f"{rid}-a", f"{rid}-b"):
        assert [q.startswith("other-") for q in await store.slots_held(iid)] == [True]


async def test_full_instances_hold_queries_until_a_slot_frees(env) -> None:  # type: ignore[no-untyped-def]
    rid, store, producer = env
    await heartbeat(store, rid, max_concurrency=1)
    done: list[Inbound] = []
    svc = make_service(rid, store, producer, max_concurrency=1, done=done)
    items = [Inbound(body(f"{rid}-{k}"), "queries", 0, k) for k in range(3)]
    outcome, unfinished = await svc.handle(items)
    assert outcome.routed == 2 and [it.offset for it in unfinished] == [
        2
    ]  # two slots, one query waits
    assert await svc.retry_held() is not None and not done  # still full
    held_slots = await store.slots_held(f"{rid}-a") + await store.slots_held(f"{rid}-b")
    await store.release_slots(f"{rid}-a", held_slots)
    await store.release_slots(f"{rid}-b", held_slots)
    outcome = await svc.retry_held()
    assert outcome is not None and outcome.routed == 1
    assert [it.offset for it in done] == [2] and svc.held_count == 0


class _PausedBeforeIntent(RouterService):
    """A router paused (SIGSTOP) after deciding and reserving, before recording its intents,
    for longer than its group session: meanwhile ``meanwhile`` (another router) runs."""

    meanwhile: Callable[[], object] | None = None

    async def _route(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        state = self.state

        class _Late:
            def __getattr__(self, name: str) -> object:
                return getattr(state, name)

            async def mark_intent_many(_, intents):  # type: ignore[no-untyped-def]
                if self.meanwhile is not None:
                    await self.meanwhile()  # type: ignore[misc]
                return await state.mark_intent_many(intents)

        self.state = _Late()
        try:
            await super()._route(*args, **kwargs)
        finally:
            self.state = state


async def _zombie_and_other(env, cls, tag: str, config: RouterConfig):  # type: ignore[no-untyped-def]
    """A zombie service of ``cls`` and a window of 6 queries; ``zombie.meanwhile_later`` (to
    set as its ``meanwhile``) has another router handle that window, its outcome in ``took``."""
    from tests.streams.fake_router import SpreadRouter

    rid, store, producer = env
    await heartbeat(store, rid)
    spec = cluster(rid)
    raws = [body(f"{rid}-{tag}{k}") for k in range(6)]
    window = [Inbound(r, "queries", 0, k) for k, r in enumerate(raws)]
    zombie = cls(spec, SpreadRouter(spec), store, BatchSink(producer), config, period_id=period_id)
    other = make_service(rid, store, producer)
    took: list[object] = []

    async def meanwhile() -> None:
        took.append((await other.handle(window))[0])

    zombie.meanwhile_later = meanwhile
    return zombie, window, took


async def test_a_paused_router_waking_mid_window_does_not_route_again(
    env, kafka_bootstrap: str
) -> None:  # type: ignore[no-untyped-def]
    """The zombie window (issue 16, scenario 9): its queries were re-delivered to and routed
    by another router while it was paused; when it wakes, theirs stands and it produces
    nothing for them, and gives back the slots it took."""
    rid, store, producer = env
    since = int(time.time() * 1000)
    zombie, window, took = await _zombie_and_other(
        env, _PausedBeforeIntent, "z", RouterConfig(window_s=0.01)
    )
    zombie.meanwhile = zombie.meanwhile_later
    woke, unfinished = await zombie.handle(window)
    assert took and took[0].routed == 6  # type: ignore[attr-defined]
    assert woke.routed == 0 and unfinished == []
    copies: dict[str, set[str]] = {}
    for iid in (f"{rid}-a", f"{rid}-b"):
        for _, v in await read_topic(
            kafka_bootstrap, topics.route(iid), since, lambda got: len(got) >= 1
        ):
            copies.setdefault(RoutedQuery.model_validate_json(v).query.id, set()).add(iid)
    assert sorted(copies) == [f"{rid}-z{k}" for k in range(6)]
    assert all(len(c) == 1 for c in copies.values()), f"routed twice: {copies}"
    held = [q for i in (f"{rid}-a", f"{rid}-b") for q in await store.slots_held(i)]
    assert sorted(held) == sorted(copies)  # the other router's slots: the zombie gave its own back


class _PausedInRedisCall(RouterService):
    """A router stopped (SIGSTOP) during a Redis call for longer than its group session: on
    waking, that call's timeout has run out (``StateUnavailable``) though Redis is fine, and
    meanwhile ``meanwhile`` (another router) routed its re-delivered inputs."""

    meanwhile: Callable[[], object] | None = None

    async def _see(self, now: float, blind: bool):  # type: ignore[no-untyped-def]
        if not blind and self.meanwhile is not None:
            go, self.meanwhile = self.meanwhile, None
            await go()  # type: ignore[misc]
            await asyncio.sleep(1.5 * self.config.group_session_s)
            raise StateUnavailable("unavailable during snapshot: Timeout reading (stopped)")
        return await super()._see(now, blind)


async def test_a_router_paused_in_a_redis_call_does_not_route_blind(
    env, kafka_bootstrap: str
) -> None:  # type: ignore[no-untyped-def]
    """Scenario 9's routed-twice: the zombie woke to a timeout of the call it was stopped in
    and routed its window blind (no cross-router check), after another router had routed
    those queries. A window attempt that outlasted the group session is retried instead;
    the retry finds them routed and drops them."""
    rid, store, producer = env
    since = int(time.time() * 1000)
    zombie, window, took = await _zombie_and_other(
        env, _PausedInRedisCall, "p", RouterConfig(window_s=0.01, group_session_s=0.2)
    )
    # a window before the stop: the zombie knows the instances and the budget (what it
    # would route blind from)
    warm, _ = await zombie.handle([Inbound(body(f"{rid}-w"), "queries", 1, 0)])
    assert warm.routed == 1
    zombie.meanwhile = zombie.meanwhile_later
    woke, unfinished = await zombie.handle(window)
    assert took and took[0].routed == 6  # type: ignore[attr-defined]
    assert woke.routed == 0 and len(unfinished) == 6  # retried, not routed blind
    again, left = await zombie.handle([])
    assert again.routed == 0 and again.dropped_duplicates == 6 and left == []
    copies: dict[str, list[str]] = {}
    for iid in (f"{rid}-a", f"{rid}-b"):
        for _, v in await read_topic(
            kafka_bootstrap, topics.route(iid), since, lambda got: len(got) >= 1
        ):
            copies.setdefault(RoutedQuery.model_validate_json(v).query.id, []).append(iid)
    assert sorted(copies) == sorted([f"{rid}-p{k}" for k in range(6)] + [f"{rid}-w"])
    assert all(len(c) == 1 for c in copies.values()), f"routed twice: {copies}"


class _Faulty:
    """Wraps the store, router or sink of a service: ``method`` raises while it sees ``poison``."""

    def __init__(self, inner: object, method: str, poison: str, find: Callable[..., bool]) -> None:
        self._inner, self._method, self._poison, self._find = inner, method, poison, find
        self.hits = 0

    def __getattr__(self, name: str) -> object:
        real = getattr(self._inner, name)
        if name != self._method:
            return real

        def check(*a: object, **kw: object) -> None:
            if self._find(self._poison, *a, **kw):
                self.hits += 1
                raise RuntimeError(f"injected fault in {name}")

        if asyncio.iscoroutinefunction(real):

            async def wrapped_async(*a: object, **kw: object) -> object:
                check(*a, **kw)
                return await real(*a, **kw)

            return wrapped_async

        def wrapped(*a: object, **kw: object) -> object:
            check(*a, **kw)
            return real(*a, **kw)

        return wrapped


def _raw_of(letter: bytes) -> str:
    return DeadLetter.model_validate_json(letter).raw().decode(errors="replace")


def _has(poison: str, *a: object, **kw: object) -> bool:
    return poison in repr(a) + repr(kw)


def _routes_it(poison: str, outs: list[tuple[str, bytes, bytes]], *a: object) -> bool:
    """A record Kafka refuses: only the poison's route message (its dead letter goes out)."""
    return any(t.startswith("route.") and poison.encode() in v for t, _, v in outs)


# stage -> (what is wrapped, the method that raises)
_STAGES = {
    "dedupe": ("state", "dedupe_many"),
    "decide": ("router", "decide"),
    "reserve": ("state", "reserve_slots"),
    "produce": ("sink", "send_all"),
    "commit": ("state", "mark_routed_many"),
}


@pytest.mark.parametrize("stage", ["validate", *_STAGES])
async def test_a_fault_at_each_stage_is_contained(
    stage: str, env, kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """One poison query in a window of five: the window is retried WINDOW_TRIES times, then
    each input alone; the poison is dead-lettered with the stage named (and answered, unless
    its route message was out already), the four others are routed; nothing loops."""
    import streams.service as service_mod

    rid, store, producer = env
    await heartbeat(store, rid)
    svc = make_service(rid, store, producer)
    since = int(time.time() * 1000)
    poison = f"{rid}-poison"
    if stage == "validate":
        real_parse = service_mod.parse_query

        def parse(raw: bytes, *a: object, **kw: object) -> object:
            if raw is not None and poison.encode() in raw:
                raise RuntimeError("injected fault in parse_query")
            return real_parse(raw, *a, **kw)

        monkeypatch.setattr(service_mod, "parse_query", parse)
    else:
        target, method = _STAGES[stage]
        find = _routes_it if stage == "produce" else _has
        setattr(svc, target, _Faulty(getattr(svc, target), method, poison, find))
    qids = [f"{rid}-ok{k}" for k in range(2)] + [poison] + [f"{rid}-ok{k}" for k in range(2, 4)]
    window = [Inbound(body(q), "queries", 0, 100 + k) for k, q in enumerate(qids)]
    done: list[Inbound] = []
    svc._on_done = done.append  # type: ignore[method-assign]
    outcome, unfinished = await svc.handle(window)
    calls = 1
    while svc.held_count and calls < 10:  # the app's retry timer
        await svc.retry_held()
        calls += 1
    assert svc.held_count == 0 and calls <= service_mod.WINDOW_TRIES + 1
    letters = [
        DeadLetter.model_validate_json(v)
        for _, v in await read_topic(
            kafka_bootstrap,
            topics.DEAD_LETTERS,
            since,
            lambda got: any(poison in _raw_of(v) for _, v in got),
        )  # fmt: skip
    ]
    mine = [d for d in letters if poison in d.raw().decode()]
    assert [(d.stage, d.offset) for d in mine] == [(stage, 102)], mine
    assert f"router stage {stage} failed" in mine[0].reason and "injected fault" in mine[0].reason
    routed: set[str] = set()
    entries = {q: await store.dedupe_entry(q) for q in qids if q != poison or stage == "commit"}
    for iid in (f"{rid}-a", f"{rid}-b"):
        want = sum(
            1
            for e in entries.values()
            if e and iid in (e.routed_to, getattr(e.intent, "instance_id", None))
        )
        for _, v in await read_topic(
            kafka_bootstrap, topics.route(iid), since, lambda got, want=want: len(got) >= want
        ):
            routed.add(RoutedQuery.model_validate_json(v).query.id)
    others = set(qids) - {poison}
    assert others <= routed
    assert (poison in routed) == (stage == "commit")  # only a failed commit had produced it
    results = {
        json.loads(v)["query_id"]: json.loads(v)
        for _, v in await read_topic(
            kafka_bootstrap,
            topics.RESULTS,
            since,
            lambda got: (
                stage in ("commit", "validate") or any(poison.encode() in k for k, _ in got)
            ),
        )  # fmt: skip
    }
    if stage not in ("commit", "validate"):
        assert f"router stage {stage} failed" in results[poison]["error"]
    else:  # commit: its worker answers it; validate: no query could be read from it
        assert poison not in results
    assert not others & set(results)  # the routed ones get no error Result


class _SinkDownOnce:
    """A sink whose next ``send_all`` after ``arm()`` fails as a broker away would (nothing
    written)."""

    def __init__(self, inner: BatchSink) -> None:
        self.inner, self.armed, self.failed = inner, False, 0

    def arm(self) -> None:
        self.armed = True

    async def send_all(self, outs: list[tuple[str, bytes, bytes]]) -> None:
        if self.armed:
            self.armed, self.failed = False, self.failed + 1
            from aiokafka.errors import KafkaTimeoutError

            raise KafkaTimeoutError("injected: broker away")
        await self.inner.send_all(outs)


async def test_a_held_query_whose_window_failed_to_produce_is_routed_on_the_retry(
    env, kafka_bootstrap: str
) -> None:  # type: ignore[no-untyped-def]
    """A query held in one window (no live instance), routed in the next, whose produce
    failed after its route intent was recorded: the retry decides it again, and must not
    take its own recorded intent for another router's (dropped: lost)."""
    from tests.streams.fake_router import SpreadRouter

    rid, store, producer = env
    since = int(time.time() * 1000)
    spec = cluster(rid)
    done: list[Inbound] = []
    sink = _SinkDownOnce(BatchSink(producer))
    svc = RouterService(spec, SpreadRouter(spec), store, sink, RouterConfig(window_s=0.01),
                        on_done=done.append, period_id=period_id)  # fmt: skip
    qid = f"{rid}-h0"
    first, unfinished = await svc.handle([Inbound(body(qid), "queries", 0, 0)])
    assert first.routed == 0 and len(unfinished) == 1  # held: no live instance yet
    await heartbeat(store, rid)
    sink.arm()
    failed, _ = await svc.handle([])  # routed, intent recorded, produce failed
    assert failed.routed == 0 and sink.failed == 1
    for _ in range(5):
        await asyncio.sleep(0.05)
        await svc.handle([])
        if done:
            break
    copies = [
        RoutedQuery.model_validate_json(v).query.id
        for iid in (f"{rid}-a", f"{rid}-b")
        for _, v in await read_topic(
            kafka_bootstrap, topics.route(iid), since, lambda got: len(got) >= 1
        )
    ]
    assert copies == [qid], f"the held query was acknowledged without being routed: {copies}"


async def test_the_window_reads_the_online_step_time_with_the_snapshot(env) -> None:  # type: ignore[no-untyped-def]
    from schemas import StepTimeCoefficients
    from tests.streams.fake_router import SpreadRouter

    rid, store, producer = env
    await heartbeat(store, rid)
    coef = StepTimeCoefficients(
        c0_ms=9.0, c1_ms_per_token=0.06, c2_ms_per_ctx_token=0.0008, c3_ms_per_attn_unit=2e-6
    )
    await store.step_time_publish(
        "m", coef, rows=64, instance_id=f"{rid}-a", ttl_s=60.0, ttft_error=0.07
    )
    spec = cluster(rid)
    seen: list[list[object]] = []

    class Recording(SpreadRouter):
        def decide(self, queries, instances, budget, now):  # type: ignore[no-untyped-def]
            seen.append([v.step_time for v in instances])
            return super().decide(queries, instances, budget, now)

    for online in (True, False):
        svc = RouterService(spec, Recording(spec), store, BatchSink(producer),
                            RouterConfig(window_s=0.01, online_step_time=online),
                            period_id=period_id)  # fmt: skip
        outcome, _ = await svc.handle([Inbound(body(f"{rid}-{online}"), "queries", 0, 1)])
        assert outcome.routed == 1
        if online:
            samples = {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for m in svc.metrics.registry.collect()
                for s in m.samples
            }
            key = (("coefficient", "c1_ms_per_token"), ("model", "m"))
            assert samples[("switchyard_router_step_time_coefficient", key)] == 0.06
            assert samples[("switchyard_router_live_ttft_error", (("model", "m"),))] == 0.07
            assert samples[("switchyard_router_step_time_online", (("model", "m"),))] == 1
    from routing.steptime import StepTimeModel

    want = StepTimeModel.from_coefficients(coef)
    assert seen == [[want, want], [None, None]]  # off: the configured coefficients


async def test_a_flood_past_the_backlog_sheds_with_a_decision_and_a_result_each(
    env, kafka_bootstrap: str
) -> None:  # type: ignore[no-untyped-def]
    """Load shedding (routing.window.shed) in the service: 3 queries sent 10 s ago (past
    their 2 s SLO) and a flood of 12 into 2 slots with a backlog limit of 6. The 3 late ones
    and the 6 with the earliest deadlines are shed: each gets a final Decision saying so and
    an error Result with code ``shed``; 2 are routed, 4 held. Nothing is lost or silent."""
    rid, store, producer = env
    await heartbeat(store, rid, max_concurrency=1)
    done: list[Inbound] = []
    spec = cluster(rid, 1)
    from tests.streams.fake_router import SpreadRouter

    config = RouterConfig(window_s=0.01, shed_backlog=6, shed_after_slo=1.0)
    svc = RouterService(spec, SpreadRouter(spec), store, BatchSink(producer), config,
                        on_done=done.append, period_id=period_id)  # fmt: skip
    since = int(time.time() * 1000)
    now = time.time()
    late = [Inbound(body(f"{rid}-old{k}"), "queries", 1, k, timestamp_s=now - 10.0)
            for k in range(3)]  # fmt: skip
    flood = [Inbound(body(f"{rid}-f{k:02d}"), "queries", 0, k, timestamp_s=now - 0.5 + k * 0.01)
             for k in range(12)]  # fmt: skip
    outcome, unfinished = await svc.handle(late + flood)
    assert (outcome.shed, outcome.final_errors, outcome.routed, outcome.held) == (9, 9, 2, 4)
    assert [it.offset for it in unfinished] == [8, 9, 10, 11] and svc.held_count == 4
    shed_ids = {f"{rid}-old{k}" for k in range(3)} | {f"{rid}-f{k:02d}" for k in range(6)}

    def mine(got: list[tuple[bytes, bytes]]) -> set[str]:
        return {k.decode() for k, _ in got if k.decode() in shed_ids}

    results = await read_topic(kafka_bootstrap, topics.RESULTS, since,
                               lambda got: mine(got) == shed_ids)  # fmt: skip
    codes = {k.decode(): json.loads(v) for k, v in results if k.decode().startswith(rid)}
    assert set(codes) == shed_ids
    assert all(r["code"] == "shed" and r["error"].startswith("not routed (rejected): shed:")
               for r in codes.values())  # fmt: skip
    decisions = await read_topic(kafka_bootstrap, topics.DECISIONS, since,
                                 lambda got: len(mine(got)) >= len(shed_ids))  # fmt: skip
    final = {
        k.decode(): json.loads(v) for k, v in decisions
        if k.decode() in shed_ids and json.loads(v)["status"] == "rejected"
    }  # fmt: skip
    assert set(final) == shed_ids
    assert all(d["reason"].startswith("shed: waited") for q, d in final.items() if "old" in q)
    assert all("past its backlog limit of 6" in d["reason"]
               for q, d in final.items() if "old" not in q)  # fmt: skip
    samples = {(s.name, s.labels.get("status")): s.value
               for m in svc.metrics.registry.collect() for s in m.samples}  # fmt: skip
    assert samples[("switchyard_router_decisions_total", "shed")] == 9
    # the held four are routed once slots free: every one of the 15 answered exactly once
    for iid in (f"{rid}-a", f"{rid}-b"):
        await store.release_slots(iid, await store.slots_held(iid))
    again = await svc.retry_held()
    assert again is not None and (again.routed, again.shed) == (2, 0)
    assert sorted(it.offset for it in done) == [8, 9] and svc.held_count == 2
