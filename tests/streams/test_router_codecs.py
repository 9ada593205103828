"""The real router process routes queries compressed with every Kafka codec by real producers
(the Kafka console producer, kcat); a router without the codec libraries (the state that
crash-looped it in issue 16) dead-letters each undecodable batch with its offsets (stage
``decode``) and routes what follows."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer

from schemas import DeadLetter, RoutedQuery
from tests.real_producers import CODECS, console_produce, kcat_produce
from tests.streams.test_router_app import MAX_CONCURRENCY, end_offsets, rig
from wiring import topics

pytestmark = pytest.mark.integration

NO_CODECS = "import aiokafka.codec as c; c.cramjam = None; from switchyard.cli import app; app()"


def _queries(rid: str, tag: str, n: int) -> list[tuple[bytes, bytes]]:
    out = []
    for i in range(n):
        qid = f"{rid}-{tag}-{i}"
        body = {"id": qid, "prompt": f"question {i} " + "word " * 60, "ttft_slo_ms": 5000}
        out.append((qid.encode(), json.dumps(body).encode()))
    return out


async def _run(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path, *, codecs_installed: bool
) -> tuple[Counter[str], list[DeadLetter], dict[str, list[tuple[bytes, bytes]]]]:
    rid, cluster, procs, store = await rig("c", kafka_bootstrap, redis_url, tmp_path)
    for inst in cluster.instances:
        await store.heartbeat(inst.id, inst.model, 600.0, MAX_CONCURRENCY * 100)
    args = ["router", "--cluster", str(tmp_path / "cluster.json"), "--policy",
            "tests.streams.fake_router:factory", "--from", "latest", "--app-id", f"router-{rid}",
            "--rescue-grace-s", "0"]  # fmt: skip
    if codecs_installed:
        router = procs.switchyard("router", *args)
    else:
        router = procs.start("router", [sys.executable, "-c", NO_CODECS, *args])
    try:
        await asyncio.to_thread(procs.wait_for_line, router, "assigned queries partitions", 90)
        watched = [topics.route(i.id) for i in cluster.instances] + [topics.DEAD_LETTERS]
        start = await end_offsets(kafka_bootstrap, watched)
        sent: dict[str, list[tuple[bytes, bytes]]] = {}
        sent["plain-a"] = _queries(rid, "plain-a", 5)
        console_produce(kafka_bootstrap, topics.QUERIES, sent["plain-a"], "none")
        for codec in CODECS:
            for tool, produce in (("console", console_produce), ("kcat", kcat_produce)):
                tag = f"{tool}-{codec}"
                sent[tag] = _queries(rid, tag, 10)
                await asyncio.to_thread(produce, kafka_bootstrap, topics.QUERIES, sent[tag], codec)
        sent["plain-b"] = _queries(rid, "plain-b", 5)
        console_produce(kafka_bootstrap, topics.QUERIES, sent["plain-b"], "none")
        expect_routed = {
            k.decode()
            for tag, recs in sent.items()
            if codecs_installed or tag.startswith("plain") or tag.endswith("gzip")
            for k, _ in recs
        }
        routed: Counter[str] = Counter()
        letters: list[DeadLetter] = []
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            consumer.assign(list(start))
            for tp, off in start.items():
                consumer.seek(tp, off)
            async with asyncio.timeout(60):
                while not expect_routed <= set(routed) or (not codecs_installed and len(letters) < 6):
                    batch = await consumer.getmany(timeout_ms=500)
                    for tp, records in batch.items():
                        for r in records:
                            if tp.topic == topics.DEAD_LETTERS:
                                letter = DeadLetter.model_validate_json(r.value)
                                if letter.stage == "decode" and letter.topic == topics.QUERIES:
                                    letters.append(letter)
                            else:
                                rq = RoutedQuery.model_validate_json(r.value)
                                if rq.query.id.startswith(rid):
                                    routed[rq.query.id] += 1
            await asyncio.sleep(1.0)  # anything routed late (or twice) shows now
            batch = await consumer.getmany(timeout_ms=1000)
            for tp, records in batch.items():
                for r in records:
                    if tp.topic != topics.DEAD_LETTERS:
                        routed[RoutedQuery.model_validate_json(r.value).query.id] += 1
        finally:
            await consumer.stop()
        assert router.alive(), router.tail()
        assert set(routed) == expect_routed, sorted(set(routed) ^ expect_routed)[:5]
        assert all(n == 1 for n in routed.values())
        return routed, letters, sent
    finally:
        procs.stop_all()
        await store.close()


async def test_router_routes_every_codec_of_both_real_producers(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    routed, _, sent = await _run(kafka_bootstrap, redis_url, tmp_path, codecs_installed=True)
    assert len(routed) == sum(len(v) for v in sent.values()) == 90


async def test_router_without_codec_libraries_dead_letters_batches_and_moves_on(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    _, letters, sent = await _run(kafka_bootstrap, redis_url, tmp_path, codecs_installed=False)
    # each lz4/snappy/zstd batch of both producers: a decode dead letter naming its codec
    # and offsets; the records after it (and gzip, which needs no library) were routed
    codecs = {c for letter in letters for c in ("lz4", "snappy", "zstd") if f"codec {c}" in letter.reason}
    assert codecs == {"lz4", "snappy", "zstd"}, [letter.reason for letter in letters]
    assert all("could not be decoded" in letter.reason for letter in letters)
    assert all(f"-{letter.offset} of {topics.QUERIES}[" in letter.reason for letter in letters)
    assert len(letters) >= 6 and sum(len(v) for v in sent.values()) == 90
