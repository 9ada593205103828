"""``switchyard.kafka_admin.ensure_topics`` returns only once the broker's metadata lists what it
created (a group joined earlier gets an empty assignment: faults scenario 4, bug 10)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from wiring import kafka_admin


class Admin:
    """An admin client whose metadata lists a topic only after ``lag`` describe calls."""

    def __init__(self, lag: int, existing: tuple[str, ...] = ()) -> None:
        self.lag = lag
        self.existing = list(existing)
        self.described = 0
        self.created: list[str] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def list_topics(self) -> list[str]:
        return self.existing

    async def create_topics(self, new: list[Any]) -> Any:
        self.created += [t.name for t in new]
        return SimpleNamespace(topic_errors=[(t.name, 0, None) for t in new])

    async def describe_topics(self, names: list[str]) -> list[dict[str, Any]]:
        self.described += 1
        if self.described <= self.lag:  # what a KRaft broker answers right after a create
            if self.described == 1:
                return [{"topic": n, "error_code": 3, "partitions": []} for n in names]
            return [{"topic": n, "error_code": 0, "partitions": [{"partition": 0, "leader": -1}]}
                    for n in names]  # fmt: skip
        return [{"topic": n, "error_code": 0, "partitions": [{"partition": 0, "leader": 1}]}
                for n in names]  # fmt: skip


class Admins:
    """Installs ``Admin``s with a given metadata lag in place of aiokafka's admin client."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.made: list[Admin] = []

    def use(self, lag: int) -> None:
        def build(**_kw: Any) -> Admin:
            self.made.append(Admin(lag))
            return self.made[-1]

        self.monkeypatch.setattr("aiokafka.admin.AIOKafkaAdminClient", build)


@pytest.fixture
def admins(monkeypatch: pytest.MonkeyPatch) -> Admins:
    return Admins(monkeypatch)


async def test_waits_until_created_topics_have_leaders(admins: Admins) -> None:
    admins.use(lag=3)
    created = await kafka_admin.ensure_topics({}, ["route.a", "route.b"])
    got = admins.made[-1]
    assert created == ["route.a", "route.b"] and got.created == created
    assert got.described == 4  # unknown, leaderless, leaderless, then visible


async def test_gives_up_with_a_warning_naming_the_topics(
    admins: Admins, caplog: pytest.LogCaptureFixture
) -> None:
    admins.use(lag=10**9)  # never visible
    with caplog.at_level(logging.WARNING, logger="wiring.kafka_admin"):
        await kafka_admin.ensure_topics({}, ["route.slow"], visible_timeout_s=0.2)
    assert admins.made[-1].described >= 2
    assert "route.slow" in caplog.text and "not yet in the broker's metadata" in caplog.text


async def test_existing_topics_are_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    held = Admin(lag=10**9, existing=("queries",))
    monkeypatch.setattr("aiokafka.admin.AIOKafkaAdminClient", lambda **_kw: held)
    assert await kafka_admin.ensure_topics({}, ["queries"]) == []
    assert held.described == 0


@pytest.mark.integration
async def test_replication_above_the_broker_count_is_an_error_naming_it(
    kafka_bootstrap: str,
) -> None:
    """The single test broker cannot hold 3 replicas: an error at start, no topic created."""
    import uuid

    from aiokafka.admin import AIOKafkaAdminClient

    name = f"t-rf3-{uuid.uuid4().hex[:8]}"
    with pytest.raises(
        kafka_admin.TopicSettingsError, match=r"needs at least 3 Kafka brokers.*lists 1"
    ):
        await kafka_admin.ensure_topics(
            {"bootstrap_servers": kafka_bootstrap}, [name], replication_factor=3
        )
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        assert name not in await admin.list_topics()
    finally:
        await admin.close()
    with pytest.raises(kafka_admin.TopicSettingsError, match="exceeds the replication factor"):
        await kafka_admin.ensure_topics(
            {"bootstrap_servers": kafka_bootstrap}, [name], min_insync_replicas=2
        )


class _Refusing(Admin):
    """An admin whose broker answers CreateTopics with ``codes`` per topic (in order)."""

    def __init__(self, codes: list[int]) -> None:
        super().__init__(lag=0)
        self.codes = codes

    async def create_topics(self, new: list[Any]) -> Any:
        return SimpleNamespace(
            topic_errors=[(t.name, c, None) for t, c in zip(new, self.codes, strict=True)]
        )


async def test_a_topic_that_exists_already_is_not_reported_created(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """list_topics asked a broker whose metadata lagged: the create answers "exists" (36)
    for the topic another broker already holds; only the other is reported created."""
    monkeypatch.setattr("aiokafka.admin.AIOKafkaAdminClient", lambda **_: _Refusing([36, 0]))
    assert await kafka_admin.ensure_topics({}, ["route.old", "route.new"]) == ["route.new"]


async def test_a_topic_kafka_refuses_is_an_error_naming_it_and_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("aiokafka.admin.AIOKafkaAdminClient", lambda **_: _Refusing([0, 38]))
    with pytest.raises(kafka_admin.TopicSettingsError) as err:
        await kafka_admin.ensure_topics({"bootstrap_servers": "b:9092"}, ["ok", "bad"])
    assert "Kafka at b:9092 refused to create bad (InvalidReplicationFactorError" in str(err.value)
