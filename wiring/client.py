"""Python client: produce queries to ``queries`` and await their ``Result`` by id.

    async with SwitchyardClient("127.0.0.1:19092") as client:
        await client.submit(Query(id="q1", prompt="Hello", max_tokens=16))
        result = await client.result("q1", timeout_s=30)
        results = await client.run_many(queries, timeout_s=120)  # {id: Result}

The client reads ``results`` from every partition, starting at the end of the topic as it
was when the client started (``from_timestamp_s`` reads earlier results, e.g. to resume a
batch job). It is positioned before the first query is produced, so no result of its own
queries can be missed. Results are matched by query id; a repeated result for an id
(the service is at-least-once) is counted in ``duplicates`` and otherwise ignored.
Queries are keyed by id, so every copy of one id lands on the same partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from pydantic import ValidationError

from schemas import Query, Result
from wiring import kafka_admin, topics
from wiring.settings import Settings

log = logging.getLogger(__name__)


class SwitchyardClient:
    def __init__(
        self,
        bootstrap: str | None = None,
        *,
        settings: Settings | None = None,
        client_id: str = "switchyard-client",
        from_timestamp_s: float | None = None,
        buffer_results: int = 200_000,
    ) -> None:
        base = settings or Settings.from_env()
        if bootstrap:
            # re-validate with the given address (secrets are carried as they are)
            data = {k: getattr(base, k) for k in type(base).model_fields}
            data["kafka"] = bootstrap
            base = Settings.model_validate(data)
        self.settings = base
        self.client_id = client_id
        self.from_timestamp_s = from_timestamp_s
        self.buffer_results = buffer_results
        self.duplicates = 0
        self.malformed = 0
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._reader: asyncio.Task[None] | None = None
        self._results: OrderedDict[str, Result] = OrderedDict()
        self._waiters: dict[str, list[asyncio.Future[Result]]] = {}
        self._start_lock = asyncio.Lock()
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> SwitchyardClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect, and position the results reader before anything is produced. Idempotent."""
        async with self._start_lock:
            if self._producer is not None:
                return
            kw = self.settings.kafka_kwargs(client_id=self.client_id)
            await kafka_admin.ensure_topics(
                kw, [topics.QUERIES, topics.RESULTS], **self.settings.topic_kwargs()
            )
            consumer = AIOKafkaConsumer(
                **kw, enable_auto_commit=False, isolation_level="read_committed"
            )
            await consumer.start()
            try:
                tps = await kafka_admin.partitions(kw, [topics.RESULTS])
                consumer.assign(tps)
                if self.from_timestamp_s is not None:
                    found = await consumer.offsets_for_times(
                        {tp: int(self.from_timestamp_s * 1000) for tp in tps}
                    )
                    for tp in tps:
                        ot = found.get(tp)
                        if ot is None:
                            await consumer.seek_to_end(tp)
                        else:
                            consumer.seek(tp, ot.offset)
                else:
                    await consumer.seek_to_end(*tps)
                for tp in tps:
                    await consumer.position(tp)  # resolve now, not lazily after our first produce
            except BaseException:
                await consumer.stop()
                raise
            producer = AIOKafkaProducer(**kw, acks="all", enable_idempotence=True, linger_ms=5)
            await producer.start()
            self._consumer = consumer
            self._producer = producer
            self._reader = asyncio.create_task(self._read(), name="switchyard-client-results")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        for fut_list in self._waiters.values():
            for fut in fut_list:
                if not fut.done():
                    fut.cancel()
        self._waiters.clear()
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None
        if self._producer is not None:
            await self._producer.stop()
            self._producer = None

    # ------------------------------------------------------------------ queries

    async def submit(self, query: Query) -> None:
        """Produce one query; returns once the broker acknowledged it (acks=all)."""
        await self.start()
        assert self._producer is not None
        await self._producer.send_and_wait(
            topics.QUERIES, value=_body(query), key=query.id.encode()
        )

    async def submit_many(self, queries: Iterable[Query]) -> int:
        """Produce many queries, pipelined; returns how many, once all are acknowledged."""
        await self.start()
        assert self._producer is not None
        futures = [
            await self._producer.send(topics.QUERIES, value=_body(q), key=q.id.encode())
            for q in queries
        ]
        await asyncio.gather(*futures)
        return len(futures)

    async def result(self, query_id: str, timeout_s: float) -> Result:
        """The first result for ``query_id``; ``TimeoutError`` naming the id when none arrives."""
        await self.start()
        if query_id in self._results:
            return self._results[query_id]
        self._raise_if_failed()
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(query_id, []).append(fut)
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise TimeoutError(f"no result for query {query_id!r} within {timeout_s} s") from None
        finally:
            waiters = self._waiters.get(query_id)
            if waiters is not None:
                with contextlib.suppress(ValueError):
                    waiters.remove(fut)
                if not waiters:
                    self._waiters.pop(query_id, None)

    async def run_many(self, queries: Sequence[Query], timeout_s: float) -> dict[str, Result]:
        """Submit ``queries`` and wait up to ``timeout_s`` for all their results.

        Returns ``{query id: Result}`` for the results that arrived in time; a missing id
        means no result within the timeout (the caller decides whether that is an error).
        """
        ids = list(dict.fromkeys(q.id for q in queries))
        await self.submit_many(queries)
        out: dict[str, Result] = {}

        async def one(qid: str) -> None:
            with contextlib.suppress(TimeoutError):
                out[qid] = await self.result(qid, timeout_s)

        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pending = [qid for qid in ids if qid not in self._results]
        for qid in ids:
            if qid in self._results:
                out[qid] = self._results[qid]
        if pending:
            await asyncio.gather(*(one(qid) for qid in pending))
        if loop.time() > deadline + 1.0:
            log.debug("run_many overran its timeout by %.1f s", loop.time() - deadline)
        return {qid: out[qid] for qid in ids if qid in out}

    def get(self, query_id: str) -> Result | None:
        """The result for ``query_id`` if it has arrived (never waits)."""
        return self._results.get(query_id)

    def received(self) -> int:
        return len(self._results)

    # ------------------------------------------------------------------ the reader

    async def _read(self) -> None:
        assert self._consumer is not None
        try:
            while True:
                batch = await self._consumer.getmany(timeout_ms=200, max_records=5000)
                for records in batch.values():
                    for rec in records:
                        self._deliver(rec.value)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._failure = exc
            log.exception("results reader failed")
            for fut_list in self._waiters.values():
                for fut in fut_list:
                    if not fut.done():
                        fut.set_exception(RuntimeError(f"results reader failed: {exc!r}"))

    def _deliver(self, raw: Any) -> None:
        try:
            result = Result.model_validate_json(raw)
        except (ValidationError, ValueError, TypeError):
            self.malformed += 1
            return
        qid = result.query_id
        if qid in self._results:
            self.duplicates += 1
            return
        self._results[qid] = result
        if len(self._results) > self.buffer_results:
            self._results.popitem(last=False)
        for fut in self._waiters.pop(qid, []):
            if not fut.done():
                fut.set_result(result)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"results reader failed: {self._failure!r}")


def _body(query: Query) -> bytes:
    return query.model_dump_json(exclude_none=True).encode()
