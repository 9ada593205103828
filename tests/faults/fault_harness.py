"""Fault-injection harness: services and processes this suite owns, stopped and killed by pid.

* :class:`OwnedServices` — a Kafka broker and a Redis server started for one test module
  in its own state directory (never the session's shared ones), which a test may stop,
  kill and restart on the same ports. The broker restarts on its own data directory (same
  cluster id, same logs), so a restart is a real broker restart, not a fresh cluster.
* :class:`Proc` / :class:`Procs` — router and worker subprocesses, each in its own
  session, logged to a file, stopped with SIGTERM then SIGKILL by pid, or ``kill -9``'d by
  pid on purpose. ``Procs.stop_all`` runs at teardown whatever happened.
* :class:`TopicTally` — reads ``results`` / ``decisions`` / ``dead-letters`` / ``route.*``
  from the beginning and counts, per query id, how many times each was seen: the lost and
  duplicated figures every scenario reports.
* :func:`write_figures` — appends a scenario's measured figures to the JSON summary that
  ``docs/reliability.md`` is written from.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from switchyard import services
from switchyard.devcerts import TlsFiles
from switchyard.services import ScramUser, ServiceRecord
from wiring.paths import REPO_ROOT

PYTHON = sys.executable
FIGURES_ENV = "SWITCHYARD_FAULTS_FIGURES"


class HarnessError(AssertionError):
    """A bounded wait ran out or a process misbehaved; the message says what and where to look."""


def wait_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1
) -> float:
    """Poll ``predicate`` until true; return the seconds it took, else fail naming ``what``."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        if predicate():
            return time.monotonic() - t0
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


async def await_until(
    predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.1
) -> float:
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while True:
        if predicate():
            return time.monotonic() - t0
        if time.monotonic() > deadline:
            raise HarnessError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(poll_s)


# --------------------------------------------------------------------------- services


def _cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [part.decode() for part in raw.split(b"\0") if part]


