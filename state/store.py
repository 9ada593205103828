"""``StateStore``: the service's shared state in Redis (DESIGN.md, "state/").

Workers write instance live state (heartbeats with a TTL, resident requests and their
token progress); routers read every instance's snapshot in one pipelined round trip and
reserve capacity slots and budget; result handlers settle the budget ledger.

Every read-modify-write is one Lua script (``state/lua/``), never read-then-write, so any
number of routers and workers stay correct together. Every script is idempotent per query
id, so a retry after a lost reply or a re-delivered Kafka message changes nothing twice.
Money is kept in integer nano-USD: comparisons against a budget are exact.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal, TypeVar, cast

import redis
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript
from redis.exceptions import (
    AskError,
    ClusterError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from schemas import InstanceSnapshot, ResidentRequest, StepTimeCoefficients
from state.cluster import (
    StateConfigError,
    check_cluster,
    check_single,
    cluster_client,
    is_cluster_url,
)
from state.keys import Keys, dedupe_bucket

T = TypeVar("T")

NANO_PER_USD = 1_000_000_000
MAX_LEDGER_NANO = (
    2**53
)  # exact integers in Lua's doubles: about 9 million USD per tenant and period
RESIDENTS_KEEP_S = 600.0  # residents of a worker that stopped writing vanish after this
LEDGER_KEEP_S = 86_400.0  # a ledger period stays readable this long after it ends
SCRIPTS = (
    "heartbeat",
    "resident_add",
    "resident_progress",
    "resident_done",
    "residents_reconcile",
    "reserve_slots",
    "reserve_budget",
    "release_budget",
    "settle",
    "dedupe",
    "mark_routed",
    "mark_intent",
    "snapshot",
    "residents_sync",
    "ledger_lease",
    "ledger_mark",
    "ledger_rebuild",
    "claim",
    "attempt",
    "step_time",
)
LEDGER_REBUILD_CHUNK = 1000  # query ids per ledger_rebuild call: Redis never blocks long
TOMBSTONE_KEEP_S = 3600.0  # a done resident is not re-added by a resync for this long

Verdict = Literal["new", "duplicate", "conflict"]
ClaimOutcome = Literal["won", "lost", "wait", "busy"]
CLAIM_TTL_S = 7 * 86_400.0  # as long as a result mark: a copy can wait that long in Kafka


class StateUnavailable(RuntimeError):
    """Redis could not be reached or timed out; callers fall back (LPS estimates, blind budget)."""


# What a Redis (Cluster) that is not serving right now answers; each goes away by itself:
# the node is unreachable or timed out; a failover is under way (CLUSTERDOWN, MASTERDOWN,
# TRYAGAIN, a slot no primary serves yet, redirections that do not settle: ClusterError
# "TTL exhausted"); a write reached a primary demoted to a replica (READONLY); a node still
# loading its AOF (LOADING, a ConnectionError in redis-py); a primary that refuses writes
# under ``min-replicas-to-write`` until a replica is back (NOREPLICAS); a full Redis under
# ``noeviction`` (OOM, docs/deploy.md). Each is a
# ``StateUnavailable``, so routers route blind and workers skip best-effort writes, as for
# a Redis that is down. Before, only the first kind was: during a Redis Cluster failover
# the others reached a worker as failures of the message's own, and lost queries
# (docs/reliability.md, bug 19).
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterError,  # ClusterDownError, MasterDownError, "TTL exhausted"
    TryAgainError,
    SlotNotCoveredError,
    ReadOnlyError,
    AskError,  # MovedError too: a redirection the client could not follow
    OutOfMemoryError,  # maxmemory with noeviction: writes refused until TTLs free memory
)


_REDIS_PY = os.path.dirname(redis.__file__)


def unavailable(exc: BaseException, *, cluster: bool = False) -> bool:
    """True for an error that means Redis is not serving right now (``UNAVAILABLE_ERRORS``,
    or redis-py's "cannot be connected" after a failed re-discovery of the cluster).

    ``cluster``: the error came out of a call of redis-py's cluster client. On CLUSTERDOWN
    that client closes every connection of the cluster, also those other tasks are using,
    which then fail inside redis-py with ``AttributeError`` (``'NoneType' object has no
    attribute 'writelines'``) or ``RuntimeError``; raised from redis-py's own code, those
    are the failover too (seen in scenario 15)."""
    if isinstance(exc, UNAVAILABLE_ERRORS):
        return True
    if cluster and isinstance(exc, AttributeError | RuntimeError) and _raised_in_redis_py(exc):
        return True
    if isinstance(exc, ResponseError) and str(exc).startswith("NOREPLICAS"):
        return True  # a primary under ``min-replicas-to-write`` without its replicas
    return isinstance(exc, RedisClusterException) and isinstance(exc.__cause__, UNAVAILABLE_ERRORS)


def _raised_in_redis_py(exc: BaseException) -> bool:
    """True when a frame of redis-py's own code is on ``exc``'s traceback."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_REDIS_PY):
            return True
        tb = tb.tb_next
    return False


@dataclass(frozen=True)
class InstanceLive:
    """One instance as the router sees it.

    ``snapshot`` is None when there is no live heartbeat (never started, or its TTL ran
    out): the router then uses LPS estimates. ``age_s`` is ``now - taken_at`` (``inf``
    without a snapshot); ``slots_used`` counts capacity slots held by routed, unfinished
    queries (queued in Kafka or running).
    """

    instance_id: str
    snapshot: InstanceSnapshot | None
    slots_used: int
    alive: bool
    age_s: float
    max_concurrency: int | None = None
    engine_running: int | None = None  # as the engine itself reports (vLLM /metrics)
    engine_waiting: int | None = None
    engine_kv_usage: float | None = None  # KV-cache usage, 0..1

    def free_slots(self, max_slots: int) -> int:
        return max(0, max_slots - self.slots_used)


@dataclass(frozen=True)
class LiveStepTime:
    """One model's Eq. 9 coefficients as its workers refit them online
    (``routing.recalibration``): the last write wins; ``version`` counts the writes."""

    model: str
    coefficients: StepTimeCoefficients
    version: int
    at: float  # unix seconds of the write
    rows: int  # observations in the writer's window
    instance_id: str  # the worker that wrote it
    fit_mape: float | None = None  # the fit's error on its rows (a fraction)
    ttft_error: float | None = None  # the writer's recent |predicted - measured| / measured

    def age_s(self, now: float) -> float:
        return max(0.0, now - self.at)


@dataclass(frozen=True)
class BudgetStatus:
    """One tenant's ledger for one period. ``limit_usd`` is None until a reservation set it."""

    tenant: str
    period_id: str
    limit_usd: float | None
    reserved_usd: float
    spent_usd: float
    n_reserved: int = 0
    n_settled: int = 0

    @property
    def committed_usd(self) -> float:
        return self.reserved_usd + self.spent_usd

    def remaining_usd(self, limit_usd: float | None = None) -> float:
        """``limit - reserved - spent`` (never negative), for ``limit_usd`` or the stored limit."""
        limit = self.limit_usd if limit_usd is None else limit_usd
        if limit is None:
            raise ValueError(
                f"tenant {self.tenant!r} period {self.period_id!r} has no stored limit; pass limit_usd"
            )
        return max(0.0, limit - self.committed_usd)


@dataclass(frozen=True)
class ResultMark:
    """A result was published; ``cost_usd`` as the worker settled it (None if not recorded)."""

    cost_usd: float | None


@dataclass(frozen=True)
class DedupeEntry:
    body_sha256: str
    routed_to: str | None
    intent: RouteIntent | None = None


@dataclass(frozen=True)
class RouteIntent:
    """Where a router was sending a query, and the exact decision, before Kafka acknowledged it."""

    instance_id: str
    decision_json: str
    # set by a router re-routing a rescued copy (``streams.rescue``): the silent instance the
    # query was routed to. Not stored: ``mark_intent_many`` lets such an intent replace the
    # original routing, which would otherwise count as "taken" and drop the re-routed copy.
    rerouted_from: str | None = None


def period_id(now_s: float, period_s: float) -> str:
    """Ledger period containing ``now_s``: ``"<period_s>s-<index>"``, e.g. ``"86400s-20421"``."""
    if not math.isfinite(period_s) or period_s <= 0:
        raise ValueError(f"period_s must be a finite number > 0, got {period_s}")
    if not math.isfinite(now_s) or now_s < 0:
        raise ValueError(f"now_s must be a finite number >= 0, got {now_s}")
    length = str(int(period_s)) if float(period_s).is_integer() else f"{period_s:.6f}".rstrip("0")
    return f"{length}s-{int(now_s // period_s)}"


def period_bounds(period: str) -> tuple[float, float] | None:
    """(start_s, end_s) of a ``period_id`` string, None for a free-form period name."""
    length, sep, index = period.partition("s-")
    if not sep or not index.isdigit():
        return None
    try:
        p = float(length)
    except ValueError:
        return None
    if not math.isfinite(p) or p <= 0:
        return None
    return int(index) * p, (int(index) + 1) * p


def usd_to_nano(usd: float, what: str, *, round_up: bool = True) -> int:
    """USD → integer nano-USD; reservations round up so rounding never lets spend through."""
    if not isinstance(usd, int | float) or not math.isfinite(usd) or usd < 0:
        raise ValueError(f"{what} must be a finite number >= 0 USD, got {usd!r}")
    scaled = usd * NANO_PER_USD
    nano = math.ceil(scaled - 1e-6) if round_up else math.floor(scaled + 1e-6)
    nano = max(0, nano)
    if nano > MAX_LEDGER_NANO:
        raise ValueError(
            f"{what} = {usd} USD is over the ledger's cap of {MAX_LEDGER_NANO / NANO_PER_USD:.0f} USD"
        )
    return nano


def _seconds_ms(value: float, what: str) -> int:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{what} must be a finite number of seconds > 0, got {value}")
    return max(1, int(value * 1000))


def _count(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return value


def _fraction(value: float, what: str) -> float:
    if not isinstance(value, int | float) or not math.isfinite(value) or not 0 <= value <= 1:
        raise ValueError(f"{what} must be a number in [0, 1], got {value!r}")
    return float(value)


def _encode_resident(r: ResidentRequest) -> str:
    return f"{r.prompt_tokens},{r.prefilled_tokens},{r.decoded_tokens},{r.predicted_output_tokens},{r.arrived_at!r}"


def _decode_resident(query_id: str, text: str) -> ResidentRequest | None:
    """Parse one resident record; a malformed one is skipped rather than failing the snapshot."""
    try:
        p, f, d, o, a = text.split(",")
        prompt, prefilled, decoded = max(0, int(p)), max(0, int(f)), max(0, int(d))
        predicted, arrived = max(1, int(o)), max(0.0, float(a))
    except ValueError:
        return None
    prefilled = min(prefilled, prompt)
    if decoded > 0:
        prefilled = prompt
    # fields are sanitised above; skip pydantic validation on the router's hot path
    return ResidentRequest.model_construct(
        query_id=query_id,
        prompt_tokens=prompt,
        prefilled_tokens=prefilled,
        decoded_tokens=decoded,
        predicted_output_tokens=predicted,
        arrived_at=arrived,
    )


def _opt_int(value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(float(value))
    except ValueError:
        return None


def is_cluster_client(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)


class StateStore:
    """Async access to Switchyard's Redis state; one per process, safe to share across tasks."""

    def __init__(self, client: aioredis.Redis, keys: Keys, display_url: str) -> None:
        self._r = client
        self._cluster = is_cluster_client(client)
        self.keys = keys
        self.display_url = display_url
        self._snap_cache: dict[str, dict[str, tuple[str, ResidentRequest]]] = {}
        # redis-py's cluster client raises MaxConnectionsError where the single-node blocking
        # pool waits: at most this many calls in flight (one connection per node each)
        self._gate: asyncio.Semaphore | None = None
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(
                resources.files("state").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")
            )
            for name in SCRIPTS
        }

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        password: str | None = None,
        tls_ca_file: str | None = None,
        namespace: str = "sy",
        max_connections: int = 64,
        socket_timeout_s: float = 10.0,
    ) -> StateStore:
        """Connect and check with PING; raise ``StateUnavailable`` naming the (password-free) URL."""
        from wiring.settings import redact_url

        display = redact_url(url)
        kwargs: dict[str, Any] = {
            "decode_responses": True,
            "max_connections": max_connections,
            "timeout": socket_timeout_s,  # wait for a free pooled connection
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": min(5.0, socket_timeout_s),
            "health_check_interval": 30,
        }
        if password is not None:
            kwargs["password"] = password
        if tls_ca_file:
            if not url.startswith(("rediss://", "rediss+cluster://")):
                raise ValueError(f"a Redis TLS CA file needs a rediss:// URL, got {display}")
            kwargs["ssl_ca_certs"] = tls_ca_file
        if is_cluster_url(url):  # see state/cluster.py: every slot served, or an error at start
            client = cluster_client(url, kwargs)
            store = cls(client, Keys(namespace), display)
            store._gate = asyncio.Semaphore(max_connections)
            try:
                await store._call("connect", client.initialize())
                await store._call("connect", check_cluster(client, display))
            except BaseException as exc:
                await client.aclose()
                unreachable = (RedisConnectionError, RedisTimeoutError, OSError)
                if isinstance(exc.__cause__, unreachable):
                    raise StateUnavailable(
                        f"Redis Cluster at {display} unavailable during connect: {exc}"
                    ) from exc
                if isinstance(exc, RedisClusterException | RedisError) and not isinstance(
                    exc, unreachable
                ):  # e.g. "Cluster mode is not enabled on this node"
                    raise StateConfigError(f"Redis Cluster at {display}: {exc}") from exc
                raise
            return store
        pool = aioredis.BlockingConnectionPool.from_url(url, **kwargs)
        client = aioredis.Redis(connection_pool=pool)
        store = cls(client, Keys(namespace), display)
        try:
            await store._call("connect", client.ping())
            await store._call("connect", check_single(client, display))
        except BaseException:
            await client.aclose(close_connection_pool=True)
            raise
        return store

    async def close(self) -> None:
        if is_cluster_client(self._r):
            await self._r.aclose()
        else:
            await self._r.aclose(close_connection_pool=True)

    async def ping(self) -> bool:
        try:
            return bool(await self._r.ping())
        except (RedisError, OSError):
            return False

    async def _call(self, op: str, awaitable: Awaitable[T]) -> T:
        try:
            if self._gate is not None:
                async with self._gate:
                    return await awaitable
            return await awaitable
        except Exception as exc:
            if isinstance(exc, StateConfigError) or not unavailable(exc, cluster=self._cluster):
                raise
            raise StateUnavailable(
                f"Redis at {self.display_url} unavailable during {op}: {type(exc).__name__}: {exc}"
            ) from exc

    def _raise_reply(self, op: str, reply: BaseException) -> None:
        """Raise an error reply of a ``raise_on_error=False`` pipeline as ``_call`` would."""
        if unavailable(reply, cluster=self._cluster):
            raise StateUnavailable(
                f"Redis at {self.display_url} unavailable during {op}: "
                f"{type(reply).__name__}: {reply}"
            ) from reply
        raise reply

    async def _script_many(
        self,
        name: str,
        calls: Sequence[tuple[Sequence[str], Sequence[Any]]],
        extra: Sequence[tuple[str, ...]] = (),
    ) -> list[Any]:
        """One script over many key sets in one pipelined round trip (EVALSHA; loads it once
        if the server lost it, e.g. after a restart); ``extra`` plain commands (a command
        name and its key first) ride in the same round trip, their replies last."""
        script = self._scripts[name]
        for attempt in (0, 1):
            pipe: Pipeline = self._r.pipeline(transaction=False)
            for keys, args in calls:
                # execute_command, not evalsha(): redis-py's cluster pipeline blocks the
                # helper but routes the raw command by its first key's slot
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            for command in extra:
                pipe.execute_command(*command)
            try:
                return cast(list[Any], await self._call(name, pipe.execute()))
            except NoScriptError:
                if attempt:
                    raise
                await self._call(name, self._r.script_load(script.script))
        raise AssertionError("unreachable")

    async def _script(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return await self._call(name, self._scripts[name](keys=list(keys), args=list(args)))

    # ------------------------------------------------------------------ worker writes

    async def heartbeat(
        self,
        instance_id: str,
        model: str,
        ttl_s: float,
        max_concurrency: int,
        *,
        engine_running: int | None = None,
        engine_waiting: int | None = None,
        engine_kv_usage: float | None = None,
        now: float | None = None,
    ) -> None:
        """Mark the instance alive for ``ttl_s``; refresh its residents and their slots' leases."""
        ttl_ms = _seconds_ms(ttl_s, "heartbeat ttl_s")
        _count(max_concurrency, "max_concurrency")
        keep_ms = _seconds_ms(max(RESIDENTS_KEEP_S, 10 * ttl_s), "residents keep")
        k = self.keys
        await self._script(
            "heartbeat",
            [k.heartbeat(instance_id), k.residents(instance_id), k.slots(instance_id)],
            [
                model,
                max_concurrency,
                repr(time.time() if now is None else now),
                ttl_ms,
                keep_ms,
                "" if engine_running is None else _count(engine_running, "engine_running"),
                "" if engine_waiting is None else _count(engine_waiting, "engine_waiting"),
                ""
                if engine_kv_usage is None
                else repr(_fraction(engine_kv_usage, "engine_kv_usage")),
            ],
        )

    async def resident_add(
        self, instance_id: str, r: ResidentRequest, *, now: float | None = None
    ) -> None:
        k = self.keys
        await self._script(
            "resident_add",
            [
                k.heartbeat(instance_id),
                k.residents(instance_id),
                k.slots(instance_id),
                k.gone(instance_id),
            ],
            [
                r.query_id,
                _encode_resident(r),
                repr(time.time() if now is None else now),
                int(RESIDENTS_KEEP_S * 1000),
            ],
        )

    async def resident_progress(
        self,
        instance_id: str,
        query_id: str,
        prefilled_tokens: int,
        decoded_tokens: int,
        *,
        now: float | None = None,
    ) -> None:
        """Update token counts; a no-op when the resident is gone (``resident_done`` won a race)."""
        k = self.keys
        await self._script(
            "resident_progress",
            [k.heartbeat(instance_id), k.residents(instance_id)],
            [
                k.check_query_id(query_id),
                _count(prefilled_tokens, "prefilled_tokens"),
                _count(decoded_tokens, "decoded_tokens"),
                repr(time.time() if now is None else now),
            ],
        )

    async def resident_done(
        self, instance_id: str, query_id: str, *, now: float | None = None
    ) -> None:
        """Remove the resident and release its capacity slot. Idempotent."""
        k = self.keys
        await self._script(
            "resident_done",
            [
                k.heartbeat(instance_id),
                k.residents(instance_id),
                k.slots(instance_id),
                k.gone(instance_id),
            ],
            [
                k.check_query_id(query_id),
                repr(time.time() if now is None else now),
                repr(TOMBSTONE_KEEP_S),
            ],
        )

    async def residents_reconcile(self, instance_id: str, keep_query_ids: Sequence[str]) -> int:
        """Drop residents not in ``keep_query_ids`` (what the worker really runs); return how many."""
        ids = [self.keys.check_query_id(q) for q in keep_query_ids]
        return int(
            await self._script("residents_reconcile", [self.keys.residents(instance_id)], ids)
        )

    async def residents_sync(
        self,
        instance_id: str,
        residents: Sequence[ResidentRequest],
        *,
        view_at: float | None = None,
    ) -> int:
        """Make Redis hold the worker's own view of its residents (drift, Redis restarts).

        ``view_at``: when the view was taken. Residents done since then are not re-added
        (tombstones), and residents added since then (``arrived_at > view_at``) are not
        removed, so a resync never undoes a concurrent add or done. None: replace outright.
        Returns how many residents were dropped.
        """
        k = self.keys
        args: list[Any] = [
            "1e300" if view_at is None else repr(view_at),
            int(RESIDENTS_KEEP_S * 1000),
        ]
        for r in residents:
            args += [r.query_id, _encode_resident(r)]
        return int(
            await self._script(
                "residents_sync", [k.residents(instance_id), k.gone(instance_id)], args
            )
        )

    async def residents(self, instance_id: str) -> list[ResidentRequest]:
        """The instance's residents in arrival order (also for tests and the CLI)."""
        raw = await self._call("residents", self._r.hgetall(self.keys.residents(instance_id)))
        return _residents_of(cast(dict[str, str], raw))

    # ------------------------------------------------------------------ router reads

    async def snapshots(self, instance_ids: Sequence[str], now: float) -> dict[str, InstanceLive]:
        """Every instance's live state in one pipelined round trip."""
        live, _ = await self.snapshots_and_step_times(instance_ids, (), now)
        return live

    async def snapshots_and_step_times(
        self, instance_ids: Sequence[str], models: Sequence[str], now: float
    ) -> tuple[dict[str, InstanceLive], dict[str, LiveStepTime]]:
        """Every instance's live state and the online step-time coefficients of ``models``
        (those with a record), in one pipelined round trip."""
        k = self.keys
        ids = list(dict.fromkeys(instance_ids))
        names = list(dict.fromkeys(models))
        replies = await self._script_many(
            "snapshot",
            [([k.heartbeat(iid), k.residents(iid), k.slots(iid)], []) for iid in ids],
            extra=[("HGETALL", k.step_time(m)) for m in names],
        )
        out: dict[str, InstanceLive] = {}
        for iid, (hb_blob, res_blob, slots) in zip(ids, replies[: len(ids)], strict=True):
            hb = _pairs(hb_blob)
            res = _pairs(res_blob)
            slots_used = int(slots)
            taken_at = _opt_float(hb.get("at")) if hb else None
            if not hb or taken_at is None:
                out[iid] = InstanceLive(iid, None, slots_used, False, math.inf)
                continue
            snap = InstanceSnapshot.model_construct(
                instance_id=iid,
                model=hb.get("model", ""),
                taken_at=taken_at,
                residents=self._residents_cached(iid, res),
                healthy=True,
                source="redis",
            )
            out[iid] = InstanceLive(
                iid,
                snap,
                slots_used,
                True,
                max(0.0, now - taken_at),
                max_concurrency=_opt_int(hb.get("max_concurrency")),
                engine_running=_opt_int(hb.get("engine_running")),
                engine_waiting=_opt_int(hb.get("engine_waiting")),
                engine_kv_usage=_opt_float(hb.get("engine_kv_usage")),
            )
        steps: dict[str, LiveStepTime] = {}
        for m, raw in zip(names, replies[len(ids) :], strict=True):
            rec = _live_step_time(m, raw)
            if rec is not None:
                steps[m] = rec
        return out, steps

    def _residents_cached(self, instance_id: str, raw: Mapping[str, str]) -> list[ResidentRequest]:
        """Parse residents, reusing the (frozen) objects whose record did not change since the
        last snapshot: between two windows most residents are unchanged, and building a
        pydantic object costs more than the rest of the read."""
        prev = self._snap_cache.get(instance_id, {})
        cur: dict[str, tuple[str, ResidentRequest]] = {}
        for qid, text in raw.items():
            hit = prev.get(qid)
            if hit is not None and hit[0] == text:
                cur[qid] = hit
            elif (r := _decode_resident(qid, text)) is not None:
                cur[qid] = (text, r)
        self._snap_cache[instance_id] = cur
        rs = [r for _, r in cur.values()]
        rs.sort(key=lambda r: (r.arrived_at, r.query_id))
        return rs

    # ------------------------------------------------------------------ dedupe

    async def dedupe(self, query_id: str, body_sha256: str, ttl_s: float) -> Verdict:
        """``new`` the first time an id is seen, then ``duplicate`` (same body) or ``conflict``."""
        return (await self.dedupe_ex(query_id, body_sha256, ttl_s))[0]

    async def dedupe_ex(
        self, query_id: str, body_sha256: str, ttl_s: float
    ) -> tuple[Verdict, str | None]:
        """``dedupe`` plus the instance a previous copy was routed to (None: not routed yet).

        A ``duplicate`` that was never marked routed is what a router crash between dedupe
        and produce leaves behind: route it again (reservations are idempotent per id).
        """
        return (await self.dedupe_many([(query_id, body_sha256)], ttl_s))[0]

    async def dedupe_many(
        self, items: Sequence[tuple[str, str]], ttl_s: float
    ) -> list[tuple[Verdict, str | None]]:
        """``dedupe_ex`` for a whole window: (query id, body sha256) each, answers in order.

        One pipelined round trip; one script call per dedupe bucket. An id given twice is
        ``new`` then ``duplicate`` (or ``conflict``), as if the two arrived one after the other.
        """
        if not items:
            return []
        ttl_ms = _seconds_ms(ttl_s, "dedupe ttl_s")
        groups: dict[int, list[int]] = {}
        for n, (qid, sha) in enumerate(items):
            if not isinstance(sha, str) or not sha or len(sha) > 128:
                raise ValueError(f"query {qid}: body_sha256 must be a hex digest, got {sha!r}")
            groups.setdefault(dedupe_bucket(qid), []).append(n)
        calls: list[tuple[Sequence[str], Sequence[Any]]] = [
            ([self.keys.dedupe(items[n][0]) for n in rows], [ttl_ms, *(items[n][1] for n in rows)])
            for rows in groups.values()
        ]
        replies = await self._script_many("dedupe", calls)
        out: list[tuple[Verdict, str | None]] = [("new", None)] * len(items)
        for rows, reply in zip(groups.values(), replies, strict=True):
            for j, n in enumerate(rows):
                out[n] = (cast(Verdict, str(reply[2 * j])), str(reply[2 * j + 1]) or None)
        return out

    async def mark_routed_many(self, routed: Mapping[str, str]) -> int:
        """``mark_routed`` for many queries ({query id: instance id}); returns how many were marked."""
        if not routed:
            return 0
        groups: dict[int, list[tuple[str, str]]] = {}
        for qid, iid in routed.items():
            self.keys.heartbeat(iid)  # validates the id
            groups.setdefault(dedupe_bucket(qid), []).append((qid, iid))
        calls: list[tuple[Sequence[str], Sequence[Any]]] = [
            ([self.keys.dedupe(q) for q, _ in rows], [i for _, i in rows])
            for rows in groups.values()
        ]
        return sum(int(r) for r in await self._script_many("mark_routed", calls))

    async def mark_intent_many(self, intents: Mapping[str, RouteIntent]) -> dict[str, str]:
        """Record each query's route intent before producing it; returns the ids *taken*,
        each with the instance that holds it: already marked routed, or with another intent
        recorded first (another router routed them while this one was paused mid-window).
        Those must not be produced.

        A router killed between producing and ``mark_routed_many`` leaves the intent behind;
        its successor re-sends that decision to that instance (``intents``) rather than
        deciding again, so a query is never routed to two instances. A query with no dedupe
        entry (expired) is neither recorded nor taken.

        An intent with ``rerouted_from`` (a rescuer's claim made the query this router's) is
        recorded over the original routing to that instance; it is taken only when the query
        was marked routed to a third instance meanwhile (another rescuer re-routed it).
        """
        if not intents:
            return {}
        for iid in {i.instance_id for i in intents.values()}:
            self.keys.heartbeat(iid)  # validates each instance id once, not once per query
        groups: dict[int, list[tuple[str, str, str]]] = {}
        for qid, intent in intents.items():
            payload = f"{intent.instance_id}\n{intent.decision_json}"
            row = (qid, payload, intent.rerouted_from or "")
            groups.setdefault(dedupe_bucket(qid), []).append(row)
        rows = list(groups.values())
        calls: list[tuple[Sequence[str], Sequence[Any]]] = [
            (
                [self.keys.dedupe(q) for q, _, _ in group],
                [p for _, p, _ in group] + [f for _, _, f in group],
            )
            for group in rows
        ]
        replies = await self._script_many("mark_intent", calls)
        return {
            qid: holder.decode() if isinstance(holder, bytes) else str(holder)
            for group, got in zip(rows, replies, strict=True)
            for (qid, _, _), holder in zip(group, got, strict=True)
            if not isinstance(holder, int)
        }

    async def intents(self, query_ids: Sequence[str]) -> dict[str, RouteIntent]:
        """The recorded route intent of each query that has one (one pipelined round trip)."""
        if not query_ids:
            return {}
        pipe: Pipeline = self._r.pipeline(transaction=False)
        for qid in query_ids:
            pipe.hget(self.keys.dedupe(qid), "intent")
        replies = cast(list[Any], await self._call("intents", pipe.execute()))
        out: dict[str, RouteIntent] = {}
        for qid, raw in zip(query_ids, replies, strict=True):
            intent = _route_intent(raw)
            if intent is not None:
                out[qid] = intent
        return out

    async def mark_routed(self, query_id: str, instance_id: str) -> bool:
        """Record where a deduped query went (after its routed message was acknowledged)."""
        return await self.mark_routed_many({query_id: instance_id}) == 1

    async def dedupe_entry(self, query_id: str) -> DedupeEntry | None:
        raw = cast(
            dict[str, str],
            await self._call("dedupe_entry", self._r.hgetall(self.keys.dedupe(query_id))),
        )
        if not raw or "sha" not in raw:
            return None
        return DedupeEntry(raw["sha"], raw.get("routed") or None, _route_intent(raw.get("intent")))

    async def forget(self, query_id: str) -> None:
        """Drop a query's dedupe entry (its routing failed and it will be retried as new)."""
        await self._call("forget", self._r.delete(self.keys.dedupe(query_id)))

    # ------------------------------------------------------------------ budget ledger

    def _ledger_expire_at(self, period: str) -> int:
        bounds = period_bounds(period)
        if bounds is None:
            return 0
        start, end = bounds
        keep = max(LEDGER_KEEP_S, end - start)
        # never in the past: a late settle of an old period must not delete its ledger
        return int(math.ceil(max(end, time.time()) + keep))

    async def reserve_budget(
        self, tenant: str, period_id: str, limit_usd: float, amounts_usd: Mapping[str, float]
    ) -> dict[str, bool]:
        """Reserve each query's predicted cost, in order; accept iff reserved+spent+amount <= limit.

        Atomic (one script). Idempotent per query id: re-reserving a held id returns True and
        adds nothing; an id already settled returns False (its spend is booked; do not run it again).
        """
        keys = self.keys.ledger(tenant, period_id)
        if not amounts_usd:
            return {}
        args: list[Any] = [
            usd_to_nano(limit_usd, "limit_usd", round_up=False),
            self._ledger_expire_at(period_id),
        ]
        for qid, usd in amounts_usd.items():
            args += [self.keys.check_query_id(qid), usd_to_nano(usd, f"query {qid}: amount")]
        reply = await self._script("reserve_budget", keys, args)
        return {qid: bool(ok) for qid, ok in zip(amounts_usd, reply, strict=True)}

    async def release_budget(self, tenant: str, period_id: str, query_ids: Sequence[str]) -> None:
        """Give back reservations of queries that will not run. Unknown or settled ids: no-op."""
        if not query_ids:
            return
        ledger, res, _ = self.keys.ledger(tenant, period_id)
        await self._script(
            "release_budget", [ledger, res], [self.keys.check_query_id(q) for q in query_ids]
        )

    async def settle(
        self, tenant: str, period_id: str, query_id: str, actual_cost_usd: float
    ) -> bool:
        """Reserved → spent at the actual cost. Idempotent: a second settle returns False."""
        keys = self.keys.ledger(tenant, period_id)
        reply = await self._script(
            "settle",
            keys,
            [
                self.keys.check_query_id(query_id),
                usd_to_nano(actual_cost_usd, f"query {query_id}: actual_cost_usd"),
                self._ledger_expire_at(period_id),
            ],
        )
        return bool(reply)

    async def budget_status(self, tenant: str, period_id: str) -> BudgetStatus:
        ledger, res, settled = self.keys.ledger(tenant, period_id)
        # MULTI/EXEC only on a single node: redis-py's cluster transaction runs a pending
        # re-discovery in a thread of its own, whose event loop trips over the client's lock
        # ("bound to a different event loop") after a failover. The one HGETALL that holds
        # the money is atomic without it; the two counts are informative
        pipe: Pipeline = self._r.pipeline(transaction=not is_cluster_client(self._r))
        pipe.hgetall(ledger)
        pipe.hlen(res)
        pipe.hlen(settled)
        raw, n_res, n_set = await self._call("budget_status", pipe.execute())
        raw = cast(dict[str, str], raw)
        limit = raw.get("limit")
        return BudgetStatus(
            tenant=tenant,
            period_id=period_id,
            limit_usd=int(limit) / NANO_PER_USD if limit is not None else None,
            reserved_usd=int(raw.get("reserved", 0)) / NANO_PER_USD,
            spent_usd=int(raw.get("spent", 0)) / NANO_PER_USD,
            n_reserved=int(n_res),
            n_settled=int(n_set),
        )

    # ------------------------------------------------------------------ ledger completeness

    async def ledger_mark(self) -> str | None:
        """The ledger's completeness mark (None: Redis lost its data, or never held a ledger)."""
        mark, _ = self.keys.ledger_epoch()
        raw = await self._call("ledger_mark", self._r.get(mark))
        return None if raw is None else str(raw)

    async def ledger_lease(
        self, token: str, lease_s: float, *, renew: bool = False
    ) -> Literal["marked", "held", "ours", "lost"]:
        """Take (or ``renew``) the lease on rebuilding the ledger: ``marked`` (nothing to
        rebuild), ``ours``, ``held`` (another router has it) or ``lost`` (a renew found it
        gone: it expired or Redis restarted empty). See ``state/lua/ledger_lease.lua``."""
        if not isinstance(token, str) or not token or len(token) > 128:
            raise ValueError(f"ledger lease token must be a non-empty string, got {token!r}")
        reply = await self._script(
            "ledger_lease",
            list(self.keys.ledger_epoch()),
            [token, _seconds_ms(lease_s, "ledger lease_s"), "renew" if renew else "take"],
        )
        return cast(Literal["marked", "held", "ours", "lost"], str(reply))

    async def ledger_set_mark(self, token: str, value: str) -> bool:
        """Mark the ledger complete iff ``token`` still holds the rebuild lease."""
        return bool(
            await self._script("ledger_mark", list(self.keys.ledger_epoch()), [token, value])
        )

    async def ledger_rebuild(
        self,
        tenant: str,
        period_id: str,
        limit_usd: float,
        settled_usd: Mapping[str, float],
        reserved_usd: Mapping[str, float],
    ) -> tuple[int, int]:
        """Book settled spend and worst-case reservations read back from Kafka, idempotently.

        Returns (settlements booked now, reservations booked now): ids already settled or
        reserved in Redis (by a worker or router meanwhile, or an earlier rebuild) count 0.
        """
        keys = self.keys.ledger(tenant, period_id)
        limit = usd_to_nano(limit_usd, "limit_usd", round_up=False)
        expire = self._ledger_expire_at(period_id)
        settled = [
            (self.keys.check_query_id(q), usd_to_nano(usd, f"query {q}: settled cost"))
            for q, usd in settled_usd.items()
        ]
        reserved = [
            (self.keys.check_query_id(q), usd_to_nano(usd, f"query {q}: worst-case cost"))
            for q, usd in reserved_usd.items()
            if q not in settled_usd
        ]
        booked = held = 0
        step = LEDGER_REBUILD_CHUNK
        for i in range(0, max(len(settled), len(reserved), 1), step):
            s_part, r_part = settled[i : i + step], reserved[i : i + step]
            args: list[Any] = [limit, expire, len(s_part)]
            for qid, nano in (*s_part, *r_part):
                args += [qid, nano]
            b, h = await self._script("ledger_rebuild", keys, args)
            booked, held = booked + int(b), held + int(h)
        return booked, held

    # ------------------------------------------------------------------ capacity slots

    async def reserve_slots(
        self,
        instance_id: str,
        max_slots: int,
        query_ids: Sequence[str],
        *,
        lease_s: float | None = None,
    ) -> list[bool]:
        """Hold one slot per query id while fewer than ``max_slots`` are held. Atomic; idempotent per id.

        ``lease_s``: slots not touched for that long (no resident progress, no heartbeat
        while resident) are reclaimed first, so a query lost before reaching its worker
        cannot leak capacity forever. None keeps slots until released.
        """
        _count(max_slots, "max_slots")
        if not query_ids:
            return []
        lease = 0.0 if lease_s is None else float(lease_s)
        if not math.isfinite(lease) or lease < 0:
            raise ValueError(f"lease_s must be a finite number >= 0, got {lease_s}")
        ids = [self.keys.check_query_id(q) for q in query_ids]
        reply = await self._script(
            "reserve_slots", [self.keys.slots(instance_id)], [max_slots, repr(lease), *ids]
        )
        return [bool(x) for x in reply]

    async def release_slots(self, instance_id: str, query_ids: Sequence[str]) -> None:
        if not query_ids:
            return
        ids = [self.keys.check_query_id(q) for q in query_ids]
        await self._call("release_slots", self._r.zrem(self.keys.slots(instance_id), *ids))

    async def slots_held(self, instance_id: str) -> list[str]:
        return cast(
            list[str],
            await self._call("slots_held", self._r.zrange(self.keys.slots(instance_id), 0, -1)),
        )

    # ------------------------------------------------------------------ results

    async def mark_result(
        self, query_id: str, ttl_s: float, *, cost_usd: float | None = None
    ) -> bool:
        """True the first time a result for this id is marked published; False for a duplicate.

        ``cost_usd`` is kept with the mark, so a worker that skips a re-delivered copy can
        still settle the ledger (idempotently) if a crash cut that short.
        """
        value = (
            "-" if cost_usd is None else str(usd_to_nano(cost_usd, f"query {query_id}: cost_usd"))
        )
        ok = await self._call(
            "mark_result",
            self._r.set(
                self.keys.result(query_id), value, nx=True, px=_seconds_ms(ttl_s, "result ttl_s")
            ),
        )
        return bool(ok)

    async def finish(
        self,
        instance_id: str,
        query_id: str,
        *,
        result_ttl_s: float,
        cost_usd: float,
        tenant: str | None = None,
        period_id: str | None = None,
    ) -> tuple[bool, bool]:
        """A worker's three closing writes in one round trip, in this order: ``mark_result``
        (with the cost), ``settle`` (when ``tenant`` and ``period_id`` are given) and
        ``resident_done``. Each is idempotent on its own; returns (first result, settled now).
        """
        k = self.keys
        cost_nano = usd_to_nano(cost_usd, f"query {query_id}: cost_usd")
        ttl_ms = _seconds_ms(result_ttl_s, "result ttl_s")
        now = repr(time.time())
        calls: list[tuple[str, list[str], list[Any]]] = []
        if tenant is not None and period_id is not None:
            calls.append(
                (
                    "settle",
                    list(k.ledger(tenant, period_id)),
                    [query_id, cost_nano, self._ledger_expire_at(period_id)],
                )
            )
        calls.append(
            (
                "resident_done",
                [
                    k.heartbeat(instance_id),
                    k.residents(instance_id),
                    k.slots(instance_id),
                    k.gone(instance_id),
                ],
                [query_id, now, repr(TOMBSTONE_KEEP_S)],
            )
        )
        pipe: Pipeline = self._r.pipeline(transaction=False)
        pipe.set(k.result(query_id), str(cost_nano), nx=True, px=ttl_ms)
        for name, keys, args in calls:
            pipe.execute_command("EVALSHA", self._scripts[name].sha, len(keys), *keys, *args)
        replies = await self._call("finish", pipe.execute(raise_on_error=False))
        for n, (name, keys, args) in enumerate(calls, start=1):
            if isinstance(replies[n], NoScriptError):  # Redis restarted: load and run just this one
                replies[n] = await self._script(name, keys, args)
            elif isinstance(replies[n], Exception):
                self._raise_reply("finish", replies[n])
        if isinstance(replies[0], Exception):
            self._raise_reply("finish", replies[0])
        settled = bool(replies[1]) if len(calls) == 2 else False
        return bool(replies[0]), settled

    async def result_mark(self, query_id: str) -> ResultMark | None:
        """The published-result mark of a query (None: no result published yet)."""
        raw = await self._call("result_mark", self._r.get(self.keys.result(query_id)))
        if raw is None:
            return None
        text = str(raw)
        return ResultMark(cost_usd=int(text) / NANO_PER_USD if text.isdigit() else None)

    async def mark_attempt(self, query_id: str, ttl_s: float) -> int:
        """Count one more start of this query by a worker; returns the count (1 the first time).

        A count above 1 is repeated inference: a re-delivery after a worker crash.
        """
        key = self.keys.attempt(query_id)
        return int(await self._script("attempt", [key], [_seconds_ms(ttl_s, "attempt ttl_s")]))

    # ------------------------------------------------------------------ claims (re-routing)

    async def claim_run(
        self, instance_id: str, query_id: str, *, ttl_s: float = CLAIM_TTL_S
    ) -> ClaimOutcome:
        """The worker of ``instance_id`` claims its copy of ``query_id`` right before running it.

        ``won``: run it (also when this instance claimed it before: a re-delivery, or a
        rescuer's lease that ran out without a re-route). ``lost``: a rescuer re-routed it
        elsewhere, skip the copy. ``wait``: a rescuer holds a live lease and has not
        re-routed it yet; ask again later.
        """
        reply = await self._claims(instance_id, [query_id], "run", "", 1.0, ttl_s)
        return reply[0]

    async def claim_rescue(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        rescuer_id: str,
        *,
        lease_s: float,
        ttl_s: float = CLAIM_TTL_S,
    ) -> list[ClaimOutcome]:
        """A rescuer claims (or renews its lease on) copies waiting in a silent instance's topic.

        Per id: ``won`` (re-route it; the lease must be renewed before ``lease_s`` passes),
        ``lost`` (its worker started it, or it was re-routed already) or ``busy`` (another
        rescuer's lease is live). One script call.
        """
        return await self._claims(instance_id, query_ids, "rescue", rescuer_id, lease_s, ttl_s)

    async def claim_rerouted(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        rescuer_id: str,
        *,
        ttl_s: float = CLAIM_TTL_S,
    ) -> list[ClaimOutcome]:
        """Mark claims final once the re-routed copies were acknowledged by Kafka.

        ``won``: marked (the instance's worker will skip its copy for good). ``lost``: the
        rescuer no longer held the claim (its lease lapsed and the worker started the query).
        """
        return await self._claims(instance_id, query_ids, "rerouted", rescuer_id, 1.0, ttl_s)

    async def claim_returned(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        rescuer_id: str,
        *,
        ttl_s: float = CLAIM_TTL_S,
    ) -> list[ClaimOutcome]:
        """Drop claims whose re-routed copy went back to ``instance_id`` itself (it came back
        before the window that re-routed it): its worker runs one of its copies.

        A ``rerouted`` mark there would make that worker skip every copy of the query on it,
        the re-routed one included (the claim is per instance and query). ``won``: dropped.
        ``lost``: the rescuer no longer held the claim (its lease lapsed, the worker took it).
        """
        return await self._claims(instance_id, query_ids, "returned", rescuer_id, 1.0, ttl_s)

    async def claim_state(self, instance_id: str, query_id: str) -> str | None:
        """The raw claim value (``run``, ``rescue <id> <ms>``, ``rerouted <id>``) or None."""
        raw = await self._call("claim_state", self._r.get(self.keys.claim(instance_id, query_id)))
        return None if raw is None else str(raw)

    async def _claims(
        self,
        instance_id: str,
        query_ids: Sequence[str],
        mode: str,
        rescuer_id: str,
        lease_s: float,
        ttl_s: float,
    ) -> list[ClaimOutcome]:
        if mode != "run" and (not rescuer_id or any(c.isspace() for c in rescuer_id)):
            raise ValueError(f"rescuer id must be a non-empty word, got {rescuer_id!r}")
        if not query_ids:
            return []
        keys = [self.keys.claim(instance_id, q) for q in query_ids]
        args = [
            mode,
            rescuer_id,
            _seconds_ms(lease_s, "claim lease_s"),
            _seconds_ms(ttl_s, "claim ttl_s"),
        ]
        reply = await self._script("claim", keys, args)
        return [cast(ClaimOutcome, str(v)) for v in reply]

    async def has_results(self, query_ids: Sequence[str]) -> list[bool]:
        """``has_result`` for many ids in one pipelined round trip."""
        if not query_ids:
            return []
        pipe: Pipeline = self._r.pipeline(transaction=False)
        for q in query_ids:
            pipe.exists(self.keys.result(q))
        return [bool(n) for n in await self._call("has_results", pipe.execute())]

    async def has_result(self, query_id: str) -> bool:
        return bool(await self._call("has_result", self._r.exists(self.keys.result(query_id))))

    # ------------------------------------------------------------------ maintenance

    async def step_time_publish(
        self,
        model: str,
        coefficients: StepTimeCoefficients,
        *,
        rows: int,
        instance_id: str,
        ttl_s: float,
        fit_mape: float | None = None,
        ttft_error: float | None = None,
        now: float | None = None,
    ) -> int:
        """Publish ``model``'s online-refitted Eq. 9 coefficients; returns their version.
        Without a new write for ``ttl_s`` the record expires (routers fall back to the
        configured coefficients)."""
        c = coefficients

        def opt(v: float | None) -> str:
            return "" if v is None or not math.isfinite(v) else repr(float(v))

        version = await self._script(
            "step_time",
            [self.keys.step_time(model)],
            [
                repr(c.c0_ms),
                repr(c.c1_ms_per_token),
                repr(c.c2_ms_per_ctx_token),
                repr(c.c3_ms_per_attn_unit),
                repr(time.time() if now is None else now),
                _count(rows, "rows"),
                opt(fit_mape),
                opt(ttft_error),
                self.keys.check_instance_id(instance_id),
                _seconds_ms(ttl_s, "step-time ttl_s"),
            ],
        )
        return int(version)

    async def instance_down(self, instance_id: str) -> None:
        """Drop the heartbeat now (a worker stopping cleanly): routers see it dead at once."""
        await self._call("instance_down", self._r.delete(self.keys.heartbeat(instance_id)))

    async def reset_instance(self, instance_id: str) -> None:
        """Forget an instance's residents (a worker restarting: its work is re-delivered by Kafka)."""
        await self._call("reset_instance", self._r.delete(self.keys.residents(instance_id)))


def _opt_float(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        f = float(value)
    except ValueError:
        return None
    return f if math.isfinite(f) else None


def _live_step_time(model: str, raw: Mapping[str, str] | None) -> LiveStepTime | None:
    """A step-time record; None when missing or malformed (the configured ones apply)."""
    if not raw:
        return None
    try:
        coef = StepTimeCoefficients(
            c0_ms=float(raw["c0_ms"]),
            c1_ms_per_token=float(raw["c1_ms_per_token"]),
            c2_ms_per_ctx_token=float(raw["c2_ms_per_ctx_token"]),
            c3_ms_per_attn_unit=float(raw["c3_ms_per_attn_unit"]),
        )
        return LiveStepTime(
            model=model,
            coefficients=coef,
            version=int(raw.get("version", "0")),
            at=float(raw["at"]),
            rows=int(raw.get("rows", "0")),
            instance_id=str(raw.get("instance", "")),
            fit_mape=_opt_float(raw.get("fit_mape")),
            ttft_error=_opt_float(raw.get("ttft_error")),
        )
    except (KeyError, ValueError):  # pydantic's ValidationError is a ValueError
        return None


def _pairs(blob: str) -> dict[str, str]:
    """``"k\0v\0k\0v"`` (a flattened HGETALL) → dict."""
    if not blob:
        return {}
    parts = blob.split("\0")
    return dict(zip(parts[::2], parts[1::2], strict=False))


def _residents_of(raw: Mapping[str, str]) -> list[ResidentRequest]:
    rs = [r for qid, text in raw.items() if (r := _decode_resident(qid, text)) is not None]
    rs.sort(key=lambda r: (r.arrived_at, r.query_id))
    return rs


def _route_intent(raw: str | None) -> RouteIntent | None:
    """Parse a dedupe entry's ``intent`` field ("<instance id>\\n<decision json>")."""
    if not raw or "\n" not in raw:
        return None
    instance_id, decision_json = raw.split("\n", 1)
    return RouteIntent(instance_id, decision_json) if instance_id and decision_json else None
