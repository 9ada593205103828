"""Local Kafka and Redis without Docker: start, check, stop — by recorded pid only.

Kafka: the Apache Kafka broker jars resolved from Maven Central (``services/kafka/pom.xml``),
KRaft combined mode on loopback, a freshly formatted data directory per start, ready only
when a real metadata request succeeds. Redis: Debian's ``redis-server`` on loopback with
append-only-file persistence (``appendonly yes``, ``appendfsync always``: the budget ledger is
a hard limit, see ``REDIS_APPENDFSYNC``) in its data directory, which survives ``stop`` and a
``kill -9``; installed with apt-get when missing.

Every started process is recorded (pid, command marker, address) under
``<state dir>/services/<name>.json``; ``stop`` signals only those pids, and only while the
pid still runs the command it was recorded with.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from switchyard.devcerts import TlsFiles
from wiring.paths import REPO_ROOT, state_dir

KAFKA_DIR = REPO_ROOT / "services" / "kafka"
DEFAULT_KAFKA_PORT = 19092
DEFAULT_REDIS_PORT = 16379
# Redis writes every command to its append-only file (write(2)) before it replies, so a
# kill -9 of redis-server alone loses nothing acknowledged with "everysec" or "always": the
# kernel's page cache outlives the process. They differ on a host crash or power loss
# ("everysec" loses up to ~1 s, up to 2 s when the disk stalls, and during such a stall it
# postpones the write(2) while still replying, so even a process kill loses those writes)
# and in cost (measured on the dev box: 51k INCR/s with "everysec", 7.4k with "always", 10
# clients). A settle lost from the ledger lets a tenant spend it again, and Switchyard writes
# a few hundred commands per second at most, so the launcher pays for "always".
REDIS_APPENDFSYNC = "always"
APPENDFSYNC_MODES = ("always", "everysec", "no")


class ServiceError(RuntimeError):
    """A service could not be installed, started or checked; the message says what to do."""


@dataclass
class ServiceRecord:
    name: str
    pid: int
    address: str
    version: str
    marker: str  # a string in the process's command line, checked before any signal
    log: str
    data_dir: str
    started_at: float
    extra: dict[str, Any] = field(default_factory=dict)

    def alive(self) -> bool:
        return _pid_runs(self.pid, self.marker)


def _records_dir(home: Path | None = None) -> Path:
    d = (home or state_dir()) / "services"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _save(rec: ServiceRecord, home: Path | None) -> None:
    (_records_dir(home) / f"{rec.name}.json").write_text(json.dumps(asdict(rec), indent=2))


def load_records(home: Path | None = None) -> dict[str, ServiceRecord]:
    out: dict[str, ServiceRecord] = {}
    for path in sorted(_records_dir(home).glob("*.json")):
        try:
            out[path.stem] = ServiceRecord(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue
    return out


def _pid_runs(pid: int, marker: str) -> bool:
    """True when ``pid`` is alive and its command line still contains ``marker``."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[-1].split()[0] == "Z":
        return False
    return marker in cmdline


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pick_port(preferred: int | None, default: int) -> int:
    if preferred:
        if not port_free(preferred):
            raise ServiceError(f"port {preferred} on 127.0.0.1 is in use; pick another")
        return preferred
    return default if port_free(default) else free_port()


# --------------------------------------------------------------------------- Kafka


