"""The worker end to end on the real Kafka broker and Redis, against a real HTTP server
(fake vLLM over the simulated engine): a result for every query, state transitions visible
in Redis while running, the budget settled at the actual cost, dead letters for bad bodies,
error Results when the backend is down, duplicates skipped, offsets committed."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener

from schemas import (
    ClusterConfig,
    DeadLetter,
    Decision,
    Query,
    Result,
    RoutedQuery,
    StepTimeCoefficients,
)
from state import FINISHED_KEEP, StateStore, period_id
from switchyard.client import SwitchyardClient
from switchyard.services import free_port
from wiring import kafka_admin, topics
from wiring.settings import Settings
from workers.backends.sim import SimBackend
from workers.backends.vllm import VllmBackend, VllmConfig
from workers.fake_vllm import FakeVllmConfig, build_server, start_server
from workers.timings import RequestTiming, StepBatch, parse_report
from workers.worker import Worker, WorkerConfig

pytestmark = pytest.mark.integration

COEF = StepTimeCoefficients(
    c0_ms=4.0, c1_ms_per_token=0.02, c2_ms_per_ctx_token=0.0001, c3_ms_per_attn_unit=1e-6
)
IN_USD, OUT_USD = 1e-6, 2e-6


def _cluster(instance_id: str, max_concurrency: int = 4) -> ClusterConfig:
    return ClusterConfig.model_validate(
        {
            "models": [
                {
                    "name": "tiny",
                    "input_usd_per_token": IN_USD,
                    "output_usd_per_token": OUT_USD,
                    "max_concurrency": max_concurrency,
                    "step_time": COEF.model_dump(),
                }
            ],
            "instances": [{"id": instance_id, "model": "tiny"}],
            "tenants": [{"tenant": "acme", "budget_usd": 10.0, "period_s": 3600}],
        }
    )


def _routed(
    qid: str, instance_id: str, period: str, *, chat: bool = False, max_tokens: int = 24
) -> RoutedQuery:
    now = time.time()
    if chat:
        q = Query(
            id=qid,
            tenant="acme",
            messages=[{"role": "user", "content": "tell me " * 40}],
            max_tokens=max_tokens,
            created_at=now,
        )
    else:
        q = Query(
            id=qid, tenant="acme", prompt="word " * 200, max_tokens=max_tokens, created_at=now
        )
    d = Decision(
        query_id=qid,
        tenant="acme",
        status="routed",
        instance_id=instance_id,
        model="tiny",
        policy="test",
        decided_at=now,
        budget_period=period,
        predicted_output_tokens=max_tokens,
        predicted_cost_usd=0.01,
    )
    return RoutedQuery(query=q, decision=d)


@pytest.fixture
async def env(kafka_bootstrap: str, redis_url: str) -> AsyncIterator[dict[str, Any]]:
    ns = "w" + uuid.uuid4().hex[:10]
    settings = Settings(kafka=kafka_bootstrap, redis=redis_url, namespace=ns)
    state = await StateStore.connect(**settings.redis_kwargs())
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
    )
    await producer.start()
    client = SwitchyardClient(settings=settings)
    await client.start()
    cleanup: list[Any] = []
    yield {
        "settings": settings,
        "state": state,
        "producer": producer,
        "client": client,
        "cleanup": cleanup,
    }
    for fn in cleanup:
        await fn()
    await client.close()
    await producer.stop()
    await state.close()


async def _produce(producer: AIOKafkaProducer, topic: str, values: list[bytes]) -> None:
    await kafka_admin.ensure_topics(
        {"bootstrap_servers": producer.client._bootstrap_servers}, [topic]
    )
    futs = [await producer.send(topic, value=v, key=b"k") for v in values]
    await asyncio.gather(*futs)


@contextlib.asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Event]:
    """Run ``worker`` until the block ends (or sets the yielded event); always stops it."""
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        async with asyncio.timeout(30):
            while not worker.started.is_set():
                if task.done():
                    await task
                await asyncio.sleep(0.05)
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)  # a worker must stop once asked, never hang the test


def _sim_worker(env: dict[str, Any], iid: str, **config: Any) -> Worker:
    """A worker of one ``tiny`` instance on the sim backend (twice real time)."""
    cluster = _cluster(iid)
    backend = SimBackend(cluster.model("tiny"), instance_id=iid, time_scale=2.0)
    cfg = WorkerConfig(instance_id=iid, heartbeat_s=0.1, **config)
    return Worker(cfg, cluster, backend, env["settings"], env["state"])


async def _read_topic(
    bootstrap: str, topic: str, enough: Any, match: Any, timeout_s: float = 20
) -> list[Any]:
    """Records of ``topic`` that ``match`` maps to non-None, read until ``enough(out)``."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    out: list[Any] = []
    try:
        consumer.assign(await kafka_admin.partitions({"bootstrap_servers": bootstrap}, [topic]))
        await consumer.seek_to_beginning()
        async with asyncio.timeout(timeout_s):
            while not enough(out):
                batch = await consumer.getmany(timeout_ms=200)
                for recs in batch.values():
                    out.extend(x for r in recs if (x := match(r.value)) is not None)
    finally:
        await consumer.stop()
    return out


