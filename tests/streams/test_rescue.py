"""``streams.rescue``: re-routing the queue of an instance that stopped heart-beating.

Pure parts (silence, parsing the stranded copies, the adopted ``Pending``) without any
service; then the whole rescue on real Redis and Kafka with a ``RouterService``: the copies
nobody started are re-routed to a live instance with ``REROUTED``, a started or answered
copy is left alone, the old reservation and slot are given back, the claim is final, and a
successor finds the copies a dead rescuer had claimed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from schemas import ClusterConfig, Decision, DecisionFlag, Query, RoutedQuery
from schemas.parse import Limits
from state import StateStore, period_id
from streams.app import BatchSink
from streams.rescue import (
    Copy,
    KafkaRouteReader,
    RescueConfig,
    Rescuer,
    SilenceTracker,
    Stranded,
    ledger_of,
    parse_copies,
    query_bytes,
    to_pending,
)
from streams.service import Adopted, Pending, RouterConfig, RouterService
from wiring import kafka_admin, topics


def _cluster(rid: str) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "m",
                    "input_usd_per_token": 1e-7,
                    "output_usd_per_token": 1e-7,
                    "max_concurrency": 8,
                }
            ],  # fmt: skip
            "instances": [{"id": f"{rid}-a", "model": "m"}, {"id": f"{rid}-b", "model": "m"}],
            "tenants": [{"tenant": "default", "budget_usd": 10.0, "period_s": 86400}],
        }
    )


def _raw_query(qid: str) -> bytes:
    return json.dumps({"id": qid, "prompt": f"what is {qid}?", "ttft_slo_ms": 5000}).encode()


def _routed_bytes(qid: str, instance_id: str, decided_at: float, period: str | None) -> bytes:
    """A routed message exactly as ``RouterService`` writes it (raw query body spliced in)."""
    raw = _raw_query(qid)
    d = Decision(
        query_id=qid,
        tenant="default",
        status="routed",
        instance_id=instance_id,
        model="m",
        policy="t",
        decided_at=decided_at,
        budget_period=period,
    )
    return (
        b'{"query":' + raw + b',"decision":' + d.model_dump_json(exclude_none=True).encode() + b"}"
    )


# ---------------------------------------------------------------------- pure


def test_silence_counts_from_the_first_look_without_a_heartbeat() -> None:
    t = SilenceTracker(grace_s=3.0)
    up, down = SimpleNamespace(alive=True), SimpleNamespace(alive=False)
    assert t.update(["a", "b"], {"a": up, "b": down}, 100.0) == []
    assert t.update(["a", "b"], {"a": up}, 102.9) == []  # missing counts as silent
    assert t.update(["a", "b"], {"a": down, "b": down}, 103.0) == ["b"]
    assert t.update(["a", "b"], {"a": down, "b": up}, 106.5) == ["a"]  # b is back: reset
    assert t.update(["a", "b"], {"a": down, "b": down}, 107.0) == ["a"]
    with pytest.raises(ValueError, match="grace_s"):
        SilenceTracker(0.0)


def test_rescue_config_is_checked() -> None:
    with pytest.raises(ValueError, match="grace_s"):
        RescueConfig(grace_s=float("nan"))
    with pytest.raises(ValueError, match="more than two intervals"):
        RescueConfig(lease_s=1.0, interval_s=0.5)


def test_parse_copies_keeps_valid_copies_for_the_instance_and_names_the_rest() -> None:
    good = _routed_bytes("q1", "a", 10.0, "p1")
    copies = [
        Copy(0, 5, good),
        Copy(0, 6, b"not json"),
        Copy(1, 2, _routed_bytes("q2", "other", 10.0, None)),
        Copy(1, 3, good),  # the same id twice: one copy is enough
        Copy(1, 4, None),
    ]
    stranded, skipped = parse_copies("a", copies, Limits())
    assert [(s.routed.query.id, s.copy.offset) for s in stranded] == [("q1", 5)]
    assert len(skipped) == 3
    assert "route.a[0]@6" in skipped[0] and "route.a[1]@2" in skipped[1]
    assert "decision names instance 'other'" in skipped[1]
    # the query's body is the one the router received, byte for byte
    assert (
        stranded[0].raw_query
        == json.dumps({"id": "q1", "prompt": "what is q1?", "ttft_slo_ms": 5000}).encode()
    )


def test_query_bytes_falls_back_to_the_query_json() -> None:
    rq = RoutedQuery(
        query=Query(id="q", prompt="p"),
        decision=Decision(
            query_id="q",
            tenant="default",
            status="routed",
            policy="t",
            decided_at=1.0,
            reason='x,"decision":y',
        ),  # fmt: skip
    )
    value = rq.model_dump_json().encode()  # not the router's shape: query is not first
    assert json.loads(query_bytes(value, rq))["id"] == "q"
    spliced = (
        b'{"query":{"id":"q","prompt":"p"},"decision":'
        + rq.decision.model_dump_json().encode()
        + b"}"
    )
    assert query_bytes(spliced, rq) == b'{"id":"q","prompt":"p"}'


def test_to_pending_keeps_the_body_and_counts_the_slo_from_the_first_decision() -> None:
    value = _routed_bytes("q1", "a", 1000.0, "p1")
    [s], _ = parse_copies("a", [Copy(0, 1, value)], Limits())
    done: list[Any] = []
    p = to_pending(s, 1002.0, done.append)
    assert p.query.created_at == 1000.0 and s.routed.query.created_at is None
    assert p.raw == s.raw_query and p.sha == hashlib.sha256(s.raw_query).hexdigest()
    assert p.rerouted_from == "a" and p.first_seen_s == 1002.0
    assert isinstance(p.inbound.handle, Adopted) and p.inbound.topic == "route.a"
    p.inbound.handle.on_done(p.inbound)
    assert done == [p.inbound]
    # a query that carries created_at keeps it
    q = s.routed.query.model_copy(update={"created_at": 990.0})
    s2 = Stranded("a", s.copy, s.routed.model_copy(update={"query": q}), s.raw_query)
    assert to_pending(s2, 1002.0, done.append).query.created_at == 990.0


def test_ledger_of_uses_the_old_decision_period() -> None:
    c = _cluster("x")
    [s], _ = parse_copies(
        "x-a", [Copy(0, 1, _routed_bytes("q", "x-a", 86400.0 * 3 + 5, None))], Limits()
    )
    assert ledger_of(s.routed, c) == ("default", period_id(86400.0 * 3 + 5, 86400))
    [s], _ = parse_copies("x-a", [Copy(0, 1, _routed_bytes("q", "x-a", 5.0, "per-x"))], Limits())
    assert ledger_of(s.routed, c) == ("default", "per-x")


async def test_adopt_takes_only_rerouted_queries() -> None:
    svc = RouterService(_cluster("x"), None, None, None)  # type: ignore[arg-type]
    [s], _ = parse_copies("x-a", [Copy(0, 1, _routed_bytes("q", "x-a", 5.0, None))], Limits())
    p = to_pending(s, 6.0, lambda _it: None)
    bad = Pending(p.query, p.raw, p.inbound.__class__(p.raw, "queries", 0, 1), 6.0)
    with pytest.raises(ValueError, match="re-routed queries only"):
        await svc.adopt([bad])
    assert await svc.adopt([p]) == 1
    assert await svc.adopt([p]) == 0  # already held
    assert svc.held_count == 1
    gone = to_pending(s, 6.0, lambda _it: None, wanted=lambda: False)
    svc.drop_held()
    assert await svc.adopt([gone]) == 0  # finished meanwhile: not adopted again


class _Reader:
    def __init__(self, copies: list[Copy]) -> None:
        self.copies, self.reads = copies, 0

    async def read(self, instance_id: str, start: Any) -> tuple[list[Copy], dict[int, int]]:
        self.reads += 1
        return list(self.copies), {0: len(self.copies)}

    async def close(self) -> None:
        return None


class _State:
    def __init__(self, alive: dict[str, bool]) -> None:
        self.alive = alive

    async def snapshots(self, ids: Sequence[str], now: float) -> dict[str, Any]:
        return {i: SimpleNamespace(alive=self.alive.get(i, False)) for i in ids}

    async def has_results(self, qids: Sequence[str]) -> list[bool]:
        return [False] * len(qids)

    async def claim_rescue(self, iid: str, qids: Sequence[str], who: str, **_: Any) -> list[str]:
        return ["won"] * len(qids)

    async def release_budget(self, *_: Any) -> None:
        return None

    async def release_slots(self, *_: Any) -> None:
        return None


class _Adopter:
    def __init__(self) -> None:
        self.got: list[Pending] = []

    async def adopt(self, pendings: Sequence[Pending]) -> int:
        self.got = list(pendings)
        return len(pendings)


async def test_nothing_is_rescued_while_no_instance_is_alive() -> None:
    spec = _cluster("x")
    reader = _Reader([Copy(0, 0, _routed_bytes("q", "x-a", 5.0, "p"))])
    state, svc = _State({}), _Adopter()
    r = Rescuer(spec, state, svc, reader, RescueConfig(grace_s=1.0))
    await r.tick(now=100.0)
    await r.tick(now=105.0)
    assert reader.reads == 0 and r.in_flight == 0  # every instance down: copies stay put
    state.alive["x-b"] = True
    await r.tick(now=106.0)
    assert reader.reads == 1 and [p.query.id for p in svc.got] == ["q"]
    assert svc.got[0].rerouted_from == "x-a"


# ---------------------------------------------------------------------- real Redis + Kafka


@pytest.fixture
async def env(kafka_bootstrap: str, redis_url: str) -> AsyncIterator[dict[str, Any]]:
    rid = "r" + uuid.uuid4().hex[:6]
    store = await StateStore.connect(redis_url, namespace=f"t{rid}")
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
    )
    await producer.start()
    spec = _cluster(rid)
    names = [topics.DECISIONS, topics.RESULTS, topics.DEAD_LETTERS]
    names += [topics.route(i.id) for i in spec.instances]
    await kafka_admin.ensure_topics({"bootstrap_servers": kafka_bootstrap}, names, partitions=2)
    reader = KafkaRouteReader({"bootstrap_servers": kafka_bootstrap})
    try:
        yield {"rid": rid, "store": store, "producer": producer, "spec": spec, "reader": reader}
    finally:
        await reader.close()
        await producer.stop()
        await store.close()


def _service(env: dict[str, Any]) -> RouterService:
    from tests.streams.fake_router import SpreadRouter

    spec = env["spec"]
    return RouterService(spec, SpreadRouter(spec), env["store"], BatchSink(env["producer"]),
                         RouterConfig(window_s=0.01), period_id=period_id)  # fmt: skip


async def _strand(env: dict[str, Any], n: int, old_usd: float = 0.001) -> tuple[list[str], str]:
    """``n`` copies routed to instance a (deduped, reserved, slotted and marked routed there,
    as a router leaves them), which then went silent."""
    rid, store = env["rid"], env["store"]
    a = f"{rid}-a"
    now = time.time()
    period = period_id(now, 86400)
    qids = [f"{rid}-q{k}" for k in range(n)]
    for q in qids:
        await store.dedupe(q, hashlib.sha256(_raw_query(q)).hexdigest(), ttl_s=600)
    await store.reserve_budget("default", period, 10.0, {q: old_usd for q in qids})
    assert all(await store.reserve_slots(a, 8, qids))
    # the router's first-intent-wins marks: a re-routed copy must still be routed (bug 15)
    assert await store.mark_routed_many({q: a for q in qids}) == n
    futs = [
        await env["producer"].send(
            topics.route(a), _routed_bytes(q, a, now - 1.0, period), key=q.encode()
        )
        for q in qids
    ]
    await asyncio.gather(*futs)
    await store.heartbeat(f"{rid}-b", "m", 30.0, 8)  # b is alive; a never heart-beats
    return qids, period


async def _routed_to(
    env: dict[str, Any], kafka_bootstrap: str, instance: str, want: int
) -> list[RoutedQuery]:
    reader = KafkaRouteReader({"bootstrap_servers": kafka_bootstrap})
    try:
        deadline = time.monotonic() + 20
        while True:
            copies, _ = await reader.read(instance, {})
            got = [RoutedQuery.model_validate_json(c.value or b"") for c in copies]
            if len(got) >= want or time.monotonic() > deadline:
                return got
            await asyncio.sleep(0.2)
    finally:
        await reader.close()


@pytest.mark.integration
async def test_rescue_reroutes_unstarted_copies_and_leaves_started_ones(
    env: dict[str, Any], kafka_bootstrap: str
) -> None:
    rid, store = env["rid"], env["store"]
    a, b = f"{rid}-a", f"{rid}-b"
    qids, period = await _strand(env, 6)
    started, answered = qids[0], qids[1]
    assert await store.claim_run(a, started) == "won"  # its worker started it before the stop
    await store.mark_result(answered, 60, cost_usd=0.0)
    assert await store.claim_run(a, answered) == "won"
    svc = _service(env)
    rescuer = Rescuer(env["spec"], store, svc, env["reader"], RescueConfig(grace_s=1.0))
    t0 = time.time()
    await rescuer.tick(now=t0)
    assert rescuer.in_flight == 0  # silent, but not for long enough yet
    await rescuer.tick(now=t0 + 1.5)
    assert rescuer.in_flight == 4 and svc.held_count == 4
    assert (rescuer.counts["taken"], rescuer.counts["answered"]) == (1, 1)
    assert await store.slots_held(a) == [started, answered]  # the rescued slots are given back
    outcome = await svc.retry_held()
    assert outcome is not None and outcome.routed == 4
    await rescuer.tick(now=t0 + 2.0)  # marks the claims final; nothing adopted again
    assert rescuer.in_flight == 0 and rescuer.counts["rerouted"] == 4
    assert await svc.retry_held() is None
    copies = await _routed_to(env, kafka_bootstrap, b, 4)
    assert sorted(c.query.id for c in copies) == sorted(qids[2:])
    for c in copies:
        assert DecisionFlag.REROUTED in c.decision.flags and c.decision.instance_id == b
        assert f"re-routed from silent instance {a}" in (c.decision.reason or "")
    for q in qids[2:]:
        assert await store.claim_run(a, q) == "lost"  # its worker, coming back, skips it
        assert (await store.claim_state(a, q) or "").startswith("rerouted ")
    status = await store.budget_status("default", period)
    assert status.n_reserved == 6  # 2 left on a, 4 reserved again at b's worst case
    # a later scan finds nothing new to claim and routes nothing twice
    await rescuer.tick(now=t0 + 3.0)
    await svc.retry_held()
    assert rescuer.counts["claimed"] == 4
    assert len(await _routed_to(env, kafka_bootstrap, b, 4)) == 4


@pytest.mark.integration
async def test_a_copy_rerouted_back_to_its_own_instance_is_run_there(
    env: dict[str, Any], kafka_bootstrap: str
) -> None:
    """Bug 21: the instance comes back (a worker restarted after ``kill -9``) between the
    claim and the window, and the policy picks it again. Its worker then holds two copies
    of each query under one claim; the claim must be dropped, not marked ``rerouted``,
    or the worker skips both and the query never gets a Result."""
    rid, store = env["rid"], env["store"]
    a, b = f"{rid}-a", f"{rid}-b"
    qids, period = await _strand(env, 3)
    svc = _service(env)
    rescuer = Rescuer(env["spec"], store, svc, env["reader"], RescueConfig(grace_s=1.0))
    t0 = time.time()
    await rescuer.tick(now=t0)
    await rescuer.tick(now=t0 + 1.5)
    assert rescuer.in_flight == 3 and svc.held_count == 3
    await store.instance_down(b)  # b goes away and a heart-beats again: a is the only choice
    await store.heartbeat(a, "m", 30.0, 8)
    outcome = await svc.retry_held()
    assert outcome is not None and outcome.routed == 3
    await rescuer.tick(now=t0 + 2.0)  # the rescuer's marks
    copies = await _routed_to(env, kafka_bootstrap, a, 6)
    assert sorted(c.query.id for c in copies) == sorted(qids * 2)  # the old copy and the new
    for c in copies:
        assert c.decision.instance_id == a
    for q in qids:
        # a's worker runs one of its two copies (the other is skipped as a duplicate by id);
        # with a "rerouted" mark this was "lost" for both: no Result, ever
        assert await store.claim_state(a, q) is None
        assert await store.claim_run(a, q) == "won"
    assert rescuer.in_flight == 0 and await svc.retry_held() is None
    assert (rescuer.counts.get("returned"), rescuer.counts["rerouted"]) == (3, 0)
    status = await store.budget_status("default", period)
    assert status.n_reserved == 3  # reserved again at a's worst case, once per query
    assert sorted(await store.slots_held(a)) == sorted(qids)


class _DeadService:
    """A router that claims and then dies before routing anything."""

    async def adopt(self, pendings: Sequence[Pending]) -> int:
        return 0


@pytest.mark.integration
async def test_a_successor_reroutes_what_a_dead_rescuer_claimed(
    env: dict[str, Any], kafka_bootstrap: str
) -> None:
    rid, store = env["rid"], env["store"]
    b = f"{rid}-b"
    qids, _ = await _strand(env, 3)
    cfg = RescueConfig(grace_s=0.5, lease_s=1.2, interval_s=0.2)
    dead = Rescuer(env["spec"], store, _DeadService(), env["reader"], cfg)
    t0 = time.time()
    await dead.tick(now=t0)
    await dead.tick(now=t0 + 1.0)
    assert dead.counts["claimed"] == 3
    svc = _service(env)
    reader2 = KafkaRouteReader({"bootstrap_servers": kafka_bootstrap})
    try:
        heir = Rescuer(env["spec"], store, svc, reader2, cfg)
        await heir.tick(now=t0)
        await heir.tick(now=t0 + 1.0)
        assert heir.counts["busy"] == 3 and heir.in_flight == 0  # the lease is still live
        await asyncio.sleep(1.3)
        await heir.tick(now=t0 + 2.5)  # the lease lapsed: rescanned from the worker's commit
        assert heir.in_flight == 3
        await svc.retry_held()
        await heir.tick(now=t0 + 3.0)
        assert heir.counts["rerouted"] == 3
    finally:
        await reader2.close()
    copies = await _routed_to(env, kafka_bootstrap, b, 3)
    assert sorted(c.query.id for c in copies) == sorted(qids)
