"""Faults on the clusters: a broker ``kill -9``'d mid-replay, a rolling restart of all three
brokers under load, and a Redis primary ``kill -9``'d with its replica promoted.

One rig for the module on the session's clusters (3 KRaft brokers, replication 3 and
``min.insync.replicas`` 2; a Redis Cluster of 3 primaries with a replica each): a real
``switchyard router`` with the product policy and real ``switchyard worker --backend sim``
processes on the demo's three-tier cluster. Queries are replayed at a steady rate by an
idempotent ``acks=all`` producer; every query's fate is read back from ``results``,
``decisions`` and ``route.*``. Figures go to the faults summary (``write_figures``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "faults"))

from fault_harness import (  # noqa: E402
    FAULTS_DIR,
    Proc,
    Procs,
    TopicReader,
    await_until,
    demo_cluster_spec,
    produce_all,
    product_policy,
    start_router,
    wait_router_ready,
    wait_until,
    write_cluster,
    write_figures,
)

from switchyard import clusters, services  # noqa: E402
from switchyard.services import ServiceRecord  # noqa: E402
from wiring.settings import Settings  # noqa: E402

pytestmark = pytest.mark.faults

TENANT = "clusterfault"
TIME_SCALE = 50.0
HEARTBEAT_S = 0.5
N_QUERIES = 1_000
RATE_PER_S = 100.0


@dataclass
class Rig:
    procs: Procs
    settings: Settings
    cluster: Any
    cluster_file: Path
    policy: str
    kafka: list[ServiceRecord]
    redis: list[ServiceRecord]
    home: Path
    router: Proc | None = None
    workers: dict[str, Proc] = field(default_factory=dict)

    def worker_args(self, instance_id: str) -> list[str]:
        return [
            "worker", "--instance", instance_id, "--cluster", str(self.cluster_file),
            "--backend", "sim", "--time-scale", f"{TIME_SCALE:g}",
            "--heartbeat-s", f"{HEARTBEAT_S:g}", "--log-level", "INFO",
        ]  # fmt: skip

    def dead(self) -> list[str]:
        return [
            f"{p.name} (pid {p.pid}) exited {p.popen.returncode}: {p.tail(400)!r}"
            for p in [self.router, *self.workers.values()]
            if p is not None and not p.alive()
        ]


@pytest.fixture(scope="module")
def rig(
    tmp_path_factory: pytest.TempPathFactory,
    cluster_home: Path,
    kafka_cluster: list[ServiceRecord],
    redis_cluster: list[ServiceRecord],
) -> Iterator[Rig]:
    home = tmp_path_factory.mktemp("cluster-faults")
    prefix = "cf" + uuid.uuid4().hex[:5]
    cluster_file = home / "cluster.json"
    cluster = write_cluster(cluster_file, demo_cluster_spec(prefix, {TENANT: 1e6, "default": 1e6}))
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SWITCHYARD_") or k == "SWITCHYARD_SHARED"
    }
    env.update(
        SWITCHYARD_HOME=str(home),
        SWITCHYARD_NAMESPACE=prefix,
        SWITCHYARD_KAFKA=",".join(r.address for r in kafka_cluster),
        SWITCHYARD_REDIS=clusters.redis_cluster_url(redis_cluster),
        SWITCHYARD_KAFKA_REPLICATION_FACTOR="3",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(FAULTS_DIR), env.get("PYTHONPATH", "")) if p),
    )
    procs = Procs(home / "logs", env)
    try:
        policy, extra, _ = product_policy(cluster)
        router = start_router(procs, cluster_file, policy, window_ms=100, extra=extra, wait_s=0)
        r = Rig(procs, Settings.from_env(env), cluster, cluster_file, policy,
                kafka_cluster, redis_cluster, cluster_home, router)  # fmt: skip
        for inst in cluster.instances:
            r.workers[inst.id] = procs.start(f"worker-{inst.id}", r.worker_args(inst.id))
        wait_router_ready(router, 180)
        wait_until(lambda: _all_alive(r), 120, "every worker's heartbeat")
        yield r
    finally:
        procs.stop_all()
        for rec in [*kafka_cluster, *redis_cluster]:  # a test that failed midway: bring it back
            if not rec.alive():
                clusters.restart_node(rec, cluster_home)


def _all_alive(rig: Rig) -> bool:
    from state import StateStore

    async def check() -> bool:
        store = await StateStore.connect(**rig.settings.redis_kwargs())
        try:
            live = await store.snapshots([i.id for i in rig.cluster.instances], time.time())
            return all(v.alive for v in live.values())
        finally:
            await store.close()

    return asyncio.run(check())


def _queries(run_id: str, n: int) -> list[tuple[bytes, bytes]]:
    return [
        (
            f"{run_id}-{i}".encode(),
            f'{{"id": "{run_id}-{i}", "tenant": "{TENANT}", "prompt": "cluster question {i}", '
            f'"max_tokens": 32, "ttft_slo_ms": 5000}}'.encode(),
        )
        for i in range(n)
    ]


def _whereabouts(rig: Rig, reader: TopicReader, qids: list[str]) -> dict[str, Any]:
    """Where each of ``qids`` (lost, or answered twice) got to: its decisions, the route topics
    it was sent to, every Redis key the router and workers write for it (read on the
    promoted cluster, with the port of the primary that serves it), and the log lines that
    name it. The failure message of a fault test carries this."""
    import redis

    from state.keys import Keys

    keys = Keys(rig.settings.namespace)
    client = redis.RedisCluster(
        startup_nodes=[
            redis.cluster.ClusterNode("127.0.0.1", int(r.extra["port"])) for r in rig.redis
        ],
        decode_responses=True,
        socket_timeout=5,
    )
    logs = {p.name: p.text() for p in rig.procs.started}
    out: dict[str, Any] = {}
    try:
        for qid in qids[:20]:
            dedupe = keys.dedupe(qid)
            claims = {}
            for inst in rig.cluster.instances:
                value = client.get(keys.claim(inst.id, qid))
                if value is not None:
                    claims[inst.id] = value
            out[qid] = {
                "decisions": [
                    (
                        d.get("status"),
                        d.get("instance_id"),
                        d.get("flags"),
                        (d.get("reason") or "")[:80],
                    )
                    for d in reader.tally.decisions.get(qid, [])
                ],
                "route_topics": [t for t, _ in reader.tally.routed.get(qid, [])],
                "dedupe": client.hgetall(dedupe),
                "dedupe_primary": client.get_node_from_key(dedupe).port,
                "result_mark": client.get(keys.result(qid)),
                "starts": client.hgetall(keys.start(qid)),
                "claims": claims,
                "log_lines": [
                    f"{name}: {line.strip()[:200]}"
                    for name, text in logs.items()
                    for line in text.splitlines()
                    if qid in line
                ][:10],
            }
    finally:
        client.close()
    return out


def _dead_letters_of(reader: TopicReader, run_id: str) -> int:
    """Dead letters whose message is one of this run's queries (its ids start with ``run_id``)."""
    needle = f'"{run_id}-'.encode()
    return sum(1 for d in reader.tally.dead_letters if needle in base64.b64decode(d["raw_b64"]))