async def test_worker_on_fake_vllm_results_state_budget_dead_letters(
    env: dict[str, Any], kafka_bootstrap: str
) -> None:
    iid = "it-" + uuid.uuid4().hex[:8]
    cluster = _cluster(iid, max_concurrency=4)
    state: StateStore = env["state"]
    t0 = time.time()
    period = period_id(t0, 3600)
    # the engine at a quarter of real speed: requests last long enough to watch them
    server = await start_server(
        build_server(coefficients=COEF, time_scale=0.25, config=FakeVllmConfig(model="tiny"))
    )
    env["cleanup"].append(server.stop)
    n = 24
    queries = [
        _routed(f"{iid}-q{i}", iid, period, chat=i % 3 == 0, max_tokens=16 + i % 5)
        for i in range(n)
    ]
    reserved = await state.reserve_budget(
        "acme", period, 10.0, {rq.query.id: 0.01 for rq in queries}
    )
    assert all(reserved.values())
    assert all(await state.reserve_slots(iid, n, [rq.query.id for rq in queries]))
    bad = [b"{not json", json.dumps({"query": {"id": "x"}, "decision": {}}).encode()]
    wrong = _routed(f"{iid}-elsewhere", "other-instance", period).model_dump_json().encode()
    route = topics.route(iid)
    await _produce(
        env["producer"],
        route,
        [rq.model_dump_json().encode() for rq in queries[:12]] + bad + [wrong],
    )
    # a second copy of a query while the first is still queued or running: skipped
    await _produce(env["producer"], route, [queries[3].model_dump_json().encode()])
    await _produce(env["producer"], route, [rq.model_dump_json().encode() for rq in queries[12:]])

    backend = VllmBackend(VllmConfig(endpoint=server.url, model="tiny"))
    worker = Worker(
        WorkerConfig(instance_id=iid, heartbeat_s=0.2, progress_every_tokens=4, metrics_port=0),
        cluster,
        backend,
        env["settings"],
        state,
    )
    async with running(worker):
        seen: dict[str, set[tuple[int, int]]] = {}
        max_residents = 0

        async def watch() -> None:
            nonlocal max_residents
            while True:
                live = (await state.snapshots([iid], time.time()))[iid]
                if live.snapshot is not None:
                    max_residents = max(max_residents, len(live.snapshot.residents))
                    for r in live.snapshot.residents:
                        seen.setdefault(r.query_id, set()).add(
                            (r.prefilled_tokens, r.decoded_tokens)
                        )
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        client: SwitchyardClient = env["client"]
        results: dict[str, Result] = {}
        async with asyncio.timeout(40):
            for rq in queries:
                results[rq.query.id] = await client.result(rq.query.id, timeout_s=40)
        watcher.cancel()

        # every query: exactly one result, real token counts, cost from the model's prices
        assert len(results) == n
        for rq in queries:
            r = results[rq.query.id]
            assert r.error is None, r.error
            assert r.output_tokens == rq.query.max_tokens
            assert r.instance_id == iid and r.model == "tiny" and r.tenant == "acme"
            assert r.ttft_ms is not None and 0 < r.ttft_ms <= r.e2e_ms  # type: ignore[operator]
            assert r.cost_usd == pytest.approx(IN_USD * r.prompt_tokens + OUT_USD * r.output_tokens)
            assert len(r.text.split()) == r.output_tokens
        # state transitions were visible in Redis while running: queued, then decoding with counts
        assert max_residents > worker.concurrency  # queued residents beyond the running ones
        phases = [p for obs in seen.values() for p in obs]
        assert any(d == 0 and f == 0 for f, d in phases), "no queued resident seen"
        assert any(d > 0 for f, d in phases), "no decoding resident seen"
        assert all(d == 0 or f > 0 for f, d in phases)
        # done: no residents, every slot released, ledger settled at the actual cost
        await asyncio.sleep(0.3)
        live = (await state.snapshots([iid], time.time()))[iid]
        assert live.alive and live.snapshot is not None and live.snapshot.residents == []
        assert live.slots_used == 0
        # what the engine ran for the latest ones is listed for the routers' catch-up (in the
        # order they were closed, newest first): the tokens its results report, sent before
        # its last token, within the run
        fin = live.snapshot.finished
        assert len(fin) == min(n, FINISHED_KEEP)
        by_tokens = {(r.prompt_tokens, r.output_tokens) for r in results.values()}
        assert all((f.prompt_tokens, f.output_tokens) in by_tokens for f in fin)
        assert all(t0 < f.arrived_at < f.finished_at <= time.time() for f in fin)
        status = await state.budget_status("acme", period)
        assert status.reserved_usd == 0.0
        assert status.spent_usd == pytest.approx(
            sum(r.cost_usd for r in results.values()), abs=1e-8
        )
        assert status.n_settled == n

        # a re-delivered query whose result is out is skipped, not run again
        await _produce(env["producer"], route, [queries[0].model_dump_json().encode()])
        async with asyncio.timeout(10):
            while worker.counts["duplicates_skipped"] < 2:
                await asyncio.sleep(0.05)
        assert worker.counts["results"] == n

        # metrics endpoint
        import httpx

        async with httpx.AsyncClient() as http:
            text = (await http.get(f"http://127.0.0.1:{worker.metrics_port}/metrics")).text
        assert (
            f'switchyard_worker_results_total{{instance="{iid}",model="tiny",outcome="ok"}} {float(n)}'
            in text
        )
        assert "switchyard_worker_ttft_seconds_bucket" in text
        assert (
            f'switchyard_worker_duplicates_skipped_total{{instance="{iid}",model="tiny"}} 2.0'
            in text
        )

    assert worker.counts["dead_letters"] == 3
    assert not (await state.snapshots([iid], time.time()))[
        iid
    ].alive  # a clean stop drops the heartbeat

    # dead letters carry the raw bytes, the reason, topic, partition and offset
    def mine(raw: bytes) -> DeadLetter | None:
        dl = DeadLetter.model_validate_json(raw)
        return dl if dl.topic == route else None

    dls = await _read_topic(kafka_bootstrap, topics.DEAD_LETTERS, lambda out: len(out) >= 3, mine)
    assert sorted(dl.raw() for dl in dls) == sorted([*bad, wrong])
    assert {dl.offset for dl in dls} == {12, 13, 14} and all(dl.stage == "worker" for dl in dls)
    reasons = " | ".join(dl.reason for dl in dls)
    assert "malformed JSON" in reasons and "decision names instance 'other-instance'" in reasons

    # every offset was committed after its result: a new consumer in the group has nothing left
    probe = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=topics.worker_group(iid),
        enable_auto_commit=False,
    )
    await probe.start()
    try:
        committed = await probe.committed(TopicPartition(route, 0))
    finally:
        await probe.stop()
    assert committed == n + 3 + 2


