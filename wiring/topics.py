"""Every Kafka topic name Switchyard uses, built in one place (DESIGN.md, "Contracts").

Routers, workers, replay, batch jobs and the client import these names; nobody writes
a topic string by hand. Creating and describing topics is ``wiring.kafka_admin``.
"""

from __future__ import annotations

import re

from schemas.cluster import INSTANCE_ID_PATTERN
from schemas.query import RELAY_TOPIC_PATTERN

QUERIES = "queries"  # body: schemas.Query
RESULTS = "results"  # body: schemas.Result
DEAD_LETTERS = "dead-letters"  # body: schemas.DeadLetter
DECISIONS = "decisions"  # body: schemas.Decision (audit)
STEP_TIMINGS = "step-timings"  # body: workers.timings.StepTiming (online step-time recalibration)
ROUTE_PREFIX = "route."  # body: schemas.RoutedQuery
RELAY_PREFIX = "relay."  # body: schemas.RelayChunk (one topic per gateway id)

_INSTANCE_ID = re.compile(INSTANCE_ID_PATTERN)


def route(instance_id: str) -> str:
    """``route.<instance_id>``: the topic a router sends an instance's queries to."""
    if not _INSTANCE_ID.match(instance_id):
        raise ValueError(f"instance id {instance_id!r} must match {INSTANCE_ID_PATTERN}")
    return f"{ROUTE_PREFIX}{instance_id}"


def relay(gateway_id: str) -> str:
    """``relay.<gateway_id>``: where workers relay the streamed text of that gateway's queries."""
    name = f"{RELAY_PREFIX}{gateway_id}"
    if not re.match(RELAY_TOPIC_PATTERN, name):
        raise ValueError(f"gateway id {gateway_id!r} must match [A-Za-z0-9_-]{{1,100}}")
    return name


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
