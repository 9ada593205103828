"""StateStore on a real Redis Cluster (3 primaries, 1 replica each).

A tour calls every public method of ``StateStore`` — so every Lua script and every pipeline
and multi-key command the project sends — against the cluster, recording each command: the
cluster itself rejects a ``CROSSSLOT`` command or a script reaching a key of another slot,
and the test checks that every script of ``state/lua`` and every method was covered (a new
one fails here until it is added to the tour). Snapshots of many instances stay one round
trip per node. Bad URLs and a cluster with an unserved slot fail at connect, naming the
problem.
"""

from __future__ import annotations

import hashlib
import inspect
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.crc import key_slot

from schemas import ResidentRequest, StepTimeCoefficients
from state import RouteIntent, Starts, StateConfigError, StateStore, StateUnavailable, period_id
from state.cluster import parse_cluster_url
from state.prefix import PrefixTouch
from state.store import SCRIPTS
from switchyard import clusters, services
from tests.clusters.conftest import Clusters


@pytest.fixture
async def store(local_redis: Clusters) -> AsyncIterator[StateStore]:
    s = await StateStore.connect(local_redis.redis_url, namespace="c" + uuid.uuid4().hex[:10])
    yield s
    await s.close()


class Recorder:
    """Every command the cluster client sends, directly or queued in a pipeline."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.commands: list[tuple[Any, ...]] = []
        direct, queued = RedisCluster.execute_command, ClusterPipeline.execute_command
        rec = self.commands

        async def run(client: Any, *args: Any, **kw: Any) -> Any:
            rec.append(args)
            return await direct(client, *args, **kw)

        def queue(pipe: Any, *args: Any, **kw: Any) -> Any:
            rec.append(args)
            return queued(pipe, *args, **kw)

        monkeypatch.setattr(RedisCluster, "execute_command", run)
        monkeypatch.setattr(ClusterPipeline, "execute_command", queue)

    def script_keys(self) -> list[tuple[str, list[str]]]:
        out = []
        for args in self.commands:
            if str(args[0]).upper() in ("EVALSHA", "EVAL"):
                n = int(args[2])
                out.append((str(args[1]), [str(k) for k in args[3 : 3 + n]]))
        return out


async def tour(s: StateStore) -> set[str]:
    """Call every public coroutine method of the store with realistic arguments."""
    called: set[str] = set()

    def mark(name: str) -> None:
        called.add(name)

    now = time.time()
    period = period_id(now, 3600)
    insts = [f"gpu-{i}" for i in range(12)]
    for iid in insts:
        await s.heartbeat(iid, "m", 60.0, 8, engine_running=1, engine_waiting=0,
                          engine_kv_usage=0.1)  # fmt: skip
    mark("heartbeat")
    r = ResidentRequest(
        query_id="q-1", prompt_tokens=100, predicted_output_tokens=20, arrived_at=now
    )
    await s.resident_add("gpu-0", r)
    mark("resident_add")
    await s.resident_progress("gpu-0", "q-1", 100, 5)
    mark("resident_progress")
    assert [x.query_id for x in await s.residents("gpu-0")] == ["q-1"]
    mark("residents")
    r2 = ResidentRequest(query_id="q-2", prompt_tokens=10, arrived_at=now)
    assert await s.residents_sync("gpu-0", [r, r2], view_at=now) >= 0
    mark("residents_sync")
    await s.resident_done("gpu-0", "q-2")
    mark("resident_done")
    assert await s.residents_reconcile("gpu-0", ["q-1"]) >= 0
    mark("residents_reconcile")
    touches = [
        PrefixTouch("gpu-0", [11, 12, 13], 16.0, 4096.0),
        PrefixTouch("gpu-1", [7], 16.0, 4096.0),
    ]
    assert len(await s.prefix_touch_many(touches)) == 2
    mark("prefix_touch_many")
    snaps = await s.snapshots(insts, now)
    assert set(snaps) == set(insts)
    held = snaps["gpu-0"].prefix_hashes
    assert held is not None and sorted(held.tolist()) == [11, 12, 13]  # read back in the snapshot
    mark("snapshots")
    coefficients = StepTimeCoefficients(
        c0_ms=1.0, c1_ms_per_token=0.01, c2_ms_per_ctx_token=0.001, c3_ms_per_attn_unit=0.0
    )
    assert (
        await s.step_time_publish(
            "tiny@cpu", coefficients, rows=10, instance_id="gpu-0", ttl_s=60.0
        )
        == 1
    )
    mark("step_time_publish")
    live, steps = await s.snapshots_and_step_times(insts, ["tiny@cpu", "other"], now)
    assert set(live) == set(insts) and set(steps) == {"tiny@cpu"}
    mark("snapshots_and_step_times")
    assert await s.reserve_slots("gpu-1", 2, ["a", "b", "c"]) == [True, True, False]
    mark("reserve_slots")
    assert sorted(await s.slots_held("gpu-1")) == ["a", "b"]
    mark("slots_held")
    await s.release_slots("gpu-1", ["a"])
    mark("release_slots")
    ok = await s.reserve_budget("tenant-a", period, 1.0, {"q-1": 0.3, "q-2": 0.3, "q-3": 0.5})
    assert ok == {"q-1": True, "q-2": True, "q-3": False}
    mark("reserve_budget")
    assert await s.settle("tenant-a", period, "q-1", 0.1)
    mark("settle")
    await s.release_budget("tenant-a", period, ["q-2"])
    mark("release_budget")
    st = await s.budget_status("tenant-a", period)
    assert abs(st.spent_usd - 0.1) < 1e-9 and st.n_settled == 1
    mark("budget_status")
    assert await s.ledger_mark() is None
    mark("ledger_mark")
    assert await s.ledger_lease("tok", 10.0) == "ours"
    mark("ledger_lease")
    assert await s.ledger_set_mark("tok", "rebuilt")
    mark("ledger_set_mark")
    assert await s.ledger_rebuild("tenant-b", period, 5.0, {"x-1": 0.2}, {"x-2": 0.4}) == (1, 1)
    mark("ledger_rebuild")
    sha = hashlib.sha256(b"body").hexdigest()
    assert await s.dedupe("d-1", sha, 60.0) == "new"
    mark("dedupe")
    assert (await s.dedupe_ex("d-1", sha, 60.0))[0] == "duplicate"
    mark("dedupe_ex")
    many = await s.dedupe_many([(f"d-{i}", sha) for i in range(200)], 60.0)
    assert many[1][0] == "duplicate" and {v for i, (v, _) in enumerate(many) if i != 1} == {"new"}
    mark("dedupe_many")
    assert await s.mark_routed("d-1", "gpu-0")
    mark("mark_routed")
    assert await s.mark_routed_many({f"d-{i}": "gpu-1" for i in range(2, 50)}) == 48
    mark("mark_routed_many")
    intents = {f"d-{i}": RouteIntent("gpu-2", '{"x":1}') for i in range(50, 90)}
    assert await s.mark_intent_many(intents) == {}  # none taken by another router
    mark("mark_intent_many")
    assert set(await s.intents([f"d-{i}" for i in range(40, 95)])) == set(intents)
    mark("intents")
    entry = await s.dedupe_entry("d-1")
    assert entry is not None
    mark("dedupe_entry")
    await s.forget("d-199")
    mark("forget")
    assert await s.mark_result("r-1", 60.0, cost_usd=0.01)
    mark("mark_result")
    assert (await s.result_mark("r-1")) is not None
    mark("result_mark")
    assert await s.has_result("r-1")
    mark("has_result")
    assert await s.has_results(["r-1", "r-2", "r-3"]) == [True, False, False]
    mark("has_results")
    assert await s.mark_start("r-9", "proc-a", 60.0) == Starts(number=1, processes=1)
    mark("mark_start")
    await s.reserve_slots("gpu-3", 4, ["f-1"])
    await s.reserve_budget("tenant-c", period, 1.0, {"f-1": 0.2})
    published, _ = await s.finish("gpu-3", "f-1", result_ttl_s=60.0, cost_usd=0.05,
                                  tenant="tenant-c", period_id=period)  # fmt: skip
    assert published
    mark("finish")
    assert (await s.claim_run("gpu-4", "k-1")) is not None
    mark("claim_run")
    assert len(await s.claim_rescue("gpu-4", ["k-1", "k-2"], "router-1", lease_s=5.0)) == 2
    mark("claim_rescue")
    assert len(await s.claim_rerouted("gpu-4", ["k-2"], "router-1")) == 1
    mark("claim_rerouted")
    assert len(await s.claim_returned("gpu-4", ["k-2"], "router-1")) == 1
    mark("claim_returned")
    assert await s.claim_state("gpu-4", "k-1") is not None
    mark("claim_state")
    await s.instance_down("gpu-5")
    mark("instance_down")
    await s.reset_instance("gpu-6")
    mark("reset_instance")
    assert await s.ping()
    mark("ping")
    return called


async def test_every_script_and_command_runs_on_the_cluster(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recorder(monkeypatch)
    called = await tour(store)
    public = {
        n
        for n, f in inspect.getmembers(StateStore, inspect.iscoroutinefunction)
        if not n.startswith("_") and n not in ("connect", "close")
    }
    assert public - called == set(), "add the new StateStore methods to the tour"
    # every script was sent, each with all its keys in one slot (the cluster enforced it too)
    sent = rec.script_keys()
    shas = {sha for sha, _ in sent}
    missing = [n for n in SCRIPTS if store._scripts[n].sha not in shas]
    assert missing == [], f"scripts never run on the cluster: {missing}"
    for sha, keys in sent:
        assert len({key_slot(k.encode()) for k in keys}) <= 1, (sha, keys)


async def test_snapshots_are_one_round_trip_per_node(
    store: StateStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    insts = [f"inst-{i}" for i in range(60)]
    for iid in insts:
        await store.heartbeat(iid, "m", 60.0, 8)
    trips: list[str] = []
    original = ClusterNode.execute_pipeline

    async def counted(node: ClusterNode, commands: Any) -> Any:
        trips.append(node.name)
        return await original(node, commands)

    monkeypatch.setattr(ClusterNode, "execute_pipeline", counted)
    snaps = await store.snapshots(insts, time.time())
    assert set(snaps) == set(insts)
    # 60 instances spread over the 3 primaries: one pipelined round trip to each
    assert len(trips) == len(set(trips)) == 3, trips


def test_cluster_url_parsing() -> None:
    u = parse_cluster_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001/0")
    assert u.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001)) and u.password == "pw"
    assert parse_cluster_url("rediss+cluster://h:1").tls
    for bad, why in [
        ("redis+cluster://h:1/3", "only database 0"),
        ("redis+cluster://h:x", "must be host:port"),
        ("redis+cluster://", "must be host:port"),
    ]:
        with pytest.raises(StateConfigError, match=why):
            parse_cluster_url(bad)


@pytest.fixture
def single_redis() -> Iterator[str]:
    home = Path(tempfile.mkdtemp(prefix="switchyard-single-"))
    try:
        yield services.redis_up(home=home, port=services.free_port(), appendfsync=None).address
    finally:
        services.down(home, purge=True)
        shutil.rmtree(home, ignore_errors=True)


async def test_cluster_url_at_a_single_redis_is_an_error(single_redis: str) -> None:
    hostport = single_redis.removeprefix("redis://").removesuffix("/0")
    with pytest.raises(StateConfigError, match="Redis Cluster at redis\\+cluster://"):
        await StateStore.connect(f"redis+cluster://{hostport}", socket_timeout_s=2.0)


async def test_unreachable_cluster_is_unavailable_not_misconfigured() -> None:
    url = f"redis+cluster://127.0.0.1:{services.free_port()}"
    with pytest.raises(StateUnavailable, match="unavailable during connect"):
        await StateStore.connect(url, socket_timeout_s=1.0)


async def test_plain_url_at_a_cluster_node_is_an_error(local_redis: Clusters) -> None:
    with pytest.raises(StateConfigError, match="is a Redis Cluster node: use a redis\\+cluster"):
        await StateStore.connect(local_redis.redis[0].address)


async def test_a_cluster_with_an_unserved_slot_is_refused(local_redis: Clusters) -> None:
    """A slot no primary serves (DELSLOTS on its owner): an error naming the slots, then back."""
    s = await StateStore.connect(local_redis.redis_url)
    await s.close()
    # a slot that holds no key (earlier tests' namespaces are random, so any slot may hold
    # one), and the primary that serves it
    owner, slot = None, -1
    for rec in local_redis.redis:
        c = redis.Redis.from_url(rec.address, decode_responses=True)
        try:
            if owner is None and c.execute_command("ROLE")[0] == "master":
                port = int(rec.address.rsplit(":", 1)[1].split("/")[0])
                for r in c.cluster("SLOTS"):
                    if int(r[2][1]) != port:
                        continue
                    for cand in range(int(r[0]), min(int(r[1]), int(r[0]) + 200) + 1):
                        if c.cluster("COUNTKEYSINSLOT", cand) == 0:
                            owner, slot = rec, cand
                            break
                    if owner is not None:
                        break
        finally:
            c.close()
    assert owner is not None
    c = redis.Redis.from_url(owner.address, decode_responses=True)
    try:
        c.execute_command("CLUSTER", "DELSLOTS", slot)
        with pytest.raises(
            StateConfigError, match=r"not healthy: cluster_state fail, 16383 of 16384"
        ):
            await StateStore.connect(local_redis.redis_url, socket_timeout_s=3.0)
    finally:
        c.execute_command("CLUSTER", "ADDSLOTS", slot)
        c.close()
    deadline = time.monotonic() + 30
    while not all(clusters.cluster_ok(r.address) for r in local_redis.redis if
                  clusters.redis_role(r.address) == "master"):  # fmt: skip
        assert time.monotonic() < deadline, "cluster did not heal after ADDSLOTS"
        time.sleep(0.2)
