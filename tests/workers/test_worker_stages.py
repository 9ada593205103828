"""A fault at each stage of a worker's handling of one message is contained (issue 16): the
message is retried a bounded number of times, then dead-lettered with the stage named and
answered with an error Result (unless its Result is out already); the other queries are
answered, the worker keeps running and its offsets move past the poison."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import pytest

from schemas import DeadLetter, Result
from state import period_id
from tests.workers.test_worker import _produce, _read_topic, _routed, running
from tests.workers.test_worker_codecs import sim_worker
from wiring import topics
from workers import worker as worker_mod
from workers.worker import STAGE_TRIES, Worker

pytestmark = pytest.mark.integration


class Boom(RuntimeError):
    """The injected fault."""


def _inject(worker: Worker, stage: str, poison: str, calls: Counter[str]) -> None:
    """Make ``stage`` raise for the query ``poison`` (every time), counting the tries."""

    def hit() -> None:
        calls[stage] += 1
        raise Boom(f"injected fault at {stage}")

    state = worker.state
    if stage == "validate":
        real_parse = worker_mod.parse_model

        def parse(model: Any, raw: Any, *a: Any, **kw: Any) -> Any:
            if raw is not None and poison.encode() in raw:
                hit()
            return real_parse(model, raw, *a, **kw)

        worker_mod.parse_model = parse  # restored by the caller
    elif stage in ("dedupe", "claim", "finish"):
        name = {"dedupe": "result_mark", "claim": "claim_run", "finish": "finish"}[stage]
        real = getattr(state, name)

        async def call(*a: Any, **kw: Any) -> Any:
            qid = a[1] if name in ("claim_run", "finish") else a[0]
            if qid == poison:
                hit()
            return await real(*a, **kw)

        setattr(state, name, call)
    elif stage == "result":
        real_result = worker._result

        def result(rq: Any, *a: Any) -> Any:
            if rq.query.id == poison:
                hit()
            return real_result(rq, *a)

        worker._result = result  # type: ignore[method-assign]
    elif stage == "publish":
        real_publish = worker._publish

        async def publish(topic: str, key: str, value: bytes) -> None:
            if topic == topics.RESULTS and key == poison:
                hit()
            await real_publish(topic, key, value)

        worker._publish = publish  # type: ignore[method-assign]
    else:
        raise ValueError(stage)


@pytest.mark.parametrize("stage", ["validate", "dedupe", "claim", "result", "publish", "finish"])
async def test_fault_at_a_stage_is_contained(
    stage: str,
    env: dict[str, Any],
    kafka_bootstrap: str,
) -> None:
    iid = f"st-{stage[:4]}-" + uuid.uuid4().hex[:6]
    period = period_id(time.time(), 3600)
    queries = [_routed(f"{iid}-q{i}", iid, period, max_tokens=4) for i in range(8)]
    poison = queries[3].query.id
    await _produce(
        env["producer"], topics.route(iid), [rq.model_dump_json().encode() for rq in queries]
    )
    worker = sim_worker(iid, env)
    calls: Counter[str] = Counter()
    real_parse = worker_mod.parse_model
    _inject(worker, stage, poison, calls)
    try:
        async with running(worker):
            others = [rq.query.id for rq in queries if rq.query.id != poison]
            results = {q: await env["client"].result(q, timeout_s=30) for q in others}
            answer: Result | None = None
            if stage not in ("validate", "publish"):  # no query known / no Result can go out
                answer = await env["client"].result(poison, timeout_s=30)

            def mine(raw: bytes) -> DeadLetter | None:
                letter = DeadLetter.model_validate_json(raw)
                return letter if letter.topic == topics.route(iid) else None

            letters = await _read_topic(
                kafka_bootstrap, topics.DEAD_LETTERS, lambda o: len(o) >= 1, mine
            )
            deadline = time.monotonic() + 10
            while worker._tracker.committable() and time.monotonic() < deadline:
                await worker._commit()
                await asyncio.sleep(0.2)
            assert worker._fatal is None
    finally:
        worker_mod.parse_model = real_parse
    assert all(r.error is None for r in results.values())
    assert len(letters) == 1 and letters[0].stage == stage, letters
    assert f"stage {stage} failed" in letters[0].reason and "injected fault" in letters[0].reason
    assert letters[0].offset == 3
    # retried a bounded number of times; a Result that is out is never produced again
    # (publish: one more, the error Result that could not go out either)
    assert calls[stage] == {"finish": 1, "publish": STAGE_TRIES + 1}.get(stage, STAGE_TRIES)
    if stage == "finish":
        assert answer is not None and answer.error is None
    elif answer is not None:
        assert answer.error is not None and f"stage {stage} failed" in answer.error
    # the offset moved past the poison: everything is committed
    assert not worker._tracker.committable() and worker._tracker.unfinished() == 0


async def test_commit_fault_is_retried_and_offsets_still_move(
    env: dict[str, Any],
    kafka_bootstrap: str,
) -> None:
    iid = "st-comm-" + uuid.uuid4().hex[:6]
    period = period_id(time.time(), 3600)
    queries = [_routed(f"{iid}-q{i}", iid, period, max_tokens=4) for i in range(6)]
    await _produce(
        env["producer"], topics.route(iid), [rq.model_dump_json().encode() for rq in queries]
    )
    worker = sim_worker(iid, env)
    failures = Counter[str]()
    async with running(worker):
        assert worker._consumer is not None
        real_commit = worker._consumer.commit

        async def commit(*a: Any, **kw: Any) -> Any:
            if failures["commit"] < 3:
                failures["commit"] += 1
                raise Boom("injected fault at commit")
            return await real_commit(*a, **kw)

        worker._consumer.commit = commit  # type: ignore[method-assign]
        for rq in queries:
            assert (await env["client"].result(rq.query.id, timeout_s=30)).error is None
        deadline = time.monotonic() + 10
        while worker._tracker.committable() and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert failures["commit"] == 3 and worker._fatal is None
        assert not worker._tracker.committable()  # committed in the end
        tp = next(iter(worker._consumer.assignment()))
        assert await worker._consumer.committed(tp) == len(queries)


async def test_query_whose_worker_died_each_time_is_not_started_again(
    env: dict[str, Any],
    kafka_bootstrap: str,
) -> None:
    """Started MAX_RUNS times without an answer (the worker died running it each time): the
    next delivery answers it with an error Result and a dead letter instead of a crash loop."""
    iid = "st-runs-" + uuid.uuid4().hex[:6]
    period = period_id(time.time(), 3600)
    queries = [_routed(f"{iid}-q{i}", iid, period, max_tokens=4) for i in range(3)]
    poison = queries[1].query.id
    for died in range(worker_mod.MAX_RUNS):  # what MAX_RUNS deaths mid-inference leave in Redis
        await env["state"].mark_start(poison, f"died-{died}", 600.0)
    await _produce(
        env["producer"], topics.route(iid), [rq.model_dump_json().encode() for rq in queries]
    )
    worker = sim_worker(iid, env)
    async with running(worker):
        answers = {
            rq.query.id: await env["client"].result(rq.query.id, timeout_s=30) for rq in queries
        }
    assert [q for q, r in answers.items() if r.error] == [poison]
    assert "not started again" in str(answers[poison].error)

    def mine(raw: bytes) -> DeadLetter | None:
        letter = DeadLetter.model_validate_json(raw)
        return letter if letter.topic == topics.route(iid) else None

    letters = await _read_topic(kafka_bootstrap, topics.DEAD_LETTERS, lambda o: len(o) >= 1, mine)
    assert [(x.stage, x.offset) for x in letters] == [("generate", 1)]


@pytest.mark.parametrize("fault", ["failover", "own"])
async def test_a_message_whose_first_try_failed_registering_its_resident_is_answered(
    fault: str,
    env: dict[str, Any],
    kafka_bootstrap: str,
) -> None:
    """The first ``resident_add`` of one query fails once. ``failover``: inside the Redis
    client, with what a Redis Cluster answers mid-failover (CLUSTERDOWN), which the store
    reports as unavailable, so the worker goes on (a best-effort write). ``own``: a fault of
    the message's own, so its handling is retried. Either way the query is answered once,
    without an error and without a dead letter. Before bug 19's fix the first try left the
    query registered as running here, and its retry skipped it as "a second copy": no
    Result, ever (the queries a Redis Cluster failover lost in scenario 15)."""
    from redis.exceptions import ClusterDownError

    iid = f"st-res{fault[:2]}-" + uuid.uuid4().hex[:6]
    period = period_id(time.time(), 3600)
    queries = [_routed(f"{iid}-q{i}", iid, period, max_tokens=4) for i in range(4)]
    victim = queries[1].query.id
    await _produce(
        env["producer"], topics.route(iid), [rq.model_dump_json().encode() for rq in queries]
    )
    worker = sim_worker(iid, env)
    state, hits = worker.state, Counter[str]()
    if fault == "failover":
        script = state._scripts["resident_add"]

        async def add_script(keys: Any = None, args: Any = None, client: Any = None) -> Any:
            if victim in (args or []) and not hits["resident_add"]:
                hits["resident_add"] += 1
                raise ClusterDownError("CLUSTERDOWN The cluster is down")
            return await script(keys=keys, args=args, client=client)

        state._scripts["resident_add"] = add_script  # type: ignore[assignment]
    else:
        real_add = state.resident_add

        async def resident_add(instance_id: str, r: Any, **kw: Any) -> None:
            if r.query_id == victim and not hits["resident_add"]:
                hits["resident_add"] += 1
                raise Boom("injected fault at resident_add")
            await real_add(instance_id, r, **kw)

        state.resident_add = resident_add  # type: ignore[method-assign]
    async with running(worker):
        answers = {
            rq.query.id: await env["client"].result(rq.query.id, timeout_s=30) for rq in queries
        }
        deadline = time.monotonic() + 10
        while worker._tracker.committable() and time.monotonic() < deadline:
            await worker._commit()
            await asyncio.sleep(0.2)
    assert hits["resident_add"] == 1
    assert all(r.error is None for r in answers.values()), answers
    assert worker.counts["duplicates_skipped"] == 0
    assert worker.counts["dead_letters"] == 0
    assert not worker._tracker.committable() and worker._tracker.unfinished() == 0
