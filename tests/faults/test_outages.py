"""Service outages: scenario 4 (the Kafka broker restarted mid-stream) and scenario 3 (Redis
stopped for 30 s).

One rig per module: a broker and Redis this module owns (and may kill), a real ``switchyard
router`` with the product policy and real ``switchyard worker --backend sim`` processes on
the demo's three-tier cluster. Queries are produced at a steady rate by an idempotent
producer (acks=all) across each outage; every query's fate is read back from ``results``,
``decisions`` and ``route.*``. Redis runs as ``switchyard services`` runs it (AOF,
``appendfsync always``). The 30 s outage restarts it **empty** (its AOF deleted: a Redis
without persistence, a failover to an empty replica), so "state rebuilds" is tested for
real, the budget ledger included (rebuilt from Kafka by the router); the ``kill -9`` test
restarts it on its AOF.
"""

from __future__ import annotations

import asyncio
import os
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

from wiring.settings import Settings

pytestmark = pytest.mark.faults

TENANT = "outage"
TENANT_BUDGET_USD = 50.0  # not binding: these scenarios count losses and ledger drift
# one tenant per Redis scenario, so each ledger holds exactly that scenario's spend
REDIS_TENANT, AOF_TENANT = "redisout", "aofkill"
TIME_SCALE = 50.0
HEARTBEAT_S = 0.5
REDIS_DOWN_S = 30.0
REDIS: dict[str, Any] = {}  # the outage test's figures, for the requirement tests below
# the workers' log level (tests/faults/loop_scenario.py runs scenario 4 with INFO: full logs)
LOG_LEVEL = os.environ.get("SWITCHYARD_FAULTS_LOG_LEVEL", "WARNING")


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
            "--heartbeat-s", f"{HEARTBEAT_S:g}", "--log-level", LOG_LEVEL,
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
            cluster_file,
            demo_cluster_spec(
                prefix,
                {
                    TENANT: TENANT_BUDGET_USD,
                    REDIS_TENANT: TENANT_BUDGET_USD,
                    AOF_TENANT: TENANT_BUDGET_USD,
                    "default": 1e6,
                },
            ),
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


