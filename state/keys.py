"""The Redis key layout — the only place that spells a key.

Every key starts with the namespace (default ``sy``). Keys that one Lua script touches
together share a Redis Cluster hash tag, so the scripts run unchanged on a cluster:

=====================================  ======  =================================================
key                                    type    holds
=====================================  ======  =================================================
``sy:inst:{<instance>}:hb``            hash    model, max_concurrency, at (last state write),
                                               engine_running, engine_waiting,
                                               engine_kv_usage; TTL = heartbeat
``sy:inst:{<instance>}:res``           hash    query id → "prompt,prefilled,decoded,predicted,
                                               arrived_at" (resident requests)
``sy:inst:{<instance>}:slots``         zset    query id → last touch (Redis time): capacity held
``sy:inst:{<instance>}:gone``          zset    query id → when it was done (tombstones for resync)
``sy:inst:{<instance>}:fin``           list    requests that left recently, newest first:
                                               "prompt,output,arrived_at,finished_at"; at
                                               most ``FINISHED_KEEP``; TTL ``FINISHED_KEEP_S``
``sy:inst:{<instance>}:pfx``           zset    prefix block hash → recency (the router's LRU
                                               model of the instance's prefix cache)
``sy:inst:{<instance>}:pfxt``          hash    prefix block hash → tokens; ``#seq``, ``#total``
``sy:inst:{<instance>}:claim:<query>`` string  who owns the query's copy in ``route.<instance>``:
                                               ``run`` (its worker started it), ``rescue <id>
                                               <lease end ms>``, ``rerouted <id>``; TTL
``sy:budget:{<tenant>}:<period>``      hash    limit, reserved, spent (integer nano-USD)
``sy:budget:{<tenant>}:<period>:res``  hash    query id → reserved nano-USD
``sy:budget:{<tenant>}:<period>:set``  hash    query id → settled nano-USD (settle-once)
``sy:ledger:{epoch}:mark``             string  set once the ledger is known complete (rebuilt
                                               from Kafka, or written since); no TTL. Missing
                                               = Redis lost its data (or never had any)
``sy:ledger:{epoch}:lease``            string  token of the router rebuilding it; TTL
``sy:dedupe:{d<nn>}:<query>``          hash    sha (body SHA-256), routed (instance); TTL.
                                               ``nn`` = crc32(query id) mod 64: a window's
                                               dedupe is one script call per bucket
``sy:result:{<query>}``                string  once a result was published: its cost in nano-USD
                                               ("-" when unknown); TTL
``sy:start:{<query>}``                 hash    ``#``: how many times a worker started the query;
                                               ``p:<token>``: each worker process that started
                                               it (``Results.mark_start``); TTL
``sy:steptime:{<model>}``              hash    the model's Eq. 9 coefficients refitted online
                                               (c0_ms … c3_ms_per_attn_unit), version, at,
                                               rows, fit_mape, ttft_error, instance; TTL.
                                               ``<model>`` percent-encoded (no braces)
=====================================  ======  =================================================
"""

from __future__ import annotations

import functools
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import quote

from schemas.cluster import INSTANCE_ID_PATTERN
from schemas.query import QUERY_ID_PATTERN, TENANT_PATTERN

_INSTANCE = re.compile(INSTANCE_ID_PATTERN)
_TENANT = re.compile(TENANT_PATTERN)
_QUERY = re.compile(QUERY_ID_PATTERN)
_PERIOD = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_NAMESPACE = re.compile(r"^[A-Za-z0-9_\-]{1,32}$")


def _check(pattern: re.Pattern[str], value: str, what: str) -> str:
    # fullmatch: Python's ``$`` also matches before a final newline, and a newline in an id
    # would split the joined arguments of the window scripts (state/lua) one entry too many
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{what} {value!r} must match {pattern.pattern}")
    return value


DEDUPE_BUCKETS = 64


@functools.lru_cache(maxsize=1 << 16)
def dedupe_bucket(query_id: str) -> int:
    """Which dedupe hash-tag bucket a query id belongs to (validates the id). Memoised: a
    router asks for each query id's bucket six times (dedupe, intent, routed mark: the
    group, then the key), and the id check is a regular expression."""
    return zlib.crc32(_check(_QUERY, query_id, "query id").encode()) % DEDUPE_BUCKETS


