"""The router's read path: ``queries`` records handed to the window in batches, not as events.

Faust delivers a record to an agent through its conductor, a channel queue and the stream
(``take_events``): per record one ``Event``, two asyncio tasks (``Service.wait_first`` in
``Consumer._drain_messages``), a queue put and get, and the stream's per-event bookkeeping.
Measured end to end that was ~40% of a router's CPU, about as much as the window code and
the decision together (docs/benchmarks/service.md, "Hot path").

``BatchDrain`` is the same drain loop with one change: records of the feed's topic go to a
``WindowFeed`` a whole fetch at a time (a list append per record), and the agent takes its
windows from there. What Faust's loop does per record stays: the read-offset check (a
record below the read offset is dropped), gap bookkeeping for acknowledgements, the
periodic commit, and ``track_message`` (the record counts as handed out and unacknowledged
until the router acknowledges it, so Faust's rebalance and shutdown see it and
``OrderedAcker.abandon_all`` can give it up). Records of any other topic go Faust's usual
way. Committing is unchanged: Faust's consumer commits the highest contiguous acknowledged
offset, and a record is acknowledged only by ``FeedHandle.ack`` once its window was
produced and acknowledged by Kafka (``streams.app``).

Two things keep the fetches cheap without adding latency. The router's consumer fetches
patiently (``fetch_min_bytes``, ``fetch_wait_s``; Faust asks for 1 byte, so at a steady
rate every few records cost the broker and the router a fetch request each). And a window
is timed from when its oldest record was produced (its Kafka timestamp), not from when it
reached the feed, so the fetch wait counts toward the window's ``within_s`` (``credit_s``
at most, the router's fetch wait: a producer whose clock is behind, or a backlog, does not
shrink windows; batching a backlog in whole windows is what keeps a router's throughput).
docs/benchmarks/service.md, "Added latency at half the rate", has the measurements.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, cast

from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.drivers.aiokafka import Consumer as FaustKafkaConsumer


class FeedHandle:
    """``Inbound.handle`` of a record read by ``BatchDrain``: what ``OrderedAcker`` needs of
    a Faust event (``message`` and ``ack``) without building one."""

    __slots__ = ("consumer", "message")

    def __init__(self, message: Any, consumer: Any) -> None:
        self.message = message
        self.consumer = consumer

    def ack(self) -> bool:
        """Drop the reference the feed took; the last one acknowledges the offset to Faust."""
        return bool(self.message.ack(self.consumer))


class WindowFeed:
    """Records of one topic waiting for the router's next window (oldest first).

    ``take(n, within_s)`` returns up to ``n`` records once ``n`` are here or ``within_s``
    passed since the oldest waiting record was produced (its Kafka timestamp; how long it
    took to arrive counts for ``credit_s`` at most). A record that waited through the
    previous window does not wait a whole window again. ``BatchDrain`` stops fetching while
    ``capacity`` records wait (backpressure, as a full stream buffer did), and fetches
    ``fetch_min_bytes`` or what came in ``fetch_wait_s``, whichever is first."""

    def __init__(
        self,
        topic: str,
        capacity: int,
        *,
        credit_s: float = 0.0,
        fetch_min_bytes: int = 1,
        fetch_wait_s: float = 0.5,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"WindowFeed capacity must be >= 1, got {capacity}")
        if credit_s < 0 or fetch_wait_s < 0 or fetch_min_bytes < 1:
            raise ValueError(
                f"WindowFeed needs credit_s >= 0, fetch_wait_s >= 0 and fetch_min_bytes >= 1, "
                f"got {credit_s}, {fetch_wait_s} and {fetch_min_bytes}"
            )
        self.topic = topic
        self.capacity = capacity
        self.credit_s = credit_s
        self.fetch_min_bytes = fetch_min_bytes
        self.fetch_wait_s = fetch_wait_s
        self._records: deque[Any] = deque()
        self._start_s = 0.0  # when the oldest waiting record's window began (monotonic)
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    def __len__(self) -> int:
        return len(self._records)

    def _started(self, record: Any) -> float:
        """When ``record``'s window began (monotonic): when it was produced, by its Kafka
        timestamp (seconds), but at most ``credit_s`` before now."""
        age_s = time.time() - float(record.timestamp or 0.0)
        return time.monotonic() - min(max(age_s, 0.0), self.credit_s)

    def put(self, records: Sequence[Any]) -> None:
        """Records fetched, oldest first, each with a ``timestamp`` (seconds)."""
        if not records:
            return
        if not self._records:
            self._start_s = self._started(records[0])
        self._records.extend(records)
        self._arrived.set()
        if len(self._records) >= self.capacity:
            self._room.clear()

    async def wait_room(self) -> None:
        """Return once fewer than ``capacity`` records wait."""
        while len(self._records) >= self.capacity:
            self._room.clear()
            await self._room.wait()

    async def take(self, n: int, within_s: float) -> list[Any]:
        """The next window: at least one record, at most ``n``."""
        if n < 1:
            raise ValueError(f"a window takes at least one record, got n={n}")
        while not self._records:
            self._arrived.clear()
            await self._arrived.wait()
        while len(self._records) < n:
            left = self._start_s + within_s - time.monotonic()
            if left <= 0:
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except TimeoutError:
                break
        records = self._records
        k = min(n, len(records))
        taken = [records.popleft() for _ in range(k)]
        if records:
            self._start_s = self._started(records[0])  # the rest starts its own window
        if len(records) < self.capacity:
            self._room.set()
        return taken


class _PatientConsumerThread(AIOKafkaConsumerThread):
    """Faust's consumer thread whose aiokafka consumer waits for ``fetch_min_bytes`` (or
    ``fetch_wait_s``) per fetch, as the feed asks; Faust itself sets neither."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        feed: WindowFeed | None = getattr(self.app, "query_feed", None)
        if feed is not None:
            # the constructor's own fields (read when the consumer starts its fetcher);
            # Faust passes the constructor neither
            consumer._fetch_min_bytes = feed.fetch_min_bytes
            consumer._fetch_max_wait_ms = round(feed.fetch_wait_s * 1000)
        return consumer


