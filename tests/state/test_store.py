"""StateStore against the real Redis: atomic reservations under concurrency, idempotency,
settle-once, heartbeat TTL expiry, dedupe verdicts, resident-state transitions."""

from __future__ import annotations

import asyncio
import hashlib
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from schemas import FinishedRequest, ResidentRequest, StepTimeCoefficients
from state import (
    FINISHED_KEEP,
    FINISHED_KEEP_S,
    NANO_PER_USD,
    ResultMark,
    RouteIntent,
    Starts,
    StateStore,
    StateUnavailable,
    period_id,
)
from state.keys import DEDUPE_BUCKETS, dedupe_bucket

pytestmark = pytest.mark.integration

N_CONNECTIONS = 4


def _ns() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[list[StateStore]]:
    """Several independent connections (as several routers/workers would have) on one namespace."""
    ns = _ns()
    opened = [await StateStore.connect(redis_url, namespace=ns) for _ in range(N_CONNECTIONS)]
    yield opened
    for s in opened:
        await s.close()


async def test_concurrent_budget_reservations_never_exceed_limit(stores: list[StateStore]) -> None:
    rng = random.Random(7)
    limit = 1.0
    period = period_id(1_700_000_000, 3600)
    # 600 reservation calls of 1..5 queries each, amounts 1..10 cents: ~10x over the limit
    calls: list[dict[str, float]] = []
    n = 0
    for _ in range(600):
        batch = {}
        for _ in range(rng.randint(1, 5)):
            batch[f"q{n}"] = rng.randint(1, 10) / 100
            n += 1
        calls.append(batch)
    replies = await asyncio.gather(
        *(
            stores[i % N_CONNECTIONS].reserve_budget("acme", period, limit, c)
            for i, c in enumerate(calls)
        )
    )
    accepted = {q: calls[i][q] for i, r in enumerate(replies) for q, ok in r.items() if ok}
    status = await stores[0].budget_status("acme", period)
    total_nano = sum(round(a * NANO_PER_USD) for a in accepted.values())
    assert total_nano <= limit * NANO_PER_USD
    assert status.reserved_usd == pytest.approx(total_nano / NANO_PER_USD, abs=1e-9)
    assert status.reserved_usd <= limit
    assert status.n_reserved == len(accepted)
    # the ledger is packed: whatever was refused would not have fitted at the end
    smallest_refused = min(a for c in calls for q, a in c.items() if q not in accepted)
    assert status.reserved_usd + smallest_refused > limit - 1e-9


async def test_concurrent_slot_reservations_never_exceed_capacity(stores: list[StateStore]) -> None:
    max_slots = 17
    ids = [f"q{i}" for i in range(400)]
    replies = await asyncio.gather(
        *(
            stores[i % N_CONNECTIONS].reserve_slots("gpu-a", max_slots, [qid])
            for i, qid in enumerate(ids)
        )
    )
    granted = [qid for qid, r in zip(ids, replies, strict=True) if r == [True]]
    assert len(granted) == max_slots
    live = await stores[1].snapshots(["gpu-a"], now=0.0)
    assert live["gpu-a"].slots_used == max_slots
    assert sorted(await stores[0].slots_held("gpu-a")) == sorted(granted)
    # releasing five lets exactly five more in, whoever asks
    await stores[2].release_slots("gpu-a", granted[:5])
    more = await asyncio.gather(
        *(s.reserve_slots("gpu-a", max_slots, ids[200:260]) for s in stores)
    )
    newly = {qid for r in more for qid, ok in zip(ids[200:260], r, strict=True) if ok} - set(
        granted
    )
    assert len(newly) == 5
    assert (await stores[0].snapshots(["gpu-a"], now=0.0))["gpu-a"].slots_used == max_slots


async def test_slot_reservation_is_idempotent_and_ordered(stores: list[StateStore]) -> None:
    s = stores[0]
    assert await s.reserve_slots("i1", 2, ["a", "b", "c"]) == [True, True, False]
    assert await s.reserve_slots("i1", 2, ["a", "b", "a"]) == [True, True, True]
    await s.resident_done("i1", "a")  # a worker finishing releases the slot
    await s.resident_done("i1", "a")  # idempotent
    assert await s.reserve_slots("i1", 2, ["c", "d"]) == [True, False]


async def test_slot_lease_reclaims_untouched_slots(stores: list[StateStore]) -> None:
    s = stores[0]
    assert await s.reserve_slots("i2", 1, ["old"]) == [True]
    assert await s.reserve_slots("i2", 1, ["new"], lease_s=3600) == [False]
    await asyncio.sleep(0.05)
    assert await s.reserve_slots("i2", 1, ["new"], lease_s=0.01) == [True]
    assert await s.slots_held("i2") == ["new"]