def _fates(reader: TopicReader, ids: list[str]) -> dict[str, int]:
    res, routed = reader.tally.results, reader.tally.routed
    return {
        "sent": len(ids),
        "lost": sum(1 for q in ids if q not in res),
        "duplicated_results": sum(1 for q in ids if len(res.get(q, [])) > 1),
        "routed_twice": sum(1 for q in ids if len(routed.get(q, [])) > 1),
        "error_results": sum(1 for q in ids for r in res.get(q, []) if r.get("error")),
    }


async def _leaders(rig: Rig, topic: str) -> list[int]:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**rig.settings.kafka_kwargs())
    await admin.start()
    try:
        (t,) = await admin.describe_topics([topic])
        return [int(p["leader"]) for p in t["partitions"]]
    finally:
        await admin.close()


async def _replay_with_fault(
    rig: Rig, run_id: str, fault: Any, at_fraction: float = 0.3, settle_s: float = 120.0
) -> tuple[dict[str, Any], list[str]]:
    """Replay N_QUERIES with ``fault()`` (a coroutine) started once ``at_fraction`` is sent;
    return the fates and timings, and the processes that died."""
    messages = _queries(run_id, N_QUERIES)
    ids = [k.decode() for k, _ in messages]
    marks: dict[str, float] = {}
    task: list[asyncio.Task[Any]] = []

    def on_sent(i: int) -> None:
        if i == int(N_QUERIES * at_fraction):
            marks["fault"], marks["fault_wall"] = time.monotonic(), time.time()
            task.append(asyncio.get_running_loop().create_task(fault()))

    async with TopicReader(
        rig.settings.kafka_kwargs(), ["results", "decisions", "dead-letters"]
    ) as reader:
        t0 = time.monotonic()
        await produce_all(rig.settings.kafka_kwargs(), "queries", messages,
                          rate_per_s=RATE_PER_S, on_sent=on_sent)  # fmt: skip
        sent_s = time.monotonic() - t0
        assert task, "the fault was never injected"
        extra = await task[0]

        def first_new() -> bool:
            return any(
                r.get("finished_at", 0) > marks["fault_wall"] + 1.0
                for q in ids
                for r in reader.tally.results.get(q, [])
            )

        await await_until(first_new, settle_s, "a result after the fault")
        first_after = time.monotonic()

        def all_answered() -> bool:
            reader.check()
            return all(q in reader.tally.results for q in ids)

        try:
            await await_until(all_answered, settle_s, f"a result for each of {N_QUERIES}")
        except AssertionError:
            pass  # counted as lost below
        done = time.monotonic()
        await asyncio.sleep(2.0)  # a late duplicate would show now
        fates = _fates(reader, ids)
        fates["dead_letters"] = _dead_letters_of(reader, run_id)
        odd = [q for q in ids if len(reader.tally.results.get(q, [])) != 1]
        if odd:
            try:
                fates["whereabouts"] = await asyncio.to_thread(_whereabouts, rig, reader, odd)
            except Exception as exc:  # noqa: BLE001 - the figures matter more than the trace
                fates["whereabouts"] = f"could not be read: {type(exc).__name__}: {exc}"
    fates.update(
        rate_per_s=RATE_PER_S,
        produce_s=round(sent_s, 1),
        fault_to_first_result_s=round(first_after - marks["fault"], 1),
        fault_to_all_results_s=round(done - marks["fault"], 1),
        policy=rig.policy,
        **(extra or {}),
    )
    return fates, rig.dead()


