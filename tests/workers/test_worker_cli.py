"""``switchyard worker`` as a process: settings from the environment, results published,
a clean exit on SIGTERM; a bad cluster file is refused with a message naming the problem."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from schemas import Decision, Query, RoutedQuery
from state import StateStore
from switchyard.client import SwitchyardClient
from wiring import topics

pytestmark = pytest.mark.integration


def _cluster_file(tmp_path: Path, iid: str) -> Path:
    path = tmp_path / "cluster.json"
    path.write_text(
        json.dumps(
            {
                "models": [
                    {
                        "name": "tiny",
                        "input_usd_per_token": 1e-6,
                        "output_usd_per_token": 2e-6,
                        "max_concurrency": 4,
                        "step_time": {
                            "c0_ms": 3,
                            "c1_ms_per_token": 0.01,
                            "c2_ms_per_ctx_token": 0,
                            "c3_ms_per_attn_unit": 0,
                        },
                    }
                ],
                "instances": [{"id": iid, "model": "tiny"}],
            }
        )
    )
    return path


def _env(kafka_bootstrap: str, redis_url: str, ns_prefix: str) -> dict[str, str]:
    """The services and a fresh Redis namespace for one worker subprocess."""
    return {
        **os.environ,
        "SWITCHYARD_KAFKA": kafka_bootstrap,
        "SWITCHYARD_REDIS": redis_url,
        "SWITCHYARD_NAMESPACE": ns_prefix + uuid.uuid4().hex[:6],
        "PYTHONUNBUFFERED": "1",
    }


def _worker_cmd(iid: str, cluster: Path, *extra: str) -> list[str]:
    """``switchyard worker`` on the sim backend for instance ``iid``."""
    return [sys.executable, "-m", "switchyard.cli", "worker", "--instance", iid,
            "--cluster", str(cluster), "--backend", "sim", *extra]  # fmt: skip


async def test_worker_command_runs_and_stops_cleanly(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    iid = "cli-" + uuid.uuid4().hex[:8]
    env = _env(kafka_bootstrap, redis_url, "cli")
    cmd = _worker_cmd(iid, _cluster_file(tmp_path, iid), "--time-scale", "4")
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        async with SwitchyardClient(kafka_bootstrap) as client:
            producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
            await producer.start()
            try:
                ids = []
                for i in range(3):
                    q = Query(id=f"{iid}-{i}", prompt="hello there", max_tokens=5)
                    d = Decision(
                        query_id=q.id,
                        tenant="default",
                        status="routed",
                        instance_id=iid,
                        policy="test",
                        decided_at=time.time(),
                    )
                    await producer.send_and_wait(
                        topics.route(iid),
                        RoutedQuery(query=q, decision=d).model_dump_json().encode(),
                    )
                    ids.append(q.id)
            finally:
                await producer.stop()
            for qid in ids:
                r = await client.result(qid, timeout_s=45)
                assert r.error is None and r.output_tokens == 5 and r.instance_id == iid
    finally:
        proc.send_signal(signal.SIGTERM)  # the process this test started, by pid
        rc = proc.wait(timeout=30)
    text = log.read_text()
    assert rc == 0, text
    assert f"worker {iid}: sim backend, model tiny, concurrency 4" in text
    assert "'results': 3" in text


def test_worker_command_refuses_a_bad_cluster_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"models": [], "instances": []}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "switchyard.cli",
            "worker",
            "--instance",
            "x",
            "--cluster",
            str(bad),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert f"error: {bad}:" in proc.stderr and "models" in proc.stderr


async def _mid_stream(store: StateStore, iid: str, ids: list[str], timeout_s: float) -> str:
    """A query the worker is decoding, far from its end and not answered: the moment to kill."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in await store.residents(iid):
            if 0 < r.decoded_tokens <= 33 and not await store.has_result(r.query_id):
                return r.query_id
        await asyncio.sleep(0.02)
    raise TimeoutError(f"no query of {ids} seen mid-stream on {iid} within {timeout_s} s")


async def _left_by(
    kafka_bootstrap: str, redis_url: str, namespace: str, iid: str, ids: list[str]
) -> tuple[int, list[str]]:
    """What a killed worker left: how many messages its group committed past, and the queries
    it started (an attempt mark) without marking their result — each is run again."""
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(topics.worker_group(iid))
    finally:
        await admin.close()
    done = sum(max(0, meta.offset) for meta in committed.values())
    store = await StateStore.connect(redis_url, namespace=namespace)
    r = aioredis.from_url(redis_url, decode_responses=True)
    try:
        started = [
            q for q in ids
            if int(await r.hget(store.keys.start(q), "#") or 0) >= 1 and not await store.has_result(q)
        ]  # fmt: skip
    finally:
        await r.aclose()
        await store.close()
    return done, started


