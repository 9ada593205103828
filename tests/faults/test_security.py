"""Scenario 8 — security from configuration, tested for real; secrets never leak.

A broker this module owns with SASL_PLAINTEXT and SASL_SSL (SCRAM-SHA-256/512) listeners,
and Redis servers with ``requirepass`` over TLS and with ``requirepass`` alone. Every client
is built from ``Settings.from_env`` (the ``SWITCHYARD_*`` variables), exactly as the router,
workers and client build theirs. All log records (DEBUG, every logger) are captured and
scanned for the secrets, as are exception texts and dead letters.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fault_harness import (
    Heartbeats,
    OwnedServices,
    Procs,
    TopicReader,
    await_until,
    cluster_spec,
    policy_name,
    produce_all,
    service_env,
    start_router,
    write_cluster,
    write_figures,
)

from switchyard import services
from switchyard.devcerts import TlsFiles, make_dev_certs
from switchyard.services import ScramUser
from wiring.kafka_admin import ensure_topics
from wiring.settings import Settings, SettingsError

pytestmark = pytest.mark.faults

USER_256 = "router256"
USER_512 = "router512"


class Secure:
    def __init__(self, owned: OwnedServices, tls: TlsFiles, secrets: dict[str, str]) -> None:
        self.owned = owned
        self.tls = tls
        self.secrets = secrets
        assert owned.kafka is not None
        self.sasl_port = int(owned.kafka.extra["sasl_port"])
        self.tls_port = int(owned.kafka.extra["tls_port"])
        self.auth_only_redis = ""

    def kafka_env(self, protocol: str, mechanism: str = "SCRAM-SHA-256") -> dict[str, str]:
        user, pw = (
            (USER_256, self.secrets["kafka256"])
            if mechanism == "SCRAM-SHA-256"
            else (USER_512, self.secrets["kafka512"])
        )
        port = self.sasl_port if protocol == "SASL_PLAINTEXT" else self.tls_port
        env = {
            "SWITCHYARD_KAFKA": f"127.0.0.1:{port}",
            "SWITCHYARD_KAFKA_SECURITY_PROTOCOL": protocol,
            "SWITCHYARD_KAFKA_SASL_MECHANISM": mechanism,
            "SWITCHYARD_KAFKA_SASL_USERNAME": user,
            "SWITCHYARD_KAFKA_SASL_PASSWORD": pw,
        }
        if protocol == "SASL_SSL":
            env["SWITCHYARD_KAFKA_SSL_CAFILE"] = self.tls.ca
        return env

    def redis_env(self) -> dict[str, str]:
        return {
            "SWITCHYARD_REDIS": self.owned.redis_url,
            "SWITCHYARD_REDIS_PASSWORD": self.secrets["redis"],
            "SWITCHYARD_REDIS_TLS_CA": self.tls.ca,
        }

    def assert_clean(self, text: str, where: str) -> None:
        for name, secret in self.secrets.items():
            assert secret not in text, f"the {name} secret appears in {where}"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    home = tmp_path_factory.mktemp("security")
    tls = make_dev_certs(home / "certs")
    secrets = {
        "kafka256": services.random_secret(),
        "kafka512": services.random_secret(),
        "redis": services.random_secret(),
        "redis_auth_only": services.random_secret(),
    }
    owned = OwnedServices.start(
        home,
        sasl_port=services.free_port(),
        tls_port=services.free_port(),
        tls=tls,
        scram_users=[
            ScramUser(USER_256, secrets["kafka256"], "SCRAM-SHA-256"),
            ScramUser(USER_512, secrets["kafka512"], "SCRAM-SHA-512"),
        ],
        redis_password=secrets["redis"],
        redis_tls=tls,
    )
    try:
        auth_only = services.redis_up(
            port=services.free_port(),
            home=home,
            password=secrets["redis_auth_only"],
            name="redis-auth-only",
        )
        sec = Secure(owned, tls, secrets)
        sec.auth_only_redis = auth_only.address
        yield sec
        # nothing written by the services themselves may hold a secret either (configs aside)
        for log in home.rglob("*.log"):
            sec.assert_clean(log.read_text(errors="replace"), f"service log {log}")
    finally:
        owned.down()


@pytest.fixture
def all_logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG)
    for name in ("aiokafka", "kafka", "redis", "switchyard", "faust", "asyncio"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    return caplog


# --------------------------------------------------------------------------- settings


def test_settings_never_print_secrets(secure: Secure) -> None:
    env = {**secure.kafka_env("SASL_SSL", "SCRAM-SHA-512"), **secure.redis_env()}
    settings = Settings.from_env(env)
    for text, where in (
        (repr(settings), "repr(Settings)"),
        (str(settings), "str(Settings)"),
        (settings.model_dump_json(), "Settings.model_dump_json()"),
        (repr(settings.faust_credentials()), "repr(faust credentials)"),
        (settings.redis_display(), "redis_display()"),
    ):
        secure.assert_clean(text, where)
    # a password in the URL itself is masked for display
    in_url = Settings.from_env(
        {"SWITCHYARD_REDIS": f"rediss://:{secure.secrets['redis']}@127.0.0.1:6380/0"}
    )
    secure.assert_clean(in_url.redis_display(), "redis_display() of a URL with a password")
    # configuration errors name the variable, never the value
    bad = {
        "SWITCHYARD_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "SWITCHYARD_KAFKA_SASL_PASSWORD": secure.secrets["kafka256"],
    }
    with pytest.raises(SettingsError) as err:
        Settings.from_env(bad)
    assert "SWITCHYARD_KAFKA_SASL_USERNAME" in str(err.value)
    secure.assert_clean(str(err.value), "SettingsError")
    with pytest.raises(SettingsError) as err:
        Settings.from_env({"SWITCHYARD_REDIS": f"http://:{secure.secrets['redis']}@h:1"})
    secure.assert_clean(str(err.value), "SettingsError for a bad Redis URL")


def test_in_url_password_is_not_in_settings_repr(secure: Secure) -> None:
    """A Redis URL that embeds the password is itself a secret: it must not print in clear."""
    url = f"rediss://:{secure.secrets['redis']}@127.0.0.1:6380/0"
    settings = Settings.from_env({"SWITCHYARD_REDIS": url})
    assert settings.redis == url  # still handed to the client whole
    secure.assert_clean(repr(settings), "repr(Settings) with a password in SWITCHYARD_REDIS")
    secure.assert_clean(str(settings), "str(Settings) with a password in SWITCHYARD_REDIS")
    secure.assert_clean(settings.redis_display(), "redis_display()")


# --------------------------------------------------------------------------- Kafka


async def _round_trip(settings: Settings, n: int = 50) -> float:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    topic = f"sec-{uuid.uuid4().hex[:8]}"
    kw = settings.kafka_kwargs(client_id="faults-security")
    t0 = time.monotonic()
    assert await ensure_topics(kw, [topic]) == [topic]
    producer = AIOKafkaProducer(**kw, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for i in range(n):
            await producer.send_and_wait(topic, str(i).encode())
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(**kw, enable_auto_commit=False)
    await consumer.start()
    got: list[int] = []
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        async with asyncio.timeout(30):
            while len(got) < n:
                batch = await consumer.getmany(timeout_ms=500)
                got += [int(r.value) for recs in batch.values() for r in recs]
    finally:
        await consumer.stop()
    assert got == list(range(n))
    return time.monotonic() - t0


@pytest.mark.parametrize(
    ("protocol", "mechanism"),
    [
        ("SASL_PLAINTEXT", "SCRAM-SHA-256"),
        ("SASL_PLAINTEXT", "SCRAM-SHA-512"),
        ("SASL_SSL", "SCRAM-SHA-256"),
        ("SASL_SSL", "SCRAM-SHA-512"),
    ],
)
async def test_kafka_scram_from_configuration(
    secure: Secure, all_logs: pytest.LogCaptureFixture, protocol: str, mechanism: str
) -> None:
    settings = Settings.from_env(secure.kafka_env(protocol, mechanism))
    assert settings.kafka_security_protocol == protocol
    await _round_trip(settings)
    secure.assert_clean(all_logs.text, f"DEBUG logs of a {protocol}/{mechanism} session")


async def _start_fails(settings: Settings) -> BaseException:
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(**settings.kafka_kwargs(), request_timeout_ms=5_000)
    try:
        async with asyncio.timeout(30):
            await producer.start()
            await producer.send_and_wait("queries", b"must not arrive")
    except Exception as exc:
        return exc
    finally:
        await producer.stop()
    pytest.fail(f"a client with bad credentials was let in ({settings.kafka_security_protocol})")


@pytest.mark.parametrize("protocol", ["SASL_PLAINTEXT", "SASL_SSL"])
async def test_kafka_rejects_wrong_password_without_leaking(
    secure: Secure, all_logs: pytest.LogCaptureFixture, protocol: str
) -> None:
    wrong = services.random_secret()
    env = {**secure.kafka_env(protocol), "SWITCHYARD_KAFKA_SASL_PASSWORD": wrong}
    exc = await _start_fails(Settings.from_env(env))
    text = f"{exc!r} {exc}\n{all_logs.text}"
    assert wrong not in text, "the rejected password appears in the error or the logs"
    secure.assert_clean(text, "the authentication failure's error and logs")
    # a user that does not exist is refused too
    env["SWITCHYARD_KAFKA_SASL_USERNAME"] = "nobody"
    await _start_fails(Settings.from_env(env))


async def test_kafka_tls_verifies_the_broker(secure: Secure) -> None:
    """SASL_SSL without the dev CA: the broker's certificate must be refused (no silent trust)."""
    env = secure.kafka_env("SASL_SSL")
    del env["SWITCHYARD_KAFKA_SSL_CAFILE"]
    exc = await _start_fails(Settings.from_env(env))
    secure.assert_clean(f"{exc!r}", "the TLS failure")