async def test_backend_down_gives_error_results_and_releases_budget(env: dict[str, Any]) -> None:
    iid = "down-" + uuid.uuid4().hex[:8]
    state: StateStore = env["state"]
    period = period_id(time.time(), 3600)
    queries = [_routed(f"{iid}-q{i}", iid, period) for i in range(3)]
    await state.reserve_budget("acme", period, 10.0, {rq.query.id: 0.5 for rq in queries})
    await _produce(
        env["producer"], topics.route(iid), [rq.model_dump_json().encode() for rq in queries]
    )
    dead = f"http://127.0.0.1:{free_port()}"
    backend = VllmBackend(VllmConfig(endpoint=dead, model="tiny", retries=2, backoff_s=0.01))
    worker = Worker(  # an engine that never came up: consumed after the start-up wait
        WorkerConfig(instance_id=iid, heartbeat_s=0.2, engine_start_timeout_s=0.5),
        _cluster(iid),
        backend,
        env["settings"],
        state,
    )
    client: SwitchyardClient = env["client"]
    async with running(worker):
        results = [await client.result(rq.query.id, timeout_s=20) for rq in queries]
    for r in results:
        assert r.error is not None and f"cannot connect to {dead} after 3 attempts" in r.error
        assert (
            r.output_tokens == 0 and r.cost_usd == 0.0 and r.slo_met is False and r.ttft_ms is None
        )
    status = await state.budget_status("acme", period)
    assert (status.reserved_usd, status.spent_usd, status.n_settled) == (0.0, 0.0, 3)
    assert worker.counts["errors"] == 3


