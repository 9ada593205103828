"""The Redis plumbing every state concern shares (``state.store``): one client and its
registered Lua scripts, the error mapping to ``StateUnavailable``, the pipelined script
call, and the argument checks and money units the concerns have in common.

Each concern (``state.liveness``, ``state.dedupe``, ``state.ledger``, ``state.claims``,
``state.results``) is a subclass of ``RedisCore`` with its own methods; ``StateStore``
joins them over one connection pool, so a window's reads stay one round trip.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Awaitable, Sequence
from importlib import resources
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt
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

from state.cluster import StateConfigError
from state.keys import Keys

T = TypeVar("T")

NANO_PER_USD = 1_000_000_000
MAX_LEDGER_NANO = (
    2**53
)  # exact integers in Lua's doubles: about 9 million USD per tenant and period
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
    "start",
    "step_time",
)


_INCLUDE = "--! include "


def script_text(name: str) -> str:
    """The Lua of ``state/lua/<name>.lua``, each ``--! include FILE`` line replaced by that
    file of ``state/lua`` (code the window scripts share: ``_window_keys.lua``)."""
    lua = resources.files("state").joinpath("lua")
    out = []
    for line in lua.joinpath(f"{name}.lua").read_text(encoding="utf-8").splitlines(True):
        if line.startswith(_INCLUDE):
            line = lua.joinpath(line.removeprefix(_INCLUDE).strip()).read_text(encoding="utf-8")
        out.append(line)
    return "".join(out)


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


def usd_to_nano(usd: float, what: str, query_id: str = "", *, round_up: bool = True) -> int:
    """USD → integer nano-USD; reservations round up so rounding never lets spend through.
    ``what`` (of ``query_id`` when given) names the amount in an error."""
    if not isinstance(usd, (int, float)) or not math.isfinite(usd) or usd < 0:
        what = f"query {query_id}: {what}" if query_id else what
        raise ValueError(f"{what} must be a finite number >= 0 USD, got {usd!r}")
    scaled = usd * NANO_PER_USD
    nano = math.ceil(scaled - 1e-6) if round_up else math.floor(scaled + 1e-6)
    nano = max(0, nano)
    if nano > MAX_LEDGER_NANO:
        what = f"query {query_id}: {what}" if query_id else what
        raise ValueError(
            f"{what} = {usd} USD is over the ledger's cap of {MAX_LEDGER_NANO / NANO_PER_USD:.0f} USD"
        )
    return nano


def usd_to_nanos(usds: Sequence[float], what: str, query_ids: Sequence[str]) -> list[int]:
    """``usd_to_nano`` (rounded up) of each amount, the amount of ``query_ids``' query of
    the same position: the same integers, computed as one array when every amount is a
    plain finite float within the cap (else one by one, which names the one at fault)."""
    if all(type(u) is float for u in usds):
        scaled = np.array(usds, dtype=np.float64) * NANO_PER_USD
        # math.ceil of a double is that double's integer: np.ceil's, held exactly below 2**53
        nano = np.maximum(np.ceil(scaled - 1e-6), 0.0)
        if nano.size == 0 or (np.isfinite(scaled).all() and _usds_ok(usds, nano)):
            return cast(list[int], nano.astype(np.int64).tolist())
    return [usd_to_nano(u, what, q) for u, q in zip(usds, query_ids, strict=True)]


def _usds_ok(usds: Sequence[float], nano: npt.NDArray[np.float64]) -> bool:
    """Every amount >= 0 and every rounded amount within the ledger's cap."""
    return bool(min(usds) >= 0 and nano.max() <= MAX_LEDGER_NANO)


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


def is_cluster_client(client: Any) -> bool:
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)


class RedisCore:
    """One Redis client, its scripts and the error mapping; the base of every concern."""

    def __init__(self, client: aioredis.Redis, keys: Keys, display_url: str) -> None:
        self._r = client
        self._cluster = is_cluster_client(client)
        self.keys = keys
        self.display_url = display_url
        # redis-py's cluster client raises MaxConnectionsError where the single-node blocking
        # pool waits: at most this many calls in flight (one connection per node each)
        self._gate: asyncio.Semaphore | None = None
        self._scripts: dict[str, AsyncScript] = {
            name: client.register_script(script_text(name)) for name in SCRIPTS
        }

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