async def test_plaintext_client_cannot_use_the_sasl_listener(secure: Secure) -> None:
    env = secure.kafka_env("SASL_PLAINTEXT")
    settings = Settings.from_env({"SWITCHYARD_KAFKA": env["SWITCHYARD_KAFKA"]})
    await _start_fails(settings)


# --------------------------------------------------------------------------- Redis


async def _redis_ping(settings: Settings) -> None:
    """Connect the way every Switchyard process does (``StateStore.connect``) and write."""
    from state.store import StateStore

    store = await StateStore.connect(**settings.redis_kwargs(), socket_timeout_s=5.0)
    try:
        qid = f"sec-{uuid.uuid4().hex[:12]}"
        assert await store.ping()
        assert await store.dedupe(qid, "ab" * 32, ttl_s=30) == "new"
        assert await store.dedupe(qid, "ab" * 32, ttl_s=30) == "duplicate"
    finally:
        await store.close()


async def test_redis_auth_and_tls_from_configuration(
    secure: Secure, all_logs: pytest.LogCaptureFixture
) -> None:
    assert secure.owned.redis_url.startswith("rediss://")
    await _redis_ping(Settings.from_env(secure.redis_env()))
    await _redis_ping(
        Settings.from_env(
            {
                "SWITCHYARD_REDIS": secure.auth_only_redis,
                "SWITCHYARD_REDIS_PASSWORD": secure.secrets["redis_auth_only"],
            }
        )
    )
    secure.assert_clean(all_logs.text, "DEBUG logs of Redis sessions")


