"""Scenario 9: three routers in one consumer group under faults (issue 16).

A broker and Redis this module owns; three real ``switchyard router`` processes sharing the
``queries`` partitions (one group); the test plays the workers: it heart-beats the
instances and, for every routed message it reads, frees that query's capacity slot after a
service time, so capacity binds. A tenant budget binds too. 10,000 queries are produced at
a steady rate; at 30 % one router is ``kill -9``'d (not restarted) and at 50 % another is
``SIGSTOP``'d for 30 s, then resumed (a zombie: it wakes up mid-window, its partitions long
given to the third). Throughout, samplers read the tenant's ledger and every instance's
slot set from Redis.

Requirements: 0 lost (every query routed, or answered with a final error Result by a
router), 0 routed twice (two different routings of one query), the budget never exceeded at
any sample, no instance over its capacity at any sample. Figures: the time from each fault
until a surviving router logged its new assignment (rebalance), and until every query was
answered.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fault_harness import (
    ROUTER_READY,
    Heartbeats,
    OwnedServices,
    Proc,
    Procs,
    TopicReader,
    await_until,
    cluster_spec,
    produce_all,
    service_env,
    start_router,
    write_cluster,
    write_figures,
)

from schemas import Query
from wiring.settings import Settings

pytestmark = pytest.mark.faults

N = 10_000
RATE_PER_S = 1_000.0
KILL_AT, STOP_AT = 3_000, 5_000
STOP_S = 30.0
MAX_CONCURRENCY = 40
SERVICE_S = 0.15  # how long the test's stand-in worker holds each query's slot
BUDGET_SHARE = 0.7  # of the worst case of every query at the three instances' mean price
TENANT = "group"
POLICY = "faults_policy:factory"


@dataclass
class Rig:
    owned: OwnedServices
    procs: Procs
    settings: Settings
    cluster: Any
    budget_usd: float
    routers: list[Proc] = field(default_factory=list)


def _queries(run_id: str) -> list[tuple[bytes, bytes]]:
    return [
        (
            f"{run_id}-{i}".encode(),
            json.dumps(
                {
                    "id": f"{run_id}-{i}",
                    "tenant": TENANT,
                    "prompt": f"query {i} " + "w " * (i % 40),
                    "max_tokens": 8,
                    "ttft_slo_ms": 60_000,
                }
            ).encode(),
        )  # fmt: skip
        for i in range(N)
    ]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    home = tmp_path_factory.mktemp("group")
    owned = OwnedServices.start(home)
    procs: Procs | None = None
    try:
        prefix = "g" + uuid.uuid4().hex[:5]
        spec = cluster_spec(prefix, max_concurrency=MAX_CONCURRENCY, tenants={TENANT: 1.0})
        cluster = write_cluster(home / "probe.json", spec)
        # the budget binds: a share of what every query would cost at the mean worst case
        probe = [Query.model_validate_json(v) for _, v in _queries("probe")]
        mean = sum(
            sum(cluster.model(i.model).max_cost_usd(q) for i in cluster.instances)
            / len(cluster.instances)
            for q in probe
        )
        budget = round(BUDGET_SHARE * mean, 6)
        spec["tenants"][0]["budget_usd"] = budget
        cluster_file = home / "cluster.json"
        cluster = write_cluster(cluster_file, spec)
        env = service_env(owned, namespace=prefix)
        procs = Procs(home / "logs", env)
        r = Rig(owned, procs, Settings.from_env(env), cluster, budget)
        for k in range(3):  # one group (the default app id); no rescuer: no real workers
            r.routers.append(
                start_router(
                    procs,
                    cluster_file,
                    POLICY,
                    name=f"router-{k}",
                    wait_s=0,
                    extra=["--rescue-grace-s", "0", "--max-hold-s", "120", "--budget-hold-s", "3"],
                )  # fmt: skip
            )
        for proc in r.routers:
            await_sync_ready(proc)
        yield r
    finally:
        if procs is not None:
            for proc in procs.started:  # a stopped process cannot handle SIGTERM
                _cont(proc)
            procs.stop_all()
        owned.down()


def await_sync_ready(proc: Proc, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ROUTER_READY not in proc.text():
        proc.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"{proc.name} never owned partitions:\n{proc.tail(1500)}")
        time.sleep(0.2)


def _cont(proc: Proc) -> None:
    if proc.alive():
        os.kill(proc.pid, signal.SIGCONT)


class PlayWorkers(TopicReader):
    """Reads every topic like ``TopicReader`` and frees each routed query's slot after
    ``SERVICE_S``, as a worker finishing it would (so capacity binds)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings.kafka_kwargs(), ["decisions", "results"])
        self.settings = settings
        self.due: deque[tuple[float, str, str]] = deque()
        self._freer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> PlayWorkers:
        await super().__aenter__()
        self._freer = asyncio.create_task(self._free())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._freer is not None:
            self._freer.cancel()
        await super().__aexit__(*exc)

    def _add(self, topic: str, value: bytes | None) -> None:
        super()._add(topic, value)
        if self.route_prefix and topic.startswith(self.route_prefix) and value:
            body = json.loads(value)
            self.due.append(
                (time.monotonic() + SERVICE_S, topic[len(self.route_prefix) :], body["query"]["id"])
            )

    async def _free(self) -> None:
        from state.store import StateStore

        store = await StateStore.connect(**self.settings.redis_kwargs())
        try:
            while True:
                now = time.monotonic()
                while self.due and self.due[0][0] <= now:
                    _, inst, qid = self.due.popleft()
                    await store.resident_done(inst, qid)
                await asyncio.sleep(0.01)
        finally:
            await store.close()