def _term_and_wait(rec: ServiceRecord, timeout_s: float = 60.0) -> float:
    """SIGTERM (a broker's controlled shutdown) by the recorded pid; seconds until it exited."""
    t0 = time.monotonic()
    os.kill(rec.pid, signal.SIGTERM)
    while rec.alive():
        services._reap(rec.pid)
        if time.monotonic() - t0 > timeout_s:
            clusters.kill_node(rec)
        time.sleep(0.1)
    return time.monotonic() - t0


async def test_broker_kill9_mid_replay(rig: Rig) -> None:
    """kill -9 the broker leading most ``queries`` partitions; leadership moves to the others;
    it is started again on its data directory 10 s later and rejoins."""
    before = await _leaders(rig, "queries")
    victim_id = max(set(before), key=before.count)
    victim = next(r for r in rig.kafka if r.extra["node_id"] == victim_id)

    async def kill() -> dict[str, Any]:
        clusters.kill_node(victim)
        t_kill = time.monotonic()
        moved = 0.0
        while time.monotonic() - t_kill < 60:
            try:
                leaders = await _leaders(rig, "queries")
            except Exception:
                leaders = [victim_id]
            if victim_id not in leaders and min(leaders) >= 0:
                moved = time.monotonic() - t_kill
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(max(0.0, 10.0 - (time.monotonic() - t_kill)))
        t_restart = time.monotonic()
        await asyncio.to_thread(clusters.restart_node, victim, rig.home)
        return {
            "killed_broker": victim_id,
            "leaders_before": before,
            "leadership_moved_s": round(moved, 1) if moved else None,
            "broker_restart_s": round(time.monotonic() - t_restart, 1),
        }

    fates, dead = await _replay_with_fault(rig, "bk-" + uuid.uuid4().hex[:6], kill)
    fates["leaders_after"] = await _leaders(rig, "queries")
    write_figures("cluster_broker_kill9", fates)
    assert fates["leadership_moved_s"] is not None, f"leadership never left broker {victim_id}"
    assert fates["lost"] == 0 and fates["duplicated_results"] == 0, fates
    assert fates["routed_twice"] == 0, fates
    assert not dead, dead


async def test_rolling_restart_of_all_brokers_under_load(rig: Rig) -> None:
    """Each broker in turn: SIGTERM (controlled shutdown), started again, back in the ISR."""

    async def roll() -> dict[str, Any]:
        took = []
        for rec in rig.kafka:
            stop_s = await asyncio.to_thread(_term_and_wait, rec)
            t0 = time.monotonic()
            await asyncio.to_thread(clusters.restart_node, rec, rig.home)
            took.append({"broker": rec.extra["node_id"], "stop_s": round(stop_s, 1),
                         "start_s": round(time.monotonic() - t0, 1)})  # fmt: skip
            await asyncio.sleep(3.0)  # let it catch up before the next one goes
        return {"restarts": took}

    fates, dead = await _replay_with_fault(rig, "rr-" + uuid.uuid4().hex[:6], roll, at_fraction=0.1)
    write_figures("cluster_rolling_restart", fates)
    assert fates["lost"] == 0 and fates["duplicated_results"] == 0, fates
    assert fates["routed_twice"] == 0, fates
    assert not dead, dead


