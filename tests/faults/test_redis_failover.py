"""Scenario 10: Redis failover to a replica (issue 16).

A broker this module owns, a Redis primary (AOF, ``appendfsync always``, as ``switchyard
services`` runs it) and a replica of it (Debian's ``redis-server --replicaof``, AOF too).
Every Switchyard process reaches Redis through one stable address, as a deployment does
(a Sentinel-managed virtual IP, a DNS name, a TCP proxy): here a small TCP proxy in the test
that forwards to the current primary. The real router (product policy) and three real sim
workers run on the demo's three-tier cluster; a tenant budget binds after the failover.

Mid-stream the primary is ``kill -9``'d; 2 s later the replica is promoted by script
(``REPLICAOF NO ONE``) and the proxy is pointed at it, dropping every open connection (what
a moved VIP does). Requirements: routing continues, 0 lost, 0 routed twice, the tenant's
ledger never over its budget at any sample, and the true spend (the results' cost) within
the budget. Figures: the replication offset lag at the kill, failover times, the ledger
before and after.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_harness import (
    OwnedServices,
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
from test_outages import Rig, _fates, _queries, _wait_alive, _where

from schemas import Query
from switchyard import services
from wiring.settings import Settings

pytestmark = pytest.mark.faults

TENANT = "failover"
N = 900
RATE_PER_S = 30.0
KILL_AFTER = 300  # queries sent before the primary is killed
PROMOTE_AFTER_S = 2.0
BUDGET_SHARE = 0.45


class Proxy:
    """A TCP forwarder on 127.0.0.1 to the current Redis primary; ``point(port)`` moves it and
    drops every open connection (clients reconnect to the new primary)."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = services.free_port()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True, name="redis-proxy").start()

    def point(self, port: int) -> None:
        with self._lock:
            self.target = port
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                c.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept thread (close alone does not)
        with contextlib.suppress(OSError):
            self._server.close()
        self.point(self.target)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=2.0)
                upstream.settimeout(None)
            except OSError:
                client.close()  # the primary is down: refused, as a VIP with no owner
                continue
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()


def _redis_cli(port: int, *args: str) -> str:
    cli = Path(services.ensure_redis_server()).with_name("redis-cli")
    out = subprocess.run(
        [str(cli), "-p", str(port), *args], capture_output=True, text=True, timeout=10
    )
    return out.stdout


def _info(port: int) -> dict[str, str]:
    lines = _redis_cli(port, "INFO", "replication").splitlines()
    return dict(line.split(":", 1) for line in lines if ":" in line)


