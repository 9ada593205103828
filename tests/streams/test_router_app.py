"""The Faust router as a real subprocess on real Kafka and Redis (with a test-only policy).

The test plays the workers: it heart-beats the instances in Redis, reads ``route.<id>``
and frees each routed query's slot. It checks that every valid query is routed exactly
once, bad messages land in ``dead-letters`` with a reason while the stream goes on, the
tenant ledger never exceeds its budget, and no instance ever holds more slots than its
``max_concurrency``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas import ClusterConfig, DeadLetter, Decision, Result, RoutedQuery
from state import StateStore, period_id
from switchyard.processes import ProcessGroup
from wiring import topics

pytestmark = pytest.mark.integration

N_VALID = 1500
N_TIGHT = 100
MAX_CONCURRENCY = 40
TIGHT_BUDGET_USD = 0.0005


def cluster_yaml(rid: str, path: Path) -> ClusterConfig:
    spec = {
        "models": [
            {
                "name": "small",
                "input_usd_per_token": 1e-7,
                "output_usd_per_token": 2e-7,
                "max_concurrency": MAX_CONCURRENCY,
            },
            {
                "name": "large",
                "input_usd_per_token": 1e-6,
                "output_usd_per_token": 2e-6,
                "max_concurrency": MAX_CONCURRENCY,
            },
        ],
        "instances": [
            {"id": f"{rid}-s1", "model": "small"},
            {"id": f"{rid}-s2", "model": "small"},
            {"id": f"{rid}-l1", "model": "large"},
        ],
        "tenants": [
            {"tenant": "default", "budget_usd": 1000.0, "period_s": 86400},
            {"tenant": "tight", "budget_usd": TIGHT_BUDGET_USD, "period_s": 86400},
        ],
    }
    path.write_text(json.dumps(spec))
    return ClusterConfig.model_validate(spec)


async def end_offsets(bootstrap: str, names: list[str]) -> dict[TopicPartition, int]:
    """Every partition of ``names`` and its end offset now."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(names)
    finally:
        await admin.close()
    tps = [TopicPartition(t["topic"], p["partition"]) for t in described for p in t["partitions"]]
    assert {tp.topic for tp in tps} == set(names), f"topics missing on the broker: {names}"
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        return dict(await consumer.end_offsets(tps))
    finally:
        await consumer.stop()