async def test_redis_primary_kill9_replica_promoted(rig: Rig) -> None:
    """kill -9 one Redis primary; its replica is promoted (cluster-node-timeout 2 s); routing
    goes on, the tenant's ledger stays within its budget, nothing is lost, and the failover
    is no failure of any query's own (no error Result, no dead letter). The old primary is
    started again and rejoins as a replica. A lost or twice-answered query is shown with
    where it got to (``_whereabouts``): bug 19 in docs/reliability.md was found that way."""
    primaries = [r for r in rig.redis if clusters.redis_role(r.address) == "master"]
    victim = primaries[0]
    port = str(victim.extra["port"])
    replicas = [r for r in rig.redis if _master_port(r.address) == port]
    assert replicas, f"{victim.name} has no replica"

    async def kill() -> dict[str, Any]:
        lag = _replica_lag_bytes(victim.address, replicas[0].address)
        clusters.kill_node(victim)
        t0 = time.monotonic()
        healed = 0.0
        # healed: one of its replicas took over and the rest of the cluster is ok again (the
        # others still say ok for the node timeout after the kill: not a sign of anything)
        while time.monotonic() - t0 < 60:
            others = [r for r in rig.redis if r is not victim]
            promoted = any(clusters.redis_role(r.address) == "master" for r in replicas)
            if promoted and all(clusters.cluster_ok(r.address) for r in others):
                healed = time.monotonic() - t0
                break
            await asyncio.sleep(0.2)
        await asyncio.to_thread(clusters.restart_node, victim, rig.home)
        t_restart, rejoined = time.monotonic(), None
        while time.monotonic() - t_restart < 20:  # it answers as a primary until gossip demotes it
            if clusters.redis_role(victim.address) == "slave":
                rejoined = round(time.monotonic() - t_restart, 1)
                break
            await asyncio.sleep(0.2)
        return {
            "killed_primary": victim.name,
            "cluster_ok_again_s": round(healed, 1) if healed else None,
            "old_primary_role_after_restart": clusters.redis_role(victim.address),
            "old_primary_replica_again_s": rejoined,
            # how far its replica was behind just before the kill: what a promotion could lose
            "replica_lag_at_kill_bytes": lag,
        }

    fates, dead = await _replay_with_fault(rig, "rk-" + uuid.uuid4().hex[:6], kill)
    from state import StateStore, period_id

    store = await StateStore.connect(**rig.settings.redis_kwargs())
    try:
        tenant = next(t for t in rig.cluster.tenants if t.tenant == TENANT)
        status = await store.budget_status(TENANT, period_id(time.time(), tenant.period_s))
    finally:
        await store.close()
    fates["ledger_spent_usd"] = status.spent_usd
    fates["ledger_reserved_usd"] = status.reserved_usd
    write_figures("cluster_redis_primary_kill9", fates)
    assert fates["cluster_ok_again_s"] is not None, "no replica was promoted within 60 s"
    assert fates["lost"] == 0 and fates["duplicated_results"] == 0, fates
    assert fates["error_results"] == 0 and fates["dead_letters"] == 0, fates
    assert fates["routed_twice"] == 0, fates
    assert status.spent_usd + status.reserved_usd <= tenant.budget_usd, status
    assert not dead, dead


def _replica_lag_bytes(primary: str, replica: str) -> int | None:
    """Bytes of replication stream the primary has written beyond what its replica has
    processed, read one after the other (primary first) just before a kill: what a promotion
    could lose. (The primary's own view of its replica's offset is up to 1 s old: REPLCONF
    ACK is sent once a second.) None when either does not answer."""
    import redis

    offsets = []
    for url, field_ in ((primary, "master_repl_offset"), (replica, "slave_repl_offset")):
        try:
            client = redis.Redis.from_url(url, socket_timeout=2, decode_responses=True)
            offsets.append(int(client.info("replication")[field_]))
            client.close()
        except Exception:  # noqa: BLE001 - a node that does not answer has no figure
            return None
    return max(0, offsets[0] - offsets[1])


def _master_port(url: str) -> str | None:
    """The port of the primary a replica at ``url`` follows (None for a primary or a dead node)."""
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2, decode_responses=True)
        role = client.execute_command("ROLE")
        client.close()
    except Exception:  # noqa: BLE001 - a node that does not answer follows nobody
        return None
    return str(role[2]) if role[0] == "slave" else None
