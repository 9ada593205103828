"""Blind mode (Redis unreachable): the ``BlindLedger`` rules, then ``RouterService`` in-process
on real Kafka with its own ``redis-server`` stopped mid-test and started again.

- views while blind: the instances alive at the last read, no live state, stale, and free
  slots = last read less what was routed blind, never above ``max_concurrency``;
- budget while blind: ``fraction`` of the last known remaining budget (0 if never read),
  less each blind query's worst-case cost; what does not fit is refused;
- dedupe while blind: ids this process finished are duplicates (or conflicts);
- ``flush`` writes dedupe entries, marks, reservations and slots, and keeps them if Redis
  fails again; allowances are not refreshed until Redis is read again.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from schemas import ClusterConfig, DecisionFlag, Query
from state.store import StateUnavailable
from streams.blind import BlindLedger


def spec(max_concurrency: int = 4, budget_usd: float = 1.0) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "m",
                    "input_usd_per_token": 1e-6,
                    "output_usd_per_token": 1e-6,
                    "max_concurrency": max_concurrency,
                }
            ],  # fmt: skip
            "instances": [{"id": "i-a", "model": "m"}, {"id": "i-b", "model": "m"}],
            "tenants": [{"tenant": "default", "budget_usd": budget_usd, "period_s": 86400}],
        }
    )


@dataclass
class Resident:
    query_id: str


@dataclass
class Live:
    slots_used: int
    alive: bool = True
    snapshot: Any = None
    age_s: float = 0.0


def test_views_are_stale_lps_views_from_the_last_read() -> None:
    c = spec(max_concurrency=4)
    b = BlindLedger()
    assert b.views(c, 0.0) == []  # never read: nothing to route to
    b.observe_instances({"i-a": Live(1), "i-b": Live(0, alive=False)}, c, 10.0)
    (v,) = b.views(c, 12.0)
    assert (v.instance_id, v.state, v.stale, v.free_slots, v.age_s) == ("i-a", None, True, 3, 2.0)
    b.reserved_slots("i-a", 1)  # reserved in Redis after the read
    assert b.views(c, 12.0)[0].free_slots == 2
    assert b.take(None, None, "i-a", "q1", 0.0) is None
    assert b.take(None, None, "i-a", "q2", 0.0) is None
    assert b.views(c, 12.0)[0].free_slots == 0
    assert "no free slot" in str(b.take(None, None, "i-a", "q3", 0.0))
    assert "no free slot" in str(b.take(None, None, "i-b", "q3", 0.0))  # not alive at the read


def test_budget_is_a_fraction_of_the_last_known_remaining_at_worst_case() -> None:
    c = spec()
    b = BlindLedger(fraction=0.5)
    b.observe_instances({"i-a": Live(0)}, c, 0.0)
    assert b.allowance("default", "p1") == 0.0  # never read: nothing may be spent blind
    b.observe_budget("default", "p1", 1.0, 0.2)  # 0.8 left
    assert b.allowance("default", "p1") == pytest.approx(0.4)
    assert b.allowance("default", "p2") == 0.0  # another period was never read
    assert b.take("default", "p1", "i-a", "q1", 0.3) is None
    short = b.take("default", "p1", "i-a", "q2", 0.3)
    assert short and "blind budget" in short
    assert b.allowance("default", "p1") == pytest.approx(0.1)
    assert b.views(c, 0.0)[0].free_slots == 3  # the refused query took no slot
    with pytest.raises(ValueError):
        BlindLedger(fraction=1.5)


def test_dedupe_is_what_this_process_finished() -> None:
    b = BlindLedger(remember=2)
    b.remember({"a": "sha-a"})
    b.routed({"b": "i-a", "c": "-"}, {"b": "sha-b", "c": "sha-c"})
    assert b.verdict("b", "sha-b") == "duplicate"
    assert b.verdict("b", "other") == "conflict"
    assert b.verdict("c", "sha-c") == "duplicate"
    assert b.verdict("a", "sha-a") == "new"  # forgotten: only the last 2 are remembered
    assert b.verdict("z", "sha-z") == "new"


class FakeState:
    def __init__(self, fail: bool = False, done: frozenset[str] = frozenset()) -> None:
        self.fail, self.done = fail, done
        self.calls: list[tuple[Any, ...]] = []

    async def reserve_budget(
        self, tenant: str, period: str, limit: float, amounts: dict[str, float]
    ) -> dict[str, bool]:
        if self.fail:
            raise StateUnavailable("down")
        self.calls.append(("budget", tenant, period, limit, dict(amounts)))
        return {q: True for q in amounts}

    async def residents(self, iid: str) -> list[Any]:
        return [Resident(q) for q in ("q2", "other") if q not in self.done]

    async def reserve_slots(
        self, iid: str, cap: int, qids: list[str], lease_s: float | None
    ) -> list[bool]:
        self.calls.append(("slots", iid, cap, list(qids)))
        return [True] * len(qids)

    async def dedupe_many(self, items: list[tuple[str, str]], ttl: float) -> list[Any]:
        self.calls.append(("dedupe", list(items)))
        return [("new", None)] * len(items)

    async def mark_routed_many(self, marks: dict[str, str]) -> int:
        self.calls.append(("marks", dict(marks)))
        return len(marks)


async def test_flush_writes_what_was_done_blind_and_keeps_it_on_failure() -> None:
    c = spec()
    b = BlindLedger()
    b.observe_instances({"i-a": Live(0)}, c, 0.0)
    b.observe_budget("default", "p1", 1.0, 0.0)
    assert not b.pending
    assert b.take("default", "p1", "i-a", "q1", 0.1) is None
    assert b.take("default", "p1", "i-a", "q2", 0.2) is None
    b.routed({"q1": "i-a", "q2": "i-a"}, {"q1": "s1", "q2": "s2"})
    assert b.pending
    with pytest.raises(StateUnavailable):
        await b.flush(FakeState(fail=True), c, 600.0, 3600.0)
    assert b.pending  # kept for the next try
    st = FakeState(done=frozenset({"q1"}))
    assert await b.flush(st, c, 600.0, 3600.0) == 0
    assert st.calls == [
        ("budget", "default", "p1", 1.0, {"q1": 0.1, "q2": 0.2}),
        ("slots", "i-a", 4, ["q2"]),  # q1 is no resident (finished): it holds no slot
        ("dedupe", [("q1", "s1"), ("q2", "s2")]),
        ("marks", {"q1": "i-a", "q2": "i-a"}),
    ]
    assert not b.pending
    # an outage that comes back before Redis is read again gets no fresh allowance
    assert b.allowance("default", "p1") == pytest.approx(0.2)
    b.observe_budget("default", "p1", 1.0, 0.3)
    assert b.allowance("default", "p1") == pytest.approx(0.35)


# ---------------------------------------------------------------- in-process, real Kafka


def body(qid: str) -> bytes:
    return json.dumps({"id": qid, "prompt": f"what is {qid}?", "max_tokens": 16}).encode()


@pytest.mark.integration
async def test_router_routes_blind_while_redis_is_down(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    from aiokafka import AIOKafkaProducer

    from state import StateStore, period_id
    from streams.app import BatchSink
    from streams.service import Inbound, RouterConfig, RouterService
    from switchyard import services
    from tests.streams.fake_router import SpreadRouter
    from tests.streams.test_service import read_topic
    from wiring import kafka_admin, topics

    rid = "b" + uuid.uuid4().hex[:6]
    worst = 0.0
    c0 = spec()
    for n in range(40):
        q = Query.model_validate_json(body(f"{rid}-q{n:02d}"))
        worst = max(worst, c0.model("m").max_cost_usd(q))
    # room for ~12 worst-case queries in total: blind mode may spend half of what is left
    c = ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "m",
                    "input_usd_per_token": 1e-6,
                    "output_usd_per_token": 1e-6,
                    "max_concurrency": 64,
                }
            ],  # fmt: skip
            "instances": [{"id": f"{rid}-a", "model": "m"}, {"id": f"{rid}-b", "model": "m"}],
            "tenants": [{"tenant": "default", "budget_usd": 12 * worst, "period_s": 86400}],
        }
    )
    port = services.free_port()
    rec = services.redis_up(home=tmp_path, port=port, name="blind-redis")
    store = await StateStore.connect(rec.address, namespace=f"t{rid}", socket_timeout_s=2.0)
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
    )
    await producer.start()
    await kafka_admin.ensure_topics(
        {"bootstrap_servers": kafka_bootstrap},
        [topics.DECISIONS, topics.DEAD_LETTERS, topics.RESULTS]
        + [topics.route(f"{rid}-{x}") for x in "ab"],
        partitions=2,
    )
    svc = RouterService(c, SpreadRouter(c), store, BatchSink(producer),
                        RouterConfig(window_s=0.01), period_id=period_id)  # fmt: skip
    pid = period_id(time.time(), 86400)
    since_ms = int(time.time() * 1000) - 1000
    offset = 0

    def inbound(qid: str) -> Inbound:
        nonlocal offset
        offset += 1
        return Inbound(body(qid), "queries", 0, offset)

    try:
        for iid in (f"{rid}-a", f"{rid}-b"):
            await store.heartbeat(iid, "m", 60.0, 64)
        # 1. Redis up: two queries routed normally; the router now knows what is left
        out, _ = await svc.handle([inbound(f"{rid}-q00"), inbound(f"{rid}-q01")])
        assert out.routed == 2
        before = await store.budget_status("default", pid)
        remaining = 12 * worst - before.committed_usd
        assert remaining > 0

        # 2. Redis down: routing goes on blind, within half of what was left
        services.stop_record(rec, tmp_path)
        blind_ids = [f"{rid}-q{n:02d}" for n in range(2, 22)]
        out, unfinished = await svc.handle([inbound(q) for q in blind_ids])
        assert out.routed > 0, out
        assert out.held == len(unfinished) > 0  # the rest waits for Redis, not dropped
        blind_spend = sum(
            c.model("m").max_cost_usd(Query.model_validate_json(body(q)))
            for q in blind_ids[: out.routed]
        )
        assert blind_spend <= 0.5 * remaining + 1e-12
        n_blind = out.routed
        # a redelivery of a query routed blind is dropped, and nothing more fits
        again, _ = await svc.handle([inbound(blind_ids[0])])
        assert again.dropped_duplicates == 1 and again.routed == 0

        # 3. Redis back empty (its AOF deleted): the window writes what was
        # done blind first, then routes normally
        rec = services.redis_up(home=tmp_path, port=port, name="blind-redis", fresh=True)
        for _ in range(20):
            try:
                for iid in (f"{rid}-a", f"{rid}-b"):
                    await store.heartbeat(iid, "m", 60.0, 64)
                break
            except StateUnavailable:
                time.sleep(0.2)
        routed_after = 0
        for _ in range(10):
            out, _ = await svc.handle([])
            routed_after += out.routed
            if not svc.held_count:
                break
        after = await store.budget_status("default", pid)
        # every query costs the same worst case here: blind ones first, then the normal ones
        assert blind_spend == pytest.approx(n_blind * worst, rel=1e-9)
        assert after.reserved_usd == pytest.approx((n_blind + routed_after) * worst, rel=1e-6)
        assert after.n_reserved == n_blind + routed_after
        assert after.committed_usd <= 12 * worst + 1e-12
        routed = blind_ids[:n_blind]
        for q in routed:
            entry = await store.dedupe_entry(q)
            assert entry is not None and entry.routed_to, q
        assert routed_after > 0  # held queries routed normally (the new Redis is empty)

        want = set(blind_ids) | {f"{rid}-q00", f"{rid}-q01"}
        got = await read_topic(
            kafka_bootstrap,
            topics.DECISIONS,
            since_ms,
            lambda rows: (
                sum(1 for k, v in rows if k.decode() in want and b'"routed"' in v)
                >= 2 + n_blind + routed_after
            ),
        )
        flags: dict[str, list[list[str]]] = {}
        for k, v in got:
            d = json.loads(v)
            if k.decode() in want and d["status"] == "routed":
                flags.setdefault(k.decode(), []).append(d.get("flags", []))
        assert all(len(f) == 1 for f in flags.values()), flags  # routed once each
        blind_flagged = [q for q, f in flags.items() if DecisionFlag.BUDGET_BLIND.value in f[0]]
        assert sorted(blind_flagged) == sorted(routed)
        assert len(flags) == 2 + n_blind + routed_after
    finally:
        await producer.stop()
        await store.close()
        services.stop_record(rec, tmp_path)