@dataclass
class OwnedServices:
    """Kafka and Redis started for one module under ``home``; restartable on the same ports."""

    home: Path
    kafka: ServiceRecord | None = None
    redis: ServiceRecord | None = None
    redis_password: str | None = None
    redis_tls: TlsFiles | None = None
    _kafka_argv: list[str] = field(default_factory=list)
    _redis_port: int = 0
    _extra: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        home: Path,
        *,
        kafka: bool = True,
        redis: bool = True,
        sasl_port: int | None = None,
        tls_port: int | None = None,
        tls: TlsFiles | None = None,
        scram_users: list[ScramUser] | None = None,
        redis_password: str | None = None,
        redis_tls: TlsFiles | None = None,
    ) -> OwnedServices:
        home.mkdir(parents=True, exist_ok=True)
        owned = cls(home=home, redis_password=redis_password, redis_tls=redis_tls)
        try:
            if redis:
                owned._redis_port = services.free_port()
                owned.redis = services.redis_up(
                    port=owned._redis_port,
                    home=home,
                    password=redis_password,
                    tls=redis_tls,
                    name="redis-faults",
                )
            if kafka:
                owned.kafka = services.kafka_up(
                    port=services.free_port(),
                    home=home,
                    sasl_port=sasl_port,
                    tls_port=tls_port,
                    tls=tls,
                    scram_users=scram_users,
                )
                owned._kafka_argv = _cmdline(owned.kafka.pid)
        except BaseException:
            owned.down()
            raise
        return owned

    @property
    def bootstrap(self) -> str:
        assert self.kafka is not None, "this module started no Kafka broker"
        return self.kafka.address

    @property
    def redis_url(self) -> str:
        assert self.redis is not None, "this module started no Redis"
        return self.redis.address

    def env(self, namespace: str = "sy") -> dict[str, str]:
        """Environment for a Switchyard process that talks to these services."""
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SWITCHYARD_") or k in ("SWITCHYARD_SHARED",)
        }
        env["SWITCHYARD_HOME"] = str(self.home)
        env["SWITCHYARD_NAMESPACE"] = namespace
        env["PYTHONUNBUFFERED"] = "1"
        if self.kafka is not None:
            env["SWITCHYARD_KAFKA"] = self.bootstrap
        if self.redis is not None:
            env["SWITCHYARD_REDIS"] = self.redis_url
            if self.redis_password:
                env["SWITCHYARD_REDIS_PASSWORD"] = self.redis_password
            if self.redis_tls:
                env["SWITCHYARD_REDIS_TLS_CA"] = self.redis_tls.ca
        return env

    # -- Kafka: stop / kill / restart on the same data directory

    def kafka_stop(self, hard: bool = False, timeout_s: float = 60.0) -> None:
        """SIGTERM (controlled shutdown) or SIGKILL the broker by its recorded pid; keep its data."""
        rec = self.kafka
        assert rec is not None
        if not rec.alive():
            return
        os.kill(rec.pid, signal.SIGKILL if hard else signal.SIGTERM)
        wait_until(
            lambda: _reaped(rec.pid) or not rec.alive(),
            timeout_s,
            f"Kafka broker pid {rec.pid} to exit",
        )

    def kafka_restart(self, timeout_s: float = 90.0) -> float:
        """Start the broker again with the same command line; return seconds until it serves.

        Blocking (its readiness probe runs its own event loop): call it from sync code or
        ``loop.run_in_executor``.
        """
        rec = self.kafka
        assert rec is not None and self._kafka_argv
        if rec.alive():
            raise HarnessError(f"Kafka broker pid {rec.pid} is still running")
        t0 = time.monotonic()
        with open(rec.log, "ab") as out:
            child = subprocess.Popen(
                self._kafka_argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._extra.append(child)
        rec.pid = child.pid
        services._save(rec, self.home)  # the record follows the new pid so `down` stops it
        while time.monotonic() - t0 < timeout_s:
            if child.poll() is not None:
                raise HarnessError(
                    f"restarted Kafka broker exited {child.returncode}; see {rec.log}"
                )
            if services.kafka_ready(rec.address, timeout_s=3.0):
                return time.monotonic() - t0
            time.sleep(0.3)
        raise HarnessError(
            f"restarted Kafka broker not ready after {timeout_s:.0f} s; see {rec.log}"
        )

    # -- Redis: stop or kill -9 (process gone, port refuses), start again on the same port,
    #    on its append-only file (the production default) or empty

    def redis_stop(self, keep_data: bool = False) -> None:
        """SIGTERM Redis by its recorded pid; ``keep_data`` keeps its AOF for the restart."""
        assert self.redis is not None
        services.stop_record(self.redis, self.home, grace_s=10.0, keep_data=keep_data)

    def redis_kill9(self, timeout_s: float = 30.0) -> None:
        """SIGKILL Redis by its recorded pid: no shutdown, its AOF stays as the kill left it."""
        rec = self.redis
        assert rec is not None
        if not rec.alive():
            raise HarnessError(f"Redis pid {rec.pid} is not running")
        os.kill(rec.pid, signal.SIGKILL)
        wait_until(lambda: _reaped(rec.pid) or not rec.alive(), timeout_s, "Redis to exit")

    def redis_restart(self, empty: bool = False) -> float:
        """Start Redis on the same port: on its AOF, or ``empty`` (AOF deleted first, as after a
        failover to an empty replica or a Redis run without persistence). Returns seconds."""
        assert self.redis is not None
        t0 = time.monotonic()
        self.redis = services.redis_up(
            port=self._redis_port,
            home=self.home,
            password=self.redis_password,
            tls=self.redis_tls,
            name="redis-faults",
            fresh=empty,
        )
        return time.monotonic() - t0

    def down(self) -> None:
        # its data is thrown away: no controlled shutdown needed (saves seconds per module)
        rec = self.kafka
        if rec is not None and rec.alive():
            os.kill(rec.pid, signal.SIGKILL)
            with contextlib.suppress(HarnessError):
                wait_until(lambda: _reaped(rec.pid) or not rec.alive(), 30, "Kafka to exit")
        services.down(self.home)
        for child in self._extra:  # reap restarted brokers (a SIGKILLed JVM takes a moment)
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                if child.poll() is None:
                    child.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    child.wait(timeout=15)


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == pid


# --------------------------------------------------------------------------- processes


@dataclass
class Proc:
    """One Switchyard subprocess in its own session, logged to ``log``."""

    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes]
    started_at: float

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        """``kill -9`` by pid: no shutdown hooks, no flush, no commit."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM by pid, SIGKILL after ``grace_s``; children left in its session are killed too."""
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # its own session: only what it spawned
        return self.popen.returncode

    def tail(self, n_chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def check_alive(self) -> None:
        if not self.alive():
            raise HarnessError(
                f"{self.name} (pid {self.pid}) exited with {self.popen.returncode}; "
                f"log {self.log}:\n{self.tail()}"
            )


@dataclass
class Procs:
    """Every process a module starts; ``stop_all`` at teardown."""

    logs: Path
    env: dict[str, str]
    started: list[Proc] = field(default_factory=list)

    def start(self, name: str, args: Iterable[str], env: Mapping[str, str] | None = None) -> Proc:
        argv = [PYTHON, "-m", "switchyard.cli", *args]
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{name}.{len(self.started)}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                env=dict(env if env is not None else self.env),
                start_new_session=True,
            )
        proc = Proc(name=name, argv=argv, log=log, popen=popen, started_at=time.time())
        self.started.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            with contextlib.suppress(Exception):
                proc.stop(grace_s=5.0)

    def all_text(self) -> str:
        return "\n".join(p.text() for p in self.started)


