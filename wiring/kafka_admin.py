"""Kafka admin helpers: create missing topics (idempotent) and list a topic's partitions.

A fresh broker works without auto-creation: every process that produces or consumes calls
``ensure_topics`` with the names of ``wiring.topics`` first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger(__name__)


async def ensure_topics(
    kafka_kwargs: Mapping[str, Any],
    names: Iterable[str],
    partitions: int = 1,
    replication_factor: int = 1,
    visible_timeout_s: float = 15.0,
    min_insync_replicas: int | None = None,
) -> list[str]:
    """Create each topic in ``names`` that does not exist yet; return the ones created.

    ``replication_factor`` and ``min_insync_replicas`` (``Settings.topic_kwargs()``): a
    cluster with fewer brokers than the replication factor, or an existing topic with fewer
    replicas than asked for, raises ``TopicSettingsError`` naming it — never a quiet topic of
    one replica. Created topics get ``min.insync.replicas`` (default ``min(2, replication)``).

    Returns once the broker's metadata lists the created topics' partitions with a leader
    (at most ``visible_timeout_s``, then it logs a warning), so a consumer that subscribes
    next is assigned them.

    ``kafka_kwargs`` is ``Settings.kafka_kwargs()`` (bootstrap, security, SASL/TLS).
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    wanted = list(dict.fromkeys(names))
    isr = min_insync_replicas or min(2, replication_factor)
    if isr > replication_factor:
        raise TopicSettingsError(
            f"min.insync.replicas {isr} exceeds the replication factor {replication_factor}"
        )
    admin = AIOKafkaAdminClient(**dict(kafka_kwargs))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [n for n in wanted if n not in existing]
        if replication_factor > 1:
            await _check_replication(admin, kafka_kwargs, wanted, missing, replication_factor)
        if not missing:
            return []
        configs = {"min.insync.replicas": str(isr)} if replication_factor > 1 else {}
        response = await admin.create_topics(
            [
                NewTopic(
                    n,
                    num_partitions=partitions,
                    replication_factor=replication_factor,
                    topic_configs=configs,
                )
                for n in missing
            ]
        )
        created = _created(response, missing, kafka_kwargs.get("bootstrap_servers", "?"))
        await _until_visible(admin, missing, visible_timeout_s)
        if replication_factor > 1:
            # a topic another client created a moment ago may be missing from list_topics
            # and refused as existing by create_topics: check every topic's replicas now
            await _check_replication(admin, kafka_kwargs, wanted, [], replication_factor)
        return created
    finally:
        await admin.close()


class TopicSettingsError(RuntimeError):
    """The cluster cannot hold the topics as configured (too few brokers or replicas)."""


def _created(response: Any, asked: list[str], where: str) -> list[str]:
    """The topics of ``asked`` that a CreateTopics ``response`` says were created. One that
    exists already (another process, or a broker whose metadata lagged behind the one that
    listed the topics, created it) was not; any other per-topic error raises
    ``TopicSettingsError`` naming the topic and Kafka's error (the broker answers errors in
    the response, it does not raise them)."""
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    created: list[str] = []
    refused: list[str] = []
    for entry in response.topic_errors:  # (topic, error code[, message]) by version
        name, code = entry[0], int(entry[1])
        if code == 0:
            created.append(name)
            continue
        error = for_code(code)
        if error is TopicAlreadyExistsError:
            continue
        message = entry[2] if len(entry) > 2 and entry[2] else error.description
        refused.append(f"{name} ({error.__name__}: {message})")
    if refused:
        raise TopicSettingsError(f"Kafka at {where} refused to create {', '.join(refused)}")
    return [n for n in asked if n in set(created)]


async def _check_replication(
    admin: Any,
    kafka_kwargs: Mapping[str, Any],
    wanted: list[str],
    missing: list[str],
    replication_factor: int,
) -> None:
    """Raise ``TopicSettingsError`` when the cluster has fewer brokers than
    ``replication_factor`` or an existing topic of ``wanted`` has fewer replicas."""
    where = kafka_kwargs.get("bootstrap_servers", "?")
    brokers = (await admin.describe_cluster()).get("brokers", [])
    if len(brokers) < replication_factor:
        raise TopicSettingsError(
            f"replication factor {replication_factor} needs at least {replication_factor} "
            f"Kafka brokers; the cluster at {where} lists {len(brokers)} "
            "(set SWITCHYARD_KAFKA_REPLICATION_FACTOR or add brokers)"
        )
    present = [n for n in wanted if n not in missing]
    if not present:
        return
    # a topic created a moment ago may be missing from the metadata of the broker asked
    # (the admin client asks any of them): ask again until each one is listed, or a
    # one-replica topic would pass unseen
    replicas: dict[str, int] = {}
    deadline = time.monotonic() + 10.0
    while True:
        for t in await admin.describe_topics([n for n in present if n not in replicas]):
            if t.get("error_code") == 0 and t.get("partitions"):
                replicas[t["topic"]] = min(len(p.get("replicas", [])) for p in t["partitions"])
        if len(replicas) == len(present) or time.monotonic() >= deadline:
            break
        await asyncio.sleep(0.05)
    unseen = sorted(set(present) - set(replicas))
    if unseen:
        log.warning("replicas of topics %s unknown: not in the brokers' metadata after 10 s", unseen)
    short = [f"{n} ({r})" for n, r in replicas.items() if r < replication_factor]
    if short:
        raise TopicSettingsError(
            f"topics with fewer replicas than the replication factor {replication_factor} at "
            f"{where}: {', '.join(short)}; reassign their partitions or recreate them"
        )


async def _until_visible(admin: Any, names: list[str], timeout_s: float) -> None:
    """Wait until the broker's metadata lists every partition of ``names`` with a leader.

    A KRaft broker learns of a topic it just created a moment later; a consumer group
    joined in between gets an empty assignment and (until its next metadata refresh) reads
    nothing while its worker heart-beats as alive (faults scenario 4, bug 10).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            described = await admin.describe_topics(names)
            ready = {
                t["topic"]
                for t in described
                if t.get("error_code") == 0
                and t.get("partitions")
                and all(p.get("leader", -1) >= 0 for p in t["partitions"])
            }
        except Exception:  # noqa: BLE001 - not known yet: ask again
            ready = set()
        if ready >= set(names):
            return
        if time.monotonic() >= deadline:
            log.warning(
                "topics %s created but not yet in the broker's metadata after %.0f s",
                sorted(set(names) - ready),
                timeout_s,
            )
            return
        await asyncio.sleep(0.05)


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
