"""The local 3-broker KRaft cluster: nodes, topic replication, min.insync.replicas, bad input."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from switchyard import clusters, services
from tests.clusters.conftest import Clusters
from wiring import kafka_admin
from wiring.settings import Settings, SettingsError


def test_every_node_recorded_running_and_listed(local_kafka: Clusters) -> None:
    rows = {r["service"]: r for r in services.status(local_kafka.home)}
    for rec in local_kafka.kafka:
        assert rows[rec.name]["running"] and rows[rec.name]["pid"] == rec.pid
    assert clusters.count_brokers(local_kafka.bootstrap) == 3
    env = dict(line.split("=", 1) for line in clusters.env_lines(local_kafka.home))
    assert env["SWITCHYARD_KAFKA"].count(",") == 2
    assert env["SWITCHYARD_KAFKA_REPLICATION_FACTOR"] == "3"


async def test_topics_get_three_replicas_and_min_isr_two(local_kafka: Clusters) -> None:
    settings = Settings(kafka=local_kafka.bootstrap, kafka_replication_factor=3)
    name = f"t-rf-{uuid.uuid4().hex[:8]}"
    created = await kafka_admin.ensure_topics(
        settings.kafka_kwargs(), [name], partitions=3, **settings.topic_kwargs()
    )
    assert created == [name]
    admin = AIOKafkaAdminClient(bootstrap_servers=local_kafka.bootstrap)
    await admin.start()
    try:
        # ensure_topics saw the topic on the broker it asked; another may lag a moment
        deadline = time.monotonic() + 10
        (described,) = await admin.describe_topics([name])
        while not described["partitions"]:
            assert time.monotonic() < deadline, f"{name} has no partitions in the metadata"
            await asyncio.sleep(0.1)
            (described,) = await admin.describe_topics([name])
        assert [len(p["replicas"]) for p in described["partitions"]] == [3, 3, 3]
        # leaders spread over the brokers
        assert len({p["leader"] for p in described["partitions"]}) == 3
        entries: dict[str, str] = {}
        while "min.insync.replicas" not in entries:  # the config reaches every broker a moment later
            assert time.monotonic() < deadline, f"{name}: no min.insync.replicas in {entries}"
            res = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
            entries = {e[0]: e[1] for e in res[0].resources[0][4]}
            await asyncio.sleep(0.1)
        assert entries["min.insync.replicas"] == "2"
    finally:
        await admin.close()
    # a second call finds them and creates nothing
    assert (
        await kafka_admin.ensure_topics(settings.kafka_kwargs(), [name], **settings.topic_kwargs())
        == []
    )
    producer = AIOKafkaProducer(
        bootstrap_servers=local_kafka.bootstrap, acks="all", enable_idempotence=True
    )
    await producer.start()
    try:
        meta = await producer.send_and_wait(name, b"x")
        assert meta.offset == 0
    finally:
        await producer.stop()


async def test_more_replicas_than_brokers_is_an_error_naming_both(local_kafka: Clusters) -> None:
    settings = Settings(kafka=local_kafka.bootstrap, kafka_replication_factor=4)
    with pytest.raises(
        kafka_admin.TopicSettingsError, match=r"needs at least 4 Kafka brokers.*lists 3"
    ):
        await kafka_admin.ensure_topics(
            settings.kafka_kwargs(), [f"t-{uuid.uuid4().hex[:8]}"], **settings.topic_kwargs()
        )


async def test_existing_topic_with_one_replica_is_named(local_kafka: Clusters) -> None:
    name = f"t-rf1-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=local_kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    settings = Settings(kafka=local_kafka.bootstrap, kafka_replication_factor=3)
    with pytest.raises(kafka_admin.TopicSettingsError, match=rf"{name} \(1\)"):
        await kafka_admin.ensure_topics(settings.kafka_kwargs(), [name], **settings.topic_kwargs())


def test_min_isr_above_replication_is_refused() -> None:
    with pytest.raises(SettingsError, match="SWITCHYARD_KAFKA_MIN_INSYNC_REPLICAS"):
        Settings.from_env(
            {
                "SWITCHYARD_KAFKA_REPLICATION_FACTOR": "2",
                "SWITCHYARD_KAFKA_MIN_INSYNC_REPLICAS": "3",
            }
        )
    assert Settings(kafka_replication_factor=3).topic_kwargs() == {
        "replication_factor": 3,
        "min_insync_replicas": 2,
    }
    assert Settings().topic_kwargs() == {"replication_factor": 1, "min_insync_replicas": 1}