async def test_kill_9_mid_stream_loses_nothing_and_counts_reruns(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """SIGKILL a worker with queries in flight, start another: every query gets a result,
    the queries started but not answered when it died are re-run (``Result.attempt`` 2), and
    the new worker reads exactly what the dead one had not committed.

    The kill is timed on the worker's own progress in Redis (a query mid-decode), not on a
    result reaching this test: on a loaded machine the first result could arrive after the
    worker had finished (and committed) more, or all, of the queries.
    """
    iid = "kill-" + uuid.uuid4().hex[:8]
    cluster = _cluster_file(tmp_path, iid)
    data = json.loads(cluster.read_text())
    data["models"][0]["max_concurrency"] = 2
    cluster.write_text(json.dumps(data))
    env = _env(kafka_bootstrap, redis_url, "kill")
    # 60 tokens of ~3 ms engine steps at 0.1x: ~1.8 s a query, so a kill mid-decode lands there
    cmd = _worker_cmd(iid, cluster, "--time-scale", "0.1", "--heartbeat-s", "0.2")

    def start(name: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / name, "wb") as out:
            return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    ids = [f"{iid}-{i}" for i in range(8)]
    first = start("first.log")
    second: subprocess.Popen[bytes] | None = None
    store = await StateStore.connect(redis_url, namespace=env["SWITCHYARD_NAMESPACE"])
    try:
        async with SwitchyardClient(kafka_bootstrap) as client:
            producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
            await producer.start()
            try:
                for qid in ids:
                    q = Query(id=qid, prompt="hello there", max_tokens=60)
                    d = Decision(
                        query_id=qid,
                        tenant="default",
                        status="routed",
                        instance_id=iid,
                        policy="test",
                        decided_at=time.time(),
                    )
                    await producer.send_and_wait(
                        topics.route(iid),
                        RoutedQuery(query=q, decision=d).model_dump_json().encode(),
                    )
            finally:
                await producer.stop()
            await client.result(ids[0], timeout_s=45)
            await _mid_stream(store, iid, ids, timeout_s=45)
            first.send_signal(signal.SIGKILL)  # the process this test started, by pid
            first.wait(timeout=10)
            committed, started = await _left_by(
                kafka_bootstrap, redis_url, env["SWITCHYARD_NAMESPACE"], iid, ids
            )
            second = start("second.log")
            results = {qid: await client.result(qid, timeout_s=45) for qid in ids}
    finally:
        await store.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=30)
    assert set(results) == set(ids) and all(
        r.error is None and r.output_tokens == 60 for r in results.values()
    )
    log = (tmp_path / "second.log").read_text()
    assert second is not None and second.returncode == 0, log
    counts = json.loads(log.rsplit("stopped: ", 1)[1].strip().replace("'", '"'))
    # killed mid-decode: at least that query was started and not answered
    assert 1 <= len(started) < len(ids), (started, counts)
    # exactly those ran again (on the engine when it died, or finished but not yet marked)
    assert counts["reruns"] == len(started), (started, counts)
    assert [r.attempt for r in results.values()].count(2) <= counts["reruns"]
    # every message past the dead worker's commit was read once: answered, or skipped as
    # answered already (published and marked, not yet committed)
    assert counts["results"] + counts["duplicates_skipped"] == len(ids) - committed, counts


async def test_worker_command_refuses_an_engine_serving_another_model(
    tmp_path: Path, kafka_bootstrap: str, redis_url: str
) -> None:
    """fake-vllm serves "other": the worker exits 1 naming both models, and never heart-beats."""
    from workers.fake_vllm import FakeVllmConfig, build_server, start_server

    iid = "wrong-" + uuid.uuid4().hex[:6]
    server = await start_server(
        build_server(profile="llama-2-7b-hf@h100", config=FakeVllmConfig(model="other"))
    )
    env = _env(kafka_bootstrap, redis_url, "wrong")
    try:
        cmd = [sys.executable, "-m", "switchyard.cli", "worker", "--instance", iid,
               "--cluster", str(_cluster_file(tmp_path, iid)), "--backend", "vllm",
               "--endpoint", server.url, "--heartbeat-s", "0.2"]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await server.stop()
    assert proc.returncode == 1, err.decode()
    assert "refuses to start" in err.decode() and "serves ['other'], not 'tiny'" in err.decode()
    store = await StateStore.connect(redis_url, namespace=env["SWITCHYARD_NAMESPACE"])
    try:
        live = await store.snapshots([iid], time.time())
    finally:
        await store.close()
    assert not live[iid].alive