def _queries(run_id: str, n: int, tenant: str = TENANT) -> list[tuple[bytes, bytes]]:
    return [
        (
            f"{run_id}-{i}".encode(),
            f'{{"id": "{run_id}-{i}", "tenant": "{tenant}", "prompt": "outage question {i}", '
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


async def _ledger(
    rig: Rig, tenant: str, ids: list[str], reader: TopicReader
) -> tuple[dict[str, float], dict[str, float], dict[str, float], str | None]:
    """Per ledger period (the decisions' ``budget_period``): the true spend (sum of the
    results' ``cost_usd``), the ledger's reserved + spent, and its limit; plus the ledger's
    completeness mark (``LedgerGuard``)."""
    from state.store import StateStore

    period_of: dict[str, str] = {}
    for q in ids:
        for d in reader.tally.ok_routed_decisions(q):
            if d.get("budget_period"):
                period_of[q] = str(d["budget_period"])
    true: dict[str, float] = {}
    for q in ids:
        for r in reader.tally.results.get(q, [])[:1]:  # a duplicate result is settled once
            if r.get("instance_id") and q in period_of:
                true[period_of[q]] = true.get(period_of[q], 0.0) + float(r.get("cost_usd", 0.0))
    store = await StateStore.connect(**rig.settings.redis_kwargs())
    try:
        ledger, limit = {}, {}
        for p in sorted(set(period_of.values())):
            st = await store.budget_status(tenant, p)
            ledger[p] = st.reserved_usd + st.spent_usd
            limit[p] = st.limit_usd if st.limit_usd is not None else float("inf")
        mark = await store.ledger_mark()
    finally:
        await store.close()
    return true, ledger, limit, mark


async def _await_ledger_mark(rig: Rig, timeout_s: float) -> float:
    """Seconds until the ledger's completeness mark is back (the router's rebuild done)."""
    from state.store import StateStore

    t0 = time.monotonic()
    store = await StateStore.connect(**rig.settings.redis_kwargs())
    try:
        while await store.ledger_mark() is None:
            if time.monotonic() - t0 > timeout_s:
                raise AssertionError(f"no ledger mark {timeout_s:.0f} s after Redis came back")
            await asyncio.sleep(0.1)
    finally:
        await store.close()
    return time.monotonic() - t0


async def test_redis_outage_30s(rig: Rig) -> None:
    import json

    died_before = rig.revive()
    if died_before:
        await asyncio.get_running_loop().run_in_executor(None, _wait_alive, rig)
    run_id = "ro-" + uuid.uuid4().hex[:6]
    messages = _queries(run_id, N_REDIS, REDIS_TENANT)
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
        # back EMPTY (AOF deleted): what a Redis without persistence or an empty replica does
        await loop.run_in_executor(None, lambda: rig.owned.redis_restart(empty=True))
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
        mark_s = await _await_ledger_mark(rig, 120)

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
        blind_after = [
            d for d in decisions if d["decided_at"] >= marks["up_wall"] and d.get("flags")
        ]
        true, ledger, limit, mark = await _ledger(rig, REDIS_TENANT, ids, reader)

    rebuild = json.loads(mark) if mark else {}
    rebuilt_periods = set(rebuild.get("periods", {}).get(REDIS_TENANT, "").split()) & set(true)
    dead = rig.dead()
    figures = {
        "policy": rig.policy,
        "queries_sent": N_REDIS,
        "rate_per_s": REDIS_RATE,
        "redis_down_s": round(marks["up"] - marks["down"], 1),
        "redis_restarted": "empty (AOF deleted)",
        **fates,
        "routed_during_outage": len(during),
        "flagged_during_outage": len(flagged),
        "flags_seen": sorted({f for d in during for f in d.get("flags", [])}),
        "routed_blind_after_restart": len(blind_after),
        "restart_to_first_decision_s": round(after[0] - marks["up_wall"], 2) if after else None,
        "restarting_to_ledger_rebuilt_s": (
            # from the start of the restart: the router may rebuild before redis_up returns
            round(rebuild["finished_at"] - marks["restarting_wall"], 2)
            if rebuild
            else round(mark_s, 2)
        ),
        "rebuild_s": rebuild.get("seconds"),
        "rebuild_records_scanned": rebuild.get("records"),
        "rebuild_routed_in_period": rebuild.get("routed"),
        "rebuild_results": rebuild.get("results"),
        "rebuild_ledgers": [x for x in rebuild.get("ledgers", []) if x["tenant"] == REDIS_TENANT],
        "restart_to_all_results_s": round(done - marks["up"], 1),
        "true_spend_usd": round(sum(true.values()), 9),
        "ledger_after_usd": round(sum(ledger.values()), 9),
        "ledger_undercount_usd": round(max(0.0, sum(true.values()) - sum(ledger.values())), 9),
        "periods": {
            p: {"true_usd": round(true.get(p, 0.0), 9), "ledger_usd": round(ledger[p], 9)}
            for p in ledger
        },  # fmt: skip
        "rebuilt_periods": sorted(rebuilt_periods),
        "processes_died": dead,
        "command": "make test PYTEST_ARGS='tests/faults/test_outages.py -k redis'",
    }
    write_figures("3_redis_outage", figures)
    REDIS.update(figures, _true=true, _ledger=ledger, _limit=limit, _rebuilt=rebuilt_periods)
    assert fates["lost"] == 0, figures
    assert not dead, f"processes died during the Redis outage: {dead}"
    assert fates["routed_twice"] == 0 and fates["duplicated_results"] == 0, figures


def test_redis_outage_ledger_rebuilt() -> None:
    """Redis back empty: the router rebuilds the current period's ledger from Kafka, so it
    covers every result's cost (and whatever is still outstanding), never over the limit."""
    if not REDIS:
        pytest.skip("the outage test did not run")
    figures = {k: v for k, v in REDIS.items() if not k.startswith("_")}
    true, ledger, limit = REDIS["_true"], REDIS["_ledger"], REDIS["_limit"]
    assert REDIS["_rebuilt"], f"no rebuild report covers this run's period: {figures}"
    for p in REDIS["_rebuilt"]:
        assert ledger[p] + 1e-9 >= true[p], (
            f"period {p}: after Redis came back empty the ledger holds ${ledger[p]:.6f} but "
            f"results cost ${true[p]:.6f}: spend was forgotten, so the tenant could spend it "
            f"again this period. {figures}"
        )
        assert true[p] <= limit[p] + 1e-9, f"period {p}: overspend {figures}"


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


N_AOF = 600
AOF_RATE = 30.0
AOF_KILL_AFTER_S = 5.0
AOF_DOWN_S = 5.0


async def test_redis_kill9_restarted_on_aof_keeps_the_ledger(rig: Rig) -> None:
    """Redis ``kill -9``'d mid-stream and started again on its append-only file (the launcher's
    production default): the ledger comes back as it was (no rebuild: its completeness mark
    survived), and after recovery covers exactly what the results cost plus any reservation
    whose settle fell into the outage, never more than the budget."""
    died_before = rig.revive()
    if died_before:
        await asyncio.get_running_loop().run_in_executor(None, _wait_alive, rig)
    await _await_ledger_mark(rig, 120)  # a complete ledger to start from
    run_id = "rk-" + uuid.uuid4().hex[:6]
    messages = _queries(run_id, N_AOF, AOF_TENANT)
    ids = [k.decode() for k, _ in messages]
    marks: dict[str, float] = {}
    outage: list[asyncio.Task[None]] = []
    from state.store import StateStore

    store = await StateStore.connect(**rig.settings.redis_kwargs())
    try:
        mark_before = await store.ledger_mark()
    finally:
        await store.close()

    async def kill_redis() -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, rig.owned.redis_kill9)
        marks["down"] = time.monotonic()
        await asyncio.sleep(AOF_DOWN_S)
        marks["load_s"] = await loop.run_in_executor(None, rig.owned.redis_restart)
        marks["up"] = time.monotonic()

    def on_sent(i: int) -> None:
        if i == int(AOF_KILL_AFTER_S * AOF_RATE):
            outage.append(asyncio.get_running_loop().create_task(kill_redis()))

    async with TopicReader(rig.settings.kafka_kwargs(), ["results", "decisions"]) as reader:
        await produce_all(
            rig.settings.kafka_kwargs(), "queries", messages, rate_per_s=AOF_RATE, on_sent=on_sent
        )
        await outage[0]

        def all_answered() -> bool:
            reader.check()
            return all(q in reader.tally.results for q in ids)

        try:
            await await_until(all_answered, 120, f"a result for each of {N_AOF} queries")
        except AssertionError as exc:
            pytest.fail(f"{exc}: {_fates(reader, ids)}; dead processes: {rig.dead()}")
        done = time.monotonic()
        await asyncio.sleep(1.0)
        fates = _fates(reader, ids)
        true, ledger, limit, mark_after = await _ledger(rig, AOF_TENANT, ids, reader)
    dead = rig.dead()
    figures = {
        "policy": rig.policy,
        "queries_sent": N_AOF,
        "rate_per_s": AOF_RATE,
        "redis": "kill -9, restarted on its AOF (appendfsync always)",
        "redis_down_s": round(marks["up"] - marks["down"], 1),
        "redis_restart_s": round(marks["load_s"], 2),
        **fates,
        "ledger_mark_kept": mark_after == mark_before,
        "restart_to_all_results_s": round(done - marks["up"], 1),
        "true_spend_usd": round(sum(true.values()), 9),
        "ledger_after_usd": round(sum(ledger.values()), 9),
        "ledger_over_true_usd": round(sum(ledger.values()) - sum(true.values()), 9),
        "processes_died": dead,
        "command": "make test PYTEST_ARGS='tests/faults/test_outages.py -k redis'",
    }
    write_figures("3b_redis_kill9_aof", figures)
    assert fates["lost"] == 0, figures
    assert not dead, f"processes died across the Redis kill -9: {dead}"
    assert mark_before is not None and mark_after == mark_before, (
        f"the ledger mark did not survive the restart on the AOF: {figures}"
    )
    for p, spent in true.items():
        assert ledger[p] + 1e-9 >= spent, f"period {p}: the ledger forgot spend: {figures}"
        assert spent <= limit[p] + 1e-9, f"period {p}: overspend: {figures}"
