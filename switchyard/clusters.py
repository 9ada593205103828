"""Local clusters on loopback: a multi-broker KRaft Kafka and a Redis Cluster — by recorded pid.

``switchyard services up --kafka-brokers 3 --redis-cluster 3`` uses these. Every node is its
own process with its own record under ``<state dir>/services/`` (``kafka-1`` … and
``redis-node-1`` …), so ``status`` shows each node and ``down`` stops exactly those pids.

Kafka: ``n`` nodes, each ``process.roles=broker,controller`` (one combined quorum of ``n``
voters), one cluster id formatted into every node's fresh data directory. Internal topics
(offsets, transactions) get replication ``min(3, n)`` and ``min.insync.replicas`` ``min(2, n)``.
Ready once every node answers a metadata request and the cluster lists all ``n`` brokers.

Redis: ``n`` primaries (``cluster-enabled yes``, AOF ``appendfsync always``) and
``replicas`` replicas per primary, joined by ``redis-cli --cluster create``; ready once every
node reports ``cluster_state:ok`` with all 16384 slots assigned. The URL the project reads is
``redis+cluster://127.0.0.1:p1,127.0.0.1:p2,…`` (see ``state/cluster.py``).

A node can be killed (``kill -9`` by a test) and started again on its own data directory with
``restart_node``: the fault tests use it for broker loss, rolling restarts and Redis failover.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from switchyard import services
from switchyard.services import KAFKA_DIR, ServiceError, ServiceRecord
from wiring.paths import state_dir

KAFKA_NODE = "kafka-"
REDIS_NODE = "redis-node-"
REDIS_CLUSTER_SCHEME = "redis+cluster"
# small heaps: several JVM brokers share a small machine with the routers they serve
KAFKA_NODE_HEAP = ("-Xms128m", "-Xmx384m")


def _node_names(prefix: str, home: Path | None) -> list[ServiceRecord]:
    recs = services.load_records(home)
    return sorted(
        (r for n, r in recs.items() if n.startswith(prefix) and n[len(prefix) :].isdigit()),
        key=lambda r: int(r.name[len(prefix) :]),
    )


def kafka_nodes(home: Path | None = None) -> list[ServiceRecord]:
    """The recorded nodes of the local Kafka cluster, by node id."""
    return _node_names(KAFKA_NODE, home)


def redis_nodes(home: Path | None = None) -> list[ServiceRecord]:
    """The recorded nodes of the local Redis Cluster (primaries first, as created)."""
    return _node_names(REDIS_NODE, home)


def _override(props: str, values: dict[str, str]) -> str:
    """``props`` with each ``key=`` line of ``values`` replaced (or appended when missing)."""
    out, seen = [], set()
    for line in props.splitlines():
        key = line.split("=", 1)[0].strip()
        if "=" in line and key in values:
            out.append(f"{key}={values[key]}")
            seen.add(key)
        else:
            out.append(line)
    out += [f"{k}={v}" for k, v in values.items() if k not in seen]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- Kafka


def kafka_cluster_up(
    brokers: int = 3, home: Path | None = None, timeout_s: float = 120.0
) -> list[ServiceRecord]:
    """Start ``brokers`` combined broker+controller nodes on 127.0.0.1; return their records.

    Idempotent: a complete running cluster is returned as it is; a partial one is an error
    (stop it with ``down`` first) rather than a silent mix.
    """
    if brokers < 1:
        raise ServiceError(f"--kafka-brokers must be at least 1, got {brokers}")
    existing = kafka_nodes(home)
    if existing:
        alive = [r for r in existing if r.alive()]
        if len(alive) == len(existing) == brokers:
            return existing
        raise ServiceError(
            f"a local Kafka cluster of {len(existing)} node(s) is recorded ({len(alive)} running);"
            " run `switchyard services down` before starting one of a different shape"
        )
    if "kafka" in services.load_records(home):
        raise ServiceError("a single-node Kafka is running; `switchyard services down` it first")
    libs = services.kafka_libs()
    ports = [(services.free_port(), services.free_port()) for _ in range(brokers)]
    voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports))
    cluster_id = services.base64_uuid()
    rf, isr = min(3, brokers), min(2, brokers)
    template = (KAFKA_DIR / "server.properties.in").read_text()
    logcfg = f"-Dlog4j.configuration=file:{KAFKA_DIR / 'log4j.properties'}"
    cp = f"{libs}/*"
    started: list[ServiceRecord] = []
    children: list[subprocess.Popen[bytes]] = []
    try:
        for i, (port, cport) in enumerate(ports):
            node = i + 1
            run = (home or state_dir()) / f"kafka-node{node}-{port}"
            subprocess.run(["rm", "-rf", str(run)], check=False)
            (run / "data").mkdir(parents=True)
            props = template
            for key, value in {
                "@CPORT@": str(cport),
                "@LISTENERS@": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}",
                "@ADVERTISED@": f"PLAINTEXT://127.0.0.1:{port}",
                "@PROTOCOL_MAP@": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
                "@DATA@": str(run / "data"),
                "@EXTRA@": "",
            }.items():
                props = props.replace(key, value)
            props = _override(
                props,
                {
                    "node.id": str(node),
                    "controller.quorum.voters": voters,
                    "default.replication.factor": str(rf),
                    "min.insync.replicas": str(isr),
                    "offsets.topic.replication.factor": str(rf),
                    "transaction.state.log.replication.factor": str(rf),
                    "transaction.state.log.min.isr": str(isr),
                    # a topic is never created behind the project's back with the wrong settings
                    "auto.create.topics.enable": "false",
                    # a restarted broker takes its partitions' leadership back soon
                    "leader.imbalance.check.interval.seconds": "10",
                },
            )
            conf = run / "server.properties"
            conf.write_text(props)
            fmt = ["java", "-Xmx256m", logcfg, "-cp", cp, "kafka.tools.StorageTool", "format",
                   "-t", cluster_id, "-c", str(conf)]  # fmt: skip
            proc = subprocess.run(fmt, capture_output=True, text=True)
            if proc.returncode != 0:
                raise ServiceError(
                    f"Kafka storage format of node {node} failed:\n{proc.stderr[-2000:]}"
                )
            marker = f"switchyard.kafka.{port}"
            cmd = [
                "java", *KAFKA_NODE_HEAP, "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20",
                "-XX:TieredStopAtLevel=1", "-Djava.awt.headless=true", f"-D{marker}=1", logcfg,
                f"-Dkafka.logs.dir={run}", "-cp", cp, "kafka.Kafka", str(conf),
            ]  # fmt: skip
            rec = ServiceRecord(
                name=f"{KAFKA_NODE}{node}",
                pid=0,
                address=f"127.0.0.1:{port}",
                version=services.kafka_version(libs),
                marker=marker,
                log=str(run / "broker.log"),
                data_dir=str(run),
                started_at=time.time(),
                extra={
                    "node_id": node,
                    "controller_port": cport,
                    "cluster_id": cluster_id,
                    "cmd": cmd,
                    "cluster_size": brokers,
                },
            )
            children.append(_spawn(rec, home))
            started.append(rec)
        bootstrap = ",".join(r.address for r in started)
        deadline = time.monotonic() + timeout_s
        pending = list(zip(started, children, strict=True))
        while pending:
            rec, child = pending[0]
            if child.poll() is not None:
                tail = Path(rec.log).read_text(errors="replace")[-3000:]
                raise ServiceError(f"Kafka node {rec.name} exited with {child.returncode}:\n{tail}")
            if services.kafka_ready(rec.address, cluster_id=cluster_id):
                pending.pop(0)
                continue
            if time.monotonic() > deadline:
                raise ServiceError(f"Kafka node {rec.name} not ready after {timeout_s:.0f} s")
            time.sleep(0.5)
        n = count_brokers(bootstrap)
        while n < brokers and time.monotonic() < deadline:
            time.sleep(0.5)
            n = count_brokers(bootstrap)
        if n < brokers:
            raise ServiceError(f"the Kafka cluster lists {n} of {brokers} brokers")
        return started
    except BaseException:
        for child in children:
            services._stop_child(child)
        for rec in started:
            services.stop_record(rec, home)
        raise


def _spawn(rec: ServiceRecord, home: Path | None) -> subprocess.Popen[bytes]:
    """Start the recorded command of ``rec`` (its own session), save the record with its pid."""
    with open(rec.log, "ab") as out:
        child = subprocess.Popen(
            rec.extra["cmd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    rec.pid = child.pid
    rec.started_at = time.time()
    services._save(rec, home)
    return child


def count_brokers(bootstrap: str, timeout_s: float = 5.0) -> int:
    """How many brokers the cluster's metadata lists (0 when none answers)."""
    info = services.describe_kafka_cluster(bootstrap, timeout_s)
    return len(info.get("brokers", [])) if info else 0