async def test_budget_reservation_idempotent_and_settle_once(stores: list[StateStore]) -> None:
    s, other = stores[0], stores[1]
    p = period_id(1_700_000_000, 86_400)
    assert await s.reserve_budget("t1", p, 1.0, {"a": 0.4, "b": 0.4, "c": 0.4}) == {
        "a": True,
        "b": True,
        "c": False,
    }
    # re-reserving accepted ids adds nothing, even with other amounts, from another connection
    assert await other.reserve_budget("t1", p, 1.0, {"a": 0.9, "b": 0.4}) == {"a": True, "b": True}
    st = await s.budget_status("t1", p)
    assert (st.limit_usd, st.reserved_usd, st.spent_usd) == (1.0, pytest.approx(0.8), 0.0)
    # settle at the actual cost: reservation released, spend booked, exactly once
    results = await asyncio.gather(*(x.settle("t1", p, "a", 0.25) for x in stores))
    assert sorted(results) == [False, False, False, True]
    st = await s.budget_status("t1", p)
    assert st.reserved_usd == pytest.approx(0.4)
    assert st.spent_usd == pytest.approx(0.25)
    assert st.remaining_usd() == pytest.approx(0.35)
    # a settled id cannot be reserved again (its spend is booked)
    assert await s.reserve_budget("t1", p, 1.0, {"a": 0.01}) == {"a": False}
    # release gives back only what is still reserved; unknown and settled ids are no-ops
    await s.release_budget("t1", p, ["b", "a", "zzz"])
    st = await s.budget_status("t1", p)
    assert (st.reserved_usd, st.spent_usd) == (0.0, pytest.approx(0.25))
    assert await s.reserve_budget("t1", p, 1.0, {"c": 0.75}) == {"c": True}
    assert await s.reserve_budget("t1", p, 1.0, {"d": 1e-9}) == {"d": False}  # exactly full
    # a settle without a reservation (e.g. reserved while Redis was down) still books the spend
    assert await s.settle("t1", p, "walk-in", 0.5) is True
    assert (await s.budget_status("t1", p)).spent_usd == pytest.approx(0.75)


async def test_concurrent_reserve_and_settle_keep_the_ledger_consistent(
    stores: list[StateStore],
) -> None:
    p = "free-form-period"
    ids = [f"q{i}" for i in range(300)]
    await asyncio.gather(
        *(stores[i % 4].reserve_budget("t2", p, 100.0, {q: 0.1}) for i, q in enumerate(ids))
    )
    await asyncio.gather(
        *(stores[(i + 1) % 4].settle("t2", p, q, 0.05) for i, q in enumerate(ids)),
        *(stores[(i + 2) % 4].settle("t2", p, q, 0.05) for i, q in enumerate(ids)),
    )
    st = await stores[0].budget_status("t2", p)
    assert st.reserved_usd == 0.0
    assert st.spent_usd == pytest.approx(15.0)
    assert (st.n_reserved, st.n_settled) == (0, 300)


async def test_bad_amounts_are_refused_with_a_clear_error(stores: list[StateStore]) -> None:
    s = stores[0]
    with pytest.raises(ValueError, match="query q1: amount must be a finite number >= 0"):
        await s.reserve_budget("t3", "p", 1.0, {"q1": float("nan")})
    with pytest.raises(ValueError, match="query q1: amount must be a finite number >= 0"):
        await s.reserve_budget("t3", "p", 1.0, {"q1": -1.0})
    with pytest.raises(ValueError, match="tenant 'bad tenant'"):
        await s.reserve_budget("bad tenant", "p", 1.0, {"q1": 1.0})
    with pytest.raises(ValueError, match="instance id 'a}b'"):
        await s.reserve_slots("a}b", 1, ["q"])
    # a final newline passes Python's `$`, and would split a joined script argument
    with pytest.raises(ValueError, match=r"query id 'q1\\n'"):
        await s.reserve_slots("i1", 1, ["q1\n"])
    with pytest.raises(ValueError, match=r"query id 'q1\\n'"):
        await s.reserve_budget("t3", "p", 1.0, {"q1\n": 1.0})
    with pytest.raises(ValueError, match=r"instance id 'i1\\n'"):
        await s.mark_routed_many({"q1": "i1\n"})
    with pytest.raises(ValueError, match="over the ledger's cap"):
        await s.reserve_budget("t3", "p", 1e12, {"q1": 1.0})


