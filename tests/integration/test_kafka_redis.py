"""The real broker and the real Redis: ordered idempotent produce/consume, Lua round trip."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

pytestmark = pytest.mark.integration

N_MESSAGES = 10_000
PARTITIONS = 4


async def test_produce_consume_10k_in_order_per_partition(kafka_bootstrap: str) -> None:
    topic = f"it-order-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(topic, num_partitions=PARTITIONS, replication_factor=1)]
        )
    finally:
        await admin.close()

    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True, linger_ms=5
    )
    await producer.start()
    sent: dict[int, list[int]] = {p: [] for p in range(PARTITIONS)}
    try:
        futures = []
        for i in range(N_MESSAGES):
            part = i % PARTITIONS
            sent[part].append(i)
            futures.append(await producer.send(topic, value=str(i).encode(), partition=part))
        metadata = await asyncio.gather(*futures)
    finally:
        await producer.stop()
    assert all(m.topic == topic for m in metadata)

    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    got: dict[int, list[int]] = {p: [] for p in range(PARTITIONS)}
    try:
        consumer.assign([TopicPartition(topic, p) for p in range(PARTITIONS)])
        await consumer.seek_to_beginning()
        total = 0
        async with asyncio.timeout(60):
            while total < N_MESSAGES:
                batch = await consumer.getmany(timeout_ms=1000, max_records=5000)
                for tp, records in batch.items():
                    got[tp.partition].extend(int(r.value) for r in records)
                    total += len(records)
    finally:
        await consumer.stop()
    assert got == sent  # every message, none twice, in order within each partition


async def test_redis_round_trip_and_lua(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    key = f"it:{uuid.uuid4().hex}"
    try:
        await client.set(key, "41")
        assert await client.get(key) == b"41"
        incr_if_below = client.register_script(
            "local v = tonumber(redis.call('GET', KEYS[1]) or '0')\n"
            "if v + tonumber(ARGV[1]) > tonumber(ARGV[2]) then return -1 end\n"
            "return redis.call('INCRBY', KEYS[1], ARGV[1])"
        )
        assert await incr_if_below(keys=[key], args=[1, 42]) == 42
        assert await incr_if_below(keys=[key], args=[1, 42]) == -1
        assert await client.get(key) == b"42"
    finally:
        await client.delete(key)
        await client.aclose()


async def test_kafka_ready_works_from_async_code(kafka_bootstrap: str) -> None:
    """The launcher's readiness probe is called from benchmarks running in an event loop."""
    from switchyard import services

    assert services.kafka_ready(kafka_bootstrap)
    assert not services.kafka_ready(f"127.0.0.1:{services.free_port()}", timeout_s=1.0)


@pytest.mark.parametrize("service", ["kafka", "redis"])
def test_a_failed_start_leaves_nothing_running(
    service: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A readiness probe that raises (once: asyncio.run inside a running loop) must not leave
    the process it was probing behind: the launcher stops what it started, then re-raises."""
    from switchyard import services

    def broken(*_a: object, **_kw: object) -> bool:
        raise RuntimeError("probe broke")

    monkeypatch.setattr(services, "kafka_ready" if service == "kafka" else "redis_version", broken)
    up = services.kafka_up if service == "kafka" else services.redis_up
    with pytest.raises(RuntimeError, match="probe broke"):
        up(home=tmp_path, port=services.free_port())
    assert services.load_records(tmp_path) == {}
    pids = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]
    mine = []
    for pid in pids:
        proc = Path("/proc") / str(pid)
        try:  # the command line names the data dir until redis-server retitles itself; cwd stays
            cmd, cwd = proc.joinpath("cmdline").read_bytes(), str(proc.joinpath("cwd").resolve())
        except OSError:
            continue
        if str(tmp_path).encode() in cmd or cwd.startswith(str(tmp_path)):
            mine.append(pid)
    assert not mine, f"processes left running from {tmp_path}: {mine}"
