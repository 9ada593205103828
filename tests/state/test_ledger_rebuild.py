"""Rebuilding the budget ledger against the real Redis: the scripts are idempotent and safe
beside concurrent settles, the lease admits one rebuilder, the mark needs the lease, and
``LedgerGuard`` (with an in-memory scan standing in for Kafka) books what the records say."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Mapping

import pytest

from schemas import ClusterConfig, Decision, DecisionStatus, Query, Result, RoutedQuery
from state import StateStore, period_id
from streams.ledger_rebuild import LedgerGuard
from wiring import topics

pytestmark = pytest.mark.integration


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[StateStore]:
    s = await StateStore.connect(redis_url, namespace="t" + uuid.uuid4().hex[:12])
    yield s
    await s.close()


async def test_rebuild_is_idempotent_and_commutes_with_settles(store: StateStore) -> None:
    p = period_id(1_700_000_000, 3600)
    await store.reserve_budget("acme", p, 10.0, {"q1": 0.4, "q5": 0.6})  # survived
    await store.settle("acme", p, "q2", 0.2)  # a worker settled after the restart
    got = await store.ledger_rebuild(
        "acme", p, 10.0, {"q1": 0.1, "q2": 0.25, "q3": 0.3}, {"q4": 0.5, "q2": 0.9, "q5": 0.6}
    )
    assert got == (2, 1)  # q1, q3 settled now; q4 reserved; q2 and q5 already booked
    st = await store.budget_status("acme", p)
    assert st.spent_usd == pytest.approx(0.1 + 0.2 + 0.3)
    assert st.reserved_usd == pytest.approx(0.5 + 0.6)
    assert (st.n_settled, st.n_reserved, st.limit_usd) == (3, 2, 10.0)
    # again (another router, or a retry): nothing changes
    assert await store.ledger_rebuild("acme", p, 10.0, {"q1": 0.1, "q3": 0.3}, {"q4": 0.5}) == (
        0,
        0,
    )
    assert await store.budget_status("acme", p) == st
    # the workers settle the outstanding ones; a settle of a rebuilt settlement is a no-op
    assert await store.settle("acme", p, "q4", 0.05)
    assert not await store.settle("acme", p, "q1", 0.1)
    st2 = await store.budget_status("acme", p)
    assert st2.spent_usd == pytest.approx(0.65) and st2.reserved_usd == pytest.approx(0.6)
    # a rebuild's reservation never resurrects a settled query
    assert await store.ledger_rebuild("acme", p, 10.0, {}, {"q4": 0.5}) == (0, 0)


async def test_rebuild_books_over_the_limit_and_in_chunks(store: StateStore) -> None:
    p = period_id(1_700_000_000, 3600)
    settled = {f"s{i}": 0.001 for i in range(2500)}
    reserved = {f"r{i}": 0.002 for i in range(1200)}
    assert await store.ledger_rebuild("t", p, 1.0, settled, reserved) == (2500, 1200)
    st = await store.budget_status("t", p)
    assert st.committed_usd == pytest.approx(2.5 + 2.4)  # the truth, even past the limit
    assert await store.reserve_budget("t", p, 1.0, {"new": 0.001}) == {"new": False}


async def test_lease_admits_one_rebuilder_and_the_mark_needs_it(store: StateStore) -> None:
    assert await store.ledger_mark() is None
    assert await store.ledger_lease("a", 30) == "ours"
    assert await store.ledger_lease("b", 30) == "held"
    assert await store.ledger_lease("a", 30, renew=True) == "ours"
    assert await store.ledger_lease("b", 30, renew=True) == "lost"
    assert not await store.ledger_set_mark("b", "{}")
    # Redis restarted empty mid-rebuild: the lease is gone, so no mark from that rebuild
    _, lease = store.keys.ledger_epoch()
    await store._r.delete(lease)
    assert await store.ledger_lease("a", 30, renew=True) == "lost"
    assert not await store.ledger_set_mark("a", "{}")
    assert await store.ledger_lease("a", 30) == "ours"
    assert await store.ledger_set_mark("a", '{"ok":1}')
    assert await store.ledger_mark() == '{"ok":1}'
    assert await store.ledger_lease("b", 30) == "marked"


def _cluster() -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "m",
                    "input_usd_per_token": 1e-6,
                    "output_usd_per_token": 2e-6,
                    "max_concurrency": 8,
                }
            ],  # fmt: skip
            "instances": [{"id": "i-a", "model": "m"}, {"id": "i-b", "model": "m"}],
            "tenants": [{"tenant": "acme", "budget_usd": 3.0, "period_s": 3600}],
        }
    )


def _records(pid: str) -> list[tuple[str, bytes]]:
    out = []
    for i in range(6):
        q = Query(id=f"g{i}", tenant="acme", prompt=f"question {i}", max_tokens=50, ttft_slo_ms=1e4)
        inst = "i-a" if i % 2 else "i-b"
        d = Decision(query_id=q.id, tenant="acme", status=DecisionStatus.ROUTED, instance_id=inst,
                     policy="t", decided_at=1.0, budget_period=pid)  # fmt: skip
        out.append(
            (topics.route(inst), RoutedQuery(query=q, decision=d).model_dump_json().encode())
        )
        if i < 4:
            r = Result(query_id=q.id, tenant="acme", instance_id=inst, model="m",
                       cost_usd=0.001 * (i + 1), finished_at=2.0)  # fmt: skip
            out.append((topics.RESULTS, r.model_dump_json().encode()))
    out.append((topics.RESULTS, b"{not json"))  # a bad record is counted, not fatal
    return out


async def test_guard_rebuilds_once_with_several_routers(redis_url: str) -> None:
    ns = "t" + uuid.uuid4().hex[:12]
    stores = [await StateStore.connect(redis_url, namespace=ns) for _ in range(3)]
    cluster = _cluster()
    scans: list[Mapping[str, float]] = []

    def fixed_period(_now: float, period_s: float) -> str:
        return period_id(1_700_000_000, period_s)

    pid = fixed_period(0, 3600)

    async def scan(since: Mapping[str, float], handle: Callable[[str, bytes | None], None]) -> int:
        scans.append(since)
        await asyncio.sleep(0.3)  # long enough for the other routers to find the lease held
        recs = _records(pid)
        for topic, value in recs:
            handle(topic, value)
        return len(recs)

    guards = [LedgerGuard(cluster, scan, fixed_period, lease_s=3.0) for _ in stores]
    try:
        assert not any(
            await asyncio.gather(*(g.ready(s) for g, s in zip(guards, stores, strict=True)))
        )
        for _ in range(100):
            if all(
                await asyncio.gather(*(g.ready(s) for g, s in zip(guards, stores, strict=True)))
            ):
                break
            await asyncio.sleep(0.1)
        assert all(await asyncio.gather(*(g.ready(s) for g, s in zip(guards, stores, strict=True))))
        assert len(scans) == 1  # one router rebuilt; the others waited for its mark
        start = 1_700_000_000 // 3600 * 3600
        assert set(scans[0]) == {topics.route("i-a"), topics.route("i-b"), topics.RESULTS}
        assert set(scans[0].values()) == {start - 60.0}
        st = await stores[0].budget_status("acme", pid)
        worst = [
            cluster.model("m").max_cost_usd(
                Query(
                    id=f"g{i}",
                    tenant="acme",
                    prompt=f"question {i}",
                    max_tokens=50,
                    ttft_slo_ms=1e4,
                )
            )
            for i in (4, 5)
        ]
        assert st.spent_usd == pytest.approx(0.001 + 0.002 + 0.003 + 0.004)
        assert st.reserved_usd == pytest.approx(sum(worst), rel=1e-6)
        report = next(g.last for g in guards if g.last is not None)
        assert (report.records, report.routed, report.results, report.bad) == (11, 6, 4, 1)
        assert await stores[1].ledger_mark() == report.to_json()
    finally:
        for g in guards:
            await g.close()
        for s in stores:
            await s.close()


async def test_wait_ready_waits_for_the_rebuild_and_gives_up_on_a_failing_scan(
    redis_url: str,
) -> None:
    cluster = _cluster()
    ok_store = await StateStore.connect(redis_url, namespace="t" + uuid.uuid4().hex[:12])
    bad_store = await StateStore.connect(redis_url, namespace="t" + uuid.uuid4().hex[:12])

    async def scan(since: Mapping[str, float], handle: Callable[[str, bytes | None], None]) -> int:
        await asyncio.sleep(0.2)
        return 0

    async def broken(
        since: Mapping[str, float], handle: Callable[[str, bytes | None], None]
    ) -> int:
        raise OSError("Kafka unreachable")

    good = LedgerGuard(cluster, scan, period_id, lease_s=3.0)
    bad = LedgerGuard(cluster, broken, period_id, lease_s=3.0, retry_s=0.1)
    try:
        assert await good.wait_ready(ok_store, timeout_s=30)
        assert await ok_store.ledger_mark() is not None
        assert not await bad.wait_ready(bad_store, timeout_s=1.0)
        assert await bad_store.ledger_mark() is None
    finally:
        for g in (good, bad):
            await g.close()
        for s in (ok_store, bad_store):
            await s.close()
