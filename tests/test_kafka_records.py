"""Records compressed by real producers with every Kafka codec decode; an undecodable batch
becomes one marked record and the consumer moves past it (``wiring.kafka_records``).

On the real broker, with the Kafka console producer and kcat. "Undecodable" is made real by
taking the codec library away from this process (``aiokafka.codec.cramjam = None``), which
is exactly the state that crash-looped the router in issue 16.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import aiokafka.codec
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from tests.real_producers import CODECS, console_produce, kcat_produce
from wiring import kafka_admin
from wiring.kafka_records import UNDECODABLE_HEADER, install, undecodable_reason

pytestmark = pytest.mark.integration


def _records(tag: str, n: int) -> list[tuple[bytes, bytes]]:
    # values that compress, so librdkafka really compresses them
    return [(f"{tag}-{i}".encode(), f"{tag} {i} ".encode() + b"word " * 60) for i in range(n)]


async def _read_all(bootstrap: str, topic: str, group: str | None = None) -> list[Any]:
    install()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        if group is None:
            await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        out: list[Any] = []
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=2000)
            out.extend(batch.get(tp, []))
        if group is not None:
            await consumer.commit()
        return out
    finally:
        await consumer.stop()


async def test_every_codec_from_both_real_producers_is_read(kafka_bootstrap: str) -> None:
    topic = f"codecs-{uuid.uuid4().hex[:8]}"
    await kafka_admin.ensure_topics({"bootstrap_servers": kafka_bootstrap}, [topic])
    sent: list[tuple[bytes, bytes]] = []
    for codec in CODECS:
        for tool, produce in (("console", console_produce), ("kcat", kcat_produce)):
            recs = _records(f"{tool}-{codec}", 12)
            produce(kafka_bootstrap, topic, recs, codec)
            sent.extend(recs)
    got = await _read_all(kafka_bootstrap, topic)
    assert [(r.key, r.value) for r in got] == sent
    assert not [r for r in got if undecodable_reason(r.headers, r.value)]


async def test_batches_really_are_compressed_and_undecodable_ones_are_marked(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the codec library each compressed batch is one mark naming its codec and
    offsets; plain records around it are read; a group commits past it (no loop)."""
    topic = f"codecs-{uuid.uuid4().hex[:8]}"
    await kafka_admin.ensure_topics({"bootstrap_servers": kafka_bootstrap}, [topic])
    before, after = _records("plain-a", 3), _records("plain-b", 3)
    console_produce(kafka_bootstrap, topic, before, "none")
    for codec in ("lz4", "snappy", "zstd"):
        console_produce(kafka_bootstrap, topic, _records(f"console-{codec}", 5), codec)
        kcat_produce(kafka_bootstrap, topic, _records(f"kcat-{codec}", 5), codec)
    console_produce(kafka_bootstrap, topic, after, "none")

    monkeypatch.setattr(aiokafka.codec, "cramjam", None)
    group = f"g-{topic}"
    got = await _read_all(kafka_bootstrap, topic, group)
    plain = [(r.key, r.value) for r in got if r.value is not None]
    marks = [(r.offset, undecodable_reason(r.headers, r.value)) for r in got if r.value is None]
    assert plain == before + after
    # every compressed record is covered by exactly one mark's span, in order, codec named
    covered: list[int] = []
    codecs: list[str] = []
    for offset, reason in marks:
        assert reason is not None and "UnsupportedCodecError" in reason, reason
        m = re.search(rf"offsets (\d+)-(\d+) of {topic}\[0\] \(codec (\w+)\)", reason)
        assert m is not None, reason
        first, last = int(m[1]), int(m[2])
        assert last == offset  # the mark stands at the batch's last offset
        covered.extend(range(first, last + 1))
        codecs.append(m[3])
    assert covered == list(range(len(before), len(before) + 30))
    assert list(dict.fromkeys(codecs)) == ["lz4", "snappy", "zstd"]
    # the group's committed offset passed every batch: a second read finds nothing left
    assert await _read_all(kafka_bootstrap, topic, group) == []


def test_only_a_record_without_value_carries_the_mark() -> None:
    headers = [(UNDECODABLE_HEADER, b"batch at 3-9 could not be decoded")]
    assert undecodable_reason(headers, None) == "batch at 3-9 could not be decoded"
    assert undecodable_reason(headers, b"{}") is None  # a forged header on a body: validated
    assert undecodable_reason([], None) is None
    assert undecodable_reason(None, None) is None