async def test_heartbeat_ttl_expiry_and_snapshot_age(stores: list[StateStore]) -> None:
    s = stores[0]
    await s.heartbeat(
        "w1",
        "llama",
        ttl_s=1.0,
        max_concurrency=8,
        now=1000.0,
        engine_running=2,
        engine_kv_usage=0.5,
    )
    await s.heartbeat("w2", "mistral", ttl_s=30, max_concurrency=4, now=1000.0)
    live = await stores[1].snapshots(["w1", "w2", "never"], now=1002.5)
    assert live["w1"].alive and live["w1"].snapshot is not None
    assert live["w1"].snapshot.model == "llama"
    assert live["w1"].age_s == pytest.approx(2.5)
    assert live["w1"].max_concurrency == 8 and live["w1"].engine_running == 2
    assert live["w1"].engine_kv_usage == 0.5 and live["w1"].engine_waiting is None
    assert (
        live["never"].snapshot is None
        and not live["never"].alive
        and live["never"].age_s == float("inf")
    )
    await asyncio.sleep(1.2)
    live = await stores[1].snapshots(["w1", "w2"], now=1003.0)
    assert not live["w1"].alive and live["w1"].snapshot is None
    assert live["w2"].alive
    # a state write after expiry does not resurrect a dead instance
    await s.resident_add("w1", ResidentRequest(query_id="x", prompt_tokens=5))
    assert not (await s.snapshots(["w1"], now=1003.0))["w1"].alive


async def test_resident_transitions_and_snapshot(stores: list[StateStore]) -> None:
    s, router = stores[0], stores[1]
    await s.heartbeat("w", "m", ttl_s=30, max_concurrency=4, now=100.0)
    await s.resident_add(
        "w", ResidentRequest(query_id="b", prompt_tokens=50, arrived_at=2.0), now=101.0
    )
    await s.resident_add(
        "w",
        ResidentRequest(
            query_id="a", prompt_tokens=100, predicted_output_tokens=20, arrived_at=1.0
        ),
        now=102.0,
    )
    snap = (await router.snapshots(["w"], now=103.0))["w"].snapshot
    assert snap is not None and snap.taken_at == 102.0
    assert [r.query_id for r in snap.residents] == ["a", "b"]  # arrival order
    assert snap.residents[0].prefilled_tokens == 0  # queued
    await s.resident_progress("w", "a", prefilled_tokens=64, decoded_tokens=0, now=104.0)
    snap = (await router.snapshots(["w"], now=104.0))["w"].snapshot
    assert snap is not None and (
        snap.residents[0].prefilled_tokens,
        snap.residents[0].decoded_tokens,
    ) == (64, 0)
    await s.resident_progress("w", "a", prefilled_tokens=100, decoded_tokens=7, now=105.0)
    await s.resident_progress(
        "w", "b", prefilled_tokens=80, decoded_tokens=0, now=105.0
    )  # clamped to prompt
    snap = (await router.snapshots(["w"], now=105.0))["w"].snapshot
    assert snap is not None
    a, b = snap.residents
    assert (a.prefilled_tokens, a.decoded_tokens, a.predicted_output_tokens) == (100, 7, 20)
    assert b.prefilled_tokens == 50
    await s.resident_done("w", "a", now=106.0)
    await s.resident_progress("w", "a", 100, 9)  # a late update after done is ignored
    snap = (await router.snapshots(["w"], now=106.0))["w"].snapshot
    assert (
        snap is not None
        and [r.query_id for r in snap.residents] == ["b"]
        and snap.taken_at == 106.0
    )
    assert await s.residents_reconcile("w", keep_query_ids=[]) == 1
    await s.residents_sync(
        "w", [ResidentRequest(query_id="c", prompt_tokens=3, prefilled_tokens=3, decoded_tokens=1)]
    )
    assert [r.query_id for r in await s.residents("w")] == ["c"]


async def test_dedupe_verdicts(stores: list[StateStore]) -> None:
    s = stores[0]
    body = hashlib.sha256(b'{"id":"q1"}').hexdigest()
    other = hashlib.sha256(b'{"id":"q1","x":1}').hexdigest()
    verdicts = await asyncio.gather(*(x.dedupe("q1", body, ttl_s=60) for x in stores * 25))
    assert verdicts.count("new") == 1 and verdicts.count("duplicate") == 99
    assert await s.dedupe("q1", other, ttl_s=60) == "conflict"
    assert await s.dedupe_ex("q1", body, ttl_s=60) == ("duplicate", None)
    assert await s.mark_routed("q1", "gpu-1")
    assert await s.dedupe_ex("q1", body, ttl_s=60) == ("duplicate", "gpu-1")
    await s.forget("q1")
    assert await s.dedupe("q1", other, ttl_s=0.2) == "new"
    await asyncio.sleep(0.35)
    assert await s.dedupe("q1", body, ttl_s=60) == "new"  # expired
    assert not await s.mark_routed("never-seen", "gpu-1")


