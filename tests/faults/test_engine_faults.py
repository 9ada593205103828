"""Scenario 11: inference engines failing under the real ``vllm`` backend (issue 16).

A broker and Redis this module owns; three OpenAI-compatible engine servers
(``switchyard fake-vllm`` over the simulated engine, the demo cluster's profiles; the real
vLLM servers of issue 18 take their place where CI time allows), one real ``switchyard
worker --backend vllm`` per instance, the real router. Queries stream at a steady rate;

- the small instance's server is ``kill -9``'d mid-stream (and stays down),
- the medium instance's server is ``SIGSTOP``'d for 10 s (a frozen engine), then resumed,
- the large instance's server answers ``--error-rate 0.3`` of its requests with HTTP 500.

Requirements: every query ends with a Result, a good one or an error Result, within its
deadline (``DEADLINE_S`` after it was produced), counted per instance and kind; nothing is
lost or answered twice; no decision routes to the killed instance later than two heartbeats
after the kill (its worker drops its heartbeat when the engine fails its health probe).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections import Counter
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
    policy_name,
    produce_all,
    service_env,
    start_router,
    wait_router_ready,
    wait_until,
    write_cluster,
    write_figures,
)

from switchyard import services
from wiring.settings import Settings

pytestmark = pytest.mark.faults

N = 600
RATE_PER_S = 20.0
KILL_AT, FREEZE_AT = 100, 200  # queries sent before each fault
FREEZE_S = 10.0
ERROR_RATE = 0.3
HEARTBEAT_S = 0.5
DEADLINE_S = 60.0
TIME_SCALE = 20.0


@dataclass
class Rig:
    owned: OwnedServices
    procs: Procs
    settings: Settings
    cluster: Any
    servers: dict[str, Proc] = field(default_factory=dict)
    workers: dict[str, Proc] = field(default_factory=dict)
    router: Proc | None = None


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    home = tmp_path_factory.mktemp("engines")
    owned = OwnedServices.start(home)
    procs: Procs | None = None
    try:
        prefix = "e" + uuid.uuid4().hex[:5]
        spec = demo_cluster_spec(prefix, {"default": 1e6})
        ports = {inst["id"]: services.free_port() for inst in spec["instances"]}
        for inst in spec["instances"]:
            inst["endpoint"] = f"http://127.0.0.1:{ports[inst['id']]}"
        cluster_file = home / "cluster.json"
        cluster = write_cluster(cluster_file, spec)
        env = service_env(owned, namespace=prefix)
        procs = Procs(home / "logs", env)
        r = Rig(owned, procs, Settings.from_env(env), cluster)
        large = cluster.instances[-1].id
        for inst in cluster.instances:
            errors = ["--error-rate", f"{ERROR_RATE:g}"] if inst.id == large else []
            r.servers[inst.id] = procs.start(
                f"engine-{inst.id}",
                ["fake-vllm", "--cluster", str(cluster_file), "--instance", inst.id,
                 "--port", str(ports[inst.id]), "--time-scale", f"{TIME_SCALE:g}",
                 "--seed", "1", *errors],
            )  # fmt: skip
        for inst in cluster.instances:
            r.workers[inst.id] = procs.start(
                f"worker-{inst.id}",
                ["worker", "--instance", inst.id, "--cluster", str(cluster_file),
                 "--backend", "vllm", "--heartbeat-s", f"{HEARTBEAT_S:g}", "--log-level", "INFO"],
            )  # fmt: skip
        r.router = start_router(
            procs, cluster_file, policy_name(None), window_ms=50, wait_s=0,
            extra=["--rescue-grace-s", "3"],
        )  # fmt: skip
        wait_router_ready(r.router, 120)
        wait_until(
            lambda: all("heartbeat" in w.text() or w.alive() for w in r.workers.values()),
            60, "the workers to start",
        )  # fmt: skip
        yield r
    finally:
        if procs is not None:
            for p in procs.started:
                if p.alive():
                    os.kill(p.pid, signal.SIGCONT)
            procs.stop_all()
        owned.down()


async def test_engines_killed_frozen_and_failing_every_query_answered_in_time(rig: Rig) -> None:
    cluster = rig.cluster
    small, medium, large = (i.id for i in cluster.instances)
    run_id = "en-" + uuid.uuid4().hex[:6]
    ids = [f"{run_id}-{i}" for i in range(N)]
    messages = [
        (q.encode(),
         f'{{"id": "{q}", "prompt": "engine fault question {i} " , "max_tokens": 24, '
         f'"ttft_slo_ms": 30000}}'.encode())
        for i, q in enumerate(ids)
    ]  # fmt: skip
    sent_at: dict[str, float] = {}
    marks: dict[str, float] = {}
    loop = asyncio.get_running_loop()

    def on_sent(i: int) -> None:
        sent_at[ids[i]] = time.time()
        if i == KILL_AT:
            rig.servers[small].kill9()
            marks["killed"] = time.time()
        elif i == FREEZE_AT:
            os.kill(rig.servers[medium].pid, signal.SIGSTOP)
            marks["frozen"] = time.time()

            def thaw() -> None:
                os.kill(rig.servers[medium].pid, signal.SIGCONT)
                marks["thawed"] = time.time()

            loop.call_later(FREEZE_S, thaw)

    async with TopicReader(rig.settings.kafka_kwargs(), ["results", "decisions"]) as reader:
        t0 = time.monotonic()
        await produce_all(rig.settings.kafka_kwargs(), "queries", messages,
                          rate_per_s=RATE_PER_S, on_sent=on_sent)  # fmt: skip
        tally = reader.tally
        try:
            await await_until(lambda: all(q in tally.results for q in ids),
                              DEADLINE_S + 30, f"a Result for each of {N} queries")  # fmt: skip
        except AssertionError:
            pass
        await asyncio.sleep(2.0)
        elapsed = time.monotonic() - t0
        results = {q: tally.results.get(q, []) for q in ids}
        routed_to = {
            q: [d for d in tally.decisions.get(q, []) if d.get("status") == "routed"] for q in ids
        }

    lost = [q for q in ids if not results[q]]
    late = [
        q for q in ids
        if results[q] and results[q][0].get("finished_at", 0) - sent_at[q] > DEADLINE_S
    ]  # fmt: skip
    twice = [q for q in ids if len(results[q]) > 1]
    kinds: Counter[str] = Counter()
    for q in ids:
        for r in results[q][:1]:
            inst = r.get("instance_id") or "router"
            kinds[f"{inst.split('-', 1)[-1]} {'error' if r.get('error') else 'ok'}"] += 1
    after_kill = marks["killed"] + 2 * HEARTBEAT_S
    to_dead = sum(
        1 for q in ids for d in routed_to[q]
        if d.get("instance_id") == small and d.get("decided_at", 0) > after_kill
    )  # fmt: skip
    slowest = max(
        (results[q][0].get("finished_at", 0) - sent_at[q] for q in ids if results[q]), default=0.0
    )
    figures = {
        "queries_sent": N, "rate_per_s": RATE_PER_S, "lost": len(lost),
        "answered_twice": len(twice), "past_deadline": len(late), "deadline_s": DEADLINE_S,
        "slowest_answer_s": round(slowest, 1), "results_by_instance_and_kind": dict(kinds),
        "routed_to_killed_instance_after_two_heartbeats": to_dead,
        "heartbeat_s": HEARTBEAT_S, "freeze_s": FREEZE_S, "error_rate": ERROR_RATE,
        "elapsed_s": round(elapsed, 1),
        "command": "make test PYTEST_ARGS='tests/faults/test_engine_faults.py'",
    }  # fmt: skip
    write_figures("11_engine_faults", figures)
    print(figures)
    assert not lost, f"{len(lost)} without a Result, e.g. {lost[:5]}: {figures}"
    assert not late, f"{len(late)} answered after {DEADLINE_S:g} s: {figures}"
    assert not twice, figures
    assert all(w.alive() for w in rig.workers.values()), "a worker died"
    assert to_dead == 0, figures