async def test_copies_rerouted_elsewhere_are_skipped_and_never_settled(
    env: dict[str, Any],
) -> None:
    """The claim (``StateStore.claim_run``): a copy a rescuer re-routed is skipped without
    touching the ledger (the re-route owns it); a copy whose rescuer died (lease ran out)
    is run here; offsets of all of them are finished."""
    iid = "claim-" + uuid.uuid4().hex[:8]
    state: StateStore = env["state"]
    period = period_id(time.time(), 3600)
    queries = [_routed(f"{iid}-q{i}", iid, period) for i in range(4)]
    q0, q1, q2, q3 = (rq.query.id for rq in queries)
    await state.reserve_budget("acme", period, 10.0, {rq.query.id: 0.5 for rq in queries})
    assert await state.claim_rescue(iid, [q0, q3], "r1", lease_s=30) == ["won", "won"]
    assert await state.claim_rerouted(iid, [q0, q3], "r1") == ["won", "won"]
    await state.mark_result(q3, 60, cost_usd=0.25)  # its re-routed copy was answered
    assert await state.claim_rescue(iid, [q1], "dead", lease_s=0.6) == ["won"]
    await _produce(
        env["producer"], topics.route(iid), [rq.model_dump_json().encode() for rq in queries]
    )
    dead = f"http://127.0.0.1:{free_port()}"
    backend = VllmBackend(VllmConfig(endpoint=dead, model="tiny", retries=0, backoff_s=0.01))
    worker = Worker(
        WorkerConfig(instance_id=iid, heartbeat_s=0.2, engine_start_timeout_s=0.5),
        _cluster(iid), backend,
        env["settings"], state,
    )  # fmt: skip
    client: SwitchyardClient = env["client"]
    async with running(worker):
        ran = {q: await client.result(q, timeout_s=20) for q in (q1, q2)}
        async with asyncio.timeout(10):
            while worker._tracker.unfinished() or worker._tracker.committable():
                await asyncio.sleep(0.05)
    assert all(r.instance_id == iid for r in ran.values())
    assert worker.counts["results"] == 2
    assert worker.counts["rerouted_skipped"] == 1  # q0 (q3 is skipped by its result mark)
    assert worker.counts["duplicates_skipped"] == 2
    assert await state.claim_state(iid, q1) == "run"  # the lapsed lease went to the worker
    status = await state.budget_status("acme", period)
    # q1, q2 settled here; q0, q3 untouched (their re-route owns those entries)
    assert status.n_settled == 2 and status.reserved_usd == pytest.approx(1.0)
    assert await state.slots_held(iid) == []


