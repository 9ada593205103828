"""End to end on real Kafka and Redis: router → workers → fake vLLM servers → results.

2,000 queries (plus bad messages) through ``switchyard router`` (a test-only policy),
one ``switchyard worker`` per instance and three ``switchyard fake-vllm`` servers (small,
medium, large profiles; the large one fails 5% of its requests). Checks: every query
has exactly one Result, none lost or duplicated; the tight tenant's ledger never exceeds
its budget; no instance ever holds more capacity slots than its ``max_concurrency``; bad
messages land in ``dead-letters`` while the stream goes on; backend errors come back as
error Results.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from schemas import DeadLetter, Result
from state import StateStore, period_id
from switchyard import services
from switchyard.processes import ProcessGroup
from wiring import topics

pytestmark = pytest.mark.integration

N_DEFAULT = 1900
N_TIGHT = 100
MAX_CONCURRENCY = 24
TIGHT_BUDGET_USD = 0.004
TIERS = (("small", "llama-2-7b-hf@h100", 1e-7, 2e-7), ("medium", "internlm-20b@h100", 4e-7, 8e-7),
         ("large", "llama-2-70b-hf@h100", 1e-6, 2e-6))  # fmt: skip


def cluster_spec(rid: str, ports: dict[str, int]) -> dict[str, object]:
    return {
        "models": [
            {
                "name": name,
                "profile": profile,
                "input_usd_per_token": pin,
                "output_usd_per_token": pout,
                "max_concurrency": MAX_CONCURRENCY,
                "mean_output_tokens": 16,
            }
            for name, profile, pin, pout in TIERS
        ],  # fmt: skip
        "instances": [
            {"id": f"{rid}-{name}", "model": name, "endpoint": f"http://127.0.0.1:{ports[name]}"}
            for name, *_ in TIERS
        ],
        "tenants": [
            {"tenant": "default", "budget_usd": 1000.0, "period_s": 86400},
            {"tenant": "tight", "budget_usd": TIGHT_BUDGET_USD, "period_s": 86400},
        ],
    }


def http_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f} s")


async def partitions(bootstrap: str, names: list[str]) -> list[TopicPartition]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        described = await admin.describe_topics(names)
    finally:
        await admin.close()
    return [TopicPartition(t["topic"], p["partition"]) for t in described for p in t["partitions"]]


async def test_two_thousand_queries_end_to_end(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    rid = "e" + uuid.uuid4().hex[:6]
    ns = f"t{rid}"
    ports = {name: services.free_port() for name, *_ in TIERS}
    spec = cluster_spec(rid, ports)
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    env = dict(
        os.environ,
        SWITCHYARD_KAFKA=kafka_bootstrap,
        SWITCHYARD_REDIS=redis_url,
        SWITCHYARD_NAMESPACE=ns,
    )
    procs = ProcessGroup(tmp_path / "logs", env=env)
    store = await StateStore.connect(redis_url, namespace=ns)
    try:
        for name, profile, *_ in TIERS:
            args = ["fake-vllm", "--profile", profile, "--port", str(ports[name]), "--model", name,
                    "--time-scale", "20", "--mean-output-tokens", "16", "--seed", "1"]  # fmt: skip
            if name == "large":
                args += ["--error-rate", "0.05"]
            procs.switchyard(f"vllm-{name}", *args)
        for name in ports:
            await asyncio.to_thread(http_ready, f"http://127.0.0.1:{ports[name]}/v1/models")
        router = procs.switchyard(
            "router",
            "router", "--cluster", str(cluster_file), "--policy", "tests.streams.fake_router:factory",
            "--window-ms", "50", "--from", "latest", "--app-id", f"router-{rid}",
        )  # fmt: skip
        await asyncio.to_thread(procs.wait_for_line, router, "assigned queries partitions", 90)
        for inst in spec["instances"]:  # type: ignore[attr-defined]
            procs.switchyard(
                f"worker-{inst['id']}",
                "worker", "--instance", inst["id"], "--cluster", str(cluster_file), "--backend", "vllm",
                "--heartbeat-s", "0.5", "--log-level", "WARNING",
            )  # fmt: skip
        ids = [i["id"] for i in spec["instances"]]  # type: ignore[attr-defined]
        async with asyncio.timeout(60):
            while True:
                live = await store.snapshots(ids, time.time())
                if all(v.alive for v in live.values()):
                    break
                await asyncio.sleep(0.2)

        watch = await partitions(kafka_bootstrap, [topics.RESULTS, topics.DEAD_LETTERS])
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
        await consumer.start()
        consumer.assign(watch)
        await consumer.seek_to_end(*watch)
        for tp in watch:
            await consumer.position(tp)

        default_ids = [f"{rid}-q{i}" for i in range(N_DEFAULT)]
        tight_ids = [f"{rid}-t{i}" for i in range(N_TIGHT)]
        bad = [
            b"{broken",
            json.dumps({"id": f"{rid}-bad", "prompt": "x", "max_tokens": 0}).encode(),
            b"\xc3\x28",
        ]
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True, linger_ms=5
        )
        await producer.start()
        t_start = time.time()
        try:
            futures = []
            for i, qid in enumerate(default_ids):
                body = {"id": qid, "prompt": f"question {i}: " + "tell me about trains " * (1 + i % 20),
                        "max_tokens": 16, "created_at": time.time()}  # fmt: skip
                futures.append(
                    await producer.send(topics.QUERIES, json.dumps(body).encode(), key=qid.encode())
                )
                if i % 500 == 250:
                    futures.append(await producer.send(topics.QUERIES, bad[(i // 500) % len(bad)]))
            for qid in tight_ids:
                body = {
                    "id": qid,
                    "tenant": "tight",
                    "prompt": "an expensive question " * 30,
                    "max_tokens": 16,
                }
                futures.append(
                    await producer.send(topics.QUERIES, json.dumps(body).encode(), key=qid.encode())
                )
            await asyncio.gather(*futures)
        finally:
            await producer.stop()
        n_bad = sum(1 for i in range(N_DEFAULT) if i % 500 == 250)

        results: Counter[str] = Counter()
        by_id: dict[str, Result] = {}
        letters: list[DeadLetter] = []
        max_slots = 0
        wanted = set(default_ids) | set(tight_ids)
        try:
            # past the wait the assertions below name what is missing (not a bare TimeoutError)
            async with _waiting_at_most(150):
                while not (wanted <= set(by_id) and len(letters) >= n_bad):
                    batch = await consumer.getmany(timeout_ms=300, max_records=5000)
                    for tp, records in batch.items():
                        for r in records:
                            if tp.topic == topics.DEAD_LETTERS:
                                letters.append(DeadLetter.model_validate_json(r.value))
                            else:
                                res = Result.model_validate_json(r.value)
                                if res.query_id in wanted:
                                    results[res.query_id] += 1
                                    by_id[res.query_id] = res
                    for iid in ids:
                        max_slots = max(max_slots, len(await store.slots_held(iid)))
            await asyncio.sleep(2.0)  # anything duplicated would arrive now
            batch = await consumer.getmany(timeout_ms=1000, max_records=10000)
            for tp, records in batch.items():
                for r in records:
                    if tp.topic == topics.RESULTS:
                        res = Result.model_validate_json(r.value)
                        if res.query_id in wanted:
                            results[res.query_id] += 1
        finally:
            await consumer.stop()
        elapsed = time.time() - t_start

        for child in procs.children:
            assert child.alive(), f"{child.name} died:\n{child.tail()}"
        missing = wanted - set(by_id)
        assert not missing, f"{len(missing)} queries without a Result, e.g. {sorted(missing)[:5]}"
        dupes = [q for q, n in results.items() if n > 1]
        assert not dupes, f"{len(dupes)} queries with more than one Result, e.g. {dupes[:5]}"
        assert max_slots <= MAX_CONCURRENCY
        status = await store.budget_status("tight", period_id(time.time(), 86400))
        assert status.committed_usd <= TIGHT_BUDGET_USD + 1e-9
        tight_ran = [q for q in tight_ids if by_id[q].instance_id]
        tight_refused = [q for q in tight_ids if not by_id[q].instance_id]
        reasons = Counter((by_id[q].error or "")[:90] for q in tight_refused)
        assert tight_ran and tight_refused, (
            f"the tight budget should let some but not all through: {reasons}"
        )
        reasons = Counter((by_id[q].error or "")[:60] for q in tight_refused)
        assert all("budget" in (by_id[q].error or "") for q in tight_refused), reasons
        engine_errors = [r for r in by_id.values() if r.instance_id and r.error]
        assert engine_errors, "the failing backend's errors must come back as error Results"
        assert all(r.instance_id == f"{rid}-large" for r in engine_errors)
        refused = Counter(
            (r.error or "")[:70]
            for r in by_id.values()
            if not r.instance_id and r.query_id not in tight_ids
        )
        assert not refused, refused
        ok = [r for r in by_id.values() if r.ok]
        assert len(ok) > 0.8 * N_DEFAULT and all(r.output_tokens > 0 for r in ok)
        assert len([d for d in letters if d.topic == topics.QUERIES]) >= n_bad
        assert all(d.reason for d in letters)
        print(
            f"end to end: {len(wanted)} queries in {elapsed:.1f} s, {len(engine_errors)} engine errors"
        )
    finally:
        procs.stop_all()
        await store.close()


@contextlib.asynccontextmanager
async def _waiting_at_most(seconds: float) -> AsyncIterator[None]:
    """``asyncio.timeout(seconds)`` whose expiry ends the wait quietly."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            yield
