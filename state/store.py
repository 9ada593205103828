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
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from state.claims import CLAIM_TTL_S, RedisClaims
from state.cluster import (
    StateConfigError,
    check_cluster,
    check_single,
    cluster_client,
    is_cluster_url,
)
from state.dedupe import RedisDedupe
from state.keys import Keys
from state.ledger import LEDGER_KEEP_S, LEDGER_REBUILD_CHUNK, RedisLedger, ledger_expire_at
from state.liveness import RESIDENTS_KEEP_S, TOMBSTONE_KEEP_S, RedisLiveness
from state.prefix import RedisPrefix
from state.records import (
    BudgetStatus,
    ClaimOutcome,
    DedupeEntry,
    InstanceLive,
    LiveStepTime,
    ResultMark,
    RouteIntent,
    Starts,
    Verdict,
)
from state.redis_core import (
    MAX_LEDGER_NANO,
    NANO_PER_USD,
    SCRIPTS,
    UNAVAILABLE_ERRORS,
    StateUnavailable,
    is_cluster_client,
    period_bounds,
    period_id,
    unavailable,
    usd_to_nano,
)
from state.results import RedisResults

__all__ = [
    "CLAIM_TTL_S",
    "LEDGER_KEEP_S",
    "LEDGER_REBUILD_CHUNK",
    "MAX_LEDGER_NANO",
    "NANO_PER_USD",
    "RESIDENTS_KEEP_S",
    "SCRIPTS",
    "TOMBSTONE_KEEP_S",
    "UNAVAILABLE_ERRORS",
    "BudgetStatus",
    "ClaimOutcome",
    "DedupeEntry",
    "InstanceLive",
    "LiveStepTime",
    "ResultMark",
    "RouteIntent",
    "Starts",
    "StateStore",
    "StateUnavailable",
    "Verdict",
    "is_cluster_client",
    "ledger_expire_at",
    "period_bounds",
    "period_id",
    "unavailable",
    "usd_to_nano",
]


class StateStore(
    RedisLiveness, RedisDedupe, RedisLedger, RedisClaims, RedisResults, RedisPrefix
):
    """Async access to Switchyard's Redis state; one per process, safe to share across tasks.

    One client and connection pool serving every concern (each behind its Protocol in
    ``state.protocols``); callers type against the narrow Protocols they use.
    """

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