class Limits:
    """Samples the tenant's ledger and every instance's held slots until stopped."""

    def __init__(self, settings: Settings, cluster: Any, budget_usd: float) -> None:
        self.settings, self.cluster, self.budget_usd = settings, cluster, budget_usd
        self.samples = 0
        self.max_committed_usd = 0.0
        self.over_budget = 0
        self.max_slots: dict[str, int] = {i.id: 0 for i in cluster.instances}
        self.over_capacity = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Limits:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        from state import period_id
        from state.store import StateStore

        store = await StateStore.connect(**self.settings.redis_kwargs())
        period_s = self.cluster.tenants[0].period_s
        try:
            while True:
                status = await store.budget_status(TENANT, str(period_id(time.time(), period_s)))
                committed = status.committed_usd
                self.max_committed_usd = max(self.max_committed_usd, committed)
                self.over_budget += committed > self.budget_usd + 1e-9
                for inst in self.cluster.instances:
                    held = len(await store.slots_held(inst.id))
                    self.max_slots[inst.id] = max(self.max_slots[inst.id], held)
                    self.over_capacity += held > MAX_CONCURRENCY
                self.samples += 1
                await asyncio.sleep(0.02)
        finally:
            await store.close()


async def test_three_routers_kill9_and_sigstop_lose_nothing_and_keep_limits(rig: Rig) -> None:
    run_id = "grp-" + uuid.uuid4().hex[:6]
    messages = _queries(run_id)
    ids = [k.decode() for k, _ in messages]
    killed, stopped, survivor = rig.routers
    marks: dict[str, float] = {}
    assigns_at_fault: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    resume: list[asyncio.TimerHandle] = []

    def assignments() -> int:
        return sum(p.text().count(ROUTER_READY) for p in rig.routers if p is not killed)

    def on_sent(i: int) -> None:
        if i == KILL_AT:
            killed.kill9()
            marks["killed"] = time.monotonic()
            assigns_at_fault["killed"] = assignments()
        elif i == STOP_AT:
            os.kill(stopped.pid, signal.SIGSTOP)
            marks["stopped"] = time.monotonic()
            assigns_at_fault["stopped"] = survivor.text().count(ROUTER_READY)

            def cont() -> None:
                os.kill(stopped.pid, signal.SIGCONT)
                marks["resumed"] = time.monotonic()

            resume.append(loop.call_later(STOP_S, cont))

    async def watch_rebalances() -> None:
        while "rebalanced_after_stop" not in marks:
            if "killed" in marks and "rebalanced_after_kill" not in marks:
                if assignments() > assigns_at_fault["killed"]:
                    marks["rebalanced_after_kill"] = time.monotonic()
            if (
                "stopped" in marks
                and survivor.text().count(ROUTER_READY) > assigns_at_fault["stopped"]
            ):
                marks["rebalanced_after_stop"] = time.monotonic()
            await asyncio.sleep(0.1)

    async with (
        Heartbeats(rig.settings.redis_kwargs(), rig.cluster, ttl_s=600.0),
        PlayWorkers(rig.settings) as reader,
        Limits(rig.settings, rig.cluster, rig.budget_usd) as limits,
    ):
        watcher = asyncio.create_task(watch_rebalances())
        t0 = time.monotonic()
        await produce_all(
            rig.settings.kafka_kwargs(), "queries", messages, rate_per_s=RATE_PER_S, on_sent=on_sent
        )
        tally = reader.tally

        def answered(q: str) -> bool:
            return q in tally.routed or any(r.get("error") for r in tally.results.get(q, []))

        def all_answered() -> bool:
            survivor.check_alive()
            reader.check()
            return all(answered(q) for q in ids)

        try:
            await await_until(all_answered, 240, f"all {N} queries routed or answered")
        except AssertionError as exc:
            missing = [q for q in ids if not answered(q)]
            pytest.fail(
                f"{exc}: {len(missing)} neither routed nor answered, e.g. {missing[:5]}; "
                f"survivor log:\n{survivor.tail(1500)}"
            )
        done = time.monotonic()
        # the zombie wakes up after the stop: whatever it still produces shows now
        while "resumed" not in marks:
            await asyncio.sleep(0.2)
        await asyncio.sleep(8.0)
        watcher.cancel()
        lost = [q for q in ids if not answered(q)]
        _, twice = tally.ids_routed(ids)
        twice_ids = sorted(twice & set(ids))
        refused = sum(1 for q in ids if q not in tally.routed)
        resent = tally.resent_copies(ids)
        zombie_alive = stopped.alive()

    figures = {
        "routers": 3,
        "queries_sent": N,
        "rate_per_s": RATE_PER_S,
        "kill9_after_sent": KILL_AT,
        "sigstop_after_sent": STOP_AT,
        "sigstop_s": STOP_S,
        "lost": len(lost),
        "routed_twice": len(twice_ids),
        "routed_twice_examples": [
            [(t, b["decision"].get("instance_id")) for t, b in tally.routed[q]]
            for q in twice_ids[:3]
        ],
        "identical_resent_copies": resent,
        "refused_with_error_result": refused,
        "budget_usd": rig.budget_usd,
        "max_committed_usd": round(limits.max_committed_usd, 6),
        "ledger_samples": limits.samples,
        "samples_over_budget": limits.over_budget,
        "max_slots_held": limits.max_slots,
        "max_concurrency": MAX_CONCURRENCY,
        "samples_over_capacity": limits.over_capacity,
        "kill_to_rebalanced_s": _since(marks, "killed", "rebalanced_after_kill"),
        "stop_to_rebalanced_s": _since(marks, "stopped", "rebalanced_after_stop"),
        "start_to_all_answered_s": round(done - t0, 1),
        "zombie_alive_after_resume": zombie_alive,
        "command": "make test PYTEST_ARGS='tests/faults/test_router_group.py'",
    }
    write_figures("9_router_group", figures)
    print(json.dumps(figures, indent=1))
    assert not lost, f"{len(lost)} lost, e.g. {lost[:5]}"
    assert not twice_ids, f"{len(twice_ids)} routed twice: {figures['routed_twice_examples']}"
    assert limits.samples > 100 and limits.over_budget == 0, figures
    assert limits.over_capacity == 0, figures
    assert 0 < refused < N  # the budget did bind, and not for everything


def _since(marks: dict[str, float], a: str, b: str) -> float | None:
    return round(marks[b] - marks[a], 1) if a in marks and b in marks else None