async def test_route_intent_is_kept_until_routed_and_never_overwrites_a_mark(
    stores: list[StateStore],
) -> None:
    s = stores[0]
    body = hashlib.sha256(b'{"id":"i1"}').hexdigest()
    for qid in ("i1", "i2", "i3"):
        await s.dedupe(qid, body, ttl_s=60)
    await s.mark_routed("i3", "gpu-9")  # already routed: its intent is not recorded
    decision = '{"query_id":"i1","status":"routed","instance_id":"gpu-1"}'
    taken = await s.mark_intent_many(
        {
            "i1": RouteIntent("gpu-1", decision),
            "i2": RouteIntent("gpu-2", "{}\n{}"),  # newlines in the decision survive
            "i3": RouteIntent("gpu-1", "{}"),
            "never-seen": RouteIntent("gpu-1", "{}"),
        }
    )
    assert taken == {"i3": "gpu-9"}  # routed already: that routing stands; never-seen: no entry
    # the first intent wins: another router's intent for i1 is refused, the same one is not
    assert await stores[1].mark_intent_many({"i1": RouteIntent("gpu-2", "{}")}) == {"i1": "gpu-1"}
    assert await stores[1].mark_intent_many({"i1": RouteIntent("gpu-1", decision)}) == {}
    got = await stores[1].intents(["i1", "i2", "i3", "never-seen"])
    assert got == {"i1": RouteIntent("gpu-1", decision), "i2": RouteIntent("gpu-2", "{}\n{}")}
    entry = await s.dedupe_entry("i1")
    assert entry is not None and entry.intent == RouteIntent("gpu-1", decision)
    assert entry.routed_to is None
    assert await s.mark_routed("i1", "gpu-1")  # routed for good: the intent is dropped
    entry = await s.dedupe_entry("i1")
    assert entry is not None and entry.intent is None and entry.routed_to == "gpu-1"
    assert await s.intents([]) == {}
    with pytest.raises(ValueError, match="instance id"):
        await s.mark_intent_many({"i1": RouteIntent("bad id", "{}")})


async def test_a_rerouted_intent_replaces_the_routing_to_the_silent_instance(
    stores: list[StateStore],
) -> None:
    """A rescuer's re-routed copy (its claim made it this router's) is not "taken" by the
    original routing to the silent instance it comes from (bug 15: it was dropped, and the
    resumed worker waited on the rescuer's lease for good); a copy routed to a third
    instance meanwhile (another rescuer got there first) is."""
    s = stores[0]
    body = hashlib.sha256(b'{"id":"r1"}').hexdigest()
    for qid in ("r1", "r2", "r3"):
        await s.dedupe(qid, body, ttl_s=60)
    await s.mark_routed_many({"r1": "gpu-1", "r2": "gpu-1", "r3": "gpu-1"})
    decision = '{"query_id":"r1","status":"routed","instance_id":"gpu-2","flags":["rerouted"]}'
    assert await s.mark_intent_many({"r1": RouteIntent("gpu-2", decision, "gpu-1")}) == {}
    entry = await s.dedupe_entry("r1")
    assert entry is not None and entry.intent == RouteIntent("gpu-2", decision)
    # not re-routed: the routing to gpu-1 stands, as for any router
    assert await s.mark_intent_many({"r2": RouteIntent("gpu-2", "{}")}) == {"r2": "gpu-1"}
    assert await s.mark_routed("r3", "gpu-3")  # re-routed by another rescuer meanwhile
    assert await stores[1].mark_intent_many({"r3": RouteIntent("gpu-2", "{}", "gpu-1")}) == {
        "r3": "gpu-3"
    }
    assert await s.mark_routed("r1", "gpu-2")
    entry = await s.dedupe_entry("r1")
    assert entry is not None and entry.routed_to == "gpu-2" and entry.intent is None