# --------------------------------------------------------------------------- Kafka I/O


def producer_kwargs() -> dict[str, Any]:
    """Idempotent, acks=all: the producer a careful client runs."""
    return {"acks": "all", "enable_idempotence": True, "linger_ms": 5, "max_batch_size": 262_144}


@dataclass
class TopicTally:
    """Everything read so far from a set of topics, keyed by query id."""

    decisions: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    results: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    routed: dict[str, list[tuple[str, dict[str, Any]]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    unparsable: Counter[str] = field(default_factory=Counter)

    def ids_routed(self, ids: Iterable[str]) -> tuple[set[str], set[str]]:
        """(lost, routed twice) among ``ids`` by the route.* topics.

        Routed twice: two different routings (another instance, or another decision). The
        same decision sent again to the same instance (a router's re-send after a crash) is
        one routing delivered twice; the worker drops the copy (``resent_copies`` counts them).
        """
        lost = {q for q in ids if q not in self.routed}
        twice = {q for q in self.routed if len(self.routings(q)) > 1}
        return lost, twice

    def routings(self, qid: str) -> set[tuple[str, str]]:
        """The distinct (route topic, decision) pairs ``qid`` was sent with."""
        return {
            (topic, json.dumps(body.get("decision"), sort_keys=True))
            for topic, body in self.routed.get(qid, [])
        }

    def resent_copies(self, ids: Iterable[str]) -> int:
        """Route messages beyond the first of each routing: identical re-sends."""
        return sum(len(self.routed.get(q, [])) - len(self.routings(q)) for q in ids)

    def ok_routed_decisions(self, qid: str) -> list[dict[str, Any]]:
        return [d for d in self.decisions.get(qid, []) if d.get("status") == "routed"]


class TopicReader:
    """Background consumers (manual assignment, from the beginning) filling a ``TopicTally``.

    One consumer per topic; ``route.*`` topics are picked up as they appear. Keeps reading
    across broker restarts. Use as an async context manager.
    """

    def __init__(
        self,
        kafka_kwargs: Mapping[str, Any],
        topics: Iterable[str],
        route_prefix: str | None = "route.",
    ) -> None:
        self.kafka_kwargs = dict(kafka_kwargs)
        self.fixed = list(topics)
        self.route_prefix = route_prefix
        self.tally = TopicTally()
        self.records = 0
        self.error: BaseException | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._discover: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def __aenter__(self) -> TopicReader:
        for topic in self.fixed:
            self._tasks[topic] = asyncio.create_task(self._read(topic))
        if self.route_prefix:
            self._discover = asyncio.create_task(self._discover_routes())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        tasks = [*self._tasks.values(), *([self._discover] if self._discover else [])]
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 30)

    async def _discover_routes(self) -> None:
        from aiokafka import AIOKafkaConsumer

        assert self.route_prefix
        probe = AIOKafkaConsumer(**self.kafka_kwargs)
        try:
            await probe.start()
            while not self._stop.is_set():
                with contextlib.suppress(Exception):
                    for topic in await probe.topics():
                        if topic.startswith(self.route_prefix) and topic not in self._tasks:
                            self._tasks[topic] = asyncio.create_task(self._read(topic))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 1.0)
        finally:
            with contextlib.suppress(Exception):
                await probe.stop()

    async def _read(self, topic: str) -> None:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer: Any = None
        try:
            parts: set[int] = set()
            while not self._stop.is_set():
                parts = await _partitions(self.kafka_kwargs, topic)
                if parts:
                    break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), 0.5)
            if not parts:
                return
            consumer = AIOKafkaConsumer(
                **self.kafka_kwargs,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                max_partition_fetch_bytes=4 * 1_048_576,
                fetch_max_bytes=16 * 1_048_576,
            )
            await consumer.start()
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            while not self._stop.is_set():
                try:
                    batch = await consumer.getmany(timeout_ms=200, max_records=20_000)
                except Exception:
                    await asyncio.sleep(0.5)  # broker restarts: keep reading afterwards
                    continue
                for recs in batch.values():
                    for rec in recs:
                        self._add(topic, rec.value)
        except BaseException as exc:  # surfaced by check()
            if not isinstance(exc, asyncio.CancelledError):
                self.error = exc
            raise
        finally:
            if consumer is not None:
                with contextlib.suppress(Exception):
                    await consumer.stop()

    def _add(self, topic: str, value: bytes | None) -> None:
        self.records += 1
        try:
            body = json.loads(value or b"null")
        except ValueError:
            self.tally.unparsable[topic] += 1
            return
        if not isinstance(body, dict):
            self.tally.unparsable[topic] += 1
            return
        t = self.tally
        if topic == "results":
            t.results[str(body.get("query_id"))].append(body)
        elif topic == "decisions":
            t.decisions[str(body.get("query_id"))].append(body)
        elif topic == "dead-letters":
            t.dead_letters.append(body)
        elif self.route_prefix and topic.startswith(self.route_prefix):
            query = body.get("query") or {}
            t.routed[str(query.get("id"))].append((topic, body))

    def check(self) -> None:
        if self.error is not None:
            raise HarnessError(f"topic reader failed: {self.error!r}")