@pytest.fixture(scope="module")
def failover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("failover")
    owned = OwnedServices.start(home)
    procs: Procs | None = None
    replica: subprocess.Popen[bytes] | None = None
    proxy: Proxy | None = None
    try:
        primary_port = owned._redis_port
        replica_port = services.free_port()
        rdir = home / "redis-replica"
        rdir.mkdir()
        replica = subprocess.Popen(
            [services.ensure_redis_server(), "--port", str(replica_port), "--bind", "127.0.0.1",
             "--replicaof", "127.0.0.1", str(primary_port), "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(rdir), "--save", ""],
            stdout=open(rdir / "redis.log", "wb"), stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        wait_until(
            lambda: _info(replica_port).get("master_link_status") == "up",
            30, "the replica to sync with the primary",
        )  # fmt: skip
        proxy = Proxy(primary_port)
        prefix = "f" + uuid.uuid4().hex[:5]
        cluster_file = home / "cluster.json"
        spec = demo_cluster_spec(prefix, {TENANT: 1.0, "default": 1e6})
        cluster = write_cluster(cluster_file, spec)
        # the budget binds after the failover: a share of every query's dearest worst case
        probe = [Query.model_validate_json(v) for _, v in _queries("probe", N, tenant=TENANT)]
        budget = round(
            BUDGET_SHARE
            * sum(max(cluster.model(i.model).max_cost_usd(q) for i in cluster.instances)
                  for q in probe),
            6,
        )  # fmt: skip
        spec["tenants"][0]["budget_usd"] = budget
        cluster = write_cluster(cluster_file, spec)
        env = service_env(owned, namespace=prefix)
        env["SWITCHYARD_REDIS"] = f"redis://127.0.0.1:{proxy.port}/0"
        procs = Procs(home / "logs", env)
        policy, extra, _ = product_policy(cluster)
        router = start_router(procs, cluster_file, policy, window_ms=100, extra=extra, wait_s=0)
        rig = Rig(
            owned, procs, Settings.from_env(env), cluster, cluster_file, policy, router.argv[3:]
        )
        rig.router = router
        rig.revive()
        wait_router_ready(router, 120)
        _wait_alive(rig)
        yield {"rig": rig, "proxy": proxy, "replica": replica, "primary_port": primary_port,
               "replica_port": replica_port, "budget": budget}  # fmt: skip
    finally:
        if procs is not None:
            procs.stop_all()
        if proxy is not None:
            proxy.close()
        if replica is not None and replica.poll() is None:
            os.killpg(replica.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                replica.wait(15)
            if replica.poll() is None:
                os.killpg(replica.pid, signal.SIGKILL)
        owned.down()


async def test_redis_primary_killed_replica_promoted_routing_goes_on(
    failover: dict[str, Any],
) -> None:
    from state import period_id
    from state.store import StateStore

    rig: Rig = failover["rig"]
    proxy: Proxy = failover["proxy"]
    run_id = "fo-" + uuid.uuid4().hex[:6]
    messages = _queries(run_id, N, tenant=TENANT)
    ids = [k.decode() for k, _ in messages]
    budget = failover["budget"]
    store = await StateStore.connect(**rig.settings.redis_kwargs(), socket_timeout_s=2.0)
    period_s = rig.cluster.tenants[0].period_s
    marks: dict[str, float] = {}
    samples = {"n": 0, "over": 0, "max": 0.0, "errors": 0}
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            try:
                st = await store.budget_status(TENANT, str(period_id(time.time(), period_s)))
                samples["n"] += 1
                samples["max"] = max(samples["max"], st.committed_usd)
                samples["over"] += st.committed_usd > budget + 1e-9
            except Exception:
                samples["errors"] += 1
            await asyncio.sleep(0.02)

    def promote() -> None:
        _redis_cli(failover["replica_port"], "REPLICAOF", "NO", "ONE")
        proxy.point(failover["replica_port"])
        marks["promoted"] = time.monotonic()
        marks["promoted_wall"] = time.time()

    async def fail() -> None:
        info = _info(failover["primary_port"])
        marks["primary_offset"] = float(info.get("master_repl_offset", 0))
        marks["replica_offset"] = float(_info(failover["replica_port"]).get("slave_repl_offset", 0))
        rig.owned.redis_kill9()
        marks["killed"] = time.monotonic()
        await asyncio.sleep(PROMOTE_AFTER_S)
        await asyncio.to_thread(promote)

    failing: list[asyncio.Task[None]] = []

    def on_sent(i: int) -> None:
        if i == KILL_AFTER:
            failing.append(asyncio.get_running_loop().create_task(fail()))

    sampler = asyncio.create_task(sample())
    async with TopicReader(rig.settings.kafka_kwargs(), ["results", "decisions"]) as reader:
        t0 = time.monotonic()
        await produce_all(rig.settings.kafka_kwargs(), "queries", messages,
                          rate_per_s=RATE_PER_S, on_sent=on_sent)  # fmt: skip
        await failing[0]

        def after_promotion() -> bool:  # a decision made with the new primary's ledger
            return any(
                d.get("decided_at", 0) > marks["promoted_wall"]
                and "budget_blind" not in d.get("flags", [])
                for q in ids for d in reader.tally.decisions.get(q, [])
            )  # fmt: skip

        await await_until(after_promotion, 60, "a decision on the promoted replica")
        first_routed = time.monotonic()
        timed_out = ""
        try:
            await await_until(lambda: all(q in reader.tally.results for q in ids), 120,
                              f"a result for each of {N} queries")  # fmt: skip
        except AssertionError as exc:
            timed_out = f"{exc}; {_where(reader, ids)}"
        done = time.monotonic()
        await asyncio.sleep(1.0)
        fates = _fates(reader, ids)
        true_spend = sum(
            float(r[0].get("cost_usd", 0.0)) for q in ids if (r := reader.tally.results.get(q))
        )
    stop.set()
    await sampler
    ledger = await store.budget_status(TENANT, str(period_id(time.time(), period_s)))
    await store.close()
    dead = rig.dead()
    figures = {
        "queries_sent": N, "rate_per_s": RATE_PER_S, **fates,
        "budget_usd": budget, "true_spend_usd": round(true_spend, 6),
        "ledger_after_usd": round(ledger.committed_usd, 6),
        "ledger_samples": samples["n"], "samples_over_budget": samples["over"],
        "max_committed_usd": round(samples["max"], 6), "sample_errors": samples["errors"],
        "replication_lag_bytes_at_kill": marks["primary_offset"] - marks["replica_offset"],
        "kill_to_promoted_s": round(marks["promoted"] - marks["killed"], 2),
        "promoted_to_first_decision_s": round(first_routed - marks["promoted"], 2),
        "routed_blind": sum(
            1 for q in ids for d in reader.tally.decisions.get(q, [])
            if d.get("status") == "routed" and "budget_blind" in d.get("flags", [])
        ),  # fmt: skip
        "kill_to_all_results_s": round(done - marks["killed"], 1),
        "elapsed_s": round(done - t0, 1), "processes_died": dead,
        "command": "make test PYTEST_ARGS='tests/faults/test_redis_failover.py'",
    }  # fmt: skip
    write_figures("10_redis_failover", figures)
    print(figures)
    assert fates["lost"] == 0, f"{figures}; {timed_out}"
    assert fates["routed_twice"] == 0, figures
    assert not dead, figures
    assert samples["n"] > 100 and samples["over"] == 0, figures
    assert true_spend <= budget + 1e-9, figures
    assert ledger.committed_usd + 1e-9 >= true_spend, figures  # nothing settled was forgotten