async def rig(
    prefix: str, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> tuple[str, ClusterConfig, ProcessGroup, StateStore]:
    """A run id, its cluster file, a process group with the services' env, its Redis namespace."""
    rid = prefix + uuid.uuid4().hex[:6]
    cluster = cluster_yaml(rid, tmp_path / "cluster.json")
    ns = f"t{rid}"
    env = dict(
        os.environ,
        SWITCHYARD_KAFKA=kafka_bootstrap,
        SWITCHYARD_REDIS=redis_url,
        SWITCHYARD_NAMESPACE=ns,
    )
    procs = ProcessGroup(tmp_path / "logs", env=env)
    return rid, cluster, procs, await StateStore.connect(redis_url, namespace=ns)


async def test_router_routes_each_query_once_within_budget_and_capacity(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    rid, cluster, procs, store = await rig("r", kafka_bootstrap, redis_url, tmp_path)
    stop = asyncio.Event()

    async def heartbeats() -> None:
        while not stop.is_set():
            for inst in cluster.instances:
                await store.heartbeat(inst.id, inst.model, 5.0, MAX_CONCURRENCY)
            await asyncio.sleep(0.5)

    hb = asyncio.create_task(heartbeats())
    # this test plays the worker and frees slots as fast as it reads route records: on a loaded
    # machine that can lag a few seconds, so capacity holds get 30 s before a query gives up
    router = procs.switchyard(
        "router",
        "router", "--cluster", str(tmp_path / "cluster.json"), "--policy", "tests.streams.fake_router:factory",
        "--window-ms", "50", "--max-hold-s", "30", "--from", "latest", "--app-id", f"router-{rid}",
    )  # fmt: skip
    try:
        await asyncio.to_thread(procs.wait_for_line, router, "assigned queries partitions", 90)
        watched = [topics.route(i.id) for i in cluster.instances] + [
            topics.DEAD_LETTERS,
            topics.RESULTS,
            topics.DECISIONS,
        ]
        start = await end_offsets(kafka_bootstrap, watched)

        bad = [
            b"{not json",
            b"",
            json.dumps({"id": f"{rid}-bad-1"}).encode(),  # neither prompt nor messages
            json.dumps({"id": f"{rid}-bad-2", "prompt": "x", "ttft_slo_ms": -5}).encode(),
            json.dumps({"id": f"{rid}-bad-3", "prompt": "x", "tenant": "nobody"}).encode(),
            b"\xff\xfe\x00garbage",
            json.dumps([1, 2, 3]).encode(),
        ]
        valid_ids = [f"{rid}-q{i}" for i in range(N_VALID)]
        tight_ids = [f"{rid}-t{i}" for i in range(N_TIGHT)]
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True, linger_ms=5
        )
        await producer.start()
        try:
            futures = []
            for i, qid in enumerate(valid_ids):
                body = {
                    "id": qid,
                    "prompt": f"question {i} " + "word " * (i % 50),
                    "ttft_slo_ms": 2000,
                }
                futures.append(
                    await producer.send(topics.QUERIES, json.dumps(body).encode(), key=qid.encode())
                )
                if i % 200 == 0:
                    futures.append(await producer.send(topics.QUERIES, bad[(i // 200) % len(bad)]))
            for qid in tight_ids:
                # a cap on output: the ledger reserves each query's worst case up to it
                body = {"id": qid, "tenant": "tight", "prompt": "expensive " * 40, "max_tokens": 32}
                futures.append(
                    await producer.send(topics.QUERIES, json.dumps(body).encode(), key=qid.encode())
                )
            # the same id again with another body: a conflict, dead-lettered
            conflict = {"id": valid_ids[0], "prompt": "a different body"}
            futures.append(await producer.send(topics.QUERIES, json.dumps(conflict).encode()))
            await asyncio.gather(*futures)
        finally:
            await producer.stop()
        n_bad_sent = sum(1 for i in range(N_VALID) if i % 200 == 0) + 1

        routed: Counter[str] = Counter()
        routed_cost: dict[str, float] = {}
        letters: list[DeadLetter] = []
        results: dict[str, Result] = {}
        max_slots_seen = 0
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign(list(start))
            for tp, off in start.items():
                consumer.seek(tp, off)
            expected_tight_done = lambda: all(q in results or routed[q] for q in tight_ids)  # noqa: E731
            async with asyncio.timeout(90):
                while not (
                    all(routed[q] for q in valid_ids)
                    and len(letters) >= n_bad_sent
                    and expected_tight_done()
                ):
                    print(
                        f"routed {sum(1 for q in valid_ids if routed[q])}/{N_VALID}, letters {len(letters)}, results {len(results)}"
                    )
                    batch = await consumer.getmany(timeout_ms=500)
                    for tp, records in batch.items():
                        for r in records:
                            if tp.topic == topics.DEAD_LETTERS:
                                letter = DeadLetter.model_validate_json(r.value)
                                if (
                                    rid in letter.raw().decode(errors="replace")
                                    or letter.stage == "validate"
                                ):
                                    letters.append(letter)
                            elif tp.topic == topics.RESULTS:
                                res = Result.model_validate_json(r.value)
                                if res.query_id.startswith(rid):
                                    results[res.query_id] = res
                            elif tp.topic == topics.DECISIONS:
                                Decision.model_validate_json(r.value)
                            else:
                                rq = RoutedQuery.model_validate_json(r.value)
                                assert rq.decision.instance_id == topics.instance_of(tp.topic)
                                routed[rq.query.id] += 1
                                routed_cost[rq.query.id] = rq.decision.predicted_cost_usd or 0.0
                                # play the worker: the query ran and finished, free its slot
                                await store.resident_done(rq.decision.instance_id, rq.query.id)
                    for inst in cluster.instances:
                        max_slots_seen = max(max_slots_seen, len(await store.slots_held(inst.id)))
        finally:
            await consumer.stop()

        assert router.alive(), router.tail()
        assert all(routed[q] == 1 for q in valid_ids), [q for q in valid_ids if routed[q] != 1][:5]
        assert not [q for q, n in routed.items() if n > 1]
        assert max_slots_seen <= MAX_CONCURRENCY
        # the tight tenant: what was routed fits the budget; the rest got an error Result
        tight_routed = [q for q in tight_ids if routed[q]]
        assert 0 < len(tight_routed) < N_TIGHT
        assert sum(routed_cost[q] for q in tight_routed) <= TIGHT_BUDGET_USD + 1e-12
        status = await store.budget_status("tight", period_id(__import__("time").time(), 86400))
        assert status.committed_usd <= TIGHT_BUDGET_USD + 1e-9
        unrouted = [q for q in tight_ids if not routed[q]]
        assert all(results[q].error and "budget" in results[q].error for q in unrouted)
        # every bad message is a dead letter with a reason; the conflict is one of them
        assert len(letters) >= n_bad_sent
        assert all(letter.reason for letter in letters)
        assert any(
            letter.stage == "dedupe" and "different query body" in letter.reason
            for letter in letters
        )
        assert any("unknown tenant" in letter.reason for letter in letters)
    finally:
        stop.set()
        await hb
        procs.stop_all()
        await store.close()


async def test_router_killed_mid_stream_loses_nothing(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """kill -9 the router while it routes, start another: every query routed, none routed
    twice (identical re-sends of a route intent to the same instance are counted apart)."""
    rid, cluster, procs, store = await rig("k", kafka_bootstrap, redis_url, tmp_path)
    for inst in cluster.instances:  # capacity never binds here: only crash safety is tested
        await store.heartbeat(inst.id, inst.model, 600.0, MAX_CONCURRENCY)
    args = ["router", "--cluster", str(tmp_path / "cluster.json"), "--policy", "tests.streams.fake_router:factory",
            "--app-id", f"router-{rid}", "--commit-interval-s", "1.0"]  # fmt: skip
    first = procs.switchyard("router-1", *args, "--from", "latest")
    n = 3000
    try:
        await asyncio.to_thread(procs.wait_for_line, first, "assigned queries partitions", 90)
        watched = [topics.route(i.id) for i in cluster.instances]
        start = await end_offsets(kafka_bootstrap, watched)
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
        await consumer.start()
        consumer.assign(list(start))
        for tp, off in start.items():
            consumer.seek(tp, off)
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
        )
        await producer.start()
        ids = [f"{rid}-q{i}" for i in range(n)]
        routed: Counter[str] = Counter()  # route messages per query
        routings: dict[str, set[tuple[str, str]]] = {}  # distinct (topic, decision) per query

        def count(topic: str, value: bytes) -> RoutedQuery:
            rq = RoutedQuery.model_validate_json(value)
            routed[rq.query.id] += 1
            routings.setdefault(rq.query.id, set()).add((topic, rq.decision.model_dump_json()))
            return rq

        async def produce() -> None:
            for qid in ids:
                body = json.dumps({"id": qid, "prompt": f"q {qid}", "tenant": "default"}).encode()
                await producer.send(topics.QUERIES, body, key=qid.encode())
                await asyncio.sleep(0.0005)
            await producer.flush()

        async def drain(until: int) -> None:
            while sum(1 for q in ids if routed[q]) < until:
                batch = await consumer.getmany(timeout_ms=300)
                for records in batch.values():
                    for r in records:
                        rq = count(r.topic, r.value)
                        await store.resident_done(rq.decision.instance_id, rq.query.id)

        sending = asyncio.create_task(produce())
        async with asyncio.timeout(90):
            await drain(n // 3)
        procs.kill(first)  # SIGKILL: no commit, no goodbye
        second = procs.switchyard("router-2", *args)
        async with asyncio.timeout(120):
            await sending
            await drain(n)
        await asyncio.sleep(2.0)
        batch = await consumer.getmany(timeout_ms=1000, max_records=100000)
        for records in batch.values():
            for r in records:
                count(r.topic, r.value)
        await producer.stop()
        await consumer.stop()
        assert second.alive(), second.tail()
        assert all(routed[q] >= 1 for q in ids), "a query was lost"
        # routed twice: another instance or another decision. The same decision sent again
        # to the same instance is the successor's re-send of a route intent (the worker drops
        # the copy by id); it is counted, not an error
        twice = [q for q in ids if len(routings[q]) > 1]
        resent = sum(routed[q] - len(routings[q]) for q in ids)
        assert not twice, f"{len(twice)} routed twice, e.g. {[(q, routings[q]) for q in twice[:3]]}"
        print(f"killed mid-stream: {n} queries, 0 lost, 0 routed twice, {resent} re-sent copies")
    finally:
        procs.stop_all()
        await store.close()


async def test_router_with_held_queries_stops_promptly_and_hands_them_over(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """SIGTERM while queries wait for capacity: the router exits, the next one routes them."""
    rid, cluster, procs, store = await rig("h", kafka_bootstrap, redis_url, tmp_path)
    for inst in cluster.instances:
        await store.heartbeat(inst.id, inst.model, 600.0, MAX_CONCURRENCY)
    args = ["router", "--cluster", str(tmp_path / "cluster.json"), "--policy", "tests.streams.fake_router:factory",
            "--app-id", f"router-{rid}", "--commit-interval-s", "0.2"]  # fmt: skip
    capacity = MAX_CONCURRENCY * len(cluster.instances)
    n = capacity + 60
    try:
        first = procs.switchyard("router-1", *args, "--from", "latest")
        await asyncio.to_thread(procs.wait_for_line, first, "assigned queries partitions", 90)
        watched = [topics.route(i.id) for i in cluster.instances]
        start = await end_offsets(kafka_bootstrap, watched)
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
        )
        await producer.start()
        ids = [f"{rid}-q{i}" for i in range(n)]
        for qid in ids:
            body = json.dumps({"id": qid, "prompt": f"q {qid}"}).encode()
            await producer.send(topics.QUERIES, body, key=qid.encode())
        await producer.stop()
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
        await consumer.start()
        consumer.assign(list(start))
        for tp, off in start.items():
            consumer.seek(tp, off)
        routed: Counter[str] = Counter()
        first_wave: list[RoutedQuery] = []

        async def drain(until: int, keep: list[RoutedQuery] | None) -> None:
            while sum(1 for q in ids if routed[q]) < until:
                batch = await consumer.getmany(timeout_ms=300)
                for records in batch.values():
                    for r in records:
                        rq = RoutedQuery.model_validate_json(r.value)
                        routed[rq.query.id] += 1
                        if keep is not None:
                            keep.append(rq)
                        else:
                            await store.resident_done(rq.decision.instance_id, rq.query.id)

        async with asyncio.timeout(60):
            await drain(capacity, first_wave)  # every slot taken; the rest are held
        await asyncio.sleep(1.0)
        t0 = time.monotonic()
        code = await asyncio.to_thread(procs.stop, first, 30.0)
        stop_s = time.monotonic() - t0
        assert stop_s < 15.0, f"router took {stop_s:.1f} s to stop (code {code}):\n{first.tail()}"
        for rq in first_wave:  # the first wave finishes: slots free up
            await store.resident_done(rq.decision.instance_id, rq.query.id)
        procs.switchyard("router-2", *args)
        async with asyncio.timeout(90):
            await drain(n, None)
        await consumer.stop()
        assert all(routed[q] == 1 for q in ids), [q for q in ids if routed[q] != 1][:5]
        print(f"held queries handed over: stopped in {stop_s:.1f} s, {n} routed once each")
    finally:
        procs.stop_all()
        await store.close()