async def test_mark_result_first_time_only_and_starts_per_process(stores: list[StateStore]) -> None:
    firsts = await asyncio.gather(
        *(x.mark_result("r1", ttl_s=60, cost_usd=0.0123) for x in stores * 10)
    )
    assert firsts.count(True) == 1
    assert await stores[0].has_result("r1") and not await stores[0].has_result("r2")
    mark = await stores[1].result_mark("r1")
    assert mark is not None and mark.cost_usd == pytest.approx(0.0123)
    assert await stores[0].result_mark("r2") is None
    assert await stores[0].mark_result("r3", ttl_s=60)
    assert (await stores[0].result_mark("r3")) == ResultMark(cost_usd=None)
    starts = await asyncio.gather(
        *(x.mark_start("r1", f"proc-{i}", ttl_s=60) for i, x in enumerate(stores))
    )
    assert sorted(s.number for s in starts) == [1, 2, 3, 4]
    assert sorted(s.processes for s in starts) == [1, 2, 3, 4]
    # one process starting it again (a stage retried, the call re-sent): a new start, no new process
    again = await asyncio.gather(
        *(stores[0].mark_start("r1", "proc-0", ttl_s=60) for _ in range(3))
    )
    assert sorted(s.number for s in again) == [5, 6, 7]
    assert {s.processes for s in again} == {4}
    assert await stores[0].mark_start("r2", "proc-0", ttl_s=60) == Starts(number=1, processes=1)


async def test_namespaces_are_isolated(redis_url: str) -> None:
    a = await StateStore.connect(redis_url, namespace=_ns())
    b = await StateStore.connect(redis_url, namespace=_ns())
    try:
        assert await a.reserve_slots("i", 1, ["q"]) == [True]
        assert await b.reserve_slots("i", 1, ["q2"]) == [True]
    finally:
        await a.close()
        await b.close()


async def test_unreachable_redis_raises_state_unavailable() -> None:
    from switchyard.services import free_port

    with pytest.raises(
        StateUnavailable, match=r"Redis at redis://127\.0\.0\.1:\d+/0 unavailable during connect"
    ):
        await StateStore.connect(f"redis://127.0.0.1:{free_port()}/0", socket_timeout_s=1.0)


async def test_password_never_in_error(redis_url: str) -> None:
    from switchyard.services import free_port

    with pytest.raises(StateUnavailable) as info:
        await StateStore.connect(
            f"redis://:hunter2@127.0.0.1:{free_port()}/0", socket_timeout_s=1.0
        )
    assert "hunter2" not in str(info.value)


async def test_dedupe_many_in_one_round_trip(stores: list[StateStore]) -> None:
    s = stores[0]
    sha = {i: hashlib.sha256(f"body{i}".encode()).hexdigest() for i in range(300)}
    first = await s.dedupe_many([(f"m{i}", sha[i]) for i in range(200)], ttl_s=60)
    assert first == [("new", None)] * 200
    await s.mark_routed_many({"m0": "gpu-1", "m1": "gpu-2"})
    items = [(f"m{i}", sha[i]) for i in range(300)]
    items[5] = ("m5", sha[299])  # same id, another body
    again = await stores[1].dedupe_many(items, ttl_s=60)
    assert again[0] == ("duplicate", "gpu-1") and again[1] == ("duplicate", "gpu-2")
    assert again[5] == ("conflict", None)
    assert again[2:5] + again[6:200] == [("duplicate", None)] * 197
    assert again[200:] == [("new", None)] * 100
    with pytest.raises(ValueError, match="query id 'bad id'"):
        await s.dedupe_many([("bad id", sha[0])], ttl_s=60)