async def test_sim_backend_and_step_timings(env: dict[str, Any], kafka_bootstrap: str) -> None:
    iid = "sim-" + uuid.uuid4().hex[:8]
    cluster = _cluster(iid, max_concurrency=8)
    state: StateStore = env["state"]
    period = period_id(time.time(), 3600)
    queries = [_routed(f"{iid}-q{i}", iid, period, max_tokens=10 + i) for i in range(6)]
    # one carries its prefix identity (two 64-token blocks of its ~250): finished, it is
    # touched in this instance's prefix-cache model (state.prefix); the others' text is
    # under one 1 KiB block, so they touch nothing
    q0 = queries[0].query.model_copy(update={"prefix_hashes": [71, 72], "prefix_block_tokens": 64})
    queries[0] = queries[0].model_copy(update={"query": q0})
    await _produce(
        env["producer"], topics.route(iid), [rq.model_dump_json().encode() for rq in queries]
    )
    backend = SimBackend(cluster.model("tiny"), instance_id=iid, time_scale=2.0)
    worker = Worker(
        WorkerConfig(instance_id=iid, heartbeat_s=0.1), cluster, backend, env["settings"], state
    )
    client: SwitchyardClient = env["client"]
    async with running(worker):
        results = {rq.query.id: await client.result(rq.query.id, timeout_s=20) for rq in queries}
        await asyncio.sleep(0.3)  # one more heartbeat publishes the last steps
    assert all(
        r.error is None and r.output_tokens == rq.query.max_tokens
        for rq, r in zip(queries, results.values(), strict=True)
    )
    held = (await state.snapshots([iid], time.time()))[iid].prefix_hashes
    assert held is not None and held.tolist() == [71, 72]

    def mine(raw: bytes) -> Any:
        rep = parse_report(raw)
        return rep if rep.instance_id == iid else None

    def enough(out: list[Any]) -> bool:
        return (
            any(isinstance(r, StepBatch) for r in out)
            and sum(isinstance(r, RequestTiming) for r in out) >= 6
        )

    reports = await _read_topic(kafka_bootstrap, topics.STEP_TIMINGS, enough, mine)
    steps = [r for r in reports if isinstance(r, StepBatch)]
    requests = [r for r in reports if isinstance(r, RequestTiming)]
    assert {r.query_id for r in requests} == set(results)
    assert all(
        r.engine_ttft_ms is not None and r.engine_ttft_ms > 0 and r.backend == "sim"
        for r in requests
    )
    assert sum(len(b.duration_ms) for b in steps) > 10
    # the reported steps are priced by Eq. 9 with the model's own coefficients (no noise)
    from routing.steptime import StepTimeModel

    model = StepTimeModel.from_coefficients(COEF)
    for batch in steps:
        predicted = model.step_ms(batch.n_tokens, batch.decode_ctx_tokens, batch.prefill_attn_units)
        assert predicted == pytest.approx(batch.duration_ms, rel=1e-6)


async def test_a_cloud_models_rate_limit_paces_what_the_worker_sends(
    env: dict[str, Any],
) -> None:
    """``rate_limit_rps`` (a provider's limit): a burst of 6 goes to the endpoint 1/rate
    apart, as the simulator's cloud endpoint admits it (workers.pacing), and is counted."""
    iid = "rl-" + uuid.uuid4().hex[:8]
    spec = _cluster(iid, max_concurrency=8).model_dump()
    spec["models"][0] |= {"kind": "cloud", "rate_limit_rps": 10.0}
    cluster = ClusterConfig.model_validate(spec)
    period = period_id(time.time(), 3600)
    queries = [_routed(f"{iid}-q{i}", iid, period, max_tokens=2) for i in range(6)]
    sent: list[float] = []

    class Recording(SimBackend):
        async def generate(self, req: Any, on_progress: Any) -> Any:
            sent.append(time.monotonic())
            return await super().generate(req, on_progress)

    backend = Recording(cluster.model("tiny"), instance_id=iid, time_scale=2.0)
    worker = Worker(
        WorkerConfig(instance_id=iid, heartbeat_s=0.1), cluster, backend, env["settings"],
        env["state"],
    )  # fmt: skip
    await _produce(
        env["producer"], topics.route(iid), [rq.model_dump_json().encode() for rq in queries]
    )
    client: SwitchyardClient = env["client"]
    async with running(worker):
        results = [await client.result(rq.query.id, timeout_s=20) for rq in queries]
    assert all(r.error is None for r in results) and len(sent) == 6
    gaps = sorted(b - a for a, b in zip(sorted(sent), sorted(sent)[1:], strict=False))
    assert gaps[0] >= 0.095, gaps  # 1/10 s apart, though all 6 arrived at once
    paced = worker.metrics.rate_paced_s._value.get()
    assert paced >= 0.1 + 0.2 + 0.3 + 0.4 + 0.5 - 0.05  # the burst's waits, counted