# --------------------------------------------------------------------------- Redis Cluster


def redis_cluster_up(
    primaries: int = 3,
    replicas: int = 0,
    home: Path | None = None,
    timeout_s: float = 60.0,
) -> list[ServiceRecord]:
    """Start ``primaries * (1 + replicas)`` cluster-mode redis-servers and join them.

    Redis Cluster needs at least 3 primaries. Each node keeps an AOF (``appendfsync
    always``) and its ``nodes.conf`` in its own data directory, removed by ``down``.
    """
    if primaries < 3:
        raise ServiceError(f"Redis Cluster needs at least 3 primaries, got {primaries}")
    if replicas < 0:
        raise ServiceError(f"--redis-replicas must be 0 or more, got {replicas}")
    total = primaries * (1 + replicas)
    existing = redis_nodes(home)
    if existing:
        alive = [r for r in existing if r.alive()]
        if len(alive) == len(existing) == total and cluster_ok(existing[0].address):
            return existing
        raise ServiceError(
            f"a local Redis Cluster of {len(existing)} node(s) is recorded ({len(alive)} running);"
            " run `switchyard services down` before starting one of a different shape"
        )
    binary = services.ensure_redis_server()
    cli = services.ensure_debian_tool("redis-cli", "redis-tools")
    ports = _cluster_ports(total)
    started: list[ServiceRecord] = []
    try:
        for i, port in enumerate(ports):
            run = (home or state_dir()) / f"redis-node{i + 1}-{port}"
            subprocess.run(["rm", "-rf", str(run)], check=False)
            run.mkdir(parents=True)
            lines = [
                "bind 127.0.0.1", "protected-mode yes", f"port {port}", 'save ""',
                "appendonly yes", f"appendfsync {services.REDIS_APPENDFSYNC}", f"dir {run}",
                "daemonize no", "loglevel notice", "maxmemory-policy noeviction",
                "cluster-enabled yes", "cluster-config-file nodes.conf",
                # a dead primary is failed over after ~2 s, not the default 15 s
                "cluster-node-timeout 2000", "cluster-require-full-coverage yes",
            ]  # fmt: skip
            conf = run / "redis.conf"
            conf.write_text("\n".join(lines) + "\n")
            rec = ServiceRecord(
                name=f"{REDIS_NODE}{i + 1}",
                pid=0,
                address=f"redis://127.0.0.1:{port}/0",
                version="unknown",
                marker=f"127.0.0.1:{port}",
                log=str(run / "redis.log"),
                data_dir=str(run),
                started_at=time.time(),
                extra={"cmd": [binary, str(conf)], "port": port, "persistent": False},
            )
            _spawn(rec, home)
            started.append(rec)
        deadline = time.monotonic() + timeout_s
        for rec in started:
            while not services.redis_version(rec.address, pid=rec.pid):
                if not rec.alive():
                    raise ServiceError(f"{rec.name} exited:\n{Path(rec.log).read_text()[-2000:]}")
                if time.monotonic() > deadline:
                    raise ServiceError(f"{rec.name} not answering PING after {timeout_s:.0f} s")
                time.sleep(0.2)
            rec.version = services.redis_version(rec.address) or "unknown"
            services._save(rec, home)
        create = [cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                  "--cluster-replicas", str(replicas), "--cluster-yes"]  # fmt: skip
        proc = subprocess.run(create, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise ServiceError(f"redis-cli --cluster create failed:\n{proc.stdout[-2000:]}")
        while not all(cluster_ok(r.address) for r in started):
            if time.monotonic() > deadline:
                raise ServiceError(f"Redis Cluster not ok after {timeout_s:.0f} s")
            time.sleep(0.2)
        return started
    except BaseException:
        for rec in started:
            services.stop_record(rec, home)
        raise


def _cluster_ports(n: int) -> list[int]:
    """``n`` free ports whose cluster bus ports (port + 10000) are free as well."""
    ports: list[int] = []
    while len(ports) < n:
        p = services.free_port()
        if p + 10000 < 65536 and services.port_free(p + 10000) and p not in ports:
            ports.append(p)
    return ports


def cluster_ok(url: str) -> bool:
    """True when the node at ``url`` reports ``cluster_state:ok`` with every slot assigned."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2)
        info = client.cluster("INFO")
        client.close()
    except Exception:
        return False
    if isinstance(info, dict):
        fields = {str(k): str(v) for k, v in info.items()}
    else:
        text = info.decode() if isinstance(info, bytes) else str(info)
        fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
    return fields.get("cluster_state") == "ok" and fields.get("cluster_slots_assigned") == "16384"


def redis_cluster_url(nodes: list[ServiceRecord]) -> str:
    """``redis+cluster://h:p,h:p,…``: every node a startup node (the client finds the rest)."""
    hosts = ",".join(r.address.removeprefix("redis://").removesuffix("/0") for r in nodes)
    return f"{REDIS_CLUSTER_SCHEME}://{hosts}"


# --------------------------------------------------------------------------- faults


def kill_node(rec: ServiceRecord) -> None:
    """``kill -9`` one recorded node (a fault test's broker or Redis loss), still ours only."""
    import os
    import signal

    if rec.alive():
        os.kill(rec.pid, signal.SIGKILL)
        for _ in range(100):
            services._reap(rec.pid)
            if not rec.alive():
                return
            time.sleep(0.05)


def restart_node(rec: ServiceRecord, home: Path | None = None, timeout_s: float = 90.0) -> None:
    """Start a stopped or killed node again on its own data directory; wait until it answers."""
    if rec.alive():
        raise ServiceError(f"{rec.name} is still running (pid {rec.pid})")
    child = _spawn(rec, home)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        # the child itself, not rec.alive(): redis-server shows its marker (``host:port`` in
        # its process title) only once it has set the title, a moment after the exec
        if child.poll() is not None:
            tail = Path(rec.log).read_text(errors="replace")[-2000:] if rec.log else ""
            raise ServiceError(f"{rec.name} exited at restart; {rec.log} ends:\n{tail}")
        if rec.name.startswith(KAFKA_NODE):
            if services.kafka_ready(rec.address, cluster_id=rec.extra.get("cluster_id")):
                return
        elif services.redis_version(rec.address, pid=rec.pid):
            return
        time.sleep(0.3)
    raise ServiceError(f"{rec.name} not answering {timeout_s:.0f} s after its restart")


def env_lines(home: Path | None = None) -> list[str]:
    """``SWITCHYARD_*`` lines for the local clusters (empty when none runs)."""
    lines = []
    kafka = kafka_nodes(home)
    if kafka:
        lines.append("SWITCHYARD_KAFKA=" + ",".join(r.address for r in kafka))
        rf = min(3, len(kafka))
        lines.append(f"SWITCHYARD_KAFKA_REPLICATION_FACTOR={rf}")
    redis_ = redis_nodes(home)
    if redis_:
        lines.append("SWITCHYARD_REDIS=" + redis_cluster_url(redis_))
    return lines


def down(home: Path | None = None) -> list[str]:
    """Stop every recorded cluster node at once (a broker left alone without its quorum would
    wait out its controlled shutdown); return their names."""
    import concurrent.futures

    nodes = [*kafka_nodes(home), *redis_nodes(home)]
    with concurrent.futures.ThreadPoolExecutor(max(1, len(nodes))) as pool:
        list(pool.map(lambda r: services.stop_record(r, home, grace_s=20.0), nodes))
    return [r.name for r in nodes]


def status_rows(home: Path | None = None) -> list[dict[str, Any]]:
    """Extra detail per cluster node (role) for ``services status``."""
    rows = []
    for rec in redis_nodes(home):
        rows.append({"service": rec.name, "role": redis_role(rec.address)})
    return rows


def redis_role(url: str) -> str:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2)
        role = client.execute_command("ROLE")  # type: ignore[no-untyped-call]
        client.close()
        first = role[0]
        return str(first.decode() if isinstance(first, bytes) else first)
    except Exception:
        return "down"