async def test_every_script_call_stays_in_one_cluster_hash_slot(
    stores: list[StateStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis Cluster runs a script only when all its keys hash to one slot: every call here
    must name keys with one and the same hash tag. The store is told it talks to a cluster
    (a single Redis takes a window's dedupe entries in one call instead:
    ``test_one_node_takes_a_window_of_dedupe_entries_in_one_call``)."""
    import re

    s = stores[0]
    monkeypatch.setattr(s, "_cluster", True)
    seen: list[tuple[str, set[str]]] = []

    def tags(keys: list[str]) -> set[str]:
        out = set()
        for k in keys:
            m = re.search(r"\{([^}]+)\}", k)
            assert m, f"key {k!r} has no hash tag"
            out.add(m.group(1))
        return out

    orig_script, orig_many = s._script, s._script_many

    async def script(name: str, keys: Any, args: Any) -> Any:
        seen.append((name, tags(list(keys))))
        return await orig_script(name, keys, args)

    async def many(name: str, calls: Any, extra: Any = ()) -> Any:
        for keys, _ in calls:
            seen.append((name, tags(list(keys))))
        for command in extra:  # plain commands in the same pipeline: one key each
            seen.append((command[0], tags([command[1]])))
        return await orig_many(name, calls, extra)

    monkeypatch.setattr(s, "_script", script)
    monkeypatch.setattr(s, "_script_many", many)
    p = period_id(1_700_000_000, 60)
    await s.heartbeat("i", "m", 5, 4)
    await s.resident_add("i", ResidentRequest(query_id="q", prompt_tokens=4))
    await s.resident_progress("i", "q", 4, 1)
    await s.residents_reconcile("i", ["q"])
    await s.snapshots(["i", "j"], 0.0)
    await s.reserve_slots("i", 4, ["q"])
    await s.resident_done("i", "q")
    await s.reserve_budget("t", p, 1.0, {"q": 0.1, "r": 0.2})
    await s.release_budget("t", p, ["r"])
    await s.settle("t", p, "q", 0.05)
    await s.dedupe_many([(f"d{i}", "ab" * 32) for i in range(50)], 60)
    await s.mark_intent_many({f"d{i}": RouteIntent("i", "{}") for i in range(50)})
    await s.mark_routed_many({f"d{i}": "i" for i in range(50)})
    await s.step_time_publish("m", StepTimeCoefficients(
        c0_ms=1.0, c1_ms_per_token=0.1, c2_ms_per_ctx_token=0.0, c3_ms_per_attn_unit=0.0
    ), rows=8, instance_id="i", ttl_s=60.0)  # fmt: skip
    await s.snapshots_and_step_times(["i"], ["m", "n"], 0.0)
    names = {name for name, _ in seen}
    assert names >= {"heartbeat", "resident_add", "resident_progress", "resident_done", "snapshot",
                     "reserve_slots", "reserve_budget", "release_budget", "settle", "dedupe",
                     "mark_routed", "mark_intent", "residents_reconcile", "step_time",
                     "HGETALL"}  # fmt: skip
    bad = [(name, t) for name, t in seen if len(t) != 1]
    assert not bad, f"script calls spanning several hash slots: {bad}"


async def test_one_node_takes_a_window_of_dedupe_entries_in_one_call(
    stores: list[StateStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a single Redis, dedupe, route intents and routed marks are one script call per
    window (the entries span all 64 dedupe buckets), with the same answers as per bucket,
    and the keys travel as one argument joined by newlines (KEYS is empty)."""
    s = stores[0]
    if s._cluster:  # make test-cluster: one call per bucket there (the test above)
        pytest.skip("a Redis Cluster takes one script call per dedupe bucket")
    calls: list[tuple[str, int, int]] = []
    orig_many = s._script_many

    async def many(name: str, batch: Any, extra: Any = ()) -> Any:
        calls.extend((name, len(keys), len(str(args[-1]).split("\n"))) for keys, args in batch)
        return await orig_many(name, batch, extra)

    monkeypatch.setattr(s, "_script_many", many)
    ids = [f"w{i}" for i in range(300)]
    assert len({dedupe_bucket(q) for q in ids}) == DEDUPE_BUCKETS
    sha = {q: hashlib.sha256(q.encode()).hexdigest() for q in ids}
    items = [(q, sha[q]) for q in ids] + [("w0", sha["w0"]), ("w1", "ff" * 32)]
    first = await s.dedupe_many(items, 60)
    assert first == [("new", None)] * 300 + [("duplicate", None), ("conflict", None)]
    decision = '{"a":"\\n\\u001e"}'
    intents = {q: RouteIntent(f"gpu-{i % 3}", decision) for i, q in enumerate(ids)}
    intents["w277"] = RouteIntent("gpu-9", decision, "gpu-1")  # re-routed: its own argument
    assert await s.mark_intent_many(intents) == {}
    assert await s.mark_routed_many({q: f"gpu-{i % 3}" for i, q in enumerate(ids[:200])}) == 200
    assert calls == [("dedupe", 0, 302), ("mark_intent", 0, 300), ("mark_routed", 0, 200)]
    again = await stores[1].dedupe_many([(q, sha[q]) for q in ids], 60)
    assert again[:200] == [("duplicate", f"gpu-{i % 3}") for i in range(200)]
    assert again[200:] == [("duplicate", None)] * 100
    entry = await s.dedupe_entry("w250")
    assert entry is not None and entry.intent == RouteIntent("gpu-1", decision)
    assert (await s.intents(["w277", "w250"]))["w277"] == RouteIntent("gpu-9", decision)
    with pytest.raises(ValueError, match="0x1e"):
        await s.mark_intent_many({"w1": RouteIntent("gpu-1", '{"a":"\x1e"}')})
    with pytest.raises(ValueError, match="hex digest"):
        await s.dedupe_many([("w1", "ab\ncd")], 60)


async def test_resync_never_undoes_a_concurrent_add_or_done(stores: list[StateStore]) -> None:
    s = stores[0]
    await s.heartbeat("w", "m", ttl_s=30, max_concurrency=4)
    old = ResidentRequest(query_id="old", prompt_tokens=5, arrived_at=10.0)  # lost by the worker
    kept = ResidentRequest(query_id="kept", prompt_tokens=5, arrived_at=11.0)
    done = ResidentRequest(query_id="done", prompt_tokens=5, arrived_at=12.0)
    for r in (old, kept, done):
        await s.resident_add("w", r)
    view, view_at = [kept, done], 20.0  # the worker's view, taken at t=20
    await s.resident_done("w", "done")  # finished after the view was taken
    late = ResidentRequest(query_id="late", prompt_tokens=5, arrived_at=21.0)
    await s.resident_add("w", late)  # arrived after the view was taken
    dropped = await stores[1].residents_sync("w", view, view_at=view_at)
    assert dropped == 1  # only "old": not in the view and older than it
    assert [r.query_id for r in await s.residents("w")] == ["kept", "late"]
    # a re-delivered query that was done before is resident again once re-added
    await s.resident_add("w", ResidentRequest(query_id="done", prompt_tokens=5, arrived_at=22.0))
    await s.residents_sync(
        "w",
        [kept, late, ResidentRequest(query_id="done", prompt_tokens=5, arrived_at=22.0)],
        view_at=23.0,
    )
    assert [r.query_id for r in await s.residents("w")] == ["kept", "late", "done"]


async def test_finish_marks_settles_and_frees_in_one_call(stores: list[StateStore]) -> None:
    s = stores[0]
    p = period_id(1_700_000_000, 3600)
    await s.reserve_budget("t9", p, 1.0, {"f1": 0.5})
    await s.reserve_slots("w9", 2, ["f1"])
    await s.resident_add("w9", ResidentRequest(query_id="f1", prompt_tokens=3))
    assert await s.finish("w9", "f1", result_ttl_s=60, cost_usd=0.2, tenant="t9", period_id=p) == (
        True,
        True,
    )
    assert await s.finish("w9", "f1", result_ttl_s=60, cost_usd=0.2, tenant="t9", period_id=p) == (
        False,
        False,
    )
    st = await s.budget_status("t9", p)
    assert (st.reserved_usd, st.spent_usd) == (0.0, pytest.approx(0.2))
    assert await s.slots_held("w9") == [] and await s.residents("w9") == []
    mark = await s.result_mark("f1")
    assert mark is not None and mark.cost_usd == pytest.approx(0.2)
    # after a Redis script flush (e.g. a restart) the scripts are reloaded on the fly
    await s._r.script_flush()
    assert await s.finish("w9", "f2", result_ttl_s=60, cost_usd=0.1, tenant="t9", period_id=p) == (
        True,
        True,
    )
    assert (await s.snapshots(["w9"], 0.0))["w9"].slots_used == 0


async def test_finished_requests_reach_the_snapshot_newest_first_bounded(
    stores: list[StateStore],
) -> None:
    """What the engine ran for each finished query is listed in the instance's snapshot once
    (a second finish of the same query adds nothing), newest first, at most FINISHED_KEEP,
    and only those that left within FINISHED_KEEP_S of the reader's clock."""
    s = stores[0]
    now = 1_800_000_000.0
    await s.heartbeat("wf", "m", ttl_s=30, max_concurrency=64, now=now)
    n = FINISHED_KEEP + 5
    for i in range(n):
        qid = f"fin{i}"
        await s.resident_add("wf", ResidentRequest(query_id=qid, prompt_tokens=10 + i))
        f = FinishedRequest(
            prompt_tokens=10 + i, output_tokens=1 + i, arrived_at=now - 3.0 + 0.01 * i,
            finished_at=now - 2.0 + 0.01 * i,
        )  # fmt: skip
        assert (await s.finish("wf", qid, result_ttl_s=60, cost_usd=0.0, finished=f))[0]
    # a re-delivered copy finishing again records nothing
    again = FinishedRequest(prompt_tokens=99, output_tokens=9, arrived_at=now, finished_at=now)
    await s.finish("wf", f"fin{n - 1}", result_ttl_s=60, cost_usd=0.0, finished=again)
    # a query finished without what it ran (skipped, never ran) records nothing either
    await s.resident_add("wf", ResidentRequest(query_id="skip", prompt_tokens=7))
    await s.finish("wf", "skip", result_ttl_s=60, cost_usd=0.0)
    snap = (await s.snapshots(["wf"], now))["wf"].snapshot
    assert snap is not None
    assert [f.prompt_tokens for f in snap.finished] == [10 + i for i in range(n - 1, 4, -1)]
    assert snap.finished[0] == FinishedRequest(
        prompt_tokens=10 + n - 1, output_tokens=n, arrived_at=now - 3.0 + 0.01 * (n - 1),
        finished_at=now - 2.0 + 0.01 * (n - 1),
    )  # fmt: skip
    # read later, those that left more than FINISHED_KEEP_S ago are left out
    later = now - 2.0 + 0.01 * 20 + FINISHED_KEEP_S
    snap = (await s.snapshots(["wf"], later))["wf"].snapshot
    assert snap is not None
    assert [f.prompt_tokens for f in snap.finished] == [10 + i for i in range(n - 1, 19, -1)]
    ttl_ms = await s._r.pttl(s.keys.finished("wf"))
    assert 0 < ttl_ms <= FINISHED_KEEP_S * 1000


def test_what_a_failing_over_cluster_answers_is_unavailable_not_a_bug() -> None:
    """Each error a Redis (Cluster) gives while it is not serving is ``unavailable``: the
    store raises ``StateUnavailable`` for it (bug 19: CLUSTERDOWN and company reached the
    worker as failures of the message's own). Errors that no wait fixes are not."""
    from redis import exceptions as rx

    from state.store import unavailable

    cannot_connect = rx.RedisClusterException("Redis Cluster cannot be connected")
    cannot_connect.__cause__ = rx.ConnectionError("Error 111 connecting")
    for exc in [
        rx.ConnectionError("Connection closed by server."),
        rx.TimeoutError("Timeout reading from socket"),
        rx.BusyLoadingError("LOADING Redis is loading the dataset in memory"),
        rx.ClusterDownError("CLUSTERDOWN The cluster is down"),
        rx.MasterDownError("MASTERDOWN Link with MASTER is down"),
        rx.ClusterError("TTL exhausted."),
        rx.TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"),
        rx.SlotNotCoveredError("Slot 1234 is not covered by the cluster."),
        rx.ReadOnlyError("READONLY You can't write against a read only replica."),
        rx.MovedError("3999 127.0.0.1:6381"),
        rx.ResponseError("NOREPLICAS Not enough good replicas to write."),
        rx.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."),
        cannot_connect,
        ConnectionRefusedError(111, "Connection refused"),
    ]:
        assert unavailable(exc), exc
    for exc in [
        rx.ResponseError("ERR wrong number of arguments"),
        rx.NoScriptError("NOSCRIPT No matching script"),
        rx.RedisClusterException("Cluster mode is not enabled on this node"),
        rx.DataError("Invalid input"),
        ValueError("a bug"),
    ]:
        assert not unavailable(exc), exc


async def test_a_connection_torn_down_under_the_cluster_client_is_unavailable() -> None:
    """On CLUSTERDOWN redis-py's cluster client closes every connection, also those other
    tasks are writing to; they fail inside redis-py with AttributeError (seen in scenario
    15, bug 19). From the cluster client that is the failover; from anywhere else a bug."""
    from redis.asyncio.connection import Connection
    from redis.exceptions import ConnectionError as RedisConnectionError

    from state.store import unavailable

    closed = Connection()  # what another task's aclose() left: no stream writer
    # redis-py < 8.2 fails there with AttributeError, >= 8.2 checks and raises ConnectionError:
    # from the cluster client both are the failover
    with pytest.raises((AttributeError, RedisConnectionError)) as torn:
        await closed._send_packed_command([b"PING"])
    assert unavailable(torn.value, cluster=True)
    # a writer torn down mid-call (no ``transport``/``writelines`` any more): AttributeError
    # raised inside redis-py's own code, whichever version
    closed._writer = object()  # type: ignore[assignment]
    with pytest.raises(AttributeError) as caught:
        await closed._send_packed_command([b"PING"])
    assert unavailable(caught.value, cluster=True)
    assert not unavailable(caught.value)  # a single-node client has no such race
    try:
        None.writelines  # type: ignore[attr-defined]  # noqa: B018
    except AttributeError as ours:
        assert not unavailable(ours, cluster=True)  # not raised in redis-py: a bug of ours
