"""Redis Cluster URLs and the checks made at connect time (single node or cluster).

``redis+cluster://host:port[,host:port…][/0]`` (``rediss+cluster://`` with TLS) names a Redis
Cluster by one or more startup nodes; the client discovers the rest and routes every command
and script by its keys' hash slot. A password may stand in the first host
(``redis+cluster://:secret@h1:p1,h2:p2``) or come from ``SWITCHYARD_REDIS_PASSWORD``.

Neither side is ever taken for the other: a cluster URL whose nodes are not in cluster mode,
a cluster with a slot that no primary serves (``cluster_state:fail``), or a plain
``redis://`` URL that points at a cluster node each raise ``StateConfigError`` naming the
problem at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
ALL_SLOTS = 16384


class StateConfigError(ValueError):
    """The Redis URL or the server behind it is not what the URL says (never retried)."""


@dataclass(frozen=True)
class ClusterUrl:
    nodes: tuple[tuple[str, int], ...]
    tls: bool
    password: str | None
    username: str | None


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def parse_cluster_url(url: str) -> ClusterUrl:
    """Startup nodes, TLS and credentials of a ``redis+cluster://`` URL (``ValueError`` if bad)."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in CLUSTER_SCHEMES:
        raise StateConfigError(f"not a Redis Cluster URL (redis+cluster://h:p,…): {scheme}://…")
    netloc, _, path = rest.partition("/")
    if path not in ("", "0"):
        raise StateConfigError(f"a Redis Cluster has only database 0, the URL names /{path}")
    username = password = None
    if "@" in netloc:
        cred, netloc = netloc.rsplit("@", 1)
        user, _, pw = cred.partition(":")
        username, password = (unquote(user) or None), (unquote(pw) or None)
    nodes: list[tuple[str, int]] = []
    for item in netloc.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise StateConfigError(f"Redis Cluster node {item.strip()!r} must be host:port")
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise StateConfigError("a Redis Cluster URL needs at least one host:port")
    return ClusterUrl(tuple(nodes), scheme == "rediss+cluster", password, username)


def cluster_client(url: str, kwargs: dict[str, Any]) -> Any:
    """A ``redis.asyncio.RedisCluster`` for ``url`` with the store's connection ``kwargs``."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    parsed = parse_cluster_url(url)
    kw = {k: v for k, v in kwargs.items() if k not in ("timeout", "max_connections")}
    kw["max_connections"] = kwargs.get("max_connections", 64)
    if parsed.password is not None and kw.get("password") is None:
        kw["password"] = parsed.password
    if parsed.username is not None:
        kw["username"] = parsed.username
    if parsed.tls:
        kw["ssl"] = True
    return RedisCluster(
        startup_nodes=[ClusterNode(h, p) for h, p in parsed.nodes],
        require_full_coverage=True,
        **kw,
    )


def _fields(info: Any) -> dict[str, str]:
    if isinstance(info, dict):
        return {str(k): str(v) for k, v in info.items()}
    text = info.decode() if isinstance(info, bytes) else str(info)
    return dict(line.split(":", 1) for line in text.split() if ":" in line)


async def check_cluster(client: Any, display: str) -> None:
    """Raise ``StateConfigError`` unless every slot is served (``cluster_state:ok``)."""
    from redis.asyncio.cluster import RedisCluster

    info = await client.cluster_info(target_nodes=RedisCluster.PRIMARIES)
    # one reply per primary: every primary must see the whole cluster healthy
    replies = info.values() if isinstance(info, dict) and "cluster_state" not in info else [info]
    for raw in replies:
        f = _fields(raw)
        if f.get("cluster_state") != "ok" or f.get("cluster_slots_assigned") != str(ALL_SLOTS):
            raise StateConfigError(
                f"Redis Cluster at {display} is not healthy: cluster_state "
                f"{f.get('cluster_state', '?')}, {f.get('cluster_slots_assigned', '?')} of "
                f"{ALL_SLOTS} slots assigned, {f.get('cluster_slots_fail', '?')} failed; "
                "fix the cluster (redis-cli --cluster check/fix) before starting"
            )


async def check_single(client: Any, display: str) -> None:
    """Raise ``StateConfigError`` when a plain URL points at a cluster-mode node: a single-node
    client would get MOVED for most keys instead of failing at start."""
    info = _fields(await client.info("cluster"))
    if info.get("cluster_enabled") == "1":
        raise StateConfigError(
            f"Redis at {display} is a Redis Cluster node: use a redis+cluster:// URL "
            "(e.g. redis+cluster://host:port,host:port)"
        )
