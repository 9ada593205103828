"""Worker faults: scenario 2 (``kill -9`` a worker mid-stream) and 5 (an instance stops
heart-beating).

One rig per module: a broker and Redis this module owns, a real ``switchyard router`` and
one real ``switchyard worker --backend sim`` per instance (the simulated engine in wall-clock
time), all subprocesses stopped by pid at teardown. Every query's fate is read back from
``results`` (one ``Result`` per query id expected) and ``route.*``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fault_harness import (
    HarnessError,
    OwnedServices,
    Proc,
    Procs,
    TopicReader,
    await_until,
    cluster_spec,
    policy_name,
    produce_all,
    service_env,
    start_router,
    wait_router_ready,
    wait_until,
    write_cluster,
    write_figures,
)

from wiring.settings import Settings

pytestmark = pytest.mark.faults

HEARTBEAT_S = 0.5
# the router re-routes the unstarted queue of an instance silent this long after its
# heartbeat expired: two heartbeat TTLs (a worker's TTL is three heartbeats)
RESCUE_GRACE_S = 2 * 3 * HEARTBEAT_S
SILENT: dict[str, Any] = {}  # the silent-instance test's figures, for the requirement below
TIME_SCALE = 20.0  # engine seconds per wall second: a 32-token answer takes a few ms


@dataclass
class Rig:
    owned: OwnedServices
    procs: Procs
    settings: Settings
    cluster: Any
    cluster_file: Any
    router: Proc
    policy: str
    workers: dict[str, Proc] = field(default_factory=dict)

    def start_worker(self, instance_id: str, extra: list[str] | None = None) -> Proc:
        proc = self.procs.start(
            f"worker-{instance_id}",
            [
                "worker",
                "--instance",
                instance_id,
                "--cluster",
                str(self.cluster_file),
                "--backend",
                "sim",
                "--time-scale",
                f"{TIME_SCALE:g}",
                "--heartbeat-s",
                f"{HEARTBEAT_S:g}",
                "--log-level",
                "WARNING",
                *(extra or []),
            ],
        )
        self.workers[instance_id] = proc
        return proc


async def claim_states(settings: Settings, instance_id: str, qids: list[str]) -> dict[str, str]:
    """Each query's claim on ``instance_id``'s copy (``run``, ``rescue …``, ``rerouted …``, ``-``)."""
    from state.store import StateStore

    store = await StateStore.connect(**settings.redis_kwargs(), socket_timeout_s=3.0)
    try:
        return {q: (await store.claim_state(instance_id, q) or "-") for q in qids}
    finally:
        await store.close()


async def alive_instances(settings: Settings, ids: list[str]) -> dict[str, bool]:
    from state.store import StateStore

    store = await StateStore.connect(**settings.redis_kwargs(), socket_timeout_s=3.0)
    try:
        live = await store.snapshots(ids, time.time())
        return {i: bool(live[i].alive) if i in live else False for i in ids}
    finally:
        await store.close()


def wait_alive(rig: Rig, ids: list[str], timeout_s: float = 90.0) -> float:
    def up() -> bool:
        for i in ids:
            rig.workers[i].check_alive()
        return all(asyncio.run(alive_instances(rig.settings, ids)).values())

    return wait_until(up, timeout_s, f"workers {ids} to heart-beat", poll_s=0.3)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    home = tmp_path_factory.mktemp("workers")
    owned = OwnedServices.start(home)
    procs: Procs | None = None
    try:
        prefix = "w" + uuid.uuid4().hex[:5]
        cluster_file = home / "cluster.json"
        cluster = write_cluster(
            cluster_file, cluster_spec(prefix, max_concurrency=16, tenants={"default": 1e6})
        )
        env = service_env(owned, namespace=prefix)
        procs = Procs(home / "logs", env)
        policy = policy_name("shortest-queue", cluster)
        router = start_router(
            procs, cluster_file, policy, wait_s=0, extra=["--rescue-grace-s", f"{RESCUE_GRACE_S:g}"]
        )
        r = Rig(owned, procs, Settings.from_env(env), cluster, cluster_file, router, policy)
        for inst in cluster.instances:
            r.start_worker(inst.id)
        wait_router_ready(router)
        wait_alive(r, [i.id for i in cluster.instances])
        yield r
    finally:
        if procs is not None:
            procs.stop_all()
        owned.down()


def _queries(run_id: str, n: int, max_tokens: int = 32) -> list[tuple[bytes, bytes]]:
    return [
        (
            f"{run_id}-{i}".encode(),
            f'{{"id": "{run_id}-{i}", "prompt": "question {i} about faults", '
            f'"max_tokens": {max_tokens}}}'.encode(),
        )
        for i in range(n)
    ]


def _result_counts(reader: TopicReader, ids: list[str]) -> tuple[set[str], set[str], int]:
    """(ids without a result, ids with more than one, error results)."""
    res = reader.tally.results
    lost = {q for q in ids if q not in res}
    dup = {q for q in ids if len(res.get(q, [])) > 1}
    errors = sum(1 for q in ids for r in res.get(q, []) if r.get("error"))
    return lost, dup, errors


N_WORKER_RUN = 1_500
RATE = 300.0


async def test_worker_kill9_mid_stream_loses_no_result(rig: Rig) -> None:
    victim = rig.cluster.instances[0].id
    run_id = "wk-" + uuid.uuid4().hex[:6]
    messages = _queries(run_id, N_WORKER_RUN)
    ids = [k.decode() for k, _ in messages]
    marks: dict[str, float] = {}
    restarted: list[Proc] = []

    def on_sent(i: int) -> None:
        if i == N_WORKER_RUN * 2 // 5:
            old = rig.workers[victim]
            old.kill9()
            marks["killed"] = time.monotonic()
            marks["killed_wall"] = time.time()
            # at INFO: each copy it skips, and why, is in its log (bug 21 was silent at WARNING)
            restarted.append(rig.start_worker(victim, ["--log-level", "INFO"]))

    async with TopicReader(rig.settings.kafka_kwargs(), ["results", "decisions"]) as reader:
        t0 = time.monotonic()
        await produce_all(
            rig.settings.kafka_kwargs(), "queries", messages, rate_per_s=RATE, on_sent=on_sent
        )
        assert restarted, "the worker was never killed"

        def first_result_after_restart() -> bool:
            restarted[0].check_alive()
            return any(
                r.get("instance_id") == victim and r.get("finished_at", 0) > marks["killed_wall"]
                for rs in list(reader.tally.results.values())
                for r in rs
            )

        recover_s = await await_until(
            first_result_after_restart, 120, f"a result from the restarted worker {victim}"
        )
        recovered_at = time.monotonic()

        def all_answered() -> bool:
            rig.router.check_alive()
            reader.check()
            return all(q in reader.tally.results for q in ids)

        try:
            await await_until(all_answered, 180, f"a result for each of {N_WORKER_RUN} queries")
        except AssertionError as exc:
            lost, _, _ = _result_counts(reader, ids)
            claims = await claim_states(rig.settings, victim, sorted(lost)[:20])
            pytest.fail(
                f"{exc}: {len(lost)} without a result, e.g. {sorted(lost)[:5]}; their claims on "
                f"{victim}: {claims}; router log:\n{rig.router.tail(1500)}\n"
                f"worker log:\n{restarted[0].tail(3000)}"
            )
        done = time.monotonic()
        await asyncio.sleep(1.0)  # late duplicates
        lost, dup, errors = _result_counts(reader, ids)
        routed_to_victim = sum(
            1 for q in ids for topic, _ in reader.tally.routed.get(q, []) if topic.endswith(victim)
        )

    write_figures(
        "2_worker_kill9",
        {
            "policy": rig.policy,
            "queries_sent": N_WORKER_RUN,
            "routed_to_killed_instance": routed_to_victim,
            "results_lost": len(lost),
            "duplicated_inference": len(dup),
            "error_results": errors,
            "kill_to_first_result_s": round(recovered_at - marks["killed"] + 0 * recover_s, 1),
            "kill_to_all_results_s": round(done - marks["killed"], 1),
            "elapsed_s": round(done - t0, 1),
            "command": "make test PYTEST_ARGS='tests/faults/test_worker_faults.py -k kill9'",
        },
    )
    assert not lost, f"{len(lost)} results lost, e.g. {sorted(lost)[:5]}"
    assert errors == 0, f"{errors} error results"


N_SILENT_RUN = 600
SILENT_RATE = 100.0


async def test_silent_instance_is_excluded_and_its_queue_rerouted(rig: Rig) -> None:
    """SIGSTOP a worker (by pid): its heartbeats stop while its process and queue remain.

    The router excludes it once its heartbeat expires; ``RESCUE_GRACE_S`` later its rescuer
    re-routes the copies the frozen worker had not started (claims in Redis); the copies it
    had started stay with it (re-running them would duplicate inference) and are answered
    after ``SIGCONT``, when it also skips the copies re-routed elsewhere.
    """
    victim = rig.cluster.instances[-1].id
    proc = rig.workers[victim]
    run_id = "hb-" + uuid.uuid4().hex[:6]
    messages = _queries(run_id, N_SILENT_RUN, max_tokens=64)
    ids = [k.decode() for k, _ in messages]
    marks: dict[str, float] = {}

    def on_sent(i: int) -> None:
        if i == N_SILENT_RUN // 3:
            os.kill(proc.pid, signal.SIGSTOP)
            marks["stopped_wall"] = time.time()

    try:
        async with TopicReader(rig.settings.kafka_kwargs(), ["results", "decisions"]) as reader:
            producing = asyncio.create_task(
                produce_all(
                    rig.settings.kafka_kwargs(),
                    "queries",
                    messages,
                    rate_per_s=SILENT_RATE,
                    on_sent=on_sent,
                )
            )
            await await_until(lambda: "stopped_wall" in marks, 60, "the worker to be stopped")

            async def excluded() -> float:
                while True:
                    alive = await alive_instances(rig.settings, [victim])
                    if not alive[victim]:
                        return time.time()
                    if time.time() - marks["stopped_wall"] > 30:
                        raise HarnessError(f"{victim} still alive 30 s after its worker stopped")
                    await asyncio.sleep(0.05)

            excluded_wall = await excluded()
            await producing
            await asyncio.sleep(2.0)
            to_victim_after = [
                d
                for q in ids
                for d in reader.tally.ok_routed_decisions(q)
                if d.get("instance_id") == victim and d["decided_at"] > excluded_wall
            ]
            stranded_before = {
                q
                for q in ids
                for d in reader.tally.ok_routed_decisions(q)
                if d.get("instance_id") == victim and d["decided_at"] <= excluded_wall
            }

            def others_answered() -> bool:
                return all(q in reader.tally.results for q in ids if q not in stranded_before)

            await await_until(
                others_answered, 120, "results for every query not sent to the stopped instance"
            )
            # its queued (unstarted) queries must be re-routed and answered without it coming
            # back; the ones it had started (claimed to run there) wait for it
            unstarted_answered_s: float | None = None
            deadline = time.monotonic() + 20
            while True:
                waiting = sorted(q for q in stranded_before if q not in reader.tally.results)
                claims = await claim_states(rig.settings, victim, waiting)
                if all(c == "run" for c in claims.values()):
                    unstarted_answered_s = time.time() - marks["stopped_wall"]
                    break
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            unanswered_while_stopped = {q for q in stranded_before if q not in reader.tally.results}
            claims = await claim_states(rig.settings, victim, sorted(stranded_before))
            answered_while_stopped = {q for q in stranded_before if q in reader.tally.results}
            os.kill(proc.pid, signal.SIGCONT)
            marks["resumed"] = time.time()
            await await_until(
                lambda: all(q in reader.tally.results for q in ids),
                120,
                "every query answered once the stopped worker resumed",
            )
            await asyncio.sleep(1.0)
            lost, dup, errors = _result_counts(reader, ids)
            rerouted_at = {
                q: min(d["decided_at"] for d in rerouted)
                for q in stranded_before
                if (rerouted := [
                    d for d in reader.tally.ok_routed_decisions(q)
                    if "rerouted" in d.get("flags", []) and d.get("instance_id") != victim
                ])
            }  # fmt: skip
            answered_by_victim = {
                q for q in rerouted_at for r in reader.tally.results.get(q, [])
                if r.get("instance_id") == victim
            }  # fmt: skip
    finally:
        if proc.alive():
            os.kill(proc.pid, signal.SIGCONT)

    # started by the frozen worker before the stop (claimed to run there): only it can answer
    started_at_stop = {q for q in unanswered_while_stopped if claims.get(q) == "run"}
    queued_not_rerouted = unanswered_while_stopped - started_at_stop
    rerouted_in = sorted(t - marks["stopped_wall"] for t in rerouted_at.values())
    exclusion_s = excluded_wall - marks["stopped_wall"]
    write_figures(
        "5_heartbeat_stop",
        {
            "policy": rig.policy,
            "queries_sent": N_SILENT_RUN,
            "heartbeat_interval_s": HEARTBEAT_S,
            "stop_to_excluded_s": round(exclusion_s, 2),
            "decisions_to_instance_after_exclusion": len(to_victim_after),
            "rescue_grace_s": RESCUE_GRACE_S,
            "routed_to_it_before_exclusion": len(stranded_before),
            "answered_while_stopped": len(answered_while_stopped),
            "rerouted": len(rerouted_at),
            "rerouted_answered_while_stopped": len(set(rerouted_at) & answered_while_stopped),
            "rerouted_but_also_answered_by_stopped_instance": len(answered_by_victim),
            "started_at_stop_answered_after_resume": len(started_at_stop),
            "queued_not_rerouted": len(queued_not_rerouted),
            "stop_to_first_rerouted_s": round(rerouted_in[0], 2) if rerouted_in else None,
            "stop_to_last_rerouted_s": round(rerouted_in[-1], 2) if rerouted_in else None,
            "stop_to_all_unstarted_answered_s": (
                None if unstarted_answered_s is None else round(unstarted_answered_s, 2)
            ),
            "results_lost": len(lost),
            "duplicated_inference": len(dup),
            "error_results": errors,
            "command": "make test PYTEST_ARGS='tests/faults/test_worker_faults.py -k silent'",
        },
    )
    SILENT.update(
        queued_not_rerouted=sorted(queued_not_rerouted),
        started=len(started_at_stop),
        rerouted=len(rerouted_at),
        victim=victim,
        claims={q: claims.get(q) for q in sorted(queued_not_rerouted)[:5]},
        duplicated=sorted(dup),
        answered_by_victim=sorted(answered_by_victim),
    )
    assert not lost, f"{len(lost)} results lost after the worker resumed"
    assert not to_victim_after, (
        f"{len(to_victim_after)} queries routed to {victim} after its heartbeat expired"
    )
    # the first missed heartbeat is due at most one interval after the stop: excluded
    # within two intervals of it means within three of the stop (+ polling slack)
    assert exclusion_s <= 3 * HEARTBEAT_S + 0.5, (
        f"{victim} excluded {exclusion_s:.2f} s after its worker stopped "
        f"(heartbeat every {HEARTBEAT_S} s)"
    )


def test_silent_instance_queue_rerouted() -> None:
    """Every copy the silent instance had not started was re-routed and answered while it
    was stopped; after ``SIGCONT`` its worker ran none of them again."""
    if not SILENT:
        pytest.skip("the silent-instance test did not run")
    victim, queued = SILENT["victim"], SILENT["queued_not_rerouted"]
    assert not queued, (
        f"{len(queued)} queries queued (not started) on the silent instance {victim} were "
        f"not re-routed and answered while it was stopped, e.g. {queued[:5]} "
        f"(claims {SILENT['claims']}; {SILENT['rerouted']} were re-routed)"
    )
    assert not SILENT["answered_by_victim"], (
        f"re-routed queries also run by {victim} after it resumed: {SILENT['answered_by_victim']}"
    )
    assert not SILENT["duplicated"], f"duplicated inference: {SILENT['duplicated'][:5]}"