def kafka_libs() -> Path:
    """The broker's runtime jars, resolved by Maven from Maven Central on first use."""
    libs = KAFKA_DIR / "libs"
    stamp = libs / ".pom-sha"
    pom = (KAFKA_DIR / "pom.xml").read_bytes()
    digest = hashlib.sha256(pom).hexdigest()
    if libs.is_dir() and stamp.exists() and stamp.read_text() == digest:
        return libs
    if shutil.which("mvn") is None:
        raise ServiceError("Maven (mvn) is not installed: apt-get install maven")
    if shutil.which("java") is None:
        raise ServiceError("Java is not installed: apt-get install openjdk-17-jre-headless")
    shutil.rmtree(libs, ignore_errors=True)
    cmd = [
        "mvn", "-q", "-B",
        "org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy-dependencies",
        "-DincludeScope=runtime", "-DoutputDirectory=libs",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=KAFKA_DIR, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ServiceError(
            f"Maven could not resolve the Kafka jars:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    stamp.write_text(digest)
    return libs


def kafka_version(libs: Path | None = None) -> str:
    libs = libs or KAFKA_DIR / "libs"
    for jar in sorted(libs.glob("kafka_2.13-*.jar")):
        m = re.match(r"kafka_2\.13-(.+)\.jar$", jar.name)
        if m:
            return m.group(1)
    return "unknown"


@dataclass(frozen=True)
class ScramUser:
    name: str
    password: str
    mechanism: str = "SCRAM-SHA-256"


def kafka_up(
    port: int | None = None,
    home: Path | None = None,
    sasl_port: int | None = None,
    scram_users: list[ScramUser] | None = None,
    tls_port: int | None = None,
    tls: TlsFiles | None = None,
    timeout_s: float = 90.0,
) -> ServiceRecord:
    """Start a single-node KRaft broker on 127.0.0.1; return once metadata requests succeed.

    With ``sasl_port`` a second listener ``SASL_PLAINTEXT`` is opened with SCRAM users
    created at format time (``StorageTool format --add-scram``); with ``tls_port`` and
    ``tls`` a ``SASL_SSL`` listener (SCRAM over TLS, PEM keystore) as well. Without an
    explicit ``port``, a broker that lost a race for its port is started again on a free one.
    """
    tries = 1 if port else 3
    for attempt in range(tries):
        try:
            return _kafka_up_once(port, home, sasl_port, scram_users, tls_port, tls, timeout_s)
        except ServiceError:
            if attempt == tries - 1:
                raise
            port = free_port()
    raise AssertionError("unreachable")


def _kafka_up_once(
    port: int | None,
    home: Path | None,
    sasl_port: int | None,
    scram_users: list[ScramUser] | None,
    tls_port: int | None,
    tls: TlsFiles | None,
    timeout_s: float,
) -> ServiceRecord:
    name = "kafka"
    existing = load_records(home).get(name)
    if existing and existing.alive():
        return existing
    libs = kafka_libs()
    port = _pick_port(port, DEFAULT_KAFKA_PORT)
    cport = free_port()
    run = (home or state_dir()) / f"kafka-{port}"
    shutil.rmtree(run, ignore_errors=True)
    data = run / "data"
    data.mkdir(parents=True)
    listeners = [f"PLAINTEXT://127.0.0.1:{port}", f"CONTROLLER://127.0.0.1:{cport}"]
    advertised = [f"PLAINTEXT://127.0.0.1:{port}"]
    pmap = ["CONTROLLER:PLAINTEXT", "PLAINTEXT:PLAINTEXT"]
    extra: list[str] = []
    sasl_listeners: list[tuple[str, int]] = []
    if sasl_port:
        sasl_listeners.append(("SASL_PLAINTEXT", sasl_port))
    if tls_port:
        if tls is None:
            raise ServiceError("kafka_up: tls_port needs tls files (see switchyard.devcerts)")
        sasl_listeners.append(("SASL_SSL", tls_port))
        extra += [
            "listener.name.sasl_ssl.ssl.keystore.type=PEM",
            f"listener.name.sasl_ssl.ssl.keystore.location={tls.keystore}",
        ]
    for proto, lport in sasl_listeners:
        listeners.append(f"{proto}://127.0.0.1:{lport}")
        advertised.append(f"{proto}://127.0.0.1:{lport}")
        pmap.append(f"{proto}:{proto}")
        for mech in ("scram-sha-256", "scram-sha-512"):
            extra.append(
                f"listener.name.{proto.lower()}.{mech}.sasl.jaas.config="
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            )
    if sasl_listeners:
        extra.append("sasl.enabled.mechanisms=SCRAM-SHA-256,SCRAM-SHA-512")
    props = (KAFKA_DIR / "server.properties.in").read_text()
    for key, value in {
        "@CPORT@": str(cport),
        "@LISTENERS@": ",".join(listeners),
        "@ADVERTISED@": ",".join(advertised),
        "@PROTOCOL_MAP@": ",".join(pmap),
        "@DATA@": str(data),
        "@EXTRA@": "\n".join(extra),
    }.items():
        props = props.replace(key, value)
    conf = run / "server.properties"
    conf.write_text(props)
    logcfg = f"-Dlog4j.configuration=file:{KAFKA_DIR / 'log4j.properties'}"
    cp = f"{libs}/*"
    cluster_id = base64_uuid()
    fmt = ["java", "-Xmx256m", logcfg, "-cp", cp, "kafka.tools.StorageTool", "format",
           "-t", cluster_id, "-c", str(conf)]  # fmt: skip
    for user in scram_users or []:
        fmt += ["--add-scram", f"{user.mechanism}=[name={user.name},password={user.password}]"]
    proc = subprocess.run(fmt, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ServiceError(
            f"Kafka storage format failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    log = run / "broker.log"
    marker = f"switchyard.kafka.{port}"
    cmd = [
        "java", "-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
        "-Djava.awt.headless=true", f"-D{marker}=1", logcfg, f"-Dkafka.logs.dir={run}",
        "-cp", cp, "kafka.Kafka", str(conf),
    ]  # fmt: skip
    with open(log, "wb") as out:
        child = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    rec = ServiceRecord(
        name=name,
        pid=child.pid,
        address=f"127.0.0.1:{port}",
        version=kafka_version(libs),
        marker=marker,
        log=str(log),
        data_dir=str(run),
        started_at=time.time(),
        extra={
            "controller_port": cport,
            "sasl_port": sasl_port,
            "tls_port": tls_port,
            "cluster_id": cluster_id,
        },
    )
    _save(rec, home)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if child.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:]
                raise ServiceError(f"Kafka broker exited with {child.returncode}:\n{tail}")
            if kafka_ready(rec.address, cluster_id=cluster_id):
                return rec
            time.sleep(0.5)
        raise ServiceError(f"Kafka broker not ready after {timeout_s:.0f} s; see {log}")
    except BaseException:  # not ready, a probe that failed, or interrupted: stop what we started
        _stop_child(child)
        stop_record(rec, home)
        raise


def base64_uuid() -> str:
    """A Kafka cluster id: 16 random bytes, URL-safe base64 without padding (never starts with '-')."""
    import base64

    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


def kafka_ready(bootstrap: str, timeout_s: float = 5.0, cluster_id: str | None = None) -> bool:
    """A real metadata round trip through aiokafka; with ``cluster_id``, only our broker counts
    (another broker that won a race for the same port must not pass for ours)."""
    info = describe_kafka_cluster(bootstrap, timeout_s)
    return info is not None and (cluster_id is None or info.get("cluster_id") == cluster_id)


def describe_kafka_cluster(bootstrap: str, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The admin client's ``describe_cluster`` (cluster id, brokers), None if none answers."""
    import logging

    from aiokafka.admin import AIOKafkaAdminClient

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)

    async def probe() -> dict[str, Any] | None:
        admin = AIOKafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000)
        )
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
            info: dict[str, Any] = await asyncio.wait_for(admin.describe_cluster(), timeout_s)
            return info
        except Exception:
            return None
        finally:
            try:
                await admin.close()
            except Exception:
                pass

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(probe())
    # called from async code (a benchmark, a test): the probe gets its own loop in a thread
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kafka-ready") as pool:
        return pool.submit(asyncio.run, probe()).result()


# --------------------------------------------------------------------------- Redis


def ensure_redis_server() -> str:
    return ensure_debian_tool("redis-server", "redis-server")


def ensure_kcat() -> str:
    """Debian's ``kcat`` (a librdkafka producer/consumer): the tests' second real Kafka client."""
    return ensure_debian_tool("kcat", "kcat")


def ensure_debian_tool(binary: str, package: str) -> str:
    """The path of ``binary``, installing Debian's ``package`` with apt-get (as root) when missing."""
    path = shutil.which(binary)
    if path:
        return path
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise ServiceError(f"{binary} is not installed: run `apt-get install {package}` as root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise ServiceError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    path = shutil.which(binary)
    if not path:
        raise ServiceError(f"apt-get installed {package} but {binary} is not on PATH")
    return path


def redis_up(
    port: int | None = None,
    home: Path | None = None,
    password: str | None = None,
    tls: TlsFiles | None = None,
    name: str = "redis",
    timeout_s: float = 30.0,
    appendfsync: str | None = REDIS_APPENDFSYNC,
    fresh: bool = False,
) -> ServiceRecord:
    """Start ``redis-server`` on 127.0.0.1; return once PING answers.

    ``appendfsync`` (``always``, ``everysec``, ``no``): AOF persistence in the data directory
    ``<home>/<name>-<port>``; a restart on the same port loads what it holds. None: no
    persistence, the data directory is emptied at start. ``fresh``: empty it anyway.
    ``tls`` (keys ``cert``, ``key``, ``ca``) serves TLS only on ``port``; ``password`` sets
    ``requirepass``. The password is passed in a config file, never on the command line.
    """
    if appendfsync is not None and appendfsync not in APPENDFSYNC_MODES:
        raise ServiceError(
            f"Redis appendfsync must be one of {', '.join(APPENDFSYNC_MODES)}, got {appendfsync!r}"
        )
    existing = load_records(home).get(name)
    if existing and existing.alive():
        return existing
    binary = ensure_redis_server()
    port = _pick_port(port, DEFAULT_REDIS_PORT)
    run = (home or state_dir()) / f"{name}-{port}"
    if fresh or appendfsync is None:
        shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True, exist_ok=True)
    persistence = (
        ["appendonly yes", f"appendfsync {appendfsync}"]
        if appendfsync is not None
        else ["appendonly no"]
    )
    lines = [
        "bind 127.0.0.1",
        "protected-mode yes",
        'save ""',
        *persistence,
        f"dir {run}",
        "daemonize no",
        "loglevel notice",
    ]
    if tls:
        lines += ["port 0", f"tls-port {port}", f"tls-cert-file {tls.cert}",
                  f"tls-key-file {tls.key}", f"tls-ca-cert-file {tls.ca}",
                  "tls-auth-clients no"]  # fmt: skip
    else:
        lines.append(f"port {port}")
    if password:
        lines.append(f"requirepass {password}")
    conf = run / "redis.conf"
    conf.write_text("\n".join(lines) + "\n")
    conf.chmod(0o600)
    log = run / "redis.log"
    with open(log, "wb") as out:
        child = subprocess.Popen(
            [binary, str(conf)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    scheme = "rediss" if tls else "redis"
    rec = ServiceRecord(
        name=name,
        pid=child.pid,
        address=f"{scheme}://127.0.0.1:{port}/0",
        version="unknown",
        marker=f"127.0.0.1:{port}",  # redis-server rewrites its title to "redis-server 127.0.0.1:PORT"
        log=str(log),
        data_dir=str(run),
        started_at=time.time(),
        extra={
            "tls": bool(tls),
            "auth": bool(password),
            "appendfsync": appendfsync,
            "persistent": appendfsync is not None,
        },
    )
    _save(rec, home)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if child.poll() is not None:
                raise ServiceError(
                    f"redis-server exited with {child.returncode}:\n{log.read_text()[-2000:]}"
                )
            version = redis_version(rec.address, password=password, tls=tls, pid=child.pid)
            if version:
                rec.version = version
                _save(rec, home)
                return rec
            time.sleep(0.2)
        raise ServiceError(f"redis-server not answering PING after {timeout_s:.0f} s; see {log}")
    except BaseException:  # not ready, a probe that failed, or interrupted: stop what we started
        _stop_child(child)
        stop_record(rec, home)
        raise


def redis_version(
    url: str, password: str | None = None, tls: TlsFiles | None = None, pid: int | None = None
) -> str | None:
    """The server's version, or None if it does not answer (or, with ``pid``, is not that process)."""
    import redis

    kwargs: dict[str, Any] = {"socket_timeout": 2, "password": password}
    if tls:
        kwargs.update(ssl_ca_certs=tls.ca, ssl_cert_reqs="required")
    try:
        client = redis.Redis.from_url(url, **kwargs)
        info = client.info("server")
        client.close()
        if pid is not None and int(info.get("process_id", -1)) != pid:
            return None
        return str(info.get("redis_version"))
    except Exception:
        return None


# --------------------------------------------------------------------------- stop / status


def _stop_child(child: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Stop a process this launcher just started, through its own ``Popen``.

    ``stop_record`` recognises a service by the marker in its command line, which a child
    that has not exec'd yet (a failure right after the start) does not show; the ``Popen``
    is ours whatever it shows, and never signals a pid it has already reaped.
    """
    if child.poll() is not None:
        return
    child.terminate()
    try:
        child.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def stop_record(
    rec: ServiceRecord,
    home: Path | None = None,
    grace_s: float = 30.0,
    keep_data: bool | None = None,
) -> bool:
    """SIGTERM the recorded pid (if it is still ours), SIGKILL after ``grace_s``; forget it.

    Its data directory is deleted unless ``keep_data`` (default: kept for a persistent
    Redis, whose append-only file is the ledger's durable copy).
    """
    if keep_data is None:
        keep_data = bool(rec.extra.get("persistent"))
    stopped = False
    if rec.alive():
        os.kill(rec.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and rec.alive():
            _reap(rec.pid)
            time.sleep(0.1)
        if rec.alive():
            os.kill(rec.pid, signal.SIGKILL)
            for _ in range(50):
                _reap(rec.pid)
                if not rec.alive():
                    break
                time.sleep(0.1)
        stopped = True
    _reap(rec.pid)
    (_records_dir(home) / f"{rec.name}.json").unlink(missing_ok=True)
    if not keep_data and rec.data_dir and Path(rec.data_dir).is_dir():
        shutil.rmtree(rec.data_dir, ignore_errors=True)
    return stopped


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def down(
    home: Path | None = None, names: list[str] | None = None, purge: bool = False
) -> list[str]:
    """Stop the recorded services; ``purge`` also deletes a persistent Redis's data."""
    stopped = []
    for name, rec in load_records(home).items():
        if names and name not in names:
            continue
        if rec.extra.get("process_group"):  # a vLLM server: its API server, engine and worker
            from switchyard import vllm_servers

            vllm_servers.stop_group(rec, home)
        else:
            stop_record(rec, home, keep_data=False if purge else None)
        stopped.append(name)
    return stopped


def status(home: Path | None = None) -> list[dict[str, Any]]:
    rows = []
    for name, rec in load_records(home).items():
        rows.append(
            {
                "service": name,
                "address": rec.address,
                "version": rec.version,
                "pid": rec.pid,
                "running": rec.alive(),
                "log": rec.log,
            }
        )
    return rows


def env_lines(home: Path | None = None) -> list[str]:
    recs = load_records(home)
    lines = []
    if "kafka" in recs:
        lines.append(f"SWITCHYARD_KAFKA={recs['kafka'].address}")
    if "redis" in recs:
        lines.append(f"SWITCHYARD_REDIS={recs['redis'].address}")
    return lines


def random_secret() -> str:
    return secrets.token_urlsafe(24)
