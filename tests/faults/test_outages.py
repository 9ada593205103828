"""Service outages: scenario 4 (the Kafka broker restarted mid-stream) and scenario 3 (Redis
stopped for 30 s).

One rig per module: a broker and Redis this module owns (and may kill), a real ``switchyard
router`` with the product policy and real ``switchyard worker --backend sim`` processes on
the demo's three-tier cluster. Queries are produced at a steady rate by an idempotent
producer (acks=all) across each outage; every query's fate is read back from ``results``,
``decisions`` and ``route.*``. Redis restarts empty on its port (``switchyard services``
runs it without persistence), so "state rebuilds" is tested for real.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fault_harness import (
    OwnedServices,
    Proc,
    Procs,
    TopicReader,
    await_until,
    demo_cluster_spec,
    produce_all,
    product_policy,
    service_env,
    start_router,
    wait_router_ready,
    wait_until,
    write_cluster,
    write_figures,
)

from switchyard.settings import Settings

pytestmark = pytest.mark.faults

TENANT = "outage"
TENANT_BUDGET_USD = 50.0  # not binding: these scenarios count losses and ledger drift
TIME_SCALE = 50.0
HEARTBEAT_S = 0.5
REDIS_DOWN_S = 30.0
REDIS: dict[str, Any] = {}  # the outage test's figures, for the requirement tests below


@dataclass
class Rig:
    owned: OwnedServices
    procs: Procs
    settings: Settings
    cluster: Any
    cluster_file: Any
    policy: str
    router_args: list[str]
    router: Proc | None = None
    workers: dict[str, Proc] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)

    def worker_args(self, instance_id: str) -> list[str]:
        return [
            "worker", "--instance", instance_id, "--cluster", str(self.cluster_file),
            "--backend", "sim", "--time-scale", f"{TIME_SCALE:g}",
            "--heartbeat-s", f"{HEARTBEAT_S:g}", "--log-level", "WARNING",
        ]  # fmt: skip

    def revive(self) -> list[str]:
        """Restart any process that died (each one is a crash the figures report)."""
        died = []
        if self.router is None or not self.router.alive():
            if self.router is not None:
                died.append(f"router exited {self.router.popen.returncode}")
            self.router = self.procs.start("router", self.router_args)
        for inst in self.cluster.instances:
            w = self.workers.get(inst.id)
            if w is None or not w.alive():
                if w is not None:
                    died.append(f"worker {inst.id} exited {w.popen.returncode}: {w.tail(300)!r}")
                self.workers[inst.id] = self.procs.start(
                    f"worker-{inst.id}", self.worker_args(inst.id)
                )
        self.crashes += died
        return died

    def dead(self) -> list[str]:
        out = []
        for p in [self.router, *self.workers.values()]:
            if p is not None and not p.alive():
                out.append(f"{p.name} (pid {p.pid}) exited {p.popen.returncode}")
        return out


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    home = tmp_path_factory.mktemp("outages")
    owned = OwnedServices.start(home)
    procs: Procs | None = None
    try:
        prefix = "o" + uuid.uuid4().hex[:5]
        cluster_file = home / "cluster.json"
        cluster = write_cluster(
            cluster_file, demo_cluster_spec(prefix, {TENANT: TENANT_BUDGET_USD, "default": 1e6})
        )
        env = service_env(owned, namespace=prefix)
        procs = Procs(home / "logs", env)
        policy, extra, _ = product_policy(cluster)
        router = start_router(procs, cluster_file, policy, window_ms=100, extra=extra, wait_s=0)
        r = Rig(
            owned, procs, Settings.from_env(env), cluster, cluster_file, policy, router.argv[3:]
        )
        r.router = router
        r.revive()
        wait_router_ready(router, 120)
        _wait_alive(r)
        yield r
    finally:
        if procs is not None:
            procs.stop_all()
        owned.down()


def _wait_alive(rig: Rig, timeout_s: float = 90.0) -> None:
    ids = [i.id for i in rig.cluster.instances]

    def up() -> bool:
        for p in rig.workers.values():
            p.check_alive()
        return all(asyncio.run(_alive(rig.settings, ids)))

    wait_until(up, timeout_s, "the workers to heart-beat", poll_s=0.3)


async def _alive(settings: Settings, ids: list[str]) -> list[bool]:
    from state.store import StateStore

    store = await StateStore.connect(**settings.redis_kwargs(), socket_timeout_s=3.0)
    try:
        live = await store.snapshots(ids, time.time())
        return [bool(live[i].alive) if i in live else False for i in ids]
    finally:
        await store.close()


def _queries(run_id: str, n: int) -> list[tuple[bytes, bytes]]:
    return [
        (
            f"{run_id}-{i}".encode(),
            f'{{"id": "{run_id}-{i}", "tenant": "{TENANT}", "prompt": "outage question {i}", '
            f'"max_tokens": 32, "ttft_slo_ms": 5000}}'.encode(),
        )
        for i in range(n)
    ]


def _fates(reader: TopicReader, ids: list[str]) -> dict[str, int]:
    res, routed = reader.tally.results, reader.tally.routed
    return {
        "lost": sum(1 for q in ids if q not in res),
        "duplicated_results": sum(1 for q in ids if len(res.get(q, [])) > 1),
        "routed_twice": sum(1 for q in ids if len(routed.get(q, [])) > 1),
        "error_results": sum(1 for q in ids for r in res.get(q, []) if r.get("error")),
    }


def _where(reader: TopicReader, ids: list[str]) -> str:
    """Where the unanswered queries got to: decisions and route messages of the first few."""
    lost = [q for q in ids if q not in reader.tally.results][:6]
    parts = []
    for q in lost:
        decisions = [
            (d.get("status"), d.get("instance_id"), round(d.get("decided_at", 0), 2))
            for d in reader.tally.decisions.get(q, [])
        ]
        routes = [topic for topic, _ in reader.tally.routed.get(q, [])]
        parts.append(f"{q}: decisions {decisions}, routed to {routes}")
    return "unanswered: " + "; ".join(parts)


N_KAFKA = 1_000
KAFKA_RATE = 100.0


# Was xfail (bug 10): intermittent loss of the queries routed to a worker whose group had
# joined before the broker's metadata listed its just-created route topic (an empty
# assignment, kept for aiokafka's 5 min metadata age). Fixed by the worker's 5 s metadata
# refresh (WorkerConfig.metadata_refresh_s).
async def test_kafka_broker_restart_mid_stream_loses_nothing(rig: Rig) -> None:
    assert not rig.revive(), "a process was dead before the test"
    run_id = "kr-" + uuid.uuid4().hex[:6]
    messages = _queries(run_id, N_KAFKA)
    ids = [k.decode() for k, _ in messages]
    marks: dict[str, float] = {}
    restart: list[asyncio.Task[float]] = []

    async def bounce() -> float:
        rig.owned.kafka_stop(hard=True)  # kill -9 by the recorded pid; data dir kept
        marks["killed"] = time.monotonic()
        marks["killed_wall"] = time.time()
        await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        took = await loop.run_in_executor(None, rig.owned.kafka_restart)
        marks["serving"] = time.monotonic()
        return took

    def on_sent(i: int) -> None:
        if i == N_KAFKA * 3 // 10:
            restart.append(asyncio.get_running_loop().create_task(bounce()))

    async with TopicReader(rig.settings.kafka_kwargs(), ["results", "decisions"]) as reader:
        t0 = time.monotonic()
        await produce_all(
            rig.settings.kafka_kwargs(), "queries", messages, rate_per_s=KAFKA_RATE, on_sent=on_sent
        )
        assert restart, "the broker was never restarted"
        restart_s = await restart[0]

        def first_new_result() -> bool:
            return any(
                r.get("finished_at", 0) > marks["killed_wall"] + 1.0
                for q in ids
                for r in reader.tally.results.get(q, [])
            )

        await await_until(first_new_result, 120, "a result after the broker came back")
        first_after = time.monotonic()

        def all_answered() -> bool:
            reader.check()
            return all(q in reader.tally.results for q in ids)

        timed_out = ""
        try:
            await await_until(all_answered, 90, f"a result for each of {N_KAFKA} queries")
        except AssertionError as exc:
            timed_out = f"{exc}; {_where(reader, ids)}"
        done = time.monotonic()
        await asyncio.sleep(1.0)
        fates = _fates(reader, ids)
    dead = rig.dead()
    write_figures(
        "4_kafka_restart",
        {
            "policy": rig.policy,
            "queries_sent": N_KAFKA,
            "rate_per_s": KAFKA_RATE,
            **fates,
            "broker_down_s": round(marks["serving"] - marks["killed"], 1),
            "broker_start_s": round(restart_s, 1),
            "kill_to_first_result_s": round(first_after - marks["killed"], 1),
            "kill_to_all_results_s": round(done - marks["killed"], 1),
            "elapsed_s": round(done - t0, 1),
            "processes_died": dead,
            "command": "make test PYTEST_ARGS='tests/faults/test_outages.py -k kafka'",
        },
    )
    assert fates["lost"] == 0, f"{fates}; {timed_out}; dead processes: {dead}"
    assert not dead, f"processes died across the broker restart: {dead}"


N_REDIS = 1_200
REDIS_RATE = 30.0  # 40 s of traffic: 5 s before, 30 s during, 5 s after the outage
REDIS_DOWN_AFTER_S = 5.0


async def test_redis_outage_30s(rig: Rig) -> None:
    from state import period_id
    from state.store import StateStore

    died_before = rig.revive()
    if died_before:
        await asyncio.get_running_loop().run_in_executor(None, _wait_alive, rig)
    run_id = "ro-" + uuid.uuid4().hex[:6]
    messages = _queries(run_id, N_REDIS)
    ids = [k.decode() for k, _ in messages]
    marks: dict[str, float] = {}
    outage: list[asyncio.Task[None]] = []

    async def stop_redis() -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, rig.owned.redis_stop)
        marks["down_wall"] = time.time()
        marks["down"] = time.monotonic()
        await asyncio.sleep(REDIS_DOWN_S)
        marks["restarting_wall"] = time.time()  # decisions before this were surely blind
        await loop.run_in_executor(None, rig.owned.redis_restart)
        marks["up_wall"] = time.time()
        marks["up"] = time.monotonic()

    def on_sent(i: int) -> None:
        if i == int(REDIS_DOWN_AFTER_S * REDIS_RATE):
            outage.append(asyncio.get_running_loop().create_task(stop_redis()))

    async with TopicReader(rig.settings.kafka_kwargs(), ["results", "decisions"]) as reader:
        await produce_all(
            rig.settings.kafka_kwargs(), "queries", messages, rate_per_s=REDIS_RATE, on_sent=on_sent
        )
        await outage[0]

        def all_answered() -> bool:
            reader.check()
            return all(q in reader.tally.results for q in ids)

        try:
            await await_until(all_answered, 120, f"a result for each of {N_REDIS} queries")
        except AssertionError as exc:
            pytest.fail(f"{exc}: {_fates(reader, ids)}; dead processes: {rig.dead()}")
        done = time.monotonic()
        await asyncio.sleep(1.0)
        fates = _fates(reader, ids)
        decisions = [d for q in ids for d in reader.tally.ok_routed_decisions(q)]
        during = [
            d for d in decisions if marks["down_wall"] <= d["decided_at"] < marks["restarting_wall"]
        ]
        flagged = [d for d in during if d.get("flags")]
        after = sorted(d["decided_at"] for d in decisions if d["decided_at"] >= marks["up_wall"])
        results = [r for q in ids for r in reader.tally.results.get(q, []) if not r.get("error")]
        true_spend = sum(float(r.get("cost_usd", 0.0)) for r in results)

    store = await StateStore.connect(**rig.settings.redis_kwargs())
    try:
        periods = {d.get("budget_period") for d in decisions if d.get("budget_period")}
        ledger_committed = 0.0
        for p in periods or {period_id(time.time(), 3600)}:
            st = await store.budget_status(TENANT, str(p))
            ledger_committed += st.reserved_usd + st.spent_usd
    finally:
        await store.close()
    dead = rig.dead()
    figures = {
        "policy": rig.policy,
        "queries_sent": N_REDIS,
        "rate_per_s": REDIS_RATE,
        "redis_down_s": round(marks["up"] - marks["down"], 1),
        **fates,
        "routed_during_outage": len(during),
        "flagged_during_outage": len(flagged),
        "flags_seen": sorted({f for d in during for f in d.get("flags", [])}),
        "restart_to_first_decision_s": round(after[0] - marks["up_wall"], 2) if after else None,
        "restart_to_all_results_s": round(done - marks["up"], 1),
        "true_spend_usd": round(true_spend, 9),
        "ledger_after_usd": round(ledger_committed, 9),
        "ledger_undercount_usd": round(max(0.0, true_spend - ledger_committed), 9),
        "processes_died": dead,
        "command": "make test PYTEST_ARGS='tests/faults/test_outages.py -k redis'",
    }
    write_figures("3_redis_outage", figures)
    REDIS.update(figures)
    assert fates["lost"] == 0, figures
    assert not dead, f"processes died during the Redis outage: {dead}"
    assert fates["routed_twice"] == 0 and fates["duplicated_results"] == 0, figures


@pytest.mark.xfail(
    reason="state/ keeps the ledger only in Redis and nothing rebuilds it: Redis restarted "
    "empty (switchyard services runs it without persistence) forgets the period's earlier "
    "spend, so a tenant may spend its budget again. Fix: persist Redis (AOF) and say so, or "
    "have the router rebuild an empty ledger from the decisions/results topics",
    strict=False,
)
def test_redis_outage_ledger_rebuilt() -> None:
    if not REDIS:
        pytest.skip("the outage test did not run")
    ledger_committed, true_spend = REDIS["ledger_after_usd"], REDIS["true_spend_usd"]
    figures = REDIS
    assert ledger_committed + 1e-9 >= true_spend, (
        f"after Redis came back the ledger holds ${ledger_committed:.6f} but results cost "
        f"${true_spend:.6f}: spend before/while blind was forgotten, so the tenant could "
        "spend its budget again this period (Redis restarted empty; nothing rebuilds the "
        f"ledger). {figures}"
    )


# Found unmet by this scenario (nothing was routed during the outage); implemented by the
# streams owner in e75e38b (streams/blind.py: LPS views, BUDGET_BLIND, conservative spend).
def test_redis_outage_routing_goes_on_blind() -> None:
    if not REDIS:
        pytest.skip("the outage test did not run")
    figures = REDIS
    assert figures["routed_during_outage"] > 0, (
        f"nothing was routed during the {REDIS_DOWN_S:.0f} s outage (DESIGN: 'when Redis is "
        f"unreachable ... routing goes on with LPS estimates'; see streams/blind.py). {figures}"
    )
    assert figures["flagged_during_outage"] == figures["routed_during_outage"], (
        f"decisions while blind must be flagged: {figures}"
    )