async def test_prompt_tokens_the_engine_found_cached_are_billed_at_the_cached_price(
    env: dict[str, Any],
) -> None:
    """The engine's usage says how many prompt tokens its prefix cache served (vLLM's
    ``prompt_tokens_details.cached_tokens``): the Result carries them and its cost bills
    them at ``cached_input_usd_per_token``, which the ledger settles."""
    iid = "cc-" + uuid.uuid4().hex[:8]
    spec = _cluster(iid, max_concurrency=1).model_dump()
    spec["models"][0]["cached_input_usd_per_token"] = IN_USD / 10
    cluster = ClusterConfig.model_validate(spec)
    server = await start_server(
        build_server(coefficients=COEF, time_scale=1.0, config=FakeVllmConfig(model="tiny"))
    )
    env["cleanup"].append(server.stop)
    period = period_id(time.time(), 3600)
    head = f"[{iid}] " + "a long shared system prompt " * 150  # ~4 KiB: whole cache blocks
    queries = []
    for i, tail in enumerate(("first question", "second question")):
        rq = _routed(f"{iid}-q{i}", iid, period, max_tokens=4)
        queries.append(
            rq.model_copy(update={"query": rq.query.model_copy(update={"prompt": head + tail})})
        )
    state: StateStore = env["state"]
    await state.reserve_budget("acme", period, 10.0, {rq.query.id: 0.05 for rq in queries})
    worker = Worker(
        WorkerConfig(instance_id=iid, heartbeat_s=0.2), cluster,
        VllmBackend(VllmConfig(endpoint=server.url, model="tiny")), env["settings"], state,
    )  # fmt: skip
    client: SwitchyardClient = env["client"]
    results = []
    async with running(worker):
        for rq in queries:  # one after the other: the second finds the first's blocks
            await _produce(env["producer"], topics.route(iid), [rq.model_dump_json().encode()])
            results.append(await client.result(rq.query.id, timeout_s=20))
    first, second = results
    assert first.error is None and second.error is None
    assert first.cached_tokens == 0
    assert second.cached_tokens is not None and 0 < second.cached_tokens < second.prompt_tokens
    for r in results:
        cached = r.cached_tokens or 0
        assert r.cost_usd == pytest.approx(
            IN_USD * (r.prompt_tokens - cached) + IN_USD / 10 * cached + OUT_USD * r.output_tokens
        )
    assert second.cost_usd < first.cost_usd
    status = await state.budget_status("acme", period)
    assert status.spent_usd == pytest.approx(first.cost_usd + second.cost_usd, abs=1e-9)


async def test_redis_outage_does_not_stop_results_and_state_rebuilds(
    env: dict[str, Any], tmp_path: Path
) -> None:
    """Redis stops mid-stream: results keep coming (state writes are best effort, counted);
    after Redis is back, the heartbeat and the residents are rebuilt by the worker."""
    from switchyard import services

    port = services.free_port()
    rec = services.redis_up(port=port, home=tmp_path, name="redis-outage")
    settings = Settings(kafka=env["settings"].kafka, redis=rec.address, namespace="outage")
    state = await StateStore.connect(**settings.redis_kwargs(), socket_timeout_s=1.0)
    iid = "out-" + uuid.uuid4().hex[:8]
    cluster = _cluster(iid)
    backend = SimBackend(cluster.model("tiny"), instance_id=iid, time_scale=2.0)
    worker = Worker(
        WorkerConfig(instance_id=iid, heartbeat_s=0.1), cluster, backend, settings, state
    )
    client: SwitchyardClient = env["client"]
    route = topics.route(iid)
    try:
        async with running(worker):
            first = [_routed(f"{iid}-a{i}", iid, "p1") for i in range(3)]
            await _produce(env["producer"], route, [rq.model_dump_json().encode() for rq in first])
            for rq in first:
                assert (await client.result(rq.query.id, timeout_s=20)).error is None
            services.stop_record(rec, tmp_path)
            second = [_routed(f"{iid}-b{i}", iid, "p1") for i in range(3)]
            await _produce(env["producer"], route, [rq.model_dump_json().encode() for rq in second])
            for rq in second:
                assert (await client.result(rq.query.id, timeout_s=30)).error is None
            assert worker.metrics.errors("state") > 0
            rec = services.redis_up(port=port, home=tmp_path, name="redis-outage", fresh=True)
            async with asyncio.timeout(20):
                while not (await state.snapshots([iid], time.time()))[iid].alive:
                    await asyncio.sleep(0.1)
    finally:
        await state.close()
        services.stop_record(rec, tmp_path)
    assert worker.counts["results"] == 6


