"""One worker per serving instance: ``route.<id>`` → backend → ``results`` (DESIGN.md, "workers/").

For every routed message, in arrival order:

1. validate it as a ``RoutedQuery`` — a bad body goes to ``dead-letters`` whole (raw
   bytes, reason, topic, partition, offset) and the stream goes on;
2. skip it when a result for its id was already published (``StateStore.result_mark``):
   this bounds repeated inference after a crash between publishing and committing (the
   skipped copy still settles and frees its slot, idempotently, in case the crash cut
   those short);
3. register it as a resident request (queued), wait for one of ``max_concurrency`` backend
   slots (FIFO), claim it (``StateStore.claim_run``: a copy a router's rescuer re-routed
   while this instance was silent is skipped here, without settling — the re-routed copy
   owns its budget reservation), run it, and write its progress to Redis (prefilling →
   decoding, token counts every ``progress_every_tokens``);
4. publish its ``Result`` (idempotent producer, ``acks=all``) — an engine failure is a
   Result with ``error`` set, never silence — and mark it published (with its cost) at once;
5. settle the tenant's budget at the actual cost, drop the resident and its capacity slot;
6. only then may its offset be committed (``OffsetTracker``): at-least-once.

Before anything else: wait for the engine and check it serves the instance's model (else exit
with the served names). Beside the stream: heartbeats with a TTL (with the engine's own
running/waiting counts), dropped at once while the engine fails its health probe; a
periodic resync of Redis residents to the worker's own view (repairs drift and rebuilds
state after Redis lost it), observed timings for step-time recalibration
(``workers.timings``), and Prometheus metrics.

Redis being down never stops inference: state writes are best effort (counted as
``errors{kind="state"}``); an unsettled reservation keeps the ledger conservative.
A result that cannot be published stops the worker without committing its offset, so
the query is re-delivered after a restart.

Result times: ``ttft_ms`` and ``e2e_ms`` are measured from the query's ``created_at`` when
the producer set it (what the user waited, routing window and Kafka included), else from
the moment the worker received it. The engine-side TTFT is in the step-timings reports.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, KafkaError

from routing.steptime import StepTimeModel
from schemas import (
    ClusterConfig,
    DeadLetter,
    FinishedRequest,
    ModelSpec,
    ResidentRequest,
    Result,
    RoutedQuery,
)
from schemas.parse import BadMessage, Limits, parse_model
from state import Starts, StateUnavailable, WorkerState, period_id
from state.prefix import kv_cache_tokens, touch_of
from wiring import kafka_admin, kafka_records, topics
from wiring.settings import Settings
from workers.backends.base import (
    Backend,
    EngineLoad,
    EngineUnavailable,
    Generation,
    GenerationRequest,
)
from workers.metrics import WorkerMetrics, serve_metrics
from workers.offsets import OffsetTracker
from workers.pacing import AdmissionPacer
from workers.prefix_reconcile import PrefixReconciler
from workers.relay import RelayWriter
from workers.steptime_feed import StepTimeFeed, StepTimeFeedConfig
from workers.timings import MAX_STEPS_PER_MESSAGE, RequestTiming, StepBatch

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_RESULT_BYTES = 900_000  # under the broker's default message.max.bytes (1 MiB)
CLAIM_RETRY_S = 0.25  # a rescuer holds this query's claim: ask again after this
# a message whose handling raises (a bug, a body some stage chokes on) is retried this many
# times in all, then dead-lettered with the stage named and answered with an error Result
STAGE_TRIES = 3
STAGE_RETRY_S = 0.2  # first back-off between tries (doubling)
# a query started by this many worker processes without an answer (each died running it: an
# OOM, a crash) is not started again: it gets an error Result, never a crash loop. Counted per
# process (state.Results.mark_start), so a stage retried within one process is not a death.
MAX_RUNS = 3


@dataclass(frozen=True)
class WorkerConfig:
    instance_id: str
    concurrency: int | None = None  # default: the model's max_concurrency
    heartbeat_s: float = 1.0
    heartbeat_ttl_s: float | None = None  # default: 3 heartbeats
    resync_every: int = 5  # heartbeats between resyncs of Redis residents
    progress_every_tokens: int = 16
    result_ttl_s: float = 7 * 86_400.0
    max_pending: int | None = None  # received but unfinished; default 4 x concurrency
    drain_timeout_s: float = 30.0
    # the most one offset commit (and, at shutdown, the consumer's and producer's stop) may take
    commit_timeout_s: float = 15.0
    # how long a query's closing writes (result mark, settlement, slot release) are retried
    # while Redis is unavailable: a Redis Cluster failover takes about twice the cluster's
    # cluster-node-timeout. Past it the reservation stays booked (conservative) and the
    # resync and the slot lease clean up
    finish_retry_s: float = 10.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # None: no endpoint; 0: a free port
    limits: Limits = Limits()
    report_timings: bool = True
    # how often the consumer refreshes the route topic's metadata (aiokafka's default: 5 min).
    # A group that joins while the broker's metadata does not list the route topic yet (just
    # created: KRaft brokers learn of it asynchronously) gets an empty assignment, and aiokafka
    # re-joins only when a refresh shows the partition. Meanwhile the worker heart-beats, so it
    # is routed to and consumes nothing: bug 10, the losses of faults scenario 4.
    metadata_refresh_s: float = 5.0
    # how long start-up waits for the engine to answer GET /v1/models (a real vLLM takes
    # 30-105 s to load) before consuming; past it the worker consumes with its instance
    # unavailable (no heartbeat: queries already routed here get error Results, never
    # silence) and checks the model when the engine first answers
    engine_start_timeout_s: float = 600.0
    # the longest one poll of the route topic may block. aiokafka's getmany waits, without a
    # bound and whatever its timeout, while a group rebalance is in progress; a join that
    # stalls (a slow coordinator on a loaded machine) then kept the worker from seeing
    # ``stop`` at all: two CI runs hung 300 s in tests/workers this way
    poll_bound_s: float = 1.0
    # a group join unfinished this long is logged (once per stall) with the group's name
    group_stall_warn_s: float = 20.0
    # online recalibration of the model's Eq. 9 coefficients (workers.steptime_feed): what
    # this worker observes refits them, published to Redis every step_time_refit_s (the
    # record lapses after step_time_ttl_s without a write); False: no refit, no publish
    online_step_time: bool = True
    step_time_refit_s: float = 5.0
    step_time_ttl_s: float = 900.0
    step_time_feed: StepTimeFeedConfig = StepTimeFeedConfig()

    def __post_init__(self) -> None:
        if not 0.0 <= self.finish_retry_s <= 600.0:
            raise ValueError(
                f"WorkerConfig.finish_retry_s must be within 0-600 s, got {self.finish_retry_s!r}"
            )
        if not self.poll_bound_s >= 0.2:
            raise ValueError(
                f"WorkerConfig.poll_bound_s must be >= 0.2 s, got {self.poll_bound_s!r}"
            )
        if not 0.1 <= self.step_time_refit_s <= 3600.0:
            raise ValueError(
                f"WorkerConfig.step_time_refit_s must be within 0.1-3600 s, "
                f"got {self.step_time_refit_s!r}"
            )
        if self.step_time_ttl_s < self.step_time_refit_s:
            raise ValueError(
                f"WorkerConfig.step_time_ttl_s ({self.step_time_ttl_s!r}) must be at least "
                f"step_time_refit_s ({self.step_time_refit_s!r})"
            )
        if not 0.1 <= self.metadata_refresh_s <= 300.0:
            raise ValueError(
                f"WorkerConfig.metadata_refresh_s must be within 0.1-300 s, "
                f"got {self.metadata_refresh_s!r}"
            )


class WorkerFatal(RuntimeError):
    """The worker cannot go on without risking loss (e.g. a result could not be published)."""


@dataclass
class _Progress:
    """How far one message got: the stage a failure is named after, and what is out already."""

    stage: str = "validate"
    rq: RoutedQuery | None = None
    published: bool = False  # its Result is acknowledged by Kafka: never answer it again


class _ProgressWriter:
    """Writes one query's latest token progress to Redis, in order, never more than one at a time."""

    def __init__(self, worker: Worker, qid: str) -> None:
        self.worker = worker
        self.qid = qid
        self.latest: tuple[int, int] = (0, 0)
        self.written: tuple[int, int] = (0, 0)
        self.task: asyncio.Task[None] | None = None

    def update(self, prefilled: int, decoded: int) -> None:
        self.latest = (prefilled, decoded)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        while self.latest != self.written:
            value = self.latest
            await self.worker._best_effort(
                self.worker.state.resident_progress(
                    self.worker.instance_id, self.qid, value[0], value[1]
                )
            )
            self.written = value

    async def wait(self) -> None:
        if self.task is not None:
            with contextlib.suppress(Exception):
                await self.task