async def _partitions(kafka_kwargs: Mapping[str, Any], topic: str) -> set[int]:
    """Partition ids of ``topic`` (empty while it does not exist or the broker is away)."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**dict(kafka_kwargs))
    try:
        await admin.start()
        described = await admin.describe_topics([topic])
    except Exception:
        return set()
    finally:
        with contextlib.suppress(Exception):
            await admin.close()
    out: set[int] = set()
    for entry in described:
        if entry.get("topic") == topic and not entry.get("error_code"):
            out |= {int(p["partition"]) for p in entry.get("partitions", [])}
    return out


async def produce_all(
    kafka_kwargs: Mapping[str, Any],
    topic: str,
    messages: Iterable[tuple[bytes | None, bytes | None]],
    rate_per_s: float | None = None,
    on_sent: Callable[[int], None] | None = None,
) -> list[tuple[int, int]]:
    """Produce ``(key, value)`` pairs with an idempotent producer; return (partition, offset) each.

    ``rate_per_s`` paces the stream (a replay); ``on_sent(i)`` is called after the i-th send
    is queued (a scenario injects its fault from there).
    """
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(
        **dict(kafka_kwargs),
        **producer_kwargs(),
        max_request_size=1_048_576,
        request_timeout_ms=60_000,
    )
    await producer.start()
    futures: list[asyncio.Future[Any]] = []
    try:
        t0 = time.monotonic()
        for i, (key, value) in enumerate(messages):
            if rate_per_s:
                ahead = i / rate_per_s - (time.monotonic() - t0)
                if ahead > 0:
                    await asyncio.sleep(ahead)
            futures.append(await producer.send(topic, value=value, key=key))
            if on_sent is not None:
                on_sent(i)
        metas = await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return [(m.partition, m.offset) for m in metas]


# --------------------------------------------------------------------------- figures


def figures_path() -> Path:
    env = os.environ.get(FIGURES_ENV)
    if env:
        return Path(env)
    home = os.environ.get("SWITCHYARD_HOME")
    base = Path(home) if home else REPO_ROOT / ".switchyard"
    return base / "faults-figures.json"


def write_figures(scenario: str, figures: Mapping[str, Any]) -> Path:
    """Merge one scenario's figures into the JSON summary (a dict keyed by scenario)."""
    path = figures_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[scenario] = {**figures, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path.write_text(json.dumps(data, indent=2, sort_keys=True))
    return path


# --------------------------------------------------------------------------- the service under test

FAULTS_DIR = Path(__file__).resolve().parent
ROUTER_READY = "assigned queries partitions"


POLICY_NOTES: dict[str, str] = {}


def policy_name(prefer: str | None, cluster: Any = None) -> str:
    """``prefer`` (a product policy) when it loads for ``cluster``, else the test-only one.

    The fault scenarios check the service's guarantees, which no policy may weaken; the
    figures record which policy ran and, for a fallback, why.
    """
    if prefer and cluster is not None:
        try:
            from streams.policy import load_router

            load_router(prefer, cluster)
            return prefer
        except Exception as exc:
            POLICY_NOTES[prefer] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return "faults_policy:factory"


DEMO_DATA = REPO_ROOT / "data" / "routing" / "llmrouter_dc9" / "scores_long.csv.gz"


def cached_predictor() -> tuple[Path | None, str]:
    """A knn quality predictor trained once per ``$SWITCHYARD_HOME`` (about 20 s)."""
    home = Path(os.environ.get("SWITCHYARD_HOME") or REPO_ROOT / ".switchyard")
    path = home / "faults-predictor-dc9-knn.npz"
    if path.exists():
        return path, "cached"
    home.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    cmd = [
        PYTHON, "-m", "switchyard.cli", "train", "--data", str(DEMO_DATA), "--format", "long",
        "--estimator", "knn", "--replicates", "2", "--test-fraction", "0", "--out", str(tmp),
    ]  # fmt: skip
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return None, "training timed out"
    if proc.returncode != 0 or not tmp.exists():
        return None, f"training failed: {proc.stderr[-300:]}"
    tmp.replace(path)
    return path, "trained"


def demo_cluster_spec(
    prefix: str, tenants: Mapping[str, float], period_s: float = 3600
) -> dict[str, Any]:
    """``configs/demo-cluster.yaml`` (model names the trained predictor knows), ids prefixed."""
    import yaml

    spec = yaml.safe_load((REPO_ROOT / "configs" / "demo-cluster.yaml").read_text())
    for inst in spec["instances"]:
        inst["id"] = f"{prefix}-{inst['id']}"
        inst.pop("endpoint", None)
    spec["tenants"] = [
        {"tenant": t, "budget_usd": usd, "period_s": period_s} for t, usd in tenants.items()
    ]
    return spec


def product_policy(cluster: Any, name: str = "batch-ilp-sfs") -> tuple[str, list[str], str]:
    """(policy, extra router args, note): the product policy with the cached predictor when
    it loads, else the test-only policy (the note says why)."""
    predictor, note = cached_predictor()
    if predictor is None:
        POLICY_NOTES[name] = note
        return policy_name(None), [], note
    try:
        from streams.policy import load_router

        load_router(name, cluster, predictor)
    except Exception as exc:
        POLICY_NOTES[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return policy_name(None), [], POLICY_NOTES[name]
    return name, ["--predictor", str(predictor)], note


def cluster_spec(
    prefix: str,
    *,
    n_small: int = 2,
    n_large: int = 1,
    max_concurrency: int = 64,
    tenants: Mapping[str, float] | None = None,
    period_s: float = 86_400.0,
) -> dict[str, Any]:
    """A small two-model cluster: cheap ``small`` instances and one pricey ``large`` one."""
    models = [
        {
            "name": "small",
            "input_usd_per_token": 1e-7,
            "output_usd_per_token": 2e-7,
            "max_concurrency": max_concurrency,
            "step_time": {
                "c0_ms": 5.0,
                "c1_ms_per_token": 0.01,
                "c2_ms_per_ctx_token": 0.0001,
                "c3_ms_per_attn_unit": 0.0,
            },
        },
        {
            "name": "large",
            "input_usd_per_token": 1e-6,
            "output_usd_per_token": 3e-6,
            "max_concurrency": max_concurrency,
            "step_time": {
                "c0_ms": 10.0,
                "c1_ms_per_token": 0.02,
                "c2_ms_per_ctx_token": 0.0002,
                "c3_ms_per_attn_unit": 0.0,
            },
        },
    ]
    instances = [{"id": f"{prefix}-s{i}", "model": "small"} for i in range(1, n_small + 1)]
    instances += [{"id": f"{prefix}-l{i}", "model": "large"} for i in range(1, n_large + 1)]
    budgets = tenants if tenants is not None else {"default": 1_000_000.0}
    return {
        "models": models,
        "instances": instances,
        "tenants": [
            {"tenant": t, "budget_usd": usd, "period_s": period_s} for t, usd in budgets.items()
        ],
    }


def write_cluster(path: Path, spec: Mapping[str, Any]) -> Any:
    from schemas import ClusterConfig

    path.write_text(json.dumps(spec, indent=2))
    return ClusterConfig.model_validate(spec)


def service_env(owned: OwnedServices, namespace: str) -> dict[str, str]:
    env = owned.env(namespace)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(FAULTS_DIR), os.environ.get("PYTHONPATH", "")) if p
    )
    return env


