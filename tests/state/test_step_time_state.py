"""Online step-time records in Redis (``StateStore.step_time_publish``, read with the snapshot)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from schemas import StepTimeCoefficients
from state import Keys, StateStore

pytestmark = pytest.mark.integration

COEF = StepTimeCoefficients(
    c0_ms=9.5, c1_ms_per_token=0.06, c2_ms_per_ctx_token=0.0008, c3_ms_per_attn_unit=2e-6
)


async def test_publish_then_read_with_the_snapshot_in_one_round_trip(redis_url: str) -> None:
    store = await StateStore.connect(redis_url, namespace="st" + uuid.uuid4().hex[:8])
    try:
        model = "qwen3 {tiny}/wide"  # braces in a model name must not form a hash tag
        await store.heartbeat("inst-1", model, 30.0, 4)
        v1 = await store.step_time_publish(
            model, COEF, rows=40, instance_id="inst-1", ttl_s=60.0, fit_mape=0.08
        )
        v2 = await store.step_time_publish(
            model,
            COEF,
            rows=41,
            instance_id="inst-2",
            ttl_s=60.0,
            ttft_error=0.05,
            dispatch_ms=37.5,
        )
        assert (v1, v2) == (1, 2)
        live, recs = await store.snapshots_and_step_times(["inst-1"], [model, "other"], time.time())
        assert live["inst-1"].alive and set(recs) == {model}
        rec = recs[model]
        assert rec.coefficients == COEF and rec.version == 2 and rec.rows == 41
        assert rec.instance_id == "inst-2" and rec.ttft_error == 0.05
        assert rec.dispatch_ms == 37.5
        assert rec.fit_mape is None  # the last write had none: not a stale value
        # a write without a dispatch delay clears the last one (never a stale value)
        await store.step_time_publish(model, COEF, rows=42, instance_id="inst-1", ttl_s=60.0)
        _, recs = await store.snapshots_and_step_times(["inst-1"], [model], time.time())
        assert recs[model].dispatch_ms is None and recs[model].version == 3
        assert rec.age_s(time.time()) < 5.0
        # a malformed record is ignored (the configured coefficients apply), never a crash
        key = store.keys.step_time(model)
        await store._r.hset(key, "c1_ms_per_token", "-3")
        _, recs = await store.snapshots_and_step_times(["inst-1"], [model], time.time())
        assert recs == {}
        # the record lapses when nobody refits any more
        await store.step_time_publish(model, COEF, rows=1, instance_id="inst-1", ttl_s=0.2)
        await asyncio.sleep(0.4)
        _, recs = await store.snapshots_and_step_times([], [model], time.time())
        assert recs == {}
    finally:
        await store.close()


def test_step_time_key_names_the_model_without_a_stray_hash_tag() -> None:
    k = Keys("sy")
    assert k.step_time("llama@h100") == "sy:steptime:{llama@h100}"
    assert k.step_time("a{b}c") == "sy:steptime:{a%7Bb%7Dc}"
    with pytest.raises(ValueError, match="model name"):
        k.step_time("")
