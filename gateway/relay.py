"""The gateway's end of the relay: chunks of streaming queries from ``relay.<gateway id>``.

One consumer (no group: every partition assigned, read from the end as it was at start,
so it is positioned before the first streaming query is produced) hands each
``RelayChunk`` to the queue registered for its query id; chunks of ids nobody waits for
(another gateway sharing the id, or a client that went away) are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from pydantic import ValidationError

from schemas import RelayChunk

log = logging.getLogger(__name__)


class RelayReader:
    def __init__(self, kafka_kwargs: dict[str, Any], topic: str) -> None:
        self.kafka_kwargs = kafka_kwargs
        self.topic = topic
        self.malformed = 0
        self._queues: dict[str, asyncio.Queue[RelayChunk]] = {}
        self._consumer: Any = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, partitions: list[Any]) -> None:
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(
            **self.kafka_kwargs, enable_auto_commit=False, fetch_max_wait_ms=20
        )
        await consumer.start()
        try:
            consumer.assign(partitions)
            await consumer.seek_to_end(*partitions)
            for tp in partitions:
                await consumer.position(tp)
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer
        self._task = asyncio.create_task(self._read(), name=f"relay-{self.topic}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()

    def open(self, query_id: str) -> asyncio.Queue[RelayChunk]:
        queue: asyncio.Queue[RelayChunk] = asyncio.Queue()
        self._queues[query_id] = queue
        return queue

    def close(self, query_id: str) -> None:
        self._queues.pop(query_id, None)

    async def _read(self) -> None:
        while True:
            batch = await self._consumer.getmany(timeout_ms=200, max_records=2000)
            for records in batch.values():
                for rec in records:
                    self._deliver(rec.value)

    def _deliver(self, raw: bytes | None) -> None:
        try:
            chunk = RelayChunk.model_validate_json(raw or b"")
        except (ValidationError, ValueError):
            self.malformed += 1
            return
        queue = self._queues.get(chunk.query_id)
        if queue is not None:
            queue.put_nowait(chunk)