def start_router(
    procs: Procs,
    cluster_file: Path,
    policy: str,
    *,
    window_ms: float = 50.0,
    extra: Iterable[str] = (),
    name: str = "router",
    wait_s: float = 90.0,
) -> Proc:
    """Start ``switchyard router``; wait until it owns ``queries`` partitions (``wait_s`` > 0)."""
    proc = procs.start(
        name,
        [
            "router",
            "--cluster",
            str(cluster_file),
            "--policy",
            policy,
            "--window-ms",
            f"{window_ms:g}",
            "--loglevel",
            "WARNING",
            *extra,
        ],
    )
    if wait_s > 0:
        wait_router_ready(proc, wait_s)
    return proc


def router_ready(proc: Proc) -> bool:
    """True once the router's log shows a partition assignment; fails if it died."""
    proc.check_alive()
    return ROUTER_READY in proc.text()


def wait_router_ready(proc: Proc, wait_s: float = 90.0, after: int = 0) -> float:
    """Seconds until the router's log shows a partition assignment (past ``after`` chars)."""

    def ready() -> bool:
        proc.check_alive()
        return ROUTER_READY in proc.text()[after:]

    return wait_until(ready, wait_s, f"{proc.name} (pid {proc.pid}) to be assigned partitions")


class Heartbeats:
    """Heart-beats instances in Redis as workers would (test-side), surviving Redis outages.

    ``silence(id)`` stops one instance's heartbeat (scenario 5); errors while Redis is away
    are counted, not raised.
    """

    def __init__(
        self,
        redis_kwargs: Mapping[str, Any],
        cluster: Any,
        interval_s: float = 0.5,
        ttl_s: float = 2.0,
    ) -> None:
        self.redis_kwargs = dict(redis_kwargs)
        self.cluster = cluster
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.silenced: set[str] = set()
        self.errors = 0
        self.beats = 0
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def __aenter__(self) -> Heartbeats:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 15)

    def silence(self, instance_id: str) -> None:
        self.silenced.add(instance_id)

    async def _run(self) -> None:
        from state.store import StateStore

        store: Any = None
        try:
            while not self._stop.is_set():
                try:
                    if store is None:
                        store = await StateStore.connect(**self.redis_kwargs, socket_timeout_s=2.0)
                    for inst in self.cluster.instances:
                        if inst.id in self.silenced:
                            continue
                        spec = self.cluster.model(inst.model)
                        await store.heartbeat(inst.id, inst.model, self.ttl_s, spec.max_concurrency)
                    self.beats += 1
                except Exception:
                    self.errors += 1
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), self.interval_s)
        finally:
            if store is not None:
                with contextlib.suppress(Exception):
                    await store.close()
