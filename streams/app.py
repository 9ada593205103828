"""The Faust app: an agent on ``queries`` that hands each window to ``RouterService``.

Processing guarantee and why (issue 7 asks for exactly-once "where the broker supports
it"): Faust's exactly-once mode picks the transactional producer by the *destination*
partition, only for topics the app itself consumes, and commits on a timer. Our windows
mix partitions and our outputs (``route.<instance>``) are not consumed
by the router, so in that mode the routed messages would leave outside any transaction
while offsets commit inside one — weaker than it looks. We therefore run Faust's
at-least-once mode and make redelivery harmless instead:

- the agent reads ``queries`` a fetch at a time from Faust's consumer (``streams.feed``:
  no Faust event per record); each record holds one reference that is dropped
  (``FeedHandle.ack``) only after its window's messages were acknowledged by Kafka
  (acks=all, idempotent producer), so committed offsets never run ahead of routed
  messages;
- queries held for a later window keep their reference until they are finished, and
  ``OrderedAcker`` acknowledges each partition's inputs in offset order only, so their
  offsets stay uncommitted meanwhile;
- Redis dedupe remembers where each query id was routed: a redelivered query that was
  already routed is dropped. Before producing, the router records each query's route
  intent (instance and the exact decision) in the same entry; a query redelivered after a
  crash between that and the final mark is sent again, unchanged, to the same instance,
  whose worker drops the second copy by query id. A query with neither mark is decided
  again; its budget and slot reservations are idempotent per query id (never paid or
  slotted twice).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import faust

from routing.types import Router
from schemas import ClusterConfig
from streams.feed import BatchDrain, FeedHandle, WindowFeed
from streams.ledger_rebuild import LedgerGuard, kafka_scan
from streams.metrics import RouterMetrics
from streams.rescue import KafkaRouteReader, RescueConfig, Rescuer
from streams.service import Inbound, RouterConfig, RouterService
from wiring import kafka_records, topics
from wiring.settings import Settings

log = logging.getLogger("switchyard.router")


class BatchSink:
    """Produces a window's messages as explicit record batches, one per topic partition.

    ``AIOKafkaProducer.send`` costs tens of microseconds per message in Python; a window
    of thousands of messages is cheaper appended to ``BatchBuilder``s and handed over with
    ``send_batch``. The producer is idempotent with ``acks=all``; ``send_all`` returns only
    when the broker acknowledged every batch. Keys pick the partition (CRC-32 of the key),
    so all messages of one query id land on one partition.
    """

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self._partitions: dict[str, list[int]] = {}

    async def _parts(self, topic: str) -> list[int]:
        parts = self._partitions.get(topic)
        if parts is None:
            parts = sorted(await self.producer.partitions_for(topic))
            self._partitions[topic] = parts
        return parts

    async def send_all(self, outs: list[tuple[str, bytes, bytes]]) -> None:
        groups: dict[tuple[str, int], list[tuple[bytes, bytes]]] = {}
        known = self._partitions
        for topic, key, value in outs:
            parts = known.get(topic)
            if parts is None:  # a topic's first message only: no await per message
                parts = await self._parts(topic)
            part = parts[zlib.crc32(key) % len(parts)]
            groups.setdefault((topic, part), []).append((key, value))
        futures = []
        for (topic, part), msgs in groups.items():
            batch = self.producer.create_batch()
            for key, value in msgs:
                if batch.append(key=key, value=value, timestamp=None) is None:  # batch full
                    futures.append(await self.producer.send_batch(batch, topic, partition=part))
                    batch = self.producer.create_batch()
                    if batch.append(key=key, value=value, timestamp=None) is None:
                        raise ValueError(
                            f"a message for {topic} is larger than the producer's batch size"
                        )
            futures.append(await self.producer.send_batch(batch, topic, partition=part))
        await asyncio.gather(*futures)

    async def send(self, topic: str, key: bytes, value: bytes) -> Any:
        return await self.producer.send(topic, value, key=key)


class OrderedAcker:
    """Acknowledges inputs to Faust in offset order per partition, never past an unfinished one.

    A held query finishes after later offsets of its partition. Faust commits the highest
    contiguous acknowledged offset, but its check for a gap at the *head* of the range
    lets a single missing offset right after the last commit slip (and skips the check
    before a new group's first commit). Acknowledging only contiguous runs from the head
    keeps the committed offset behind every unfinished query whatever Faust's bookkeeping.

    A rebalance or a stop gives up every message Faust handed out (``abandon_all``): they
    are never acknowledged afterwards, wherever they turn up, so Kafka re-delivers them.
    """

    def __init__(self) -> None:
        # tp -> offset -> input, in offset order. An OrderedDict: the head is read after each
        # pop from the front, which a plain dict answers by scanning past every popped slot
        # (quadratic in a window's inputs; ~6% of a router's CPU in a drain)
        self._open: dict[Any, OrderedDict[int, Inbound]] = {}
        self._done: dict[Any, set[int]] = {}
        self._given_up: weakref.WeakSet[Any] = weakref.WeakSet()  # Faust messages

    def opened(self, items: list[Inbound]) -> list[Inbound]:
        """Track the window's inputs; returns those to route (not given up already)."""
        kept = [it for it in items if self.keep(it)]
        for it in kept:
            tp = it.handle.message.tp
            opened = self._open.get(tp)
            if opened is None:
                opened = self._open[tp] = OrderedDict()
            if opened and it.offset < next(reversed(opened)):
                # out of order: after a rebalance, events the stream had buffered before it
                # (higher offsets) can arrive before the re-fetched ones from the committed
                # offset. The head must stay the lowest open offset, or finishing a buffered
                # one acknowledges it ahead of a lower unfinished one, and Faust, which lets
                # a single missing offset after its last commit slip, commits past that query
                opened[it.offset] = it
                self._open[tp] = OrderedDict(sorted(opened.items()))
            else:
                opened[it.offset] = it
        return kept

    def keep(self, it: Inbound) -> bool:
        """False for an input handed out before a give-up (rebalance or shutdown)."""
        return it.handle.message not in self._given_up

    def abandon_all(self, handed_out: Iterable[Any] = ()) -> int:
        """Give up every unfinished input without committing it (Kafka re-delivers it).

        Faust waits, on rebalance and on shutdown, until every message it handed out is
        acknowledged; a held query could keep it waiting for ``max_hold_s``. Marking the
        messages done *without* the consumer's ack keeps their offsets out of the commit,
        so whoever owns the partition next reads them again (dedupe drops those already
        routed).

        ``handed_out``: every message the stream took and nobody acknowledged yet (Faust's
        ``consumer.unacked``), opened here or not. Those ``take_events`` still buffers reach
        the agent *after* the give-up, with offsets above the held queries given up now;
        acknowledged, they would be committed past them: Faust forgets a revoked
        partition's committed offset and, without one, commits any acknowledged run.
        Returns how many opened inputs were given up.
        """
        n = 0
        for opened in self._open.values():
            for it in opened.values():
                self._give_up(it.handle.message)
                n += 1
        self._open.clear()
        self._done.clear()
        for message in list(handed_out):
            self._give_up(message)
        return n

    def _give_up(self, message: Any) -> None:
        if not message.acked:
            message.acked = True  # done for Faust's bookkeeping, but never committed
        self._given_up.add(message)

    def finished(self, it: Inbound) -> None:
        if not self.keep(it):
            return  # given up: never acknowledged
        tp = it.handle.message.tp
        opened = self._open.get(tp)
        if opened is None or opened.get(it.offset) is not it:
            it.handle.ack()  # not tracked (e.g. partition reassigned): just release it
            return
        done = self._done.setdefault(tp, set())
        done.add(it.offset)
        while opened:
            first = next(iter(opened))
            if first not in done:
                break
            done.discard(first)
            opened.pop(first).handle.ack()  # drops the extra reference: may commit now


class _RouterFaustApp(faust.App):
    """``faust.App`` that gives up held queries before Faust waits for every ack, and reads
    ``queries`` in batches (``streams.feed``: no Faust event per record)."""

    router_runtime: RouterApp | None = None
    query_feed: WindowFeed | None = None  # BatchDrain hands ``queries`` records over here

    def _new_consumer(self) -> Any:
        return BatchDrain(
            self.transport,
            callback=self.topics.on_message,
            loop=self.transport.loop,
            on_partitions_revoked=self._on_partitions_revoked,
            on_partitions_assigned=self._on_partitions_assigned,
            beacon=self.beacon,
        )

    async def _consumer_wait_empty(self, consumer: Any, logger: Any) -> None:
        runtime = self.router_runtime
        if runtime is not None:
            if runtime.service is not None:
                runtime.service.drop_held()
            # give up every message handed out, opened or still in take_events' buffer
            handed_out = list(consumer.unacked)
            n = runtime.acker.abandon_all(handed_out)
            consumer.unacked.difference_update(handed_out)  # nothing left to wait for
            if n or handed_out:
                log.warning(
                    "gave up %d unfinished queries for re-delivery (rebalance or shutdown); "
                    "%d messages handed out and not acknowledged in all",
                    n,
                    len(handed_out),
                )
        await super()._consumer_wait_empty(consumer, logger)

    async def on_stop(self) -> None:
        runtime = self.router_runtime
        if runtime is not None and runtime.rescuer is not None:
            await runtime.rescuer.flush()  # marks owed for copies Kafka already acknowledged
            await runtime.rescuer.reader.close()
        await super().on_stop()

    async def on_shutdown(self) -> None:
        # after the agents (children) stopped: nothing produces any more
        runtime = self.router_runtime
        if runtime is not None:
            await runtime.close_clients()
        await super().on_shutdown()


@dataclass
class RouterApp:
    """The Faust app plus what its agent needs, built once per process."""

    app: faust.App
    cluster: ClusterConfig
    router: Router
    settings: Settings
    config: RouterConfig
    metrics: RouterMetrics
    service: RouterService | None = None
    rescue: RescueConfig | None = None  # None: a silent instance's queue is not re-routed
    rescuer: Rescuer | None = None
    acker: OrderedAcker = field(default_factory=OrderedAcker)
    _starting: asyncio.Lock = field(default_factory=asyncio.Lock)
    _producer: Any = None  # the service's own producer (stopped on shutdown)
    _store: Any = None

    async def close_clients(self) -> None:
        """Stop the producer and Redis client ``ensure_service`` opened (a SIGTERM otherwise
        leaves them to the garbage collector: "Unclosed AIOKafkaProducer")."""
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await producer.stop()
            except Exception as exc:  # noqa: BLE001 - shutting down anyway
                log.warning("stopping the router's producer: %s", exc)
        store, self._store = self._store, None
        if store is not None:
            await store.close()

    async def ensure_service(self) -> RouterService:
        async with self._starting:
            if self.service is None:
                from aiokafka import AIOKafkaProducer

                from state import StateStore, StateUnavailable, period_id

                store = await StateStore.connect(**self.settings.redis_kwargs())
                producer = AIOKafkaProducer(
                    **self.settings.kafka_kwargs(client_id=f"{self.app.conf.id}-producer"),
                    acks="all",
                    enable_idempotence=True,
                    linger_ms=0,
                    max_batch_size=1024 * 1024,
                    max_request_size=8 * 1024 * 1024,
                )
                await producer.start()
                self._producer, self._store = producer, store
                guard = LedgerGuard(
                    self.cluster,
                    kafka_scan(
                        self.settings.kafka_kwargs(client_id=f"{self.app.conf.id}-ledger-rebuild")
                    ),
                    period_id,
                )
                try:  # a missing ledger is rebuilt before the first window
                    if not await guard.wait_ready(store, timeout_s=60.0):
                        log.warning("budget ledger rebuild still running: routing blind meanwhile")
                except StateUnavailable as exc:
                    log.warning("could not check the budget ledger in Redis yet: %s", exc)
                self.service = RouterService(
                    self.cluster,
                    self.router,
                    store,
                    BatchSink(producer),
                    self.config,
                    self.metrics,
                    on_done=self.acker.finished,
                    keep=self.acker.keep,
                    period_id=period_id,
                    ledger_guard=guard,
                )
                if self.rescue is not None:
                    reader = KafkaRouteReader(
                        self.settings.kafka_kwargs(client_id=f"{self.app.conf.id}-rescue"),
                        self.rescue.read_timeout_s,
                    )
                    self.rescuer = Rescuer(
                        self.cluster,
                        store,
                        self.service,
                        reader,
                        self.rescue,
                        limits=self.config.limits,
                    )
                quiet_gc()
            return self.service


def create_app(
    cluster: ClusterConfig,
    router: Router,
    settings: Settings,
    config: RouterConfig,
    *,
    app_id: str = "switchyard-router",
    partitions: int = 4,
    metrics: RouterMetrics | None = None,
    commit_interval_s: float = 0.5,
    offset_reset: str = "earliest",
    rescue: RescueConfig | None = None,
    datadir: str | os.PathLike[str] | None = None,
) -> RouterApp:
    """Build the Faust app; ``faust.Worker(app).execute_from_commandline()`` runs it.

    ``datadir``: Faust's state folder (default: a temporary one removed at exit; Faust's own
    default, ``<app id>-data`` in the working directory, littered wherever it was started)."""
    if datadir is None:
        import atexit
        import shutil
        import tempfile

        datadir = tempfile.mkdtemp(prefix=f"{app_id}-")
        atexit.register(shutil.rmtree, datadir, True)
    os.makedirs(datadir, exist_ok=True)
    kafka_records.install()  # an undecodable record batch is dead-lettered, never a crash loop
    app = _RouterFaustApp(
        app_id,
        broker=settings.faust_broker(),
        broker_credentials=settings.faust_credentials(),
        processing_guarantee="at_least_once",
        value_serializer="raw",
        key_serializer="raw",
        topic_partitions=partitions,
        topic_replication_factor=settings.kafka_replication_factor,
        broker_commit_interval=commit_interval_s,
        producer_acks=-1,
        producer_linger_ms=1,
        producer_max_batch_size=256 * 1024,
        producer_max_request_size=4 * 1024 * 1024,
        consumer_max_fetch_size=4 * 1024 * 1024,
        broker_max_poll_records=2000,
        stream_buffer_maxsize=max(4096, 4 * config.max_batch),
        web_enabled=False,
        # a killed router's partitions move to the others after 10 s, not Faust's 60 s
        broker_session_timeout=config.group_session_s,
        broker_heartbeat_interval=3.0,
        consumer_auto_offset_reset=offset_reset,
        table_cleanup_interval=3600.0,
        datadir=str(datadir),
    )
    runtime = RouterApp(
        app, cluster, router, settings, config, metrics or RouterMetrics(), rescue=rescue
    )
    app.router_runtime = runtime
    app.query_feed = WindowFeed(
        topics.QUERIES,
        capacity=max(4096, 4 * config.max_batch),
        credit_s=min(config.fetch_wait, config.window_s),  # the fetch wait is the window's
        fetch_min_bytes=config.fetch_min_bytes,
        fetch_wait_s=config.fetch_wait,
    )
    queries = app.topic(topics.QUERIES, value_type=bytes, key_type=bytes, partitions=partitions)

    @app.agent(queries, name="route", concurrency=1)
    async def route(stream: faust.StreamT[bytes]) -> None:  # noqa: ARG001 - read from the feed
        # the agent subscribes ``queries`` (Faust's group and assignment); its records come
        # from the feed, and the stream itself is never iterated
        # the worker configures logging before agents start; keep the clients' per-message
        # debug records from being built at all (aiokafka logs every send at DEBUG)
        for name in ("aiokafka", "faust", "mode", "kafka"):
            logging.getLogger(name).setLevel(
                max(logging.INFO, logging.getLogger().getEffectiveLevel())
            )
        service = await runtime.ensure_service()
        consumer = app.consumer
        windows: asyncio.Queue[list[Inbound]] = asyncio.Queue(maxsize=1)
        room = asyncio.Event()  # set when the worker takes the waiting window
        worker = asyncio.create_task(
            _process_windows(service, windows, runtime.acker, room), name="route-windows"
        )
        feed = app.query_feed
        assert feed is not None  # set by create_app
        try:
            while True:
                # at most one window waits for the worker (backpressure); the next is cut
                # only once there is room for it, so what came meanwhile joins it rather
                # than a window cut early waiting whole
                while windows.full():
                    room.clear()
                    await room.wait()
                # records straight from Faust's consumer (streams.feed): never the stream
                messages = await feed.take(config.max_batch, config.window_s)
                items = [
                    Inbound(
                        raw=m.value,
                        topic=m.topic,
                        partition=m.partition,
                        offset=m.offset,
                        timestamp_s=m.timestamp,
                        handle=FeedHandle(m, consumer),
                        undecodable=(
                            None
                            if m.value is not None
                            else kafka_records.undecodable_reason(m.headers, m.value)
                        ),
                    )
                    for m in messages
                ]
                # each record holds one reference (BatchDrain) that the acker drops once
                # the window is routed and produced (see _process_windows)
                items = runtime.acker.opened(items)  # minus those given up at a rebalance
                if items:
                    windows.put_nowait(items)  # room was made above
                _record_lag(runtime.metrics, consumer, messages)
                while service.held_count > config.max_held:  # backpressure: stop reading a while
                    await asyncio.sleep(config.window_s)
        finally:
            worker.cancel()

    @app.on_partitions_assigned.connect  # type: ignore[arg-type]
    async def announce(sender: Any, assigned: Any = None, **_: Any) -> None:
        parts = sorted(tp.partition for tp in assigned or () if tp.topic == topics.QUERIES)
        print(
            f"router {app_id}: assigned {topics.QUERIES} partitions {parts}",
            file=sys.stderr,
            flush=True,
        )

    @app.timer(interval=max(config.window_s, 0.05))
    async def retry_held() -> None:
        if runtime.service is not None:
            await runtime.service.retry_held()

    if rescue is not None:

        @app.timer(interval=rescue.interval_s)
        async def rescue_silent() -> None:
            # re-route what waits on an instance that stopped heart-beating (streams.rescue)
            if runtime.rescuer is not None:
                try:
                    await runtime.rescuer.tick()
                except Exception:  # a bug: log it, never stop routing for it
                    log.exception("rescuer tick failed")

    return runtime


async def _process_windows(
    service: RouterService,
    windows: asyncio.Queue[list[Inbound]],
    acker: OrderedAcker,
    room: asyncio.Event,
) -> None:
    """Route windows in arrival order while the agent already collects the next one.

    Reading and routing overlap, so a window's routing time is not dead time for the
    consumer. An input is acknowledged (its extra reference dropped) once its window has
    been produced and acknowledged by Kafka; a held input stays referenced until the
    service finishes it in a later window (``on_done``).
    """
    while True:
        items = await windows.get()
        room.set()
        try:
            _, unfinished = await service.handle(items)
        except Exception:  # never reached: handle() turns errors into retries or dead letters
            log.exception("routing window failed; its inputs stay unacknowledged")
            continue
        pending = {id(it) for it in unfinished}
        for it in items:
            if id(it) not in pending:
                acker.finished(it)


# The cyclic garbage collector's thresholds in a router (Python's: 700, 10, 10). Nearly all
# of a window's objects die by reference count; the collector finds next to nothing, but a
# full collection walks every live object (the predictor's memo, the feed's backlog, the
# app), and with the default thresholds those walks took ~17% of a router's CPU in a
# 40,000-query drain (docs/benchmarks/service.md, "Hot path, round two").
GC_THRESHOLDS = (20_000, 50, 100)


def quiet_gc() -> None:
    """Once the service is built: what exists now is kept for the process's life, so it
    leaves the collector's generations (``gc.freeze``), and collections run less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def _record_lag(metrics: RouterMetrics, consumer: Any, messages: list[Any]) -> None:
    last: dict[Any, int] = {}
    for m in messages:
        last[m.tp] = max(last.get(m.tp, -1), m.offset)
    for tp, offset in last.items():
        try:
            high = consumer.highwater(tp)
        except Exception:  # no fetch position yet
            continue
        if high is not None:
            metrics.queue_lag.labels(str(tp.partition)).set(max(0, high - offset - 1))


def run(
    runtime: RouterApp, loglevel: str = "WARNING", logging_config: dict[str, Any] | None = None
) -> None:
    """Run the app until SIGTERM/SIGINT (blocking). ``logging_config``: a ``dictConfig`` that
    replaces Faust's own (coloured) handler set-up."""
    worker = faust.Worker(
        runtime.app,
        loglevel=loglevel,
        quiet=True,
        redirect_stdouts=False,
        logging_config=logging_config,
    )
    # Faust's start-up spinner writes cursor escape codes even off a terminal, and lowers
    # the root logger to DEBUG for itself (every client's debug record then gets built)
    worker.spinner = None
    started = time.time()
    log.info("router starting (policy %s)", getattr(runtime.router, "name", "?"))
    profile_to = os.environ.get("SWITCHYARD_PROFILE")  # developer aid: cProfile the whole run
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        try:
            worker.execute_from_commandline()
        finally:
            profiler.disable()
            profiler.dump_stats(profile_to)
    else:
        worker.execute_from_commandline()
    log.info("router stopped after %.1f s", time.time() - started)
