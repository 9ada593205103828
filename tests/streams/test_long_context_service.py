"""Every registered policy in the service over long-context traffic (issue 14, part 1).

``RouterService`` in-process on real Redis and real Kafka, instances whose live state in
Redis nearly fills their KV caches, prompts of 5k-130k tokens and two longer than any
model's context. Each query gets exactly one outcome: a ``route.<instance>`` message on an
instance that can hold it, or (the too-long ones, at once) a ``rejected`` decision and an
error ``Result`` naming the sizes. Nothing raises, nothing is held or dropped.
"""

from __future__ import annotations

import json
import time
import uuid

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer

from routing.policies import ROUTERS, RouterContext, make_router
from schemas import ClusterConfig, Decision, DecisionStatus, ResidentRequest, Result, RoutedQuery
from state import StateStore, period_id
from streams.app import BatchSink
from streams.service import Inbound, RouterConfig, RouterService
from tests.routing.test_long_context import FakeQuality, cluster
from tests.streams.test_service import read_topic
from wiring import kafka_admin, topics

pytestmark = pytest.mark.integration


def service_cluster(rid: str) -> ClusterConfig:
    base = cluster().model_dump()
    for inst in base["instances"]:
        inst["id"] = f"{rid}-{inst['id']}"
    base["tenants"] = [{"tenant": "default", "budget_usd": 1e6, "period_s": 86400}]
    return ClusterConfig.model_validate(base)


async def service_io(
    kafka_bootstrap: str, cfg: ClusterConfig
) -> tuple[AIOKafkaProducer, list[str]]:
    """A started idempotent producer for ``RouterService``'s sink, and the route topics
    (made, with ``decisions`` and ``results``, one partition each)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
    )
    await producer.start()
    routes = [topics.route(i.id) for i in cfg.instances]
    try:
        await kafka_admin.ensure_topics(
            {"bootstrap_servers": kafka_bootstrap},
            [topics.DECISIONS, topics.RESULTS, *routes],
            partitions=1,
        )
    except BaseException:
        await producer.stop()
        raise
    return producer, routes


async def fill_caches(store: StateStore, cfg: ClusterConfig, rng: np.random.Generator) -> None:
    """Heart-beat every instance with long residents holding 60-95% of its KV cache."""
    for inst in cfg.instances:
        spec = cfg.model(inst.model)
        await store.heartbeat(inst.id, spec.name, 60.0, spec.max_concurrency)
        cap = spec.scheduler.kv_blocks * spec.scheduler.block_size_tokens
        parts = rng.dirichlet(np.ones(3)) * cap * rng.uniform(0.6, 0.95)
        for j, p in enumerate(np.maximum(parts.astype(int), 1).tolist()):
            await store.resident_add(
                inst.id,
                ResidentRequest(
                    query_id=f"{inst.id}-r{j}",
                    prompt_tokens=p,
                    prefilled_tokens=p if j < 2 else 0,
                    decoded_tokens=3 if j < 2 else 0,
                    predicted_output_tokens=200,
                ),
            )


@pytest.mark.parametrize("name", sorted(ROUTERS))
async def test_every_policy_in_the_service_answers_long_context_once(
    name: str, kafka_bootstrap: str, redis_url: str
) -> None:
    rid = "lc" + uuid.uuid4().hex[:6]
    cfg = service_cluster(rid)
    rng = np.random.default_rng(sorted(ROUTERS).index(name))
    store = await StateStore.connect(redis_url, namespace=f"t{rid}")
    producer, routes = await service_io(kafka_bootstrap, cfg)
    try:
        await fill_caches(store, cfg, rng)
        router = make_router(name, RouterContext.build(cfg, FakeQuality()))
        svc = RouterService(cfg, router, store, BatchSink(producer),
                            RouterConfig(window_s=0.01), period_id=period_id)  # fmt: skip
        prompts = rng.integers(5_000, 130_000, 10).tolist() + [140_000, 2_000_000]
        ids = [f"{rid}-q{i}" for i in range(len(prompts))]
        since = int(time.time() * 1000)
        items = [
            Inbound(
                json.dumps({"id": qid, "prompt": "long context", "prompt_tokens": p}).encode(),
                "queries",
                0,
                k,
            )  # fmt: skip
            for k, (qid, p) in enumerate(zip(ids, prompts, strict=True))
        ]
        outcome, unfinished = await svc.handle(items)
        assert unfinished == [] and svc.held_count == 0
        assert outcome.routed + outcome.final_errors == len(ids)
        assert outcome.final_errors == 2  # the two beyond every model's context

        routed: dict[str, str] = {}
        copies = await read_topic(
            kafka_bootstrap, routes, since, lambda got: len(got) >= outcome.routed
        )
        assert len(copies) == outcome.routed
        for _, v in copies:
            rq = RoutedQuery.model_validate_json(v)
            assert rq.query.id not in routed, f"{rq.query.id} routed twice"
            iid = str(rq.decision.instance_id)
            routed[rq.query.id] = iid
            spec = cfg.model_of(iid)
            assert rq.query.prompt_tokens is not None
            cap = spec.output_cap_tokens(rq.query, rq.query.prompt_tokens)
            assert rq.query.prompt_tokens + cap <= spec.context_tokens()
        mine = [
            Result.model_validate_json(v)
            for _, v in await read_topic(
                kafka_bootstrap,
                topics.RESULTS,
                since,
                lambda got: sum(rid.encode() in v for _, v in got) >= 2,
            )
        ]
        errors = {r.query_id: r.error for r in mine if r.query_id.startswith(rid)}
        assert sorted(routed) + sorted(errors) == sorted(ids[:10]) + sorted(ids[10:])
        assert "prompt of 140000 tokens" in str(errors[ids[10]])
        assert "exceeds the context of every model" in str(errors[ids[11]])
        rejected = [
            Decision.model_validate_json(v)
            for _, v in await read_topic(
                kafka_bootstrap,
                topics.DECISIONS,
                since,
                lambda got: sum(rid.encode() in v and b"rejected" in v for _, v in got) >= 2,
            )
        ]
        assert {d.query_id for d in rejected if d.status == DecisionStatus.REJECTED} == set(
            ids[10:]
        )
    finally:
        await producer.stop()
        await store.close()