@functools.lru_cache(maxsize=1 << 16)
def _checked_query_id(query_id: str) -> str:
    """A valid query id, memoised: a router checks each one in every reservation of its
    window (budget and slot), and the check is a regular expression."""
    return _check(_QUERY, query_id, "query id")


@functools.lru_cache(maxsize=1 << 16)
def _dedupe_key(namespace: str, query_id: str) -> str:
    """A query's dedupe key, memoised: a router names it three times per routed query
    (dedupe, intent, routed mark)."""
    return f"{namespace}:dedupe:{{d{dedupe_bucket(query_id):02d}}}:{query_id}"


@dataclass(frozen=True)
class Keys:
    """Builds every key; validates ids so a key can never carry a stray hash tag."""

    namespace: str = "sy"

    def __post_init__(self) -> None:
        _check(_NAMESPACE, self.namespace, "namespace")

    # instance live state: hash tag {instance}
    def _inst(self, instance_id: str, leaf: str) -> str:
        return f"{self.namespace}:inst:{{{_check(_INSTANCE, instance_id, 'instance id')}}}:{leaf}"

    def heartbeat(self, instance_id: str) -> str:
        return self._inst(instance_id, "hb")

    def residents(self, instance_id: str) -> str:
        return self._inst(instance_id, "res")

    def slots(self, instance_id: str) -> str:
        return self._inst(instance_id, "slots")

    def gone(self, instance_id: str) -> str:
        return self._inst(instance_id, "gone")

    def finished(self, instance_id: str) -> str:
        """Requests that left the instance recently (a capped list, newest first)."""
        return self._inst(instance_id, "fin")

    def prefix(self, instance_id: str) -> tuple[str, str]:
        """(recency zset, tokens hash) of the instance's prefix-cache model."""
        return self._inst(instance_id, "pfx"), self._inst(instance_id, "pfxt")

    def claim(self, instance_id: str, query_id: str) -> str:
        """Claim on the copy of ``query_id`` routed to ``instance_id`` (worker vs rescuer)."""
        return self._inst(instance_id, f"claim:{_check(_QUERY, query_id, 'query id')}")

    # budget ledger: hash tag {tenant}
    def ledger(self, tenant: str, period_id: str) -> tuple[str, str, str]:
        """(ledger, reservations, settled) keys of one tenant and period."""
        _check(_TENANT, tenant, "tenant")
        _check(_PERIOD, period_id, "budget period")
        base = f"{self.namespace}:budget:{{{tenant}}}:{period_id}"
        return base, f"{base}:res", f"{base}:set"

    def ledger_epoch(self) -> tuple[str, str]:
        """(mark, lease) keys of the ledger's completeness marker and its rebuild lease."""
        base = f"{self.namespace}:ledger:{{epoch}}"
        return f"{base}:mark", f"{base}:lease"

    # per model
    def step_time(self, model: str) -> str:
        """Online-refitted Eq. 9 coefficients of ``model`` (any model name: percent-encoded,
        so braces cannot form a hash tag)."""
        if not isinstance(model, str) or not model:
            raise ValueError(f"model name {model!r} must be a non-empty string")
        return f"{self.namespace}:steptime:{{{quote(model, safe='-_.@:')}}}"

    # per query
    def dedupe(self, query_id: str) -> str:
        return _dedupe_key(self.namespace, query_id)

    def dedupes(self, query_ids: Iterable[str]) -> list[str]:
        """``dedupe`` of each query id (a window's, without a method call per id)."""
        ns = self.namespace
        return [_dedupe_key(ns, q) for q in query_ids]

    def result(self, query_id: str) -> str:
        return f"{self.namespace}:result:{{{_check(_QUERY, query_id, 'query id')}}}"

    def start(self, query_id: str) -> str:
        return f"{self.namespace}:start:{{{_check(_QUERY, query_id, 'query id')}}}"

    def check_query_id(self, query_id: str) -> str:
        if type(query_id) is str:
            return _checked_query_id(query_id)
        return _check(_QUERY, query_id, "query id")

    def check_query_ids(self, query_ids: Iterable[str]) -> list[str]:
        """``check_query_id`` of each (a window's reservation, without a method call per id)."""
        return [
            _checked_query_id(q) if type(q) is str else _check(_QUERY, q, "query id")
            for q in query_ids
        ]

    def check_instance_id(self, instance_id: str) -> str:
        return _check(_INSTANCE, instance_id, "instance id")
