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
