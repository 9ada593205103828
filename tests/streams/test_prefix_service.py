"""The router service keeps each instance's prefix-cache model in Redis (issue 14, part 3):
a routed query's whole prefix blocks are touched on the instance it went to (one pipelined
call per window), and the snapshot the next window takes reads them back — into the
decision: a turn whose prefix only one of two twin instances holds goes to that one.

``RouterService`` in-process on real Redis and real Kafka.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest

from routing.policies import RouterContext, make_router
from schemas import ClusterConfig, RoutedQuery
from state import StateStore, StateUnavailable, period_id
from state.prefix import PrefixTouch
from streams.app import BatchSink
from streams.service import Inbound, RouterConfig, RouterService
from tests.routing.test_long_context import FakeQuality
from tests.streams.test_long_context_service import service_cluster, service_io
from tests.streams.test_service import read_topic

pytestmark = pytest.mark.integration


async def _live_service(
    cfg: ClusterConfig, store: StateStore, producer: object, state: object = None
) -> RouterService:
    """Every instance of ``cfg`` heart-beating in ``store``, and a ``batch-ilp-sfs`` service
    with 10-ms windows over ``state`` (default: the store itself)."""
    for inst in cfg.instances:
        spec = cfg.model(inst.model)
        await store.heartbeat(inst.id, spec.name, 60.0, spec.max_concurrency)
    router = make_router("batch-ilp-sfs", RouterContext.build(cfg, FakeQuality()))
    return RouterService(cfg, router, state or store, BatchSink(producer),  # type: ignore[arg-type]
                         RouterConfig(window_s=0.01), period_id=period_id)  # fmt: skip


async def test_routed_prefix_blocks_are_touched_and_read_back(
    kafka_bootstrap: str, redis_url: str
) -> None:
    rid = "px" + uuid.uuid4().hex[:6]
    cfg = service_cluster(rid)
    store = await StateStore.connect(redis_url, namespace=f"t{rid}")
    producer, routes = await service_io(kafka_bootstrap, cfg)
    try:
        svc = await _live_service(cfg, store, producer)
        ids = [i.id for i in cfg.instances]
        turns = [[11, 12, 13, 14], [11, 12, 13, 14, 15, 16]]  # the second extends the first
        where: list[str] = []
        for t, hashes in enumerate(turns):
            since = int(time.time() * 1000)
            body = {"id": f"{rid}-t{t}", "prompt": "a conversation so far",
                    "prompt_tokens": 512 * len(hashes) + 100, "prefix_hashes": hashes,
                    "prefix_block_tokens": 512}  # fmt: skip
            outcome, unfinished = await svc.handle(
                [Inbound(json.dumps(body).encode(), "queries", 0, t)]
            )
            assert outcome.routed == 1 and unfinished == []
            copies = await read_topic(kafka_bootstrap, routes, since, lambda got: len(got) >= 1)
            mine = [RoutedQuery.model_validate_json(v) for _, v in copies]
            this = [rq.decision for rq in mine if rq.query.id == f"{rid}-t{t}"]
            where += [str(d.instance_id) for d in this]
            # what the prefix model held there when it was routed (the worker reconciles it
            # with the engine's counters): turn 1 finds turn 0's 4 blocks only where it went
            again = t == 1 and where[0] == where[-1]
            assert [d.predicted_cached_tokens for d in this] == [4 * 512 if again else 0]
            # the turn finished (what its worker reports): the next decision weighs the
            # prefix model alone, not a resident whose progress the snapshot ages by the clock
            await store.resident_done(where[-1], f"{rid}-t{t}")
            live = await store.snapshots(ids, time.time())
            held = {i: live[i].prefix_hashes for i in ids}
            expect: dict[str, set[int]] = {}
            for k, iid in enumerate(where):
                expect.setdefault(iid, set()).update(turns[k])
            for iid in ids:
                got = held[iid]
                assert (set(got.tolist()) if got is not None else set()) == expect.get(iid, set())
        # a third conversation's prefix cached on the twin of where the second turn went; its
        # next turn's TTFT SLO (0.8 x the uncached prefill, > 2.4 x the cached one) can be met on
        # that model only with the prefix cached, so the prefix model decides: the twin
        first = where[1]
        twin = next(i.id for i in cfg.instances
                    if i.model == cfg.instance(first).model and i.id != first)  # fmt: skip
        other = [21, 22, 23, 24, 25]
        spec = cfg.model_of(twin)
        cap = spec.scheduler.kv_blocks * spec.scheduler.block_size_tokens
        await store.prefix_touch_many([PrefixTouch(twin, other, 512.0, cap)])
        prompt = 512 * 6 + 100
        step = RouterContext.build(cfg, FakeQuality()).step_time[spec.name]
        cached_ms = float(step.prefill_ms(prompt, 512 * len(other)))
        full_ms = float(step.prefill_ms(prompt))
        assert full_ms > 3 * cached_ms
        for inst in cfg.instances:  # live workers heart-beat twice a second: fresh views
            m = cfg.model(inst.model)
            await store.heartbeat(inst.id, m.name, 60.0, m.max_concurrency)
        since = int(time.time() * 1000)
        body = {"id": f"{rid}-t2", "prompt": "another conversation", "prompt_tokens": prompt,
                "prefix_hashes": [*other, 26], "prefix_block_tokens": 512,
                "ttft_slo_ms": 0.8 * full_ms}  # fmt: skip
        outcome, _ = await svc.handle([Inbound(json.dumps(body).encode(), "queries", 0, 2)])
        assert outcome.routed == 1
        copies = await read_topic(kafka_bootstrap, routes, since, lambda got: len(got) >= 1)
        decided = [RoutedQuery.model_validate_json(v).decision for _, v in copies
                   if RoutedQuery.model_validate_json(v).query.id == f"{rid}-t2"]  # fmt: skip
        assert [str(d.instance_id) for d in decided] == [twin]
        assert decided[0].predicted_cached_tokens == 512 * len(other)
    finally:
        await producer.stop()
        await store.close()


class _TouchesFail:
    """A store whose prefix touches find Redis away (everything else goes through)."""

    def __init__(self, inner: StateStore) -> None:
        self._inner = inner
        self.tries = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def prefix_touch_many(self, touches: object) -> list[int]:
        self.tries += 1
        raise StateUnavailable("injected: Redis away for the prefix touches")


async def test_prefix_touches_go_after_the_produce_and_their_failure_loses_nothing(
    kafka_bootstrap: str, redis_url: str
) -> None:
    """The touches go with the routed marks, after the produce: a Redis that fails them
    leaves the query routed once and marked routed (a redelivery is dropped), and the
    window finished; the model only misses those blocks until the worker touches them."""
    rid = "pf" + uuid.uuid4().hex[:6]
    cfg = service_cluster(rid)
    store = await StateStore.connect(redis_url, namespace=f"t{rid}")
    producer, routes = await service_io(kafka_bootstrap, cfg)
    try:
        failing = _TouchesFail(store)
        svc = await _live_service(cfg, store, producer, failing)
        since = int(time.time() * 1000)
        raw = json.dumps({"id": f"{rid}-q", "prompt": "a conversation so far",
                          "prompt_tokens": 512 * 4 + 100, "prefix_hashes": [31, 32, 33, 34],
                          "prefix_block_tokens": 512}).encode()  # fmt: skip
        outcome, unfinished = await svc.handle([Inbound(raw, "queries", 0, 0)])
        assert outcome.routed == 1 and unfinished == [] and failing.tries == 1
        # a redelivery of the same record: already routed, dropped (the marks went through)
        again, _ = await svc.handle([Inbound(raw, "queries", 0, 0)])
        assert again.routed == 0 and again.dropped_duplicates == 1
        copies = await read_topic(kafka_bootstrap, routes, since, lambda got: len(got) >= 1)
        ids = [RoutedQuery.model_validate_json(v).query.id for _, v in copies]
        assert ids.count(f"{rid}-q") == 1
        live = await store.snapshots([i.id for i in cfg.instances], time.time())
        assert all(s.prefix_hashes is None or s.prefix_hashes.size == 0 for s in live.values())
    finally:
        await producer.stop()
        await store.close()
