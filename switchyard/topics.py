"""Every Kafka topic name Switchyard uses, built in one place (DESIGN.md, "Contracts").

Routers, workers, replay, batch jobs and the client import these names; nobody writes
a topic string by hand. ``ensure_topics`` creates missing topics (idempotent), so a fresh
broker works without auto-creation.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from schemas.cluster import INSTANCE_ID_PATTERN

QUERIES = "queries"  # body: schemas.Query
RESULTS = "results"  # body: schemas.Result
DEAD_LETTERS = "dead-letters"  # body: schemas.DeadLetter
DECISIONS = "decisions"  # body: schemas.Decision (audit)
STEP_TIMINGS = "step-timings"  # body: workers.timings.StepTiming (online step-time recalibration)
ROUTE_PREFIX = "route."  # body: schemas.RoutedQuery

_INSTANCE_ID = re.compile(INSTANCE_ID_PATTERN)


def route(instance_id: str) -> str:
    """``route.<instance_id>``: the topic a router sends an instance's queries to."""
    if not _INSTANCE_ID.match(instance_id):
        raise ValueError(f"instance id {instance_id!r} must match {INSTANCE_ID_PATTERN}")
    return f"{ROUTE_PREFIX}{instance_id}"


def instance_of(topic: str) -> str | None:
    """The instance id of a ``route.<id>`` topic, else None."""
    if not topic.startswith(ROUTE_PREFIX):
        return None
    rest = topic[len(ROUTE_PREFIX) :]
    return rest if _INSTANCE_ID.match(rest) else None


def worker_group(instance_id: str) -> str:
    """Consumer group of the workers of one instance (``worker.<id>``)."""
    route(instance_id)  # validates the id
    return f"worker.{instance_id}"


CORE_TOPICS: tuple[str, ...] = (QUERIES, RESULTS, DEAD_LETTERS, DECISIONS, STEP_TIMINGS)


async def ensure_topics(
    kafka_kwargs: Mapping[str, Any],
    names: Iterable[str],
    partitions: int = 1,
    replication_factor: int = 1,
) -> list[str]:
    """Create each topic in ``names`` that does not exist yet; return the ones created.

    ``kafka_kwargs`` is ``Settings.kafka_kwargs()`` (bootstrap, security, SASL/TLS).
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError

    wanted = list(dict.fromkeys(names))
    admin = AIOKafkaAdminClient(**dict(kafka_kwargs))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [n for n in wanted if n not in existing]
        if not missing:
            return []
        try:
            await admin.create_topics(
                [
                    NewTopic(n, num_partitions=partitions, replication_factor=replication_factor)
                    for n in missing
                ]
            )
        except TopicAlreadyExistsError:
            pass  # another process created it between list and create
        return missing
    finally:
        await admin.close()


async def partitions(kafka_kwargs: Mapping[str, Any], names: Iterable[str]) -> list[Any]:
    """Every ``TopicPartition`` of ``names``, from the broker's metadata (never a guess)."""
    from aiokafka import TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**dict(kafka_kwargs))
    await admin.start()
    try:
        described = await admin.describe_topics(list(names))
    finally:
        await admin.close()
    tps = [TopicPartition(t["topic"], p["partition"]) for t in described for p in t["partitions"]]
    if not tps:
        raise RuntimeError(f"no partitions found for topics {list(names)}")
    return sorted(tps)
