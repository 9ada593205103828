"""The one settings object: service addresses and credentials from the environment.

Every process (router, worker, replay, batch, client) reads ``Settings.from_env()``;
nothing else reads ``SWITCHYARD_*`` variables. Secrets are ``SecretStr``: they print as
``**********`` in reprs, logs and error messages, and are revealed only inside the
helpers that hand them to the Kafka and Redis clients.

Environment variables (all optional):

==================================  ==========================================  ==========================
variable                            meaning                                     default
==================================  ==========================================  ==========================
SWITCHYARD_KAFKA                    bootstrap servers, comma separated          127.0.0.1:19092
SWITCHYARD_KAFKA_SECURITY_PROTOCOL  PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL     PLAINTEXT
SWITCHYARD_KAFKA_SASL_MECHANISM     PLAIN, SCRAM-SHA-256, SCRAM-SHA-512          SCRAM-SHA-256
SWITCHYARD_KAFKA_SASL_USERNAME      SASL user                                   (none)
SWITCHYARD_KAFKA_SASL_PASSWORD      SASL password (secret)                      (none)
SWITCHYARD_KAFKA_SSL_CAFILE         CA bundle for the broker's certificate      system CAs
SWITCHYARD_KAFKA_REPLICATION_FACTOR replicas of each topic Switchyard creates   1
SWITCHYARD_KAFKA_MIN_INSYNC_REPLICAS  ``min.insync.replicas`` of those topics   min(2, replication)
SWITCHYARD_REDIS                    redis://, rediss:// URL; a Redis Cluster:   redis://127.0.0.1:16379/0
                                    redis+cluster://h1:p1,h2:p2 (rediss+cluster)
SWITCHYARD_REDIS_PASSWORD           Redis AUTH password (secret)                (none)
SWITCHYARD_REDIS_TLS_CA             CA bundle for a rediss:// server            system CAs
SWITCHYARD_NAMESPACE                Redis key prefix (several deployments)      sy
SWITCHYARD_ENGINE_API_KEY           bearer token a worker sends its engine: a   (none)
                                    provider's API key, or vLLM's --api-key
                                    (secret)
==================================  ==========================================  ==========================
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

DEFAULT_KAFKA = "127.0.0.1:19092"
DEFAULT_REDIS = "redis://127.0.0.1:16379/0"
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")

_ENV: dict[str, str] = {
    "kafka": "SWITCHYARD_KAFKA",
    "kafka_security_protocol": "SWITCHYARD_KAFKA_SECURITY_PROTOCOL",
    "kafka_sasl_mechanism": "SWITCHYARD_KAFKA_SASL_MECHANISM",
    "kafka_sasl_username": "SWITCHYARD_KAFKA_SASL_USERNAME",
    "kafka_sasl_password": "SWITCHYARD_KAFKA_SASL_PASSWORD",
    "kafka_ssl_cafile": "SWITCHYARD_KAFKA_SSL_CAFILE",
    "kafka_replication_factor": "SWITCHYARD_KAFKA_REPLICATION_FACTOR",
    "kafka_min_insync_replicas": "SWITCHYARD_KAFKA_MIN_INSYNC_REPLICAS",
    "redis": "SWITCHYARD_REDIS",
    "redis_password": "SWITCHYARD_REDIS_PASSWORD",
    "redis_tls_ca_file": "SWITCHYARD_REDIS_TLS_CA",
    "namespace": "SWITCHYARD_NAMESPACE",
    "engine_api_key": "SWITCHYARD_ENGINE_API_KEY",
}


class SettingsError(ValueError):
    """A setting is missing or malformed; the message names the environment variable."""


class Settings(BaseModel):
    """Where Kafka and Redis are and how to authenticate to them (and a worker to its
    engine)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kafka: str = DEFAULT_KAFKA
    kafka_security_protocol: SecurityProtocol = "PLAINTEXT"
    kafka_sasl_mechanism: SaslMechanism = "SCRAM-SHA-256"
    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_ssl_cafile: str | None = None
    kafka_replication_factor: int = Field(default=1, ge=1, le=32)
    kafka_min_insync_replicas: int | None = Field(default=None, ge=1, le=32)
    redis: str = DEFAULT_REDIS
    redis_password: SecretStr | None = None
    redis_tls_ca_file: str | None = None
    namespace: str = Field(default="sy", pattern=r"^[A-Za-z0-9_\-]{1,32}$")
    engine_api_key: SecretStr | None = None

    @field_validator("kafka")
    @classmethod
    def _bootstrap(cls, value: str) -> str:
        hosts = [h.strip() for h in value.split(",") if h.strip()]
        if not hosts:
            raise ValueError("must name at least one host:port")
        for h in hosts:
            host, _, port = h.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"bootstrap server {h!r} must be host:port")
        return ",".join(hosts)

    @field_validator("redis")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        if urlsplit(value).scheme not in REDIS_SCHEMES:
            raise ValueError(
                "must be a redis://, rediss://, unix:// or (a Redis Cluster) "
                "redis+cluster:// or rediss+cluster:// URL"
            )
        return value

    @model_validator(mode="after")
    def _replication(self) -> Settings:
        isr = self.kafka_min_insync_replicas
        if isr is not None and isr > self.kafka_replication_factor:
            raise ValueError(
                f"{_ENV['kafka_min_insync_replicas']} ({isr}) cannot exceed "
                f"{_ENV['kafka_replication_factor']} ({self.kafka_replication_factor}): "
                "no write could ever be acknowledged"
            )
        return self

    @model_validator(mode="after")
    def _sasl(self) -> Settings:
        if self.kafka_security_protocol.startswith("SASL_") and (
            not self.kafka_sasl_username or self.kafka_sasl_password is None
        ):
            raise ValueError(
                f"security protocol {self.kafka_security_protocol} needs "
                f"{_ENV['kafka_sasl_username']} and {_ENV['kafka_sasl_password']}"
            )
        return self

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read ``SWITCHYARD_*`` variables; ``overrides`` (e.g. from CLI options) win when not None."""
        source = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field_name, var in _ENV.items():
            raw = source.get(var)
            if raw is not None and raw != "":
                values[field_name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except Exception as exc:  # pydantic ValidationError: name the variable, never the value
            from pydantic import ValidationError

            if not isinstance(exc, ValidationError):
                raise
            parts = []
            for err in exc.errors(include_url=False):
                loc = str(err["loc"][0]) if err.get("loc") else ""
                var = _ENV.get(loc, loc or "settings")
                msg = str(err.get("msg", "")).removeprefix("Value error, ")
                parts.append(f"{var}: {msg}")
            raise SettingsError("; ".join(parts)) from None

    def __repr_args__(self) -> Any:
        # a password embedded in SWITCHYARD_REDIS is a secret too: never print it
        for name, value in super().__repr_args__():
            yield name, redact_url(value) if name == "redis" and isinstance(value, str) else value

    # ------------------------------------------------------------------ Kafka

    @property
    def kafka_tls(self) -> bool:
        return self.kafka_security_protocol in ("SSL", "SASL_SSL")

    def kafka_ssl_context(self) -> ssl.SSLContext | None:
        if not self.kafka_tls:
            return None
        from aiokafka.helpers import create_ssl_context

        ctx: ssl.SSLContext = create_ssl_context(cafile=self.kafka_ssl_cafile)
        return ctx

    def kafka_kwargs(self, client_id: str | None = None) -> dict[str, Any]:
        """Keyword arguments shared by AIOKafkaProducer, AIOKafkaConsumer and AIOKafkaAdminClient."""
        kw: dict[str, Any] = {
            "bootstrap_servers": self.kafka,
            "security_protocol": self.kafka_security_protocol,
        }
        if client_id:
            kw["client_id"] = client_id
        ctx = self.kafka_ssl_context()
        if ctx is not None:
            kw["ssl_context"] = ctx
        if self.kafka_security_protocol.startswith("SASL_"):
            kw["sasl_mechanism"] = self.kafka_sasl_mechanism
            kw["sasl_plain_username"] = self.kafka_sasl_username
            kw["sasl_plain_password"] = (
                self.kafka_sasl_password.get_secret_value() if self.kafka_sasl_password else None
            )
        return kw

    def topic_kwargs(self) -> dict[str, int]:
        """``replication_factor`` and ``min_insync_replicas`` for ``topics.ensure_topics``:
        with ``acks=all`` producers a write is acknowledged once that many replicas hold it."""
        rf = self.kafka_replication_factor
        isr = self.kafka_min_insync_replicas or min(2, rf)
        return {"replication_factor": rf, "min_insync_replicas": isr}

    def faust_broker(self) -> str:
        """Faust broker URL (``kafka://h1:p1;h2:p2``)."""
        return "kafka://" + ";".join(self.kafka.split(","))

    def faust_credentials(self) -> Any:
        """``broker_credentials`` for ``faust.App`` (None for PLAINTEXT)."""
        if self.kafka_security_protocol == "PLAINTEXT":
            return None
        import faust

        ctx = self.kafka_ssl_context()
        if self.kafka_security_protocol.startswith("SASL_"):
            assert self.kafka_sasl_password is not None
            if self.kafka_sasl_mechanism == "PLAIN":
                return faust.SASLCredentials(
                    username=self.kafka_sasl_username,
                    password=self.kafka_sasl_password.get_secret_value(),
                    ssl_context=ctx,
                )
            return faust.SASLCredentials(
                username=self.kafka_sasl_username,
                password=self.kafka_sasl_password.get_secret_value(),
                mechanism=self.kafka_sasl_mechanism,
                ssl_context=ctx,
            )
        return faust.SSLCredentials(ctx)

    # ------------------------------------------------------------------ Redis

    def redis_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``state.StateStore.connect``."""
        return {
            "url": self.redis,
            "password": self.redis_password.get_secret_value() if self.redis_password else None,
            "tls_ca_file": self.redis_tls_ca_file,
            "namespace": self.namespace,
        }

    def redis_display(self) -> str:
        """The Redis URL with any password in it masked, safe to log."""
        return redact_url(self.redis)


def redact_url(url: str) -> str:
    """``redis://:secret@host`` → ``redis://:***@host``; URLs without a password unchanged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