async def test_worker_consumes_its_route_topic_when_it_appears_after_the_group_joined(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug 10 (faults scenario 4): a worker whose group joined while the broker's metadata did
    not list its route topic yet got an empty assignment, heart-beat (so it was routed to) and
    consumed nothing until aiokafka's next metadata refresh, 5 min later. The worker's
    consumer refreshes its metadata every ``metadata_refresh_s`` so it joins the partition."""
    iid = "late-" + uuid.uuid4().hex[:8]
    route = topics.route(iid)
    real_ensure = kafka_admin.ensure_topics

    async def all_but_the_route(kafka_kwargs: Any, names: Any, *a: Any, **kw: Any) -> list[str]:
        return await real_ensure(kafka_kwargs, [n for n in names if n != route], *a, **kw)

    monkeypatch.setattr(kafka_admin, "ensure_topics", all_but_the_route)
    worker = _sim_worker(env, iid)
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        # the group joins with no partition metadata for the route topic: an empty assignment
        async with asyncio.timeout(30):
            while _generation(worker) < 1:
                if task.done():
                    await task
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # the join's sync and assignment
        assert worker._consumer.assignment() == set(), "precondition: joined before the topic"
        await real_ensure({"bootstrap_servers": env["settings"].kafka}, [route])
        rq = _routed(f"{iid}-q0", iid, period_id(time.time(), 3600))
        await _produce(env["producer"], route, [rq.model_dump_json().encode()])
        client: SwitchyardClient = env["client"]
        result = await client.result(rq.query.id, timeout_s=30)
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
    assert result.error is None and worker.started.is_set()


def _generation(worker: Worker) -> int:
    """The worker's consumer-group generation (-1 until its group has been joined)."""
    coordinator = getattr(worker._consumer, "_coordinator", None)
    return int(getattr(coordinator, "generation", -1))


async def test_a_worker_stops_promptly_while_its_group_join_is_stalled(env: dict[str, Any]) -> None:
    """aiokafka's ``getmany`` waits, with no bound, while a rebalance is in progress. A member
    of the worker's group that is slow to give up its partition (its revoke callback sleeps)
    holds the worker's join for as long; the worker still sees ``stop`` within its poll
    bound, says the join is stalled, and shuts down (two CI runs hung 300 s before)."""
    iid = "stall-" + uuid.uuid4().hex[:8]
    route = topics.route(iid)
    bootstrap = env["settings"].kafka
    await kafka_admin.ensure_topics({"bootstrap_servers": bootstrap}, [route])
    release = asyncio.Event()

    class SlowToLetGo(ConsumerRebalanceListener):  # type: ignore[misc]
        async def on_partitions_revoked(self, revoked: Any) -> None:
            if revoked:
                await asyncio.wait_for(release.wait(), 60)

        async def on_partitions_assigned(self, assigned: Any) -> None:
            return None

    holder = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=topics.worker_group(iid),
        enable_auto_commit=False,
        rebalance_timeout_ms=60_000,  # the broker waits this long for the holder to rejoin
    )
    await holder.start()
    holder.subscribe([route], listener=SlowToLetGo())
    poller: asyncio.Task[None] | None = None
    task: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(30):
            while not holder.assignment():
                await holder.getmany(timeout_ms=100)

        async def keep_polling() -> None:
            while True:
                await holder.getmany(timeout_ms=100)

        poller = asyncio.create_task(keep_polling())
        worker = _sim_worker(env, iid, group_stall_warn_s=2.0, commit_timeout_s=3.0)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        async with asyncio.timeout(30):
            while worker.metrics.errors("group_join") < 1:  # the join is held by the holder
                if task.done():
                    await task
                await asyncio.sleep(0.1)
        assert not worker.started.is_set()
        stop.set()
        t0 = time.monotonic()
        await asyncio.wait_for(task, 20)
        # poll bound (1 s) + the consumer's bounded stop (3 s) + the rest of shutdown
        assert time.monotonic() - t0 < 8.0
    finally:
        release.set()
        if task is not None and not task.done():
            task.cancel()
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
        await holder.stop()