class Worker:
    """Consumes one instance's routed queries and drives its backend."""

    def __init__(
        self,
        config: WorkerConfig,
        cluster: ClusterConfig,
        backend: Backend,
        settings: Settings,
        state: WorkerState,
    ) -> None:
        self.config = config
        self.instance_id = config.instance_id
        self.cluster = cluster
        self.instance = cluster.instance(config.instance_id)
        self.spec: ModelSpec = cluster.model(self.instance.model)
        self.backend = backend
        self.settings = settings
        self.state = state
        self.concurrency = config.concurrency or self.spec.max_concurrency
        self.max_pending = config.max_pending or 4 * self.concurrency
        self.heartbeat_ttl_s = config.heartbeat_ttl_s or 3 * config.heartbeat_s
        self.topic = topics.route(self.instance_id)
        self.metrics = WorkerMetrics(self.instance_id, self.spec.name)
        self.metrics_port: int | None = None
        self._sem = asyncio.Semaphore(self.concurrency)
        # a provider's request rate limit, kept as the simulator keeps it (workers.pacing)
        rate = self.spec.rate_limit_rps
        self._pacer = AdmissionPacer(rate) if rate is not None else None
        self._tracker: OffsetTracker[TopicPartition] = OffsetTracker()
        self._residents: dict[str, ResidentRequest] = {}
        # this worker process's token in each query's start record (state.Results.mark_start)
        self._process_token = uuid.uuid4().hex
        self._last_stamp = 0.0  # residents' stamps, for resyncs that never undo an add or done
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._tasks_bg: set[asyncio.Task[None]] = set()
        self._producer: AIOKafkaProducer | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._fatal: BaseException | None = None
        self._started = asyncio.Event()
        self._stalled_since: float | None = None  # monotonic start of polls cut by poll_bound_s
        self._stall_said = False
        # the engine failed its last health probe: no heartbeat (routers stop routing here)
        self._engine_lost = False
        self._model_checked = False  # GET /v1/models named this instance's model
        self.step_feed = self._step_feed()
        self._refit_at = 0.0
        # the prefix model against the engine's own counters (workers.prefix_reconcile):
        # None for a cloud model; a capacity once reconciled, written with each touch
        self.prefix_reconciler = (
            PrefixReconciler(kv_cache_tokens(self.spec), kv_cache_tokens(self.spec))
            if self.spec.kind == "local"
            else None
        )
        self.prefix_capacity_tokens: float | None = None
        self._prefix_predicted_tokens = 0.0  # predicted cached, over the requests started
        self._prefix_prompt_tokens = 0.0
        if self.prefix_reconciler is not None:
            self.metrics.prefix_capacity_tokens.set(kv_cache_tokens(self.spec))
        self.counts = {
            "results": 0,
            "errors": 0,
            "dead_letters": 0,
            "duplicates_skipped": 0,
            "reruns": 0,
            "duplicate_results": 0,
            "rerouted_skipped": 0,  # copies a rescuer re-routed elsewhere (also duplicates_skipped)
            "engine_lost": 0,  # times the engine stopped answering its health probe
        }

    def _step_feed(self) -> StepTimeFeed | None:
        """The online refit of this model's Eq. 9, from its configured coefficients (the
        prior); None when switched off or the model has none (a cloud endpoint)."""
        if not self.config.online_step_time or self.spec.kind != "local":
            return None
        if self.spec.step_time is not None:
            prior = StepTimeModel.from_coefficients(self.spec.step_time)
        elif self.spec.profile:
            from loaders.profiles import load_profile

            prior = load_profile(self.spec.profile)
        else:
            return None
        return StepTimeFeed(prior, self.spec.scheduler, self.config.step_time_feed)

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> asyncio.Event:
        """Set once the consumer has joined its group and the first heartbeat is written."""
        return self._started

    async def run(self, stop: asyncio.Event) -> None:
        """Consume until ``stop`` is set, then finish in-flight work and commit. Raises ``WorkerFatal``."""
        # the engine first: a worker whose engine serves another model touches no topic
        await self.backend.start()
        try:
            ready = await self._engine_ready(stop)
        except BaseException:
            await self.backend.close()
            raise
        if not ready:
            await self.backend.close()
            return
        kw = self.settings.kafka_kwargs(client_id=f"switchyard-worker-{self.instance_id}")
        kafka_records.install()  # an undecodable record batch is dead-lettered, never a crash loop
        await kafka_admin.ensure_topics(
            kw,
            [self.topic, topics.RESULTS, topics.DEAD_LETTERS, topics.STEP_TIMINGS],
            **self.settings.topic_kwargs(),
        )
        self._producer = AIOKafkaProducer(
            **kw, acks="all", enable_idempotence=True, linger_ms=5, max_request_size=1_048_576
        )
        self._consumer = AIOKafkaConsumer(
            **kw,
            group_id=topics.worker_group(self.instance_id),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            isolation_level="read_committed",  # routers may write routed messages in transactions
            max_partition_fetch_bytes=1_048_576,
            metadata_max_age_ms=int(self.config.metadata_refresh_s * 1000),
        )
        metrics_runner = None
        heartbeat: asyncio.Task[None] | None = None
        try:
            await self._producer.start()
            await self._consumer.start()
            self._consumer.subscribe([self.topic], listener=_Rebalance(self))
            if self.config.metrics_port is not None:
                metrics_runner, self.metrics_port = await serve_metrics(
                    self.metrics, self.config.metrics_host, self.config.metrics_port
                )
            await self._heartbeat_once(resync=True)
            heartbeat = asyncio.create_task(
                self._heartbeat_loop(), name=f"heartbeat-{self.instance_id}"
            )
            await self._consume(stop)
        finally:
            await self._drain()
            if heartbeat is not None:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat
            await self._best_effort(self.state.instance_down(self.instance_id))
            # bounded too: a clean stop leaves the group and flushes, but never hangs shutdown
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._consumer.stop(), self.config.commit_timeout_s)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._producer.stop(), self.config.commit_timeout_s)
            await self.backend.close()
            if metrics_runner is not None:
                await metrics_runner.cleanup()
        if self._fatal is not None:
            raise WorkerFatal(f"worker {self.instance_id} stopped: {self._fatal}") from self._fatal

    async def _engine_ready(self, stop: asyncio.Event) -> bool:
        """Wait until the engine answers and serves this instance's model (before any
        heartbeat); False when ``stop`` came first. ``WorkerFatal`` when it serves another
        model. Past ``engine_start_timeout_s`` without an answer: True, with the engine
        marked lost (the heartbeat loop checks the model once it answers)."""
        deadline = time.monotonic() + self.config.engine_start_timeout_s
        said = 0.0
        while True:
            try:
                problem = await self.backend.model_problem()
            except EngineUnavailable as exc:
                now = time.monotonic()
                if now >= deadline:
                    log.error(
                        "worker %s: the engine did not answer within %g s (%s); consuming with "
                        "the instance unavailable", self.instance_id,
                        self.config.engine_start_timeout_s, exc,
                    )  # fmt: skip
                    self._engine_lost = True
                    self.metrics.engine_up.set(0)
                    return True
                if now - said >= 10.0:
                    log.warning("worker %s: waiting for the engine: %s", self.instance_id, exc)
                    said = now
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
                if stop.is_set():
                    return False
                continue
            if problem is not None:
                raise WorkerFatal(self._wrong_model(problem))
            self._model_checked = True
            self.metrics.engine_up.set(1)
            return True

    def _wrong_model(self, problem: str) -> str:
        return f"worker {self.instance_id} (model {self.spec.name!r}) refuses to start: {problem}"

    async def _consume(self, stop: asyncio.Event) -> None:
        assert self._consumer is not None
        consumer = self._consumer
        paused = False
        last_commit = time.monotonic()
        while not stop.is_set() and self._fatal is None:
            free = self.max_pending - len(self._tasks)
            if free <= 0 and not paused:
                consumer.pause(
                    *consumer.assignment()
                )  # keep polling (group membership) without fetching
                paused = True
            elif free > 0 and paused:
                consumer.resume(*consumer.assignment())
                paused = False
            batch = await self._poll(consumer, max(1, free))
            if not self._started.is_set() and consumer.assignment():
                self._started.set()
            for tp, records in batch.items():
                for rec in records:
                    self._tracker.started(tp, rec.offset)
                    task = asyncio.create_task(self._handle(tp, rec))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
            if time.monotonic() - last_commit >= 0.2:
                await self._commit()
                last_commit = time.monotonic()

    async def _poll(self, consumer: AIOKafkaConsumer, max_records: int) -> dict[Any, Any]:
        """One ``getmany``, bounded by ``poll_bound_s`` even while the group rebalances
        (aiokafka then waits for the new assignment first); a stalled join is logged.

        Cutting that wait is safe: no record has been taken from the fetcher yet. (aiokafka's
        fetch counter then stays raised, so the consumer never counts as idle — true here,
        the loop polls without pause.)"""
        try:
            async with asyncio.timeout(self.config.poll_bound_s):
                batch: dict[Any, Any] = await consumer.getmany(
                    timeout_ms=100, max_records=max_records
                )
            self._stalled_since = None
            return batch
        except TimeoutError:
            now = time.monotonic()
            if self._stalled_since is None:
                self._stalled_since = now
                self._stall_said = False
            elif (
                now - self._stalled_since >= self.config.group_stall_warn_s and not self._stall_said
            ):
                self._stall_said = True
                self.metrics.error("group_join")
                log.warning(
                    "worker %s: the consumer group %s has not finished joining for %.0f s "
                    "(nothing is consumed meanwhile); still trying",
                    self.instance_id, topics.worker_group(self.instance_id), now - self._stalled_since,
                )  # fmt: skip
            return {}

    async def _drain(self) -> None:
        """Let in-flight work finish (bounded), then commit what is done."""
        if self._tasks:
            done, pending = await asyncio.wait(
                set(self._tasks), timeout=self.config.drain_timeout_s
            )
            for task in pending:
                task.cancel()  # not committed: Kafka re-delivers it
            if pending:
                await asyncio.wait(pending)
                log.warning(
                    "worker %s: %d queries unfinished at shutdown; they will be re-delivered",
                    self.instance_id,
                    len(pending),
                )
        await self._commit()

    async def _commit(self) -> None:
        if self._consumer is None:
            return
        offsets = self._tracker.committable()
        if not offsets:
            return
        owned = self._consumer.assignment()
        offsets = {tp: off for tp, off in offsets.items() if tp in owned}
        if not offsets:
            return
        try:
            # bounded: aiokafka retries a commit while it has no coordinator, and an unbounded
            # wait stalls consumption (or shutdown); uncommitted offsets are retried next time
            await asyncio.wait_for(self._consumer.commit(offsets), self.config.commit_timeout_s)
            self._tracker.committed(offsets)
        except TimeoutError:
            log.warning(
                "worker %s: commit took over %g s; will retry",
                self.instance_id,
                self.config.commit_timeout_s,
            )
            self.metrics.error("commit")
        except (CommitFailedError, KafkaError) as exc:
            # the group rebalanced: the new owner re-reads from the last commit (duplicates are skipped)
            log.warning("worker %s: commit failed (%s); will retry", self.instance_id, exc)
            self.metrics.error("commit")
        except Exception:  # anything else: the offsets stay committable, the next commit retries
            log.exception("worker %s: commit raised; will retry", self.instance_id)
            self.metrics.error("commit")

    # ------------------------------------------------------------------ one message

    async def _handle(self, tp: TopicPartition, rec: ConsumerRecord[Any, Any]) -> None:
        """Process one message; a failure of its own is retried, then contained (``_give_up``).

        ``WorkerFatal`` (a result Kafka would not take) stops the worker without finishing the
        offset, so the message is re-delivered after a restart. Any other exception is this
        message's: it is retried ``STAGE_TRIES`` times in all, then dead-lettered with the
        stage that failed, answered with an error Result (unless its Result is out already),
        and its offset finished, so the stream goes on.
        """
        for tries in range(1, STAGE_TRIES + 1):
            at = _Progress()
            try:
                await self._process(rec, at)
                break
            except WorkerFatal as exc:
                self._fatal = exc  # offset stays unfinished: nothing after it is committed
                return
            except Exception as exc:
                log.exception(
                    "worker %s: stage %s failed on %s[%d]@%d (try %d of %d)",
                    self.instance_id, at.stage, rec.topic, rec.partition, rec.offset,
                    tries, STAGE_TRIES,
                )  # fmt: skip
                self.metrics.error(f"stage_{at.stage}")
                if tries == STAGE_TRIES or at.published:  # a published Result is never re-run
                    try:
                        await self._give_up(rec, at, exc, tries)
                    except Exception as fatal:  # not even a dead letter: stop, lose nothing
                        self._fatal = fatal
                        return
                    break
                await asyncio.sleep(STAGE_RETRY_S * 2 ** (tries - 1))
        self._tracker.finished(tp, rec.offset)

    async def _give_up(
        self, rec: ConsumerRecord[Any, Any], at: _Progress, exc: BaseException, tries: int
    ) -> None:
        """Dead-letter a message that failed at ``at.stage``; answer its query if not answered."""
        where = f"{rec.topic}[{rec.partition}]@{rec.offset}"
        reason = (
            f"worker {self.instance_id}: stage {at.stage} failed {tries} time(s) on {where}: "
            f"{type(exc).__name__}: {exc}"
        )[:2000]
        await self._dead_letter(rec, reason, time.time(), stage=at.stage)
        rq = at.rq
        if rq is None or at.published:
            return
        await self._answer_error(rq, reason)

    async def _answer_error(self, rq: RoutedQuery, reason: str) -> None:
        """An error Result for a query this worker will not run, its slot and reservation freed."""
        result = Result(
            query_id=rq.query.id,
            tenant=rq.query.tenant,
            instance_id=self.instance_id,
            model=self.spec.name,
            error=reason,
            finished_at=time.time(),
        )
        try:
            await self._publish(topics.RESULTS, rq.query.id, _result_bytes(result))
        except WorkerFatal:
            raise
        except Exception:  # the failing stage was publishing itself: the dead letter says so
            log.exception("worker %s: no error Result for %s", self.instance_id, rq.query.id)
            return
        self.counts["errors"] += 1
        self.metrics.results_error.inc()
        try:
            await self._finish(rq, 0.0)  # nothing ran: the reservation is released at 0
        except Exception:
            log.exception("worker %s: could not finish %s", self.instance_id, rq.query.id)

    async def _process(self, rec: ConsumerRecord[Any, Any], at: _Progress) -> None:
        received = time.time()
        raw: bytes | None = rec.value
        undecodable = kafka_records.undecodable_reason(rec.headers, raw)
        if undecodable is not None:
            await self._dead_letter(rec, undecodable, received, stage="decode")
            return
        try:
            rq = parse_model(RoutedQuery, raw, self.config.limits, "routed query")
        except BadMessage as exc:
            await self._dead_letter(rec, exc.reason, received)
            return
        at.rq = rq
        if rq.decision.instance_id is not None and rq.decision.instance_id != self.instance_id:
            await self._dead_letter(
                rec,
                f"routed query {rq.query.id}: decision names instance {rq.decision.instance_id!r} "
                f"but it arrived on {rec.topic} (instance {self.instance_id!r})",
                received,
            )
            return
        q = rq.query
        at.stage = "dedupe"
        mark = await self._best_effort(self.state.result_mark(q.id), default=None)
        if mark is not None:
            # its result is out (a re-delivery after a crash between publishing and committing):
            # finish what that crash may have cut short — both steps are idempotent
            await self._skip_duplicate(q.id)
            claim = await self._best_effort(
                self.state.claim_state(self.instance_id, q.id), default=None
            )
            # a copy re-routed elsewhere: that copy's decision owns the ledger entry (its
            # period may differ from this one's), so settling here could book it twice
            rerouted = claim is not None and claim.split(" ", 1)[0] in ("rescue", "rerouted")
            at.published, at.stage = True, "finish"  # answered before: never answer again
            if mark.cost_usd is not None and not rerouted:
                await self._settle(rq, mark.cost_usd)
            await self._best_effort(self.state.resident_done(self.instance_id, q.id))
            return
        prompt_tokens = q.estimated_prompt_tokens()
        predicted = max(
            1,
            int(
                rq.decision.predicted_output_tokens
                or q.output_cap_tokens()
                or self.spec.mean_output_tokens
                or 128
            ),
        )
        if q.id in self._residents:  # a second copy while the first still runs here
            await self._skip_duplicate(q.id)
            return
        # stamped and registered in one step (no await between): a resync's view either has
        # this resident or was taken before its stamp (see StateStore.residents_sync)
        resident = ResidentRequest(
            query_id=q.id,
            prompt_tokens=prompt_tokens,
            predicted_output_tokens=predicted,
            arrived_at=self._stamp(),
        )
        self._residents[q.id] = resident
        writer = _ProgressWriter(self, q.id)
        attempt = 1
        try:  # a failure from here on unregisters it: its retry is not "a second copy"
            await self._best_effort(self.state.resident_add(self.instance_id, resident))
            self.metrics.queued.inc()
            acquired = False
            queued_at = time.time()
            try:
                if self._pacer is not None:
                    self.metrics.rate_paced_s.inc(await self._pacer.wait())
                async with self._sem:
                    acquired = True
                    slot_wait_s = time.time() - queued_at
                    self.metrics.queued.dec()
                    at.stage = "claim"
                    if not await self._claim(q.id):
                        # re-routed while it waited here (this instance went silent): the
                        # copy elsewhere owns the query and its budget reservation, so this
                        # one neither runs nor settles; its offset is finished, its resident
                        # and slot dropped
                        await self._skip_duplicate(q.id, "re-routed to another instance")
                        await self._best_effort(self.state.resident_done(self.instance_id, q.id))
                        return
                    starts = await self._best_effort(
                        self.state.mark_start(q.id, self._process_token, self.config.result_ttl_s),
                        default=Starts(number=1, processes=1),
                    )
                    attempt = starts.number
                    if starts.processes > MAX_RUNS:
                        # its worker died running it every time: never a crash loop on it
                        at.stage = "generate"
                        why = (
                            f"worker {self.instance_id}: query {q.id} was started by "
                            f"{starts.processes - 1} worker processes and none answered it (each "
                            f"died running it); not started again"
                        )
                        await self._dead_letter(rec, why, received, stage="generate")
                        await self._answer_error(rq, why)
                        return
                    if attempt > 1:
                        # started before, never answered: re-delivered after a crash mid-inference,
                        # a stage retried here, or a copy moved while it ran
                        log.info(
                            "worker %s: query %s start %d (by %d worker processes)",
                            self.instance_id, q.id, attempt, starts.processes,
                        )  # fmt: skip
                        self.metrics.reruns.inc()
                        self.counts["reruns"] += 1
                    at.stage = "generate"
                    self.metrics.in_flight.inc()
                    running_before = self._running
                    self._running += 1
                    relay = self._relay(rq, attempt)
                    self._prefix_started(rq, prompt_tokens)
                    try:
                        gen = await self._generate(
                            rq, prompt_tokens, predicted, writer, relay, slot_wait_s=slot_wait_s
                        )
                        if relay is not None:
                            await relay.finish(gen)
                    finally:
                        self._running -= 1
                        self.metrics.in_flight.dec()
            finally:
                if not acquired:
                    self.metrics.queued.dec()
            await writer.wait()
            at.stage = "result"
            result = self._result(rq, gen, received, attempt)
            at.stage = "publish"
            await self._publish(topics.RESULTS, q.id, _result_bytes(result))
            at.published, at.stage = True, "finish"
            # (it stays in _residents until finished, so a copy arriving now is skipped here)
            # mark published (with its cost), settle, free the slot: one round trip, at once —
            # a crash from here on re-delivers a query that is then skipped
            if not await self._finish(rq, result.cost_usd, _finished_of(gen)):
                self.metrics.duplicate_results.inc()
                self.counts["duplicate_results"] += 1
            # its prefix blocks are the most recent in this instance's cache (state.prefix)
            touch = touch_of(self.instance_id, q, self.spec, self.prefix_capacity_tokens)
            if touch is not None:
                await self._best_effort(self.state.prefix_touch_many([touch]))
            self._observe(result, gen)
            if self.config.report_timings:
                self._report_request(q.id, gen, running_before)
        finally:
            self._residents.pop(q.id, None)  # also when cancelled at shutdown or failed

    async def _skip_duplicate(self, qid: str, why: str = "already running or answered") -> None:
        self.metrics.duplicates_skipped.inc()
        self.counts["duplicates_skipped"] += 1
        log.info("worker %s: query %s skipped: %s", self.instance_id, qid, why)

    async def _claim(self, qid: str) -> bool:
        """Claim this instance's copy of ``qid`` right before running it (``StateStore.claim_run``).

        False: a rescuer re-routed it while this instance was silent. While a rescuer's lease
        is live but the re-route is not acknowledged yet, ask again (bounded by the lease: a
        rescuer that died lets this worker win). Redis unreachable: run it (best effort, as
        every state write here; a re-route then may duplicate inference, never lose it).
        """
        while True:
            outcome = await self._best_effort(
                self.state.claim_run(self.instance_id, qid, ttl_s=self.config.result_ttl_s),
                default="won",
            )
            if outcome == "won":
                return True
            if outcome == "lost":
                self.counts["rerouted_skipped"] += 1
                return False
            await asyncio.sleep(CLAIM_RETRY_S)

    def _stamp(self) -> float:
        """Wall-clock time, never going backwards within this worker."""
        self._last_stamp = max(time.time(), self._last_stamp + 1e-6)
        return self._last_stamp

    def _ledger_of(self, rq: RoutedQuery) -> tuple[str, str] | None:
        """(tenant, ledger period) the router reserved this query's cost in, if any."""
        if rq.decision.budget_period is not None:
            return rq.query.tenant, rq.decision.budget_period
        budget = next((t for t in self.cluster.tenants if t.tenant == rq.query.tenant), None)
        if budget is None:
            return None  # no ledger for this tenant
        return rq.query.tenant, period_id(rq.decision.decided_at, budget.period_s)

    async def _finish(
        self, rq: RoutedQuery, cost_usd: float, finished: FinishedRequest | None = None
    ) -> bool:
        """``StateStore.finish`` with retries; True unless the result had been marked before.
        ``finished``: what the engine ran, for the instance's recently-finished list."""
        ledger = self._ledger_of(rq)
        uncertain = False  # a failed attempt may have set the mark before the reply was lost
        deadline = time.monotonic() + self.config.finish_retry_s
        for attempt in itertools.count():
            try:
                first, _ = await self.state.finish(
                    self.instance_id,
                    rq.query.id,
                    result_ttl_s=self.config.result_ttl_s,
                    cost_usd=cost_usd,
                    tenant=ledger[0] if ledger else None,
                    period_id=ledger[1] if ledger else None,
                    finished=finished,
                )
                return first or uncertain
            except StateUnavailable as exc:
                uncertain = True
                self.metrics.error("state")
                pause_s = min(2.0, 0.2 * 2**attempt)
                if time.monotonic() + pause_s > deadline:
                    # unsettled: the reservation stays booked (conservative, never an overspend);
                    # the resync removes the resident, the slot lease reclaims the slot
                    log.error(
                        "worker %s: could not finish %s in Redis in %.0f s: %s",
                        self.instance_id,
                        rq.query.id,
                        self.config.finish_retry_s,
                        exc,
                    )
                    return True
                await asyncio.sleep(pause_s)
        return True

    def _relay(self, rq: RoutedQuery, attempt: int) -> RelayWriter | None:
        """A relay for a query a front door streams (``relay_topic``), else None."""
        topic = rq.query.relay_topic
        if topic is None or self._producer is None:
            return None
        producer = self._producer

        async def send(topic: str, key: bytes, value: bytes) -> Any:
            return await producer.send(topic, value=value, key=key)

        return RelayWriter(send, topic, rq.query.id, max(1, attempt), self.spec.name)

    async def _generate(
        self,
        rq: RoutedQuery,
        prompt_tokens: int,
        predicted: int,
        writer: _ProgressWriter,
        relay: RelayWriter | None = None,
        *,
        slot_wait_s: float = 0.0,
    ) -> Generation:
        q = rq.query
        k = max(1, self.config.progress_every_tokens)
        last = [0, -1]  # prefilled, decoded last written

        feed = self.step_feed

        def on_progress(prefilled: int, decoded: int) -> None:
            if feed is not None and decoded > 0:
                feed.progress(q.id, decoded, time.time())
            r = self._residents.get(q.id)
            if r is None:
                return
            prefilled = min(prefilled if decoded == 0 else r.prompt_tokens, r.prompt_tokens)
            # throttle: each prefill chunk, the first token, then every k tokens
            if decoded == 0 and prefilled == last[0]:
                return
            if decoded > 0 and last[1] > 0 and decoded - last[1] < k:
                return
            last[0], last[1] = prefilled, decoded
            self._residents[q.id] = r.model_copy(
                update={"prefilled_tokens": prefilled, "decoded_tokens": decoded}
            )
            writer.update(prefilled, decoded)

        req = GenerationRequest(
            q,
            f"{q.id}.{uuid.uuid4().hex[:8]}",
            prompt_tokens,
            predicted,
            on_text=relay.text if relay is not None else None,
            output_cap_tokens=self.spec.output_cap_tokens(q, prompt_tokens),
        )
        if feed is not None:
            feed.sent(
                q.id,
                prompt_tokens,
                predicted,
                time.time(),
                predicted_ttft_ms=rq.decision.predicted_ttft_ms,
                decided_at=rq.decision.decided_at,
                slot_wait_s=slot_wait_s,
            )
        gen: Generation | None = None
        try:
            gen = await self.backend.generate(req, on_progress)
            return gen
        except Exception as exc:  # a backend bug is still an error Result, never silence
            log.exception(
                "worker %s: backend %s raised on query %s",
                self.instance_id,
                self.backend.name,
                q.id,
            )
            now = time.time()
            return Generation(
                "",
                prompt_tokens,
                0,
                now,
                None,
                now,
                error=f"backend {self.backend.name} failed: {exc!r}",
            )
        finally:  # also when cancelled: the request leaves the feed's view of the engine
            if feed is not None:
                ok = gen is not None and gen.error is None
                feed.finished(
                    q.id,
                    gen.engine_ttft_ms if ok and gen is not None else None,
                    gen.first_token_at if ok and gen is not None else None,
                    gen.prompt_tokens if ok and gen is not None and gen.usage_reported else None,
                )

    def _result(self, rq: RoutedQuery, gen: Generation, received: float, attempt: int) -> Result:
        q = rq.query
        origin = received
        if q.created_at is not None and 0 < q.created_at <= gen.finished_at:
            origin = q.created_at
        ttft_ms = (
            None if gen.first_token_at is None else max(0.0, (gen.first_token_at - origin) * 1000.0)
        )
        # prompt tokens the engine found cached are billed at the cached-input price
        cost = (
            self.spec.cost_usd(gen.prompt_tokens, gen.output_tokens, gen.cached_tokens or 0)
            if gen.output_tokens > 0
            else 0.0
        )
        slo_met = False if gen.error is not None or ttft_ms is None else ttft_ms <= q.ttft_slo_ms
        return Result(
            query_id=q.id,
            tenant=q.tenant,
            instance_id=self.instance_id,
            model=self.spec.name,
            text=gen.text,
            ttft_ms=ttft_ms,
            e2e_ms=max(0.0, (gen.finished_at - origin) * 1000.0),
            prompt_tokens=gen.prompt_tokens,
            output_tokens=gen.output_tokens,
            cached_tokens=gen.cached_tokens,
            cost_usd=cost,
            slo_met=slo_met,
            error=gen.error,
            finish_reason=gen.finish_reason,
            attempt=max(1, attempt),
            finished_at=gen.finished_at,
        )

    def _observe(self, result: Result, gen: Generation) -> None:
        self.counts["results"] += 1
        if result.error is None:
            self.metrics.results_ok.inc()
        else:
            self.counts["errors"] += 1
            self.metrics.results_error.inc()
            self.metrics.error("backend")
            log.warning(
                "worker %s: query %s failed: %s", self.instance_id, result.query_id, result.error
            )
        self.metrics.cost_usd.inc(result.cost_usd)
        self.metrics.output_tokens.inc(result.output_tokens)
        (self.metrics.slo_met if result.slo_met else self.metrics.slo_missed).inc()
        if gen.engine_ttft_ms is not None:
            self.metrics.ttft.observe(gen.engine_ttft_ms / 1000.0)
        self.metrics.e2e.observe(max(0.0, gen.finished_at - gen.sent_at))

    async def _settle(self, rq: RoutedQuery, cost_usd: float) -> None:
        ledger = self._ledger_of(rq)
        if ledger is not None:
            await self._best_effort(self.state.settle(ledger[0], ledger[1], rq.query.id, cost_usd))

    # ------------------------------------------------------------------ Kafka output

    async def _publish(self, topic: str, key: str, value: bytes) -> None:
        assert self._producer is not None
        try:
            await self._producer.send_and_wait(topic, value=value, key=key.encode())
        except KafkaError as exc:
            self.metrics.error("publish")
            raise WorkerFatal(f"cannot publish to {topic}: {exc!r}") from exc

    async def _dead_letter(
        self, rec: ConsumerRecord[Any, Any], reason: str, received: float, stage: str = "worker"
    ) -> None:
        raw = rec.value if isinstance(rec.value, bytes | bytearray) else b""
        dl = DeadLetter.of(
            bytes(raw), reason, rec.topic, rec.partition, rec.offset, received, stage=stage
        )
        await self._publish(
            topics.DEAD_LETTERS,
            f"{rec.topic}:{rec.partition}:{rec.offset}",
            dl.model_dump_json().encode(),
        )
        self.metrics.dead_letters.inc()
        self.counts["dead_letters"] += 1
        log.warning(
            "worker %s: dead letter at %s[%d]@%d: %s",
            self.instance_id,
            rec.topic,
            rec.partition,
            rec.offset,
            reason,
        )

    def _send_nowait(self, topic: str, key: str, value: bytes) -> None:
        """Fire-and-forget (timings are advisory): failures are counted, never fatal."""
        if self._producer is None:
            return

        async def go() -> None:
            try:
                assert self._producer is not None
                await self._producer.send_and_wait(topic, value=value, key=key.encode())
            except Exception:
                self.metrics.error("timings")

        task = asyncio.create_task(go())
        self._tasks_bg.add(task)
        task.add_done_callback(self._tasks_bg.discard)

    def _report_request(self, qid: str, gen: Generation, residents_ahead: int) -> None:
        tpot = None
        if gen.first_token_at is not None and gen.output_tokens > 1:
            tpot = max(
                0.0, (gen.finished_at - gen.first_token_at) * 1000.0 / (gen.output_tokens - 1)
            )
        if gen.error is not None:
            return
        rt = RequestTiming(
            instance_id=self.instance_id,
            model=self.spec.name,
            query_id=qid,
            at=time.time(),
            prompt_tokens=gen.prompt_tokens,
            output_tokens=gen.output_tokens,
            engine_ttft_ms=gen.engine_ttft_ms,
            engine_e2e_ms=max(0.0, (gen.finished_at - gen.sent_at) * 1000.0),
            tpot_ms=tpot,
            residents_ahead=residents_ahead,
            backend=self.backend.name,
        )
        self._send_nowait(topics.STEP_TIMINGS, self.instance_id, rt.model_dump_json().encode())

    def _report_steps(self) -> None:
        drain = getattr(self.backend, "drain_steps", None)
        if drain is None or not self.config.report_timings:
            return
        steps = drain()
        n = len(steps.duration_ms)
        for start in range(0, n, MAX_STEPS_PER_MESSAGE):
            sl = slice(start, start + MAX_STEPS_PER_MESSAGE)
            batch = StepBatch(
                instance_id=self.instance_id,
                model=self.spec.name,
                at=time.time(),
                n_tokens=steps.n_tokens[sl].tolist(),
                decode_ctx_tokens=steps.decode_ctx_tokens[sl].tolist(),
                prefill_attn_units=steps.prefill_attn_units[sl].tolist(),
                duration_ms=steps.duration_ms[sl].tolist(),
            )
            self._send_nowait(
                topics.STEP_TIMINGS, self.instance_id, batch.model_dump_json().encode()
            )

    # ------------------------------------------------------------------ heartbeats

    async def _heartbeat_loop(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            n += 1
            await self._heartbeat_once(resync=n % max(1, self.config.resync_every) == 0)
            self._report_steps()
            try:
                await self._refit_step_time()
            except Exception:  # advisory: a refit bug must never stop the heartbeats
                log.exception("worker %s: step-time refit failed", self.instance_id)
                self.metrics.error("step_time")

    async def _heartbeat_once(self, resync: bool) -> None:
        load = await self.backend.engine_load()
        if not load.answering:
            # engine liveness: a heartbeat says "route here", so an engine that does not
            # answer drops it at once (routers see the instance dead within one interval)
            if not self._engine_lost:
                self._engine_lost = True
                self.counts["engine_lost"] += 1
                self.metrics.engine_up.set(0)
                log.error(
                    "worker %s: engine stopped answering (%s); instance unavailable until it "
                    "answers again", self.instance_id, load.problem,
                )  # fmt: skip
            await self._best_effort(self.state.instance_down(self.instance_id))
            return
        if not self._model_checked:
            try:
                problem = await self.backend.model_problem()
            except EngineUnavailable:
                return  # answered /health, not /v1/models yet: still unavailable
            if problem is not None:
                self._fatal = WorkerFatal(self._wrong_model(problem))  # stops consuming
                return
            self._model_checked = True
        if self.step_feed is not None:
            self.step_feed.engine_counts(load.running, load.waiting)
        self._prefix_scrape(load)
        if self._engine_lost:
            self._engine_lost = False
            self.metrics.engine_up.set(1)
            log.warning("worker %s: engine answers again; instance available", self.instance_id)
        await self._best_effort(
            self.state.heartbeat(
                self.instance_id,
                self.spec.name,
                self.heartbeat_ttl_s,
                self.concurrency,
                engine_running=load.running,
                engine_waiting=load.waiting,
                engine_kv_usage=load.kv_usage,
            )
        )
        if resync:
            # the worker's own view is the truth: repairs drift and rebuilds after Redis lost state
            view_at = self._stamp()
            view = list(self._residents.values())
            await self._best_effort(
                self.state.residents_sync(self.instance_id, view, view_at=view_at)
            )

    def _prefix_started(self, rq: RoutedQuery, prompt_tokens: int) -> None:
        """The engine is about to look this request's prompt up in its prefix cache: what
        the router's model predicted it holds (``Decision.predicted_cached_tokens``, none
        when the router did not say) goes to the reconciler."""
        if self.prefix_reconciler is None:
            return
        predicted = float(rq.decision.predicted_cached_tokens or 0)
        self.prefix_reconciler.served(predicted)
        self._prefix_predicted_tokens += predicted
        self._prefix_prompt_tokens += max(0, prompt_tokens)
        if self._prefix_prompt_tokens > 0:
            self.metrics.model_prefix_hit_rate.set(
                self._prefix_predicted_tokens / self._prefix_prompt_tokens
            )

    def _prefix_scrape(self, load: EngineLoad) -> None:
        """One scrape of the engine's prefix-cache counters: its hit rate as a gauge, and
        a new model capacity when the model's predictions and the engine disagree (stored
        with this worker's next touch: ``state.prefix.touch_of``)."""
        rec = self.prefix_reconciler
        if rec is None or load.prefix_counters is None:
            return
        new = rec.scrape(load.prefix_counters)
        if rec.engine_hit_rate is not None:
            self.metrics.engine_prefix_hit_rate.set(rec.engine_hit_rate)
        if new is not None:
            log.info(
                "worker %s: prefix model capacity %.0f -> %.0f tokens (engine hit counters)",
                self.instance_id, self.prefix_capacity_tokens or rec.max_tokens, new,
            )  # fmt: skip
            self.prefix_capacity_tokens = new
            self.metrics.prefix_capacity_tokens.set(new)

    async def _refit_step_time(self, force: bool = False) -> None:
        """Every ``step_time_refit_s``: refit Eq. 9 on the feed's window, show it in the
        metrics and, once the window has ``min_rows`` observations, publish it to Redis."""
        feed = self.step_feed
        if feed is None:
            return
        now = time.monotonic()
        if not force and now - self._refit_at < self.config.step_time_refit_s:
            return
        self._refit_at = now
        fit = feed.refit()
        coef = fit.model.to_coefficients()
        self.metrics.step_time(coef.model_dump())
        self.metrics.step_time_rows.set(fit.n_rows)
        if math.isfinite(fit.mape):
            self.metrics.step_time_fit_error.set(fit.mape)
        router_err, refit_err = feed.ttft_error("router"), feed.ttft_error("refit")
        if router_err is not None:
            self.metrics.live_ttft_error("router", router_err)
        if refit_err is not None:
            self.metrics.live_ttft_error("refit", refit_err)
        if fit.n_rows < feed.config.refit.min_rows:
            return
        version = await self._best_effort(
            self.state.step_time_publish(
                self.spec.name,
                coef,
                rows=fit.n_rows,
                instance_id=self.instance_id,
                ttl_s=self.config.step_time_ttl_s,
                fit_mape=fit.mape,
                ttft_error=router_err,
                dispatch_ms=feed.dispatch_ms(),
            )
        )
        if version is not None:
            self.metrics.step_time_version.set(version)

    async def _best_effort(self, aw: Awaitable[T], default: Any = None) -> Any:
        try:
            return await aw
        except StateUnavailable as exc:
            self.metrics.error("state")
            log.debug("worker %s: state write skipped: %s", self.instance_id, exc)
            return default


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        await self.worker._commit()
        self.worker._tracker.forget(list(revoked))

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        return None


def _result_bytes(result: Result) -> bytes:
    """The Result's JSON, with its text cut to fit one Kafka message (marked as cut)."""
    body = result.model_dump_json().encode()
    if len(body) <= MAX_RESULT_BYTES:
        return body
    over = len(body) - MAX_RESULT_BYTES
    keep = max(0, len(result.text.encode()) - over - 200)
    text = result.text.encode()[:keep].decode("utf-8", "ignore")
    cut = result.model_copy(
        update={"text": text + f" …[truncated {len(result.text) - len(text)} characters]"}
    )
    return cut.model_dump_json().encode()


def _finished_of(gen: Generation) -> FinishedRequest | None:
    """What the engine ran for one request (sent to it, last token, tokens), for the
    routers' catch-up; None when it produced nothing (it took no decode steps, and a
    request refused at once took none at all)."""
    if gen.output_tokens < 1 or gen.sent_at <= 0:
        return None
    return FinishedRequest(
        prompt_tokens=max(0, int(gen.prompt_tokens)),
        output_tokens=int(gen.output_tokens),
        arrived_at=float(gen.sent_at),
        finished_at=max(float(gen.sent_at), float(gen.finished_at)),
    )
