"""SwitchyardClient on the real broker: queries produced keyed by id, results matched by id,
duplicates and malformed results ignored, timeouts naming the id, reading from a timestamp."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import Query, Result
from switchyard.client import SwitchyardClient
from wiring import kafka_admin, topics

pytestmark = pytest.mark.integration


def _result(qid: str, text: str = "ok") -> bytes:
    r = Result(
        query_id=qid, tenant="t", instance_id="i", model="m", text=text, finished_at=time.time()
    )
    return r.model_dump_json().encode()


async def test_submit_and_collect_results(kafka_bootstrap: str) -> None:
    tag = uuid.uuid4().hex[:8]
    queries = [Query(id=f"c-{tag}-{i}", prompt=f"hello {i}", max_tokens=4) for i in range(50)]
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    async with SwitchyardClient(kafka_bootstrap) as client:

        async def answer() -> None:
            # a stand-in for the workers: answer every query (one twice), plus one malformed result
            consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
            await consumer.start()
            try:
                tps = await kafka_admin.partitions(
                    {"bootstrap_servers": kafka_bootstrap}, [topics.QUERIES]
                )
                consumer.assign(tps)
                await consumer.seek_to_beginning(*tps)
                seen: set[str] = set()
                while len(seen) < len(queries):
                    batch = await consumer.getmany(timeout_ms=200)
                    for recs in batch.values():
                        for rec in recs:
                            try:
                                q = Query.model_validate_json(rec.value)
                            except ValueError:
                                continue  # other tests' bad messages share the topic
                            if q.id.startswith(f"c-{tag}-") and q.id not in seen:
                                assert rec.key == q.id.encode()
                                seen.add(q.id)
                                # keyed by query id, as workers publish them: copies of one
                                # id share a partition, so the first answer is read first
                                await producer.send(
                                    topics.RESULTS,
                                    _result(q.id, f"answer {q.id}"),
                                    key=q.id.encode(),
                                )
                await producer.send(topics.RESULTS, b"{not a result")
                await producer.send_and_wait(
                    topics.RESULTS,
                    _result(queries[0].id, "second copy"),
                    key=queries[0].id.encode(),
                )
            finally:
                await consumer.stop()

        responder = asyncio.create_task(answer())
        results = await client.run_many(queries, timeout_s=30)
        await responder
        assert set(results) == {q.id for q in queries}
        assert all(results[q.id].text == f"answer {q.id}" for q in queries)
        await asyncio.sleep(0.5)
        assert client.malformed >= 1 and client.duplicates >= 1
        assert (await client.result(queries[0].id, timeout_s=1)).text == f"answer {queries[0].id}"
        with pytest.raises(
            TimeoutError, match=f"no result for query 'c-{tag}-missing' within 0.2 s"
        ):
            await client.result(f"c-{tag}-missing", timeout_s=0.2)
    await producer.stop()

    # a later client reads earlier results from a timestamp (e.g. a resumed batch job)
    async with SwitchyardClient(kafka_bootstrap, from_timestamp_s=time.time() - 120) as late:
        assert (await late.result(queries[7].id, timeout_s=20)).text == f"answer {queries[7].id}"


async def test_result_arriving_before_the_wait_is_kept(kafka_bootstrap: str) -> None:
    qid = f"early-{uuid.uuid4().hex[:8]}"
    async with SwitchyardClient(kafka_bootstrap) as client:
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(topics.RESULTS, _result(qid))
        finally:
            await producer.stop()
        async with asyncio.timeout(20):
            while client.received() == 0 or qid not in client._results:
                await asyncio.sleep(0.05)
        assert (await client.result(qid, timeout_s=0.01)).query_id == qid
