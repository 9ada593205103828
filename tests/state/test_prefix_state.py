"""The prefix-cache model in real Redis keeps exactly what the simulator's model keeps
(``routing.prefix.LruPrefixModel``, the same LRU rules), in bounded memory."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import redis.asyncio as aioredis

from routing.prefix import LruPrefixModel
from state import Keys
from state.prefix import PrefixCacheState, PrefixTouch

pytestmark = pytest.mark.integration


async def test_redis_lru_equals_the_simulators_model(redis_url: str) -> None:
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        state = PrefixCacheState(client, Keys("t" + uuid.uuid4().hex[:10]))
        rng = np.random.default_rng(0)
        cap = {"a": 20 * 512.0, "b": 7 * 512.0}
        models = {iid: LruPrefixModel(c) for iid, c in cap.items()}
        pool = rng.integers(0, 2**63, 120).tolist()  # hashes repeat: touches refresh them
        for _ in range(30):
            touches = []
            for _ in range(int(rng.integers(1, 5))):
                iid = "a" if rng.random() < 0.6 else "b"
                start = int(rng.integers(0, 100))
                hashes = pool[start : start + int(rng.integers(1, 12))]
                touches.append(PrefixTouch(iid, hashes, 512.0, cap[iid]))
                models[iid].touch(np.asarray(hashes, dtype=np.uint64), 512.0)
            await state.touch_many(touches)
            got = await state.cached_many(["a", "b"])
            for iid, model in models.items():
                assert sorted(got[iid]) == model.cached().tolist()
                assert len(got[iid]) <= cap[iid] / 512.0  # bounded by the capacity
        # least recent first, as the model's eviction order
        order = (await state.cached_many(["a"]))["a"]
        assert order == list(models["a"]._blocks)
        with pytest.raises(ValueError, match="capacity_tokens must be > 0"):
            await state.touch_many([PrefixTouch("a", [1], 512.0, 0.0)])
    finally:
        await client.aclose()


async def test_a_reconciled_capacity_binds_every_later_touch(redis_url: str) -> None:
    """A worker's touch with ``set_capacity`` stores its capacity; the routers' touches,
    which carry the configured (larger) one, then evict down to the stored one."""
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        state = PrefixCacheState(client, Keys("t" + uuid.uuid4().hex[:10]))
        big = 8 * 512.0
        await state.touch_many([PrefixTouch("a", [1, 2, 3, 4, 5, 6], 512.0, big)])
        assert len((await state.cached_many(["a"]))["a"]) == 6  # configured: 8 blocks
        # the worker reconciled it to 3 blocks: its touch evicts at once ...
        evicted = await state.touch_many([PrefixTouch("a", [7], 512.0, 3 * 512.0, True)])
        assert evicted == [4] and (await state.cached_many(["a"]))["a"] == [2, 1, 7]
        # ... and a router's touch with the configured capacity keeps to the stored one
        await state.touch_many([PrefixTouch("a", [8, 9], 512.0, big)])
        assert (await state.cached_many(["a"]))["a"] == [7, 9, 8]
        # the worker grows it back: later touches may hold more again
        await state.touch_many([PrefixTouch("a", [10], 512.0, 5 * 512.0, True)])
        await state.touch_many([PrefixTouch("a", [11], 512.0, big)])
        assert (await state.cached_many(["a"]))["a"] == [7, 9, 8, 10, 11]
    finally:
        await client.aclose()


async def test_the_router_snapshot_carries_each_instances_prefix_model(redis_url: str) -> None:
    """What a router touches (``StateStore.prefix_touch_many``) comes back, sorted, in the
    next snapshot it takes (the same pipelined call), and on to the router's views."""
    from schemas import ClusterConfig
    from state import StateStore
    from streams.views import instance_views

    store = await StateStore.connect(redis_url, namespace="t" + uuid.uuid4().hex[:10])
    try:
        await store.heartbeat("a", "m", ttl_s=30, max_concurrency=4, now=100.0)
        evicted = await store.prefix_touch_many(
            [
                PrefixTouch("a", [30, 10, 20], 512.0, 3 * 512.0),
                PrefixTouch("b", [7], 512.0, 3 * 512.0),
                PrefixTouch("a", [40], 512.0, 3 * 512.0),  # over capacity: the tail 20 goes
            ]
        )
        assert evicted == [0, 0, 1]
        live, _ = await store.snapshots_and_step_times(["a", "b", "c"], ["m"], now=101.0)
        a, b, c = (live[i].prefix_hashes for i in "abc")
        assert a is not None and a.dtype == np.uint64 and a.tolist() == [10, 30, 40]
        assert b is not None and b.tolist() == [7] and not live["b"].alive
        assert c is None  # never touched
        assert (await store.snapshots(["a"], now=101.0))["a"].prefix_hashes.tolist() == [10, 30, 40]  # type: ignore[union-attr]
        model = {"name": "m", "input_usd_per_token": 1e-7, "output_usd_per_token": 1e-7}
        cluster = ClusterConfig.model_validate(
            {"models": [model], "instances": [{"id": "a", "model": "m"}, {"id": "b", "model": "m"}]}
        )
        views, excluded = instance_views(cluster, live, 101.0, 5.0)
        assert excluded == ["b"] and views[0].prefix_hashes is not None
        assert views[0].prefix_hashes.tolist() == [10, 30, 40]
    finally:
        await store.close()