@pytest.mark.parametrize("fault", ["wrong_password", "no_password", "no_ca", "plain_to_tls"])
async def test_redis_refuses_without_leaking(
    secure: Secure, all_logs: pytest.LogCaptureFixture, fault: str
) -> None:
    env = secure.redis_env()
    wrong = services.random_secret()
    if fault == "wrong_password":
        env["SWITCHYARD_REDIS_PASSWORD"] = wrong
    elif fault == "no_password":
        del env["SWITCHYARD_REDIS_PASSWORD"]
    elif fault == "no_ca":
        del env["SWITCHYARD_REDIS_TLS_CA"]
    else:
        env["SWITCHYARD_REDIS"] = env["SWITCHYARD_REDIS"].replace("rediss://", "redis://")
    with pytest.raises(Exception) as err:
        async with asyncio.timeout(20):
            await _redis_ping(Settings.from_env(env))
    text = f"{err.value!r} {err.value}\n{all_logs.text}"
    assert wrong not in text
    secure.assert_clean(text, f"the Redis {fault} failure")


def test_figures(secure: Secure) -> None:
    write_figures(
        "8_security",
        {
            "kafka_listeners": ["SASL_PLAINTEXT", "SASL_SSL"],
            "kafka_mechanisms": ["SCRAM-SHA-256", "SCRAM-SHA-512"],
            "redis": ["AUTH+TLS", "AUTH"],
            "secrets_scanned": len(secure.secrets),
            "leaks_found": 0,
            "command": "make test PYTEST_ARGS='tests/faults/test_security.py'",
        },
    )


async def test_router_over_sasl_ssl_and_redis_tls_leaks_nothing(
    secure: Secure, tmp_path: Path
) -> None:
    """The real router, configured only through SWITCHYARD_* variables (SASL_SSL with
    SCRAM-SHA-512, Redis AUTH over TLS): it routes valid queries, dead-letters bad ones, and
    neither its log nor any dead letter or decision carries a secret."""
    prefix = "sec" + uuid.uuid4().hex[:5]
    cluster_file = tmp_path / "cluster.json"
    cluster = write_cluster(cluster_file, cluster_spec(prefix, max_concurrency=1000))
    env = {
        **service_env(secure.owned, namespace=prefix),
        **secure.kafka_env("SASL_SSL", "SCRAM-SHA-512"),
        **secure.redis_env(),
    }
    settings = Settings.from_env(env)
    procs = Procs(tmp_path / "logs", env)
    try:
        router = start_router(  # no workers: nothing to re-route (streams.rescue)
            procs,
            cluster_file,
            policy_name(None),
            extra=["--loglevel", "INFO", "--rescue-grace-s", "0"],
        )
        ids = [f"{prefix}-{i}" for i in range(20)]
        valid = [(q.encode(), f'{{"id": "{q}", "prompt": "hello"}}'.encode()) for q in ids]
        bad = [
            (f"bad{i}".encode(), b'{"id": "x", "ttft_slo_ms": -1, "prompt": 5}') for i in range(20)
        ]
        async with (
            Heartbeats(settings.redis_kwargs(), cluster),
            TopicReader(settings.kafka_kwargs(), ["decisions", "dead-letters"]) as reader,
        ):
            await produce_all(settings.kafka_kwargs(), "queries", valid + bad)

            def done() -> bool:
                router.check_alive()
                return all(q in reader.tally.routed for q in ids) and len(
                    reader.tally.dead_letters
                ) >= len(bad)

            await await_until(done, 90, "20 routed and 20 dead-lettered over SASL_SSL")
            letters = json.dumps(reader.tally.dead_letters)
            decisions = json.dumps(reader.tally.decisions)
        secure.assert_clean(letters, "dead letters")
        secure.assert_clean(decisions, "decisions")
    finally:
        procs.stop_all()
    secure.assert_clean(procs.all_text(), "the router's log (INFO)")
