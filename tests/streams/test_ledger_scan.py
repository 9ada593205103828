"""streams.ledger_rebuild.kafka_scan against the real broker: it reads each topic from the
first record at or after its time (offsets_for_times), up to the end offsets it started with,
and skips topics that do not exist."""

from __future__ import annotations

import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer

from streams.ledger_rebuild import kafka_scan

pytestmark = pytest.mark.integration


async def test_scan_is_bounded_by_time_and_skips_missing_topics(kafka_bootstrap: str) -> None:
    kw = {"bootstrap_servers": kafka_bootstrap}
    a, b, missing = (f"scan-{x}-{uuid.uuid4().hex[:8]}" for x in "abm")
    cutoff = time.time() - 60
    producer = AIOKafkaProducer(**kw, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for i in range(10):  # an earlier period: stamped two hours back
            await producer.send_and_wait(a, b"old", timestamp_ms=int((cutoff - 7200 + i) * 1000))
        for i in range(15):
            await producer.send_and_wait(a, f"new{i}".encode())
        for i in range(4):
            await producer.send_and_wait(b, f"b{i}".encode())
    finally:
        await producer.stop()
    seen: list[tuple[str, bytes | None]] = []
    n = await kafka_scan(kw, timeout_s=60)(
        {a: cutoff, b: cutoff, missing: cutoff}, lambda t, v: seen.append((t, v))
    )
    assert n == 19 == len(seen)
    assert sorted(v for t, v in seen if t == a) == sorted(f"new{i}".encode() for i in range(15))
    assert sorted(v for t, v in seen if t == b) == [f"b{i}".encode() for i in range(4)]
    # nothing since a later time: nothing read
    assert await kafka_scan(kw)({a: time.time() + 3600}, lambda t, v: seen.append((t, v))) == 0
