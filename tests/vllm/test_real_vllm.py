"""End to end on two REAL vLLM servers (CPU build, random weights): router → workers → vLLM.

Kafka, Redis, ``switchyard router`` (the default policy, batch-ilp-sfs, with the default
quality predictor read through each model's ``quality_as``), one ``switchyard worker
--backend vllm`` per instance of ``configs/clusters/real-vllm-cpu.yaml`` and one ``vllm
serve`` per instance (``switchyard.vllm_servers``). 240 queries, completions and chat, prompt
lengths from the Azure LLM 2023 conversation trace (its first 240 rows), scaled so the longest
is ~600 tokens (below both servers' ``max_model_len``): exactly one Result each, TTFT
measured, token counts from vLLM's usage chunk, cost from usage. A prompt past the context
window (its producer under-declares ``prompt_tokens``, so the router routes it) comes back as
an error Result carrying vLLM's 400 message. Also: the real ``openai`` SDK against a server.

Workers against the real servers: one configured for the other model refuses to start
(exit 1, no heartbeat), and one whose server is frozen (SIGSTOP) drops its instance from
the live set within a heartbeat and a health-probe timeout, and is back once it answers.
Last (its server stays dead): reliability scenario 11 on real servers, a server frozen for
10 s and then ``SIGKILL``'d mid-stream under traffic: one Result per query within its
deadline, the instance out of the live set within two heartbeats each time.

Slow (servers take ~35-180 s to load); ``make test`` runs this module last (marker ``vllm``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from schemas import ClusterConfig, Result
from sim.traffic import load_trace
from state import StateStore
from switchyard import services, vllm_servers
from switchyard.processes import Child, ProcessGroup
from wiring import topics
from wiring.paths import vendored_data

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

N_QUERIES = 240
WORDS = "the train leaves the yard at noon and every car is sorted by its track".split()


@pytest.fixture(scope="module")
def vllm_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-home")


@pytest.fixture(scope="module")
def real_servers(vllm_home: Path) -> Iterator[ClusterConfig]:
    home = vllm_home
    cluster = ClusterConfig.from_file(vllm_servers.DEFAULT_CLUSTER)
    records = vllm_servers.vllm_up(cluster, home=home, free_ports=True)
    try:
        yield vllm_servers.with_endpoints(cluster, records)
    finally:
        vllm_servers.vllm_down(home)
        assert not vllm_servers.vllm_down(home)


def _trace_words(n: int, longest_words: int = 430) -> list[int]:
    """Prompt lengths (words of ~1.4 tokens) of the Azure conv trace's first ``n`` rows,
    scaled so the longest gets ``longest_words`` (~600 tokens, under narrow-0's 1024)."""
    trace = load_trace(vendored_data("profiles", "traces", "azure_llm_2023_conv_first4000.csv.gz"))
    tokens = trace.input_tokens[:n]
    return [max(1, round(int(t) * longest_words / int(tokens.max()))) for t in tokens]


def _prompt(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def _namespaced(
    real_servers: ClusterConfig, rid: str, tmp_path: Path
) -> tuple[ClusterConfig, Path]:
    """The servers' cluster with instance ids of this test's own, written for the CLI."""
    spec = real_servers.model_dump(mode="json", exclude_none=True)
    for inst in spec["instances"]:
        inst["id"] = f"{rid}-{inst['id']}"
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    return ClusterConfig.model_validate(spec), cluster_file


def _env(kafka_bootstrap: str, redis_url: str, rid: str) -> dict[str, str]:
    return dict(os.environ, SWITCHYARD_KAFKA=kafka_bootstrap, SWITCHYARD_REDIS=redis_url,
                SWITCHYARD_NAMESPACE=f"t{rid}")  # fmt: skip


async def _router_and_workers(
    procs: ProcessGroup, store: StateStore, cluster_file: Path, ids: list[str], rid: str,
    *, max_hold_s: float, heartbeat_s: float, log_level: str,
) -> None:  # fmt: skip
    """The default policy's router and one ``vllm`` worker per instance; back once all live."""
    router = procs.switchyard(
        "router",
        "router", "--cluster", str(cluster_file),  # the default policy, batch-ilp-sfs
        "--window-ms", "50", "--from", "latest", "--app-id", f"router-{rid}",
        "--max-hold-s", str(max_hold_s),
    )  # fmt: skip
    await asyncio.to_thread(procs.wait_for_line, router, "assigned queries partitions", 90)
    for iid in ids:
        procs.switchyard(
            f"worker-{iid}",
            "worker", "--instance", iid, "--cluster", str(cluster_file), "--backend", "vllm",
            "--heartbeat-s", str(heartbeat_s), "--log-level", log_level,
        )  # fmt: skip
    async with asyncio.timeout(90):
        while not all(v.alive for v in (await store.snapshots(ids, time.time())).values()):
            await asyncio.sleep(0.2)


async def _results_consumer(kafka_bootstrap: str) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(
        topics.RESULTS, bootstrap_servers=kafka_bootstrap, enable_auto_commit=False,
        auto_offset_reset="latest", group_id=None,
    )  # fmt: skip
    await consumer.start()
    await consumer.seek_to_end()
    return consumer


def test_openai_sdk_against_real_vllm(real_servers: ClusterConfig) -> None:
    import openai

    inst = real_servers.instances[0]
    model = real_servers.model(inst.model)
    client = openai.OpenAI(base_url=f"{inst.endpoint}/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [model.name]
    stream = client.chat.completions.create(
        model=model.name,
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(
            model=model.name, prompt="word " * (2 * (model.max_model_len or 0)), max_tokens=4
        )


async def test_the_worker_reads_real_vllms_prefix_counters(real_servers: ClusterConfig) -> None:
    """Issue 14 item 3 on the real engine: a turn that extends the previous one's prompt is
    a prefix hit on the server with prefix caching on (``wide-0``), none on the one with it
    off (``narrow-0``); ``VllmBackend.engine_load`` reads the counters the worker's
    ``PrefixReconciler`` takes, and the reconciler reports the engine's hit rate."""
    from schemas import Query
    from workers.backends.base import GenerationRequest
    from workers.backends.vllm import VllmBackend, VllmConfig
    from workers.prefix_reconcile import PrefixReconciler

    rng = random.Random(14)
    first = f"[{uuid.uuid4().hex}] " + _prompt(rng, 300)  # ~400 tokens: 3 whole 128-token blocks
    second = first + " " + _prompt(rng, 60)
    for inst in real_servers.instances:
        spec = real_servers.model(inst.model)
        be = VllmBackend(VllmConfig(endpoint=str(inst.endpoint), model=spec.name))
        await be.start()
        try:
            before = (await be.engine_load()).prefix_counters
            if before is None:  # an engine may leave the counters out with caching off
                assert not spec.scheduler.prefix_caching, f"{inst.id}: no vllm:prefix_cache_*"
                continue
            rec = PrefixReconciler(1e6, 1e6)
            rec.scrape(before)
            cached: list[int | None] = []
            for i, text in enumerate((first, second)):
                q = Query(id=f"px{i}", prompt=text, max_tokens=2)
                gen = await be.generate(GenerationRequest(q, uuid.uuid4().hex, 400, 2),
                                        lambda p, d: None)  # fmt: skip
                assert gen.error is None, gen.error
                cached.append(gen.cached_tokens)  # the usage chunk's, which the worker bills
            after = (await be.engine_load()).prefix_counters
            assert after is not None
            hits = after[1] - before[1]
            rec.scrape(after)
            if spec.scheduler.prefix_caching:
                assert after[0] > before[0] and hits >= 3 * 128, (before, after)
                assert rec.engine_hit_rate is not None and rec.engine_hit_rate > 0
                assert cached[0] in (0, None) and (cached[1] or 0) >= 3 * 128, cached
            else:
                assert hits == 0, (before, after)
                assert cached == [0, 0] or cached == [None, None], cached
        finally:
            await be.close()


def test_servers_run_their_engines_on_separate_cores(
    real_servers: ClusterConfig, vllm_home: Path
) -> None:
    """vLLM's own ``auto`` bind would pin both engines to one core; each has its own here."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("a user-set bind, or a single CPU: nothing to separate")
    cores: dict[str, str] = {}
    for rec in services.load_records(vllm_home).values():
        if rec.name.startswith(vllm_servers.RECORD_PREFIX):
            text = Path(rec.log).read_text(errors="replace")
            found = re.findall(r"local_rank=0, core ids=\[([0-9, ]+)\]", text)
            assert found, f"{rec.name}: no OpenMP binding line in {rec.log}"
            cores[rec.name] = found[-1]
    assert len(cores) >= 2
    sets = [set(v.replace(" ", "").split(",")) for v in cores.values()]
    assert all(a.isdisjoint(b) for i, a in enumerate(sets) for b in sets[i + 1 :]), cores


async def test_router_workers_real_vllm(
    real_servers: ClusterConfig, kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    rid = "v" + uuid.uuid4().hex[:6]
    cluster, cluster_file = _namespaced(real_servers, rid, tmp_path)
    procs = ProcessGroup(tmp_path / "logs", env=_env(kafka_bootstrap, redis_url, rid))
    store = await StateStore.connect(redis_url, namespace=f"t{rid}")
    ids = [i.id for i in cluster.instances]
    try:
        # 240 at once on 24 slots of two one-thread engines: on a loaded machine the last
        # ones wait minutes for a slot (held, not given up; their SLO is as long)
        await _router_and_workers(
            procs, store, cluster_file, ids, rid, max_hold_s=300, heartbeat_s=0.5,
            log_level="WARNING",
        )  # fmt: skip
        consumer = await _results_consumer(kafka_bootstrap)
        rng = random.Random(18)
        bodies: dict[str, dict[str, object]] = {}
        for i, n_words in enumerate(_trace_words(N_QUERIES)):
            qid = f"{rid}-q{i}"
            text = f"q{i}: " + _prompt(rng, n_words)
            body: dict[str, object] = {"id": qid, "max_tokens": 8, "created_at": time.time(),
                                       "ttft_slo_ms": 300_000}  # fmt: skip
            if i % 2:
                body["messages"] = [{"role": "user", "content": text}]
            else:
                body["prompt"] = text
            bodies[qid] = body
        too_long = f"{rid}-long"  # ~3,000 real tokens, declared as 50
        bodies[too_long] = {"id": too_long, "prompt": _prompt(rng, 3000), "prompt_tokens": 50,
                            "max_tokens": 8, "ttft_slo_ms": 300_000}  # fmt: skip
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=5)
        await producer.start()
        t0 = time.time()
        try:
            futs = [await producer.send(topics.QUERIES, json.dumps(b).encode(), key=q.encode())
                    for q, b in bodies.items()]  # fmt: skip
            await asyncio.gather(*futs)
        finally:
            await producer.stop()
        counts: Counter[str] = Counter()
        by_id: dict[str, Result] = {}
        try:
            async with asyncio.timeout(420):
                while set(bodies) - set(by_id):
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        for r in records:
                            res = Result.model_validate_json(r.value)
                            if res.query_id in bodies:
                                counts[res.query_id] += 1
                                by_id[res.query_id] = res
            elapsed = time.time() - t0
            await asyncio.sleep(2.0)  # a duplicate would arrive now
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                for r in records:
                    res = Result.model_validate_json(r.value)
                    if res.query_id in bodies:
                        counts[res.query_id] += 1
        finally:
            await consumer.stop()

        for child in procs.children:
            assert child.alive(), f"{child.name} died:\n{child.tail()}"
        assert not [q for q, n in counts.items() if n != 1], "a query with more than one Result"
        long_res = by_id.pop(too_long)
        assert not long_res.ok and long_res.instance_id, long_res
        assert "maximum context length" in (long_res.error or ""), long_res.error
        bad = {q: r.error for q, r in by_id.items() if not r.ok}
        assert not bad, f"{len(bad)} failed: {list(bad.items())[:3]}"
        assert {r.instance_id for r in by_id.values()} == set(ids)
        models = {m.name: m for m in cluster.models}
        for r in by_id.values():
            assert r.ttft_ms is not None and 0 < r.ttft_ms <= (r.e2e_ms or 0)
            assert r.prompt_tokens > 0 and 1 <= r.output_tokens <= 8
            want = models[r.model].cost_usd(r.prompt_tokens, r.output_tokens)
            assert r.cost_usd == pytest.approx(want, rel=1e-6)
        ttfts = sorted(r.ttft_ms or 0.0 for r in by_id.values())
        print(
            f"real vLLM: {len(by_id)} queries in {elapsed:.1f} s, TTFT p50 "
            f"{statistics.median(ttfts):.0f} ms, max {ttfts[-1]:.0f} ms, prompt tokens "
            f"{min(r.prompt_tokens for r in by_id.values())}-{max(r.prompt_tokens for r in by_id.values())}"
        )
    finally:
        procs.stop_all()
        await store.close()


async def test_workers_refuse_another_model_and_follow_a_frozen_engine(
    real_servers: ClusterConfig, vllm_home: Path, kafka_bootstrap: str, redis_url: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    rid = "f" + uuid.uuid4().hex[:6]
    wide, narrow = real_servers.instances[0], real_servers.instances[1]
    assert wide.model != narrow.model
    spec = real_servers.model_dump(mode="json", exclude_none=True)
    spec["instances"] = [
        {"id": f"{rid}-wrong", "model": narrow.model, "endpoint": wide.endpoint},  # wide's server
        {"id": f"{rid}-wide", "model": wide.model, "endpoint": wide.endpoint},
    ]
    cluster_file = tmp_path / "cluster.json"
    cluster_file.write_text(json.dumps(spec))
    procs = ProcessGroup(tmp_path / "logs", env=_env(kafka_bootstrap, redis_url, rid))
    store = await StateStore.connect(redis_url, namespace=f"t{rid}")
    server = services.load_records(vllm_home)[vllm_servers.RECORD_PREFIX + wide.id]
    heartbeat_s = 0.5

    async def alive(iid: str) -> bool:
        return (await store.snapshots([iid], time.time()))[iid].alive

    def worker(iid: str) -> Child:
        return procs.switchyard(
            f"worker-{iid}",
            "worker", "--instance", iid, "--cluster", str(cluster_file), "--backend", "vllm",
            "--heartbeat-s", str(heartbeat_s), "--log-level", "WARNING",
        )  # fmt: skip

    frozen = False
    try:
        wrong, good = worker(f"{rid}-wrong"), worker(f"{rid}-wide")
        async with asyncio.timeout(90):
            while wrong.alive() or not await alive(f"{rid}-wide"):
                await asyncio.sleep(0.2)
        assert wrong.proc.returncode == 1, wrong.tail()
        said = wrong.tail()
        assert "refuses to start" in said and wide.model in said and narrow.model in said, said
        assert not await alive(f"{rid}-wrong")

        os.killpg(server.pid, signal.SIGSTOP)
        frozen, t0 = True, time.monotonic()
        async with asyncio.timeout(20):
            while await alive(f"{rid}-wide"):
                await asyncio.sleep(0.05)
        down_s = time.monotonic() - t0
        os.killpg(server.pid, signal.SIGCONT)
        frozen, t1 = False, time.monotonic()
        async with asyncio.timeout(30):
            while not await alive(f"{rid}-wide"):
                await asyncio.sleep(0.05)
        back_s = time.monotonic() - t1
        assert good.alive(), good.tail()
        print(f"real vLLM frozen: instance out of the live set after {down_s:.2f} s, "
              f"back {back_s:.2f} s after it answered again")  # fmt: skip
        # a heartbeat interval plus the health probe's 1 s timeout, with room for a loaded CI
        assert down_s < heartbeat_s + 1.0 + 3.0
    finally:
        if frozen:
            os.killpg(server.pid, signal.SIGCONT)
        procs.stop_all()
        await store.close()


N_KILL_QUERIES = 40


async def test_a_real_server_frozen_then_killed_mid_stream_answers_every_query(
    real_servers: ClusterConfig, vllm_home: Path, kafka_bootstrap: str, redis_url: str,
    tmp_path: Path,
) -> None:  # fmt: skip
    """Scenario 11's freeze and ``kill -9`` on a real server (last in this module: its server
    stays dead).

    Router and one worker per real server; 40 queries; once the first Result of the victim's
    instance is out, its vLLM server's process group is frozen (``SIGSTOP``) for 10 s, mid
    stream; the instance must leave the live set within a heartbeat and the health probe's
    timeout, and come back once it answers. Then 20 more queries, and at the victim's next
    Result its server's process group is ``SIGKILL``'d. Every query gets
    exactly one Result (answered, or an error Result from the victim's worker for the
    streams the kill cut) within its deadline; the instance leaves the live set within two
    heartbeats plus the health probe's timeout; queries sent after that all go to the other.
    (Scenario 11's "returns 500s" stays on fake-vllm: a real vLLM cannot be made to.)
    """
    rid = "k" + uuid.uuid4().hex[:6]
    cluster, cluster_file = _namespaced(real_servers, rid, tmp_path)
    victim_spec = real_servers.instances[1]
    victim, other = cluster.instances[1].id, cluster.instances[0].id
    server = services.load_records(vllm_home)[vllm_servers.RECORD_PREFIX + victim_spec.id]
    procs = ProcessGroup(tmp_path / "logs", env=_env(kafka_bootstrap, redis_url, rid))
    store = await StateStore.connect(redis_url, namespace=f"t{rid}")
    ids = [i.id for i in cluster.instances]
    heartbeat_s, deadline_s = 0.5, 240.0
    try:
        await _router_and_workers(
            procs, store, cluster_file, ids, rid, max_hold_s=200, heartbeat_s=heartbeat_s,
            log_level="INFO",
        )  # fmt: skip
        consumer = await _results_consumer(kafka_bootstrap)
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all", linger_ms=5)
        await producer.start()
        rng = random.Random(11)
        sent: dict[str, float] = {}

        async def send(tag: str, n: int) -> None:
            futs = []
            for i in range(n):
                qid = f"{rid}-{tag}{i}"
                body = {"id": qid, "prompt": f"{qid}: " + _prompt(rng, 40), "max_tokens": 48,
                        "created_at": time.time(), "ttft_slo_ms": int(deadline_s * 1000)}  # fmt: skip
                sent[qid] = time.monotonic()
                futs.append(await producer.send(topics.QUERIES, json.dumps(body).encode(),
                                                key=qid.encode()))  # fmt: skip
            await asyncio.gather(*futs)

        results: dict[str, list[tuple[float, Result]]] = {}

        async def drain(timeout_ms: int = 300) -> None:
            for records in (await consumer.getmany(timeout_ms=timeout_ms)).values():
                for r in records:
                    res = Result.model_validate_json(r.value)
                    if res.query_id in sent:
                        results.setdefault(res.query_id, []).append((time.monotonic(), res))

        try:
            await send("a", N_KILL_QUERIES)
            async with asyncio.timeout(deadline_s):  # the victim's first answer: it is streaming
                while not any(r.instance_id == victim for rs in results.values() for _, r in rs):
                    await drain()
            os.killpg(server.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            try:
                async with asyncio.timeout(20):
                    while (await store.snapshots([victim], time.time()))[victim].alive:
                        await drain(50)
                frozen_out_s = time.monotonic() - frozen_at
                while time.monotonic() - frozen_at < 10.0:
                    await drain(200)
            finally:
                os.killpg(server.pid, signal.SIGCONT)
            thawed = time.monotonic()
            async with asyncio.timeout(30):
                while not (await store.snapshots([victim], time.time()))[victim].alive:
                    await drain(50)
            back_s = time.monotonic() - thawed
            seen = {q for q, rs in results.items() if rs[0][1].instance_id == victim}
            await send("c", 20)
            async with asyncio.timeout(deadline_s):  # streaming again
                while not any(
                    r.instance_id == victim and q not in seen
                    for q, rs in results.items()
                    for _, r in rs
                ):
                    await drain()
            os.killpg(server.pid, signal.SIGKILL)
            killed = time.monotonic()
            async with asyncio.timeout(30):
                while (await store.snapshots([victim], time.time()))[victim].alive:
                    await drain(50)
            down_s = time.monotonic() - killed
            await send("b", 10)  # after it left the live set
            async with asyncio.timeout(deadline_s):
                while set(sent) - set(results):
                    await drain()
            await asyncio.sleep(2.0)  # a second Result would arrive now
            await drain(1000)
        finally:
            await producer.stop()
            await consumer.stop()

        twice = [q for q, rs in results.items() if len(rs) != 1]
        assert not twice, f"{len(twice)} queries with more than one Result: {twice[:3]}"
        late = {q: t - sent[q] for q, [(t, _)] in results.items() if t - sent[q] > deadline_s}
        assert not late, f"answered past the deadline: {late}"
        final = {q: rs[0][1] for q, rs in results.items()}
        cut = {q: r.error for q, r in final.items() if not r.ok}
        assert all(final[q].instance_id == victim for q in cut), cut  # only the victim's fail
        after = [q for q in final if q.startswith(f"{rid}-b")]
        assert all(final[q].ok and final[q].instance_id == other for q in after), [
            (final[q].instance_id, final[q].error) for q in after
        ]
        print(
            f"real vLLM frozen 10 s: out of the live set after {frozen_out_s:.2f} s, back "
            f"{back_s:.2f} s after SIGCONT"
        )
        print(
            f"real vLLM killed: instance out of the live set {down_s:.2f} s after the kill; "
            f"{sum(1 for r in final.values() if r.instance_id == victim)} answered by it "
            f"({len(cut)} error Results from the cut streams), "
            f"{sum(1 for r in final.values() if r.instance_id == other)} by {other}; slowest "
            f"{max(t - sent[q] for q, [(t, _)] in results.items()):.1f} s of {deadline_s:.0f} s"
        )
        # two heartbeats plus the health probe's 1 s timeout, with room for a loaded CI
        assert frozen_out_s < 2 * heartbeat_s + 1.0 + 3.0
        assert down_s < 2 * heartbeat_s + 1.0 + 3.0
    finally:
        procs.stop_all()
        await store.close()
