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
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, cast

from faust.transport.consumer import CONSUMER_FETCHING
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
    passed since the oldest waiting record arrived (Faust's ``take_events``, timed from the
    record rather than from the call: a record that waited through the previous window
    does not wait a whole window again). ``BatchDrain`` stops fetching while ``capacity``
    records wait (backpressure, as a full stream buffer did)."""

    def __init__(self, topic: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"WindowFeed capacity must be >= 1, got {capacity}")
        self.topic = topic
        self.capacity = capacity
        self._records: deque[Any] = deque()
        self._first_s = 0.0  # when the oldest waiting record arrived (monotonic)
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()

    def __len__(self) -> int:
        return len(self._records)

    def put(self, records: Iterable[Any]) -> None:
        was_empty = not self._records
        self._records.extend(records)
        if self._records:
            if was_empty:
                self._first_s = time.monotonic()
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
            left = self._first_s + within_s - time.monotonic()
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
            self._first_s = time.monotonic()  # the rest starts its own window's wait
        if len(records) < self.capacity:
            self._room.set()
        return taken


class BatchDrain(FaustKafkaConsumer):
    """Faust's aiokafka consumer whose drain loop hands the feed's topic over in batches.

    The app names its feed in ``app.query_feed`` (a ``WindowFeed``); without one this is
    Faust's consumer unchanged."""

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