class BatchDrain(FaustKafkaConsumer):
    """Faust's aiokafka consumer whose drain loop hands the feed's topic over in batches.

    The app names its feed in ``app.query_feed`` (a ``WindowFeed``); without one this is
    Faust's consumer unchanged."""

    def _new_consumer_thread(self) -> AIOKafkaConsumerThread:
        return _PatientConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - a loop
        feed: WindowFeed | None = getattr(self.app, "query_feed", None)
        if feed is None:
            await super()._drain_messages(fetcher)
            return
        callback = self.callback
        getmany = self.getmany
        consumer_should_stop = cast(Any, self)._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        read_offset = self._read_offset
        commit_every = self._commit_every
        acks_enabled_for = self.app.topics.acks_enabled_for
        track = self.track_message
        topic = feed.topic
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                await feed.wait_room()  # the router is behind: fetch nothing more meanwhile
                self.diag.set_flag(CONSUMER_FETCHING)
                ait = getmany(timeout=1.0)
                await self.sleep(0)
                batch: list[Any] = []
                tps: set[Any] = set()
                if not self.should_stop:
                    async for tp, message in ait:
                        offset = message.offset
                        r_offset = read_offset[tp]
                        if r_offset is not None and offset < r_offset:
                            continue  # read already (Faust drops it too)
                        gap = offset - (r_offset or 0)
                        if gap > 1 and r_offset and acks_enabled_for(message.topic):
                            await self._add_gap(tp, r_offset + 1, offset)
                        if commit_every is not None and self._n_acked >= commit_every:
                            self._n_acked = 0
                            await self.commit()
                        if message.topic != topic:
                            await self.wait_first(callback(message), self.suspend_flow.wait())
                        elif not self.flow_active:
                            break  # a rebalance began: re-read from the committed offset
                        else:
                            message.incref()  # FeedHandle.ack drops it
                            track(message)  # handed out: unacknowledged until then
                            batch.append(message)
                            tps.add(tp)
                        read_offset[tp] = offset
                self.diag.unset_flag(CONSUMER_FETCHING)
                if batch:
                    feed.put(batch)
                    monitor = self.app.monitor
                    if monitor is not None:  # Faust's slow-stream check reads this
                        now = time.monotonic()
                        for tp in tps:
                            monitor.stream_inbound_time[tp] = now
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                return
            raise
        finally:
            self.diag.unset_flag(CONSUMER_FETCHING)
